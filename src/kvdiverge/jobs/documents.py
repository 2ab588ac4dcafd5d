"""Which prompt rows a workflow job runs: a shard's documents, and those of each policy of a split.

A trajectory shard job and the teacher-forced pass take the same documents of a policy (the
usable documents of its split, the controls' first few), so that the pass on a shard's documents
gives the positions of its rows in the pass over the whole split.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import polars as pl

from kvdiverge.config.workflow import control_documents

__all__ = ["policy_documents", "select_documents", "shard_documents"]


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
    return select_documents(prompts, split, int(config["shards"]), shard, control_documents(config, policy, split))


def select_documents(prompts: pl.DataFrame, split: str, shards: int, shard: int, limit: int | None) -> pl.DataFrame:
    """The usable prompt rows of ``split`` by ``doc_id``, the first ``limit`` (all when None), every ``shards``-th from ``shard``.

    Raises
    ------
    ValueError
        If ``shard`` is not in ``[0, shards)``.
    """
    if not 0 <= shard < shards:
        raise ValueError(f"shard {shard} out of range: config 'shards' is {shards}")
    docs = prompts.filter((pl.col("split") == split) & pl.col("exclusion_reason").is_null()).sort("doc_id")
    if limit is not None:
        docs = docs.head(limit)
    return docs.gather_every(shards, offset=shard)


def policy_documents(
    prompts: pl.DataFrame, split: str, limits: Mapping[str, int | None], shards: int = 1, shard: int = 0
) -> tuple[pl.DataFrame, dict[str, list[str]]]:
    """The prompt rows of ``split`` that any policy runs on in shard ``shard`` of ``shards`` (by ``doc_id``),
    and each policy's ``doc_id`` (:func:`select_documents` with its ``limit``: the first ``limit``, or all).

    Raises
    ------
    ValueError
        If ``shard`` is not in ``[0, shards)``.
    """
    runs_on = {
        name: select_documents(prompts, split, shards, shard, limit)["doc_id"].to_list()
        for name, limit in limits.items()
    }
    union = {doc for docs in runs_on.values() for doc in docs}
    docs = select_documents(prompts, split, shards, shard, None).filter(pl.col("doc_id").is_in(list(union)))
    return docs, runs_on
