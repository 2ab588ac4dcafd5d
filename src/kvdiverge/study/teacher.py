"""The workflow's teacher-forced job: one (model, split)'s documents under some policies, scored per position.

The documents are those the coupled run of each (model, policy, split) uses (every usable
document of the split; the ``none`` control and the noise floor their first ``documents``);
the continuation of each is the corpus text that follows its excerpt
(:func:`kvdiverge.study.corpus.following_texts`, tokenized without special tokens) or, where
there is none or the config asks for it, the full-cache model's greedy continuation
(:mod:`kvdiverge.engine.forced`).
"""

from __future__ import annotations

import logging
from typing import Any

import polars as pl

from kvdiverge.engine.core.sampling import Decoding, Sampling
from kvdiverge.engine.forced import teacher_forced_policies
from kvdiverge.engine.llm.pair_base import model_eos_ids
from kvdiverge.engine.llm.teacher import TeacherForcing
from kvdiverge.engine.presses.policies import Policy
from kvdiverge.engine.runner import Document
from kvdiverge.study.corpus import following_texts
from kvdiverge.study.models import load_model
from kvdiverge.study.shard import shard_documents

__all__ = ["corpus_continuations", "forcing_settings", "run_teacher_forced"]

log = logging.getLogger(__name__)


def forcing_settings(config: dict[str, Any]):
    """The :class:`kvdiverge.engine.llm.teacher.TeacherForcing` of a config's ``teacher_forced`` section."""
    section = config.get("teacher_forced") or {}
    return TeacherForcing(length=int(section.get("length", 128)))


def corpus_continuations(
    config: dict[str, Any], documents: pl.DataFrame, tokenizer, doc_ids, length: int
) -> dict[str, list[int]]:
    """Per ``doc_id``: the first ``length`` tokens of the corpus text after its excerpt (empty ones left out).

    ``documents`` is the corpus table (``doc_id``, ``paragraph_end``); the text is encoded
    with ``add_special_tokens=False``, after a blank line, as the excerpt's paragraphs are joined.
    """
    rows = documents.filter(pl.col("doc_id").is_in(list(doc_ids)))
    texts = following_texts(config["corpus"], rows, max_words=4 * int(length))
    out = {}
    for doc_id, text in texts.items():
        ids = tokenizer.encode(text, add_special_tokens=False)[: int(length)] if text else []
        if ids:
            out[doc_id] = [int(i) for i in ids]
    return out


def run_teacher_forced(
    config: dict[str, Any],
    model_name: str,
    policies: list[str],
    split: str,
    paths: dict[str, str],
    model_spec: dict[str, Any] | None = None,
    loaded=None,
) -> pl.DataFrame:
    """The teacher-forced positions of ``policies`` on one (model, split).

    Parameters
    ----------
    config : dict
        Validated workflow config (``seed``, ``models``, ``policies``, ``runs``, ``corpus``,
        optional ``teacher_forced``: ``length``, ``continuation``).
    model_name, split : str
        Key of ``config['models']``; the split.
    policies : list of str
        Keys of ``config['policies']``.
    paths : dict
        ``prompts`` (``results/prompts/{model}.parquet``) and ``corpus``
        (``results/corpus/documents.parquet``).
    model_spec : dict, optional
        Model entry to load from (a converted directory); default ``config['models'][model_name]``.
    loaded : (model, tokenizer), optional
        Already loaded (tests).

    Returns
    -------
    polars.DataFrame
        :data:`kvdiverge.estimation.teacher_forced.POSITION_SCHEMA`, policies grouped by
        their documents (those on the same documents run in one pass: one prefill forward
        and one reference side per document, :func:`kvdiverge.engine.forced.teacher_forced_policies`).
    """
    if loaded is None:
        loaded = load_model(model_spec or config["models"][model_name], model_name)
    model, tokenizer = loaded
    forcing = forcing_settings(config)
    prompts = pl.read_parquet(paths["prompts"])
    one_shard = {**config, "shards": 1}
    sampling = Sampling(T=forcing.length, replicates=1, decoding=Decoding(temperature=1.0), seed=int(config["seed"]))
    sampling = sampling.replace(model_name=model_name, eos_ids=tuple(model_eos_ids(model)))
    frames, groups = [], {}
    for name in policies:  # policies on the same documents run together: shared prefills and reference
        docs = shard_documents(prompts, one_shard, name, split, 0)
        groups.setdefault(tuple(docs["doc_id"].to_list()), (docs, []))[1].append(name)
    corpus_text = (config.get("teacher_forced") or {}).get("continuation", "corpus") == "corpus"
    corpus = pl.read_parquet(paths["corpus"]) if corpus_text else None  # read once for every group
    for doc_ids, (docs, names) in groups.items():
        conts = {}
        if corpus is not None:
            conts = corpus_continuations(config, corpus, tokenizer, list(doc_ids), forcing.length)
        log.info("%s / %s / %s: %d documents, %d with corpus text", model_name, names, split, docs.height, len(conts))
        frames.append(
            teacher_forced_policies(
                model,
                [Document(r["doc_id"], r["input_ids"]) for r in docs.iter_rows(named=True)],
                {name: Policy.from_config(name, config["policies"][name]) for name in names},
                sampling=sampling,
                forcing=forcing,
                split=split,
                continuations=conts,
            )
        )
    return pl.concat(frames)
