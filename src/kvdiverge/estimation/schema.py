"""The trajectory shard schema: the table the engine writes and the estimators read."""

from __future__ import annotations

import polars as pl

__all__ = ["TRAJECTORY_SCHEMA"]

#: Column types of a trajectory shard (docs/internals.md).
TRAJECTORY_SCHEMA: dict[str, pl.DataType] = {
    "model": pl.String,
    "policy": pl.String,
    "split": pl.String,
    "doc_id": pl.String,
    "replicate": pl.Int32,
    "T": pl.Int32,
    "prompt_len": pl.Int32,
    "kept_len": pl.Int32,
    "kept_per_layer": pl.List(pl.Int32),
    "chain_token": pl.List(pl.Int32),
    "tv": pl.List(pl.Float64),
    "survival": pl.List(pl.Float64),
    "tau_naive": pl.Int32,
    "t_star": pl.Int32,
    "x_star": pl.Int32,
    "y_star": pl.Int32,
    "branch_x": pl.List(pl.Int32),
    "branch_y": pl.List(pl.Int32),
    "branch_tv": pl.List(pl.Float64),
    "branch_mismatch": pl.List(pl.Int8),
    "seconds": pl.Float64,
}
