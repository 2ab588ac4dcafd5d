"""The workflow's shard job: the documents of one shard through the runner, written atomically.

A model of ``backend: llama_cpp`` (:mod:`kvdiverge.config.backends`) runs its GGUF file in llama.cpp
instead: each policy is a llama.cpp cache (:func:`kvdiverge.engine.llamacpp.caches.cache_from_entry`),
measured against the f16 cache by :func:`kvdiverge.engine.llamacpp.run.run_caches`, and its shard records
the llama.cpp build, rotation and threads beside the settings.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import polars as pl
import torch
from tqdm.auto import tqdm

from kvdiverge.config.backends import runs_on_llama_cpp
from kvdiverge.config.provenance import backend_metadata, layers_metadata, shard_metadata
from kvdiverge.engine.llamacpp import context as llama_context
from kvdiverge.engine.llamacpp.caches import cache_from_entry
from kvdiverge.engine.llamacpp.run import provenance as llama_provenance
from kvdiverge.engine.llamacpp.run import run_caches
from kvdiverge.engine.llm.pair_base import model_eos_ids
from kvdiverge.engine.llm.planner import default_memory_budget
from kvdiverge.engine.llm.sharing import PrefillCarry
from kvdiverge.engine.presses.layer_types import layers_of
from kvdiverge.engine.presses.policies import Policy
from kvdiverge.engine.runner import Document, RunOptions, run_policies
from kvdiverge.estimation.schema import TRAJECTORY_SCHEMA
from kvdiverge.estimation.teacher_forced import POSITION_SCHEMA
from kvdiverge.io.files import write_parquet_atomic
from kvdiverge.jobs.documents import select_documents
from kvdiverge.jobs.params import ShardSettings
from kvdiverge.jobs.positions import ShardPass, positions_metadata
from kvdiverge.jobs.teacher import reads_corpus, split_positions
from kvdiverge.models.loading import load_model, load_tokenizer
from kvdiverge.models.sources import gguf_path

__all__ = ["generation_options", "run_shard", "run_llama_shard"]

log = logging.getLogger(__name__)


def generation_options(section: Mapping[str, Any] | None) -> RunOptions:
    """The runner's batching options of a config's ``generation`` section (missing keys: the schema's defaults).

    Returns
    -------
    kvdiverge.engine.runner.RunOptions
        ``batch_documents`` (None for ``"auto"`` or unset) and ``memory_budget_gb``; no progress bar.
    """
    gen = section or {}
    batch = gen.get("batch_documents", "auto")
    return RunOptions(
        batch_documents=None if batch == "auto" else int(batch), memory_budget_gb=gen.get("memory_budget_gb")
    )


def run_shard(
    settings: ShardSettings,
    prompts_path: str | os.PathLike,
    output_path: str | os.PathLike | Sequence[str | os.PathLike],
    model=None,
    model_spec: dict[str, Any] | None = None,
    options: RunOptions | None = None,
    *,
    teacher: ShardPass | None = None,
) -> pl.DataFrame:
    """Generate the coupled trajectories of one shard of one or more policies and write each atomically.

    Policies that run on the same documents run in one call of the runner
    (:func:`kvdiverge.engine.runner.run_policies`): one model load, and each document
    prefilled once for the policies whose presses allow it (the frontier's job). Policies on other
    documents (the controls on a shard's first documents: the noise floor, the ``none`` control) run
    in calls of their own, in their own batches, with the prefills the first call made for them where
    their documents are its too (:class:`kvdiverge.engine.llm.sharing.PrefillCarry`). With ``teacher``,
    the teacher-forced pass of the split's runs on the shard's documents runs first and is written to its
    file (:mod:`kvdiverge.jobs.positions`), and the coupled run takes the prefills it made, within the
    memory budget. A model entry of ``backend: llama_cpp`` runs its GGUF file (``model``: a GGUF path or
    a ``llama_cpp.Llama``, else the entry's file) in llama.cpp instead (:func:`run_llama_shard`, with
    torch's threads: the job's), and writes an empty positions file (as a job given no teacher-forced
    settings).

    Parameters
    ----------
    settings : kvdiverge.jobs.params.ShardSettings
        The job: model, split, shard index and policies, with each policy's settings
        (:func:`kvdiverge.config.provenance.shard_settings`: model and policy entries,
        decoding, replicates, seed, shards, the control's documents).
    prompts_path : str
        ``results/prompts/{model}.parquet`` (docs/internals.md).
    output_path : str or sequence of str
        Destination ``shard-{i}.parquet`` of each policy, in the order of ``settings.policies``;
        each written only once every policy of the call is complete.
    model : transformers.PreTrainedModel or (model, tokenizer), optional
        Already loaded model (tests, benchmarks), with its tokenizer for ``teacher`` (else loaded from the
        entry); loaded otherwise. A GGUF path or a ``llama_cpp.Llama`` for a model of ``backend: llama_cpp``.
    model_spec : dict, optional
        Model entry to load from (e.g. a converted local directory); defaults to the
        settings' model entry.
    options : kvdiverge.engine.runner.RunOptions, optional
        How the runner batches (config ``generation``: :func:`generation_options`); default
        ``batch_documents: auto``. A progress bar per policy is added when it has none.
    teacher : kvdiverge.jobs.positions.ShardPass, optional
        The teacher-forced pass to run on the shard's documents first, and where to write it.

    Returns
    -------
    polars.DataFrame
        The shard tables (:data:`~kvdiverge.estimation.schema.TRAJECTORY_SCHEMA`), one row per (policy, document,
        replicate), policies in the given order. Each file also records the settings it was
        made with, the library versions and the documents per batched forward ``B`` it ran
        with (:func:`kvdiverge.config.provenance.shard_metadata`, parquet key-value metadata).

    Raises
    ------
    ValueError
        If the policies and output paths differ in number, or the shard index is out of range.
    kvdiverge.engine.core.errors.NonFiniteLogitsError
        When the model returns NaN/±inf logits; nothing is written, so a rerun after the
        fix regenerates the shard.
    """
    names = list(settings.policies)
    outputs = [output_path] if isinstance(output_path, (str, os.PathLike)) else list(output_path)
    if len(names) != len(outputs):
        raise ValueError(f"{len(names)} policies and {len(outputs)} output paths: give one path per policy")
    prompts = pl.read_parquet(prompts_path)
    groups = _document_groups(prompts, settings)
    spec = model_spec or settings.model_entry()
    if teacher is not None and (runs_on_llama_cpp(spec) or teacher.settings is None):  # no pass (none on llama.cpp)
        write_parquet_atomic(pl.DataFrame(schema=POSITION_SCHEMA), teacher.output, metadata=_positions(settings))
        teacher = None
    if runs_on_llama_cpp(spec):
        source = model if model is not None else gguf_path(spec, settings.model)
        return run_llama_shard(settings, groups, outputs, source, options, torch.get_num_threads())
    model, tokenizer = model if isinstance(model, tuple) else (model, None)
    if model is None and (any(groups) or teacher is not None):
        model, tokenizer = load_model(spec, settings.model)
    sampling = settings.run(names[0]).sampling  # every policy of a job shares the decoding, R and the seed
    eos_ids = sampling.eos_ids if sampling.eos_ids is not None or model is None else model_eos_ids(model)
    options = _with_progress(options or RunOptions(), settings)
    frames, batch = {}, {}  # per policy: its records, its documents per batched forward (None: none ran)
    sources = {name: Policy.from_config(name, dict(settings.run(name).entry)) for name in names}
    # the controls' calls take their prefills from the first call's forwards, or all those of the pass, run first
    # (then the fewest documents first: a call's first batch takes its own at once, held beside no batch)
    calls = list(groups.values())
    later = calls[0 if teacher is not None else 1 :]
    carry = PrefillCarry({name: (sources[name], frozenset(docs["doc_id"])) for docs, group in later for name in group})
    if teacher is not None:
        carry.room = _budget_bytes(model, options)
        tokenizer = load_tokenizer(spec, settings.model) if tokenizer is None else tokenizer
        _shard_pass((model, tokenizer), settings, teacher, prompts, carry)
        calls.sort(key=lambda call: call[0].height)
    for docs, group in calls:
        runs = run_policies(
            model,
            _documents(docs),
            {name: sources[name] for name in group},
            sampling,
            split=settings.split,
            options=options,
            carry=carry,
        )
        for name in group:
            frames[name] = runs.trajectories.filter(pl.col("policy") == name)
            batch[name] = runs.batch_documents
    layers = None if model is None else layers_of(model.config)
    for name, path in zip(names, outputs):
        write_parquet_atomic(
            frames[name], path, metadata=_shard_provenance(settings, name, layers, batch[name], eos_ids)
        )
    return pl.concat([frames[name] for name in names])


def _documents(rows: pl.DataFrame) -> list[Document]:
    """The engine's documents of prompt rows (``doc_id``, ``input_ids``, ``n_question`` where given)."""
    return [Document(r["doc_id"], r["input_ids"], int(r.get("n_question") or 0)) for r in rows.iter_rows(named=True)]


def _shard_provenance(settings: ShardSettings, name: str, layers, batch: int | None, eos_ids) -> dict[str, str]:
    """The key-value metadata of policy ``name``'s shard: the model's layers and
    :func:`kvdiverge.config.provenance.shard_metadata` (``batch`` None: no document ran)."""
    return layers_metadata(layers) | shard_metadata(
        settings.settings[name],
        model=settings.model,
        policy=name,
        split=settings.split,
        shard=settings.shard,
        batch_documents=batch,
        eos_ids=None if batch is None else eos_ids,
    )


def _shard_pass(loaded, settings: ShardSettings, teacher: ShardPass, prompts, carry) -> None:
    """The teacher-forced pass of ``teacher`` on the shard's documents, written to its file; its prefills held
    in ``carry`` for the coupled run where that run's prefill is the same: the same policy entries, prefill
    seed and model, and no question after compression (the pass prefills a prompt whole)."""
    split, run, job = settings.split, settings.run(settings.policies[0]), teacher.settings
    names = job.splits()[split]
    questions = "n_question" in prompts.columns and bool((prompts["n_question"].fill_null(0) > 0).any())
    same = (
        job.run(*job.runs[0]).seed == run.sampling.seed
        and not questions
        and all(name in settings.settings and job.run(name, split).entry == settings.run(name).entry for name in names)
    )
    corpus = pl.read_parquet(teacher.corpus) if reads_corpus(job) else None
    part = (run.shards, settings.shard)
    frame = split_positions(loaded, job, split, prompts, corpus, part=part, carry=carry if same else None)
    log.info("teacher-forced pass: %d positions; %d prefills held for the coupled run", frame.height, len(carry.held))
    write_parquet_atomic(frame, teacher.output, metadata=positions_metadata(job, *part))


def _positions(settings: ShardSettings) -> dict[str, str]:
    """The metadata of a shard's empty positions file (no pass)."""
    return positions_metadata(None, settings.run(settings.policies[0]).shards, settings.shard)


def _budget_bytes(model, options: RunOptions) -> int:
    """The job's memory budget in bytes (config ``generation.memory_budget_gb``, else the device's default)."""
    if options.memory_budget_gb is not None:
        return int(float(options.memory_budget_gb) * 2**30)
    return default_memory_budget(next(model.parameters()).device)


def run_llama_shard(
    settings: ShardSettings,
    groups: dict[tuple[str, ...], tuple[pl.DataFrame, list[str]]],
    outputs: Sequence[str | os.PathLike],
    model,
    options: RunOptions | None,
    threads: int,
) -> pl.DataFrame:
    """:func:`run_shard` of a model of ``backend: llama_cpp``: each policy's llama.cpp cache against the f16
    cache, on the documents each policy runs on, one document at a time.

    ``model`` is the GGUF file (or a ``llama_cpp.Llama``), loaded once when a document runs. Each shard
    records, beside :func:`kvdiverge.config.provenance.shard_metadata` (``batch_documents`` 1, the
    vocabulary's end-of-sequence ids), its policy's :func:`kvdiverge.engine.llamacpp.run.provenance`
    (:func:`kvdiverge.config.provenance.backend_metadata`).

    Raises
    ------
    ModuleNotFoundError
        Without llama_cpp (:data:`kvdiverge.engine.llamacpp.caches.INSTALL`).
    ValueError
        A repetition penalty, which the backend does not run.
    """
    names = list(settings.policies)
    caches = {name: cache_from_entry(settings.run(name).entry) for name in names}
    sampling = settings.run(names[0]).sampling
    loaded = llama_context.load_model(model) if any(groups) else None
    eos = sampling.eos_ids if sampling.eos_ids is not None or loaded is None else loaded.eos_ids
    sampling = sampling.replace(decoding=sampling.decoding.replace(eos_ids=eos))
    progress = _with_progress(options or RunOptions(), settings).progress
    frames: dict[str, pl.DataFrame] = {}
    for docs, group in groups.values():
        documents = {row["doc_id"]: list(row["input_ids"]) for row in docs.iter_rows(named=True)}
        frame = (
            run_caches(loaded, {n: caches[n] for n in group}, documents, sampling, threads, split=settings.split,
                       progress=progress)
            if documents
            else pl.DataFrame(schema=TRAJECTORY_SCHEMA)
        )  # fmt: skip
        frames |= {name: frame.filter(pl.col("policy") == name) for name in group}
    for name, path in zip(names, outputs):
        ran = frames[name].height > 0
        provenance = shard_metadata(
            settings.settings[name],
            model=settings.model,
            policy=name,
            split=settings.split,
            shard=settings.shard,
            batch_documents=1 if ran else None,
            eos_ids=eos if ran else None,
        ) | backend_metadata(llama_provenance({name: caches[name]}, threads))
        write_parquet_atomic(frames[name], path, metadata=provenance)
    return pl.concat([frames[name] for name in names])


def _document_groups(
    prompts: pl.DataFrame, settings: ShardSettings
) -> dict[tuple[str, ...], tuple[pl.DataFrame, list[str]]]:
    """The policies of a shard job grouped by the documents they run on (:func:`select_documents`).

    Returns
    -------
    dict
        ``doc_id``s (tuple, in order) -> (their prompt rows, the policies of the job that run
        on exactly them, in the job's order); groups in order of first appearance.
    """
    groups: dict[tuple[str, ...], tuple[pl.DataFrame, list[str]]] = {}
    for name in settings.policies:
        run = settings.run(name)
        docs = select_documents(prompts, settings.split, run.shards, settings.shard, run.documents)
        T, R = run.sampling.T, run.sampling.replicates
        log.info(
            "%s / %s / %s shard %d: %d documents, T=%d, R=%d",
            settings.model,
            name,
            settings.split,
            settings.shard,
            docs.height,
            T,
            R,
        )
        groups.setdefault(tuple(docs["doc_id"].to_list()), (docs, []))[1].append(name)
    return groups


def _with_progress(options: RunOptions, settings: ShardSettings) -> RunOptions:
    """``options`` with a progress bar per policy named ``{policy}/{split}/shard-{shard}``, unless it has one."""
    if options.progress is not None:
        return options
    split, shard = settings.split, settings.shard
    return dataclasses.replace(
        options,
        progress=lambda name, total: tqdm(
            total=total, desc=f"{name}/{split}/shard-{shard}", unit="step", mininterval=5.0
        ),
    )
