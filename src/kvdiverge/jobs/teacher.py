"""The workflow's teacher-forced job: one (model, split)'s documents under some policies, scored per position.

The documents are those the coupled run of each (model, policy, split) uses (every usable
document of the split; the ``none`` control and the noise floor their first ``documents``);
the continuation of each is the corpus text that follows its excerpt
(:func:`kvdiverge.data.corpus.following_texts`, tokenized without special tokens) or, where
there is none or the config asks for it, the full-cache model's greedy continuation
(:mod:`kvdiverge.engine.forced`). With ``teacher_forced.target: reconstruction`` the pass feeds
instead the config's repeat instruction in the model's chat template, then the excerpt's own text,
and scores the text; the key tokens (``teacher_forced.key_tokens``) are marked on either target.

The pass of a split runs on all its documents here (:func:`run_teacher_forced`), or on a shard's
documents in the shard job, before its coupled run and with the prefills that run then takes
(:func:`split_positions` with a carry; :mod:`kvdiverge.jobs.positions` gathers them): a document's
positions are the same either way.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import polars as pl

from kvdiverge.config.inputs import reconstruction_targets
from kvdiverge.data.corpus import following_texts
from kvdiverge.data.prompts import REPEAT_INSTRUCTION
from kvdiverge.engine.forced import TeacherPass, teacher_forced_policies
from kvdiverge.engine.llm.pair_base import model_eos_ids
from kvdiverge.engine.llm.sharing import PrefillCarry
from kvdiverge.engine.llm.teacher import DEFAULT_LENGTH, TeacherForcing
from kvdiverge.engine.presses.policies import Policy
from kvdiverge.engine.runner import Document
from kvdiverge.estimation.key_tokens import KeyTokens
from kvdiverge.jobs.documents import policy_documents
from kvdiverge.jobs.params import TeacherRun, TeacherSettings
from kvdiverge.models.loading import load_model

__all__ = ["corpus_continuations", "forcing_settings", "reads_corpus", "run_teacher_forced", "split_positions"]

log = logging.getLogger(__name__)


def forcing_settings(section: Mapping[str, Any]):
    """The :class:`kvdiverge.engine.llm.teacher.TeacherForcing` of a config's ``teacher_forced`` section
    (:attr:`kvdiverge.jobs.params.TeacherRun.forced`): its length, target and key-token rule
    (``key_tokens``; the defaults where the section leaves it out)."""
    keys = section.get("key_tokens") or {}
    rule = KeyTokens(**{k: (int if k == "short" else float)(v) for k, v in keys.items()})
    target = str(section.get("target", "continuation"))
    return TeacherForcing(length=int(section.get("length", DEFAULT_LENGTH)), target=target, key=rule)


def corpus_continuations(
    corpus: Mapping[str, Any], documents: pl.DataFrame, tokenizer, doc_ids, length: int
) -> dict[str, list[int]]:
    """Per ``doc_id``: the first ``length`` tokens of the corpus text after its excerpt (empty ones left out).

    ``corpus`` is the config's ``corpus`` section (where the text is read from), ``documents`` the corpus
    table (``doc_id``, ``paragraph_end``); the text is encoded with ``add_special_tokens=False``, after a
    blank line, as the excerpt's paragraphs are joined.
    """
    rows = documents.filter(pl.col("doc_id").is_in(list(doc_ids)))
    texts = following_texts(corpus, rows, max_words=4 * int(length))
    out = {}
    for doc_id, text in texts.items():
        ids = tokenizer.encode(text, add_special_tokens=False)[: int(length)] if text else []
        if ids:
            out[doc_id] = [int(i) for i in ids]
    return out


def run_teacher_forced(
    settings: TeacherSettings, paths: dict[str, str], model_spec: dict[str, Any] | None = None, loaded=None
) -> pl.DataFrame:
    """The teacher-forced positions of every run of the job: one model load, one prefill per document.

    Parameters
    ----------
    settings : kvdiverge.jobs.params.TeacherSettings
        The job: the model and its ``(policy, split)`` runs, with each run's settings
        (:func:`kvdiverge.config.provenance.teacher_settings`: model and policy entries, seed,
        the control's documents, the ``corpus`` and ``teacher_forced`` sections).
    paths : dict
        ``prompts`` (``results/prompts/{model}.parquet``) and ``corpus``
        (``results/corpus/documents.parquet``).
    model_spec : dict, optional
        Model entry to load from (a converted directory); default the settings' model entry.
    loaded : (model, tokenizer), optional
        Already loaded (tests).

    Returns
    -------
    polars.DataFrame
        :data:`kvdiverge.estimation.teacher_forced.POSITION_SCHEMA`, split by split: every
        document of a split prefilled once for all the policies that run on it, its reference
        side run once (:func:`kvdiverge.engine.forced.teacher_forced_policies`).
    """
    if loaded is None:
        loaded = load_model(model_spec or settings.model_entry(), settings.model)
    prompts = pl.read_parquet(paths["prompts"])
    corpus = pl.read_parquet(paths["corpus"]) if reads_corpus(settings) else None  # read once for every split
    return pl.concat([split_positions(loaded, settings, split, prompts, corpus) for split in settings.splits()])


def reads_corpus(settings: TeacherSettings) -> bool:
    """True when the pass reads the corpus table: the reconstruction's texts, or the continuations after the
    excerpts (``teacher_forced.continuation: corpus``, the default)."""
    forced = settings.run(*settings.runs[0]).forced
    return forced.get("target") == "reconstruction" or forced.get("continuation", "corpus") == "corpus"


def split_positions(
    loaded,
    settings: TeacherSettings,
    split: str,
    prompts: pl.DataFrame,
    corpus: pl.DataFrame | None,
    *,
    part: tuple[int, int] = (1, 0),
    carry: PrefillCarry | None = None,
) -> pl.DataFrame:
    """The teacher-forced positions of the runs of ``split`` on the documents of shard ``part``.

    Parameters
    ----------
    loaded : (model, tokenizer)
        The model, in eval mode, and its tokenizer.
    settings : kvdiverge.jobs.params.TeacherSettings
        The runs (those of ``split`` run) and their settings.
    split : str
        One split of ``settings``.
    prompts, corpus : polars.DataFrame
        The prompts table; the corpus table (None when :func:`reads_corpus` is False).
    part : (int, int)
        ``(shards, shard)``: each policy's documents in that shard
        (:func:`kvdiverge.jobs.documents.policy_documents`); ``(1, 0)``, all of them.
    carry : kvdiverge.engine.llm.sharing.PrefillCarry, optional
        Where the prefills are held for the coupled run of the same documents
        (:func:`kvdiverge.engine.forced.teacher_forced_policies`); a policy it names runs as the source it
        names (the coupled run's, which it holds prefills for), the others as built from the runs' entries.

    Returns
    -------
    polars.DataFrame
        :data:`kvdiverge.estimation.teacher_forced.POSITION_SCHEMA`, run by run, document by ``doc_id``.
    """
    model, tokenizer = loaded
    first = settings.run(*settings.runs[0])  # the sections every run of the job shares
    forcing = forcing_settings(first.forced)
    sampling = forcing.sampling(first.seed, settings.model, model_eos_ids(model))
    runs = {name: settings.run(name, split) for name in settings.splits()[split]}
    docs, runs_on = policy_documents(prompts, split, {name: run.documents for name, run in runs.items()}, *part)
    conts = _targets(first, corpus, tokenizer, docs["doc_id"].to_list(), forcing)
    log.info("%s / %s: %s on %d documents, %d with corpus text", settings.model, split, list(runs),
             docs.height, len(conts))  # fmt: skip
    later = {} if carry is None else carry.later
    sources = {
        name: later[name][0] if name in later else Policy.from_config(name, dict(run.entry))
        for name, run in runs.items()
    }
    return teacher_forced_policies(
        model,
        [Document(r["doc_id"], r["input_ids"]) for r in docs.iter_rows(named=True)],
        sources,
        settings=TeacherPass(sampling, forcing, split),
        continuations=conts,
        documents_of=runs_on,
        carry=carry,
    )


def _targets(run: TeacherRun, corpus: pl.DataFrame | None, tokenizer, doc_ids, forcing) -> dict[str, Any]:
    """What the pass feeds after each document: the reconstruction's targets (the excerpt's text after the
    repeat instruction, :func:`kvdiverge.config.inputs.reconstruction_targets`), or the corpus continuations
    (:func:`corpus_continuations`; none when ``corpus`` is None: greedy continuations)."""
    if forcing.target == "reconstruction":
        texts = corpus.filter(pl.col("doc_id").is_in(list(doc_ids))).select("doc_id", "text").iter_rows()
        instruction = run.forced.get("repeat_instruction", REPEAT_INSTRUCTION)
        return reconstruction_targets(dict(texts), tokenizer, instruction, "teacher_forced.target")
    if corpus is None:
        return {}
    return corpus_continuations(run.corpus, corpus, tokenizer, doc_ids, forcing.length)
