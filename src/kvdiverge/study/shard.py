"""The workflow's shard job: the documents of one shard through the runner, written atomically."""

from __future__ import annotations

import logging
from typing import Any

import polars as pl
from tqdm.auto import tqdm

__all__ = ["shard_documents", "run_shard"]

log = logging.getLogger(__name__)


def shard_documents(prompts: pl.DataFrame, config: dict[str, Any], policy: str, split: str,
                    shard: int) -> pl.DataFrame:
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
    from kvdiverge.study.config import control_documents

    docs = prompts.filter((pl.col("split") == split) & pl.col("exclusion_reason").is_null()).sort("doc_id")
    limit = control_documents(config, policy, split)
    if limit is not None:
        docs = docs.head(limit)
    return docs.gather_every(n_shards, offset=shard)


def run_shard(
    config: dict[str, Any],
    model_name: str,
    policy_name: str,
    split: str,
    shard: int,
    prompts_path: str,
    output_path: str,
    model=None,
    model_spec: dict[str, Any] | None = None,
) -> pl.DataFrame:
    """Generate the coupled trajectories of one shard and write them atomically.

    Parameters
    ----------
    config : dict
        Validated workflow config (``seed``, ``models``, ``policies``, ``runs``,
        ``decoding``, ``replicates``, ``shards``, optional ``generation``:
        ``batch_documents`` and ``memory_budget_gb``, see :func:`kvdiverge.engine.runner.run_policies`).
    model_name, policy_name, split : str
        Keys of ``config['models']`` and ``config['policies']``; ``"exploratory"`` or
        ``"confirmatory"``.
    shard : int
        Shard index in ``[0, config['shards'])``.
    prompts_path : str
        ``results/prompts/{model}.parquet`` (docs/internals.md).
    output_path : str
        Destination ``shard-{i}.parquet``; written only once the shard is complete.
    model : transformers.PreTrainedModel, optional
        Already loaded model (tests, benchmarks); loaded otherwise.
    model_spec : dict, optional
        Model entry to load from (e.g. a converted local directory); defaults to
        ``config['models'][model_name]``.

    Returns
    -------
    polars.DataFrame
        The shard table (:data:`TRAJECTORY_SCHEMA`), one row per (document, replicate).
        The file also records the settings it was made with, the library versions and the
        documents per batched forward ``B`` it ran with
        (:func:`kvdiverge.study.provenance.shard_metadata`, parquet key-value metadata).

    Raises
    ------
    kvdiverge.engine.core.errors.NonFiniteLogitsError
        When the model returns NaN/±inf logits; nothing is written, so a rerun after the
        fix regenerates the shard.
    """
    from kvdiverge.estimation.io import write_parquet_atomic
    from kvdiverge.study.provenance import shard_metadata, shard_settings
    from kvdiverge.engine.presses.policies import Policy
    from kvdiverge.engine.runner import Document, run_policies

    policy = Policy.from_config(policy_name, config["policies"][policy_name])
    docs = shard_documents(pl.read_parquet(prompts_path), config, policy_name, split, shard)
    T, R = int(config["decoding"]["max_new_tokens"]), int(config["replicates"])
    log.info("%s / %s / %s shard %d: %d documents, T=%d, R=%d",
             model_name, policy_name, split, shard, docs.height, T, R)
    if model is None and docs.height:
        from kvdiverge.study.models import load_model

        model, _ = load_model(model_spec or config["models"][model_name], model_name)
    gen = config.get("generation") or {}
    runs = run_policies(
        model, [Document(row["doc_id"], row["input_ids"]) for row in docs.iter_rows(named=True)], {policy_name: policy},
        T=T, replicates=R, temperature=float(config["decoding"]["temperature"]),
        top_p=float(config["decoding"].get("top_p", 1.0)), seed=int(config["seed"]), model_name=model_name,
        split=split, memory_budget_gb=gen.get("memory_budget_gb"),
        batch_documents=None if gen.get("batch_documents", "auto") == "auto" else int(gen["batch_documents"]),
        progress=lambda name, total: tqdm(total=total, desc=f"{name}/{split}/shard-{shard}", unit="step",
                                          mininterval=5.0),
    )
    provenance = shard_metadata(shard_settings(config, model_name, policy_name, split), model=model_name,
                                policy=policy_name, split=split, shard=shard, batch_documents=runs.batch_documents)
    write_parquet_atomic(runs.trajectories, output_path, metadata=provenance)
    return runs.trajectories
