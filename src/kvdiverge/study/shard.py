"""The workflow's shard job: the documents of one shard through the runner, written atomically."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import polars as pl
from tqdm.auto import tqdm

from kvdiverge.engine.llm.pair_base import model_eos_ids
from kvdiverge.engine.presses.policies import Policy
from kvdiverge.engine.runner import Document, RunOptions, run_policies
from kvdiverge.io.files import write_parquet_atomic
from kvdiverge.study.config import control_documents
from kvdiverge.study.models import load_model
from kvdiverge.study.provenance import shard_metadata, shard_settings
from kvdiverge.study.settings import config_sampling

__all__ = ["shard_documents", "run_shard"]

log = logging.getLogger(__name__)


def shard_documents(prompts: pl.DataFrame, config: dict[str, Any], policy: str, split: str, shard: int) -> pl.DataFrame:
    """The prompt rows one shard runs: usable documents of ``split``, by ``doc_id``.

    Documents with an ``exclusion_reason`` are skipped (the prompts table reports
    them). The ``none`` control (config ``runs.control``) runs on the first
    ``runs.control.documents`` usable documents of its split only, unless the same
    policy is also scheduled on that split in full; the noise floor (``runs.floor``)
    likewise on the first ``runs.floor.documents`` when given (all otherwise). Shard
    ``i`` of ``n`` takes every ``n``-th document starting at ``i``.

    Raises
    ------
    ValueError
        If ``shard`` is not in ``[0, shards)``.
    """
    n_shards = int(config["shards"])
    if not 0 <= shard < n_shards:
        raise ValueError(f"shard {shard} out of range: config 'shards' is {n_shards}")

    docs = prompts.filter((pl.col("split") == split) & pl.col("exclusion_reason").is_null()).sort("doc_id")
    limit = control_documents(config, policy, split)
    if limit is not None:
        docs = docs.head(limit)
    return docs.gather_every(n_shards, offset=shard)


def run_shard(
    config: dict[str, Any],
    model_name: str,
    policy_name: str | Sequence[str],
    split: str,
    shard: int,
    prompts_path: str,
    output_path: str | os.PathLike | Sequence[str | os.PathLike],
    model=None,
    model_spec: dict[str, Any] | None = None,
) -> pl.DataFrame:
    """Generate the coupled trajectories of one shard of one or more policies and write each atomically.

    Policies that run on the same documents run in one call of the runner
    (:func:`kvdiverge.engine.runner.run_policies`): one model load, and each document
    prefilled once for the policies whose presses allow it (the frontier's job).

    Parameters
    ----------
    config : dict
        Validated workflow config (``seed``, ``models``, ``policies``, ``runs``,
        ``decoding``, ``replicates``, ``shards``, optional ``generation``:
        ``batch_documents`` and ``memory_budget_gb``, see :func:`kvdiverge.engine.runner.run_policies`).
    model_name, split : str
        Key of ``config['models']``; ``"exploratory"`` or ``"confirmatory"``.
    policy_name : str or sequence of str
        Key(s) of ``config['policies']``.
    shard : int
        Shard index in ``[0, config['shards'])``.
    prompts_path : str
        ``results/prompts/{model}.parquet`` (docs/internals.md).
    output_path : str or sequence of str
        Destination ``shard-{i}.parquet`` of each policy, in the order of ``policy_name``;
        each written only once every policy of the call is complete.
    model : transformers.PreTrainedModel, optional
        Already loaded model (tests, benchmarks); loaded otherwise.
    model_spec : dict, optional
        Model entry to load from (e.g. a converted local directory); defaults to
        ``config['models'][model_name]``.

    Returns
    -------
    polars.DataFrame
        The shard tables (:data:`~kvdiverge.estimation.schema.TRAJECTORY_SCHEMA`), one row per (policy, document,
        replicate), policies in the given order. Each file also records the settings it was
        made with, the library versions and the documents per batched forward ``B`` it ran
        with (:func:`kvdiverge.study.provenance.shard_metadata`, parquet key-value metadata).

    Raises
    ------
    ValueError
        If the policies and output paths differ in number.
    kvdiverge.engine.core.errors.NonFiniteLogitsError
        When the model returns NaN/±inf logits; nothing is written, so a rerun after the
        fix regenerates the shard.
    """
    names = [policy_name] if isinstance(policy_name, str) else list(policy_name)
    outputs = [output_path] if isinstance(output_path, (str, os.PathLike)) else list(output_path)
    if len(names) != len(outputs) or not names:
        raise ValueError(f"{len(names)} policies and {len(outputs)} output paths: give one path per policy")
    groups = _document_groups(pl.read_parquet(prompts_path), config, model_name, names, split, shard)
    if model is None and any(groups):
        model, _ = load_model(model_spec or config["models"][model_name], model_name)
    sampling = config_sampling(config, model_name)
    eos_ids = sampling.eos_ids if sampling.eos_ids is not None or model is None else model_eos_ids(model)
    options = _run_options(config, split, shard)
    frames: dict[str, pl.DataFrame] = {}
    batch: dict[str, int | None] = {}
    for docs, group in groups.values():
        runs = run_policies(
            model,
            [
                Document(row["doc_id"], row["input_ids"], int(row.get("n_question") or 0))
                for row in docs.iter_rows(named=True)
            ],
            {name: Policy.from_config(name, config["policies"][name]) for name in group},
            sampling,
            split=split,
            options=options,
        )
        for name in group:
            frames[name] = runs.trajectories.filter(pl.col("policy") == name)
            batch[name] = runs.batch_documents
    for name, path in zip(names, outputs):
        provenance = shard_metadata(
            shard_settings(config, model_name, name, split),
            model=model_name,
            policy=name,
            split=split,
            shard=shard,
            batch_documents=batch[name],
            eos_ids=None if batch[name] is None else eos_ids,
        )
        write_parquet_atomic(frames[name], path, metadata=provenance)
    return pl.concat([frames[name] for name in names])


def _document_groups(
    prompts: pl.DataFrame, config: dict[str, Any], model_name: str, names: Sequence[str], split: str, shard: int
) -> dict[tuple[str, ...], tuple[pl.DataFrame, list[str]]]:
    """The policies of a shard job grouped by the documents they run on (:func:`shard_documents`).

    Returns
    -------
    dict
        ``doc_id``s (tuple, in order) -> (their prompt rows, the policies of ``names`` that run
        on exactly them, in the given order); groups in order of first appearance.
    """
    T, R = int(config["decoding"]["max_new_tokens"]), int(config["replicates"])
    groups: dict[tuple[str, ...], tuple[pl.DataFrame, list[str]]] = {}
    for name in names:
        docs = shard_documents(prompts, config, name, split, shard)
        log.info("%s / %s / %s shard %d: %d documents, T=%d, R=%d", model_name, name, split, shard, docs.height, T, R)
        groups.setdefault(tuple(docs["doc_id"].to_list()), (docs, []))[1].append(name)
    return groups


def _run_options(config: dict[str, Any], split: str, shard: int) -> RunOptions:
    """The runner's options of a shard job from config ``generation``.

    Returns
    -------
    kvdiverge.engine.runner.RunOptions
        ``batch_documents`` (None for ``"auto"`` or unset), ``memory_budget_gb`` and a
        progress bar per policy named ``{policy}/{split}/shard-{shard}``.
    """
    gen = config.get("generation") or {}
    return RunOptions(
        batch_documents=None if gen.get("batch_documents", "auto") == "auto" else int(gen["batch_documents"]),
        memory_budget_gb=gen.get("memory_budget_gb"),
        progress=lambda name, total: tqdm(
            total=total, desc=f"{name}/{split}/shard-{shard}", unit="step", mininterval=5.0
        ),
    )
