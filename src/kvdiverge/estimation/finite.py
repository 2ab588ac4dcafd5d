"""Refuse non-finite values in the tables the estimate and analysis stages read.

A NaN or an infinity in a trajectory shard or an estimate table comes from broken
arithmetic upstream (an overflowing half-precision model, a broken checkpoint, a file
edited by hand) and makes every number computed from it wrong. The estimate stage
(:func:`kvdiverge.estimation.estimators.read_shards`) and the analysis stage
(:func:`kvdiverge.estimation.estimators.read_estimates`) therefore check every float column of every
file they read, and stop with a :class:`NonFiniteError` naming the file, the column, the
row (its ``doc_id`` and ``replicate`` where the table has them) and the value.

Some columns are non-finite *by definition* where the quantity is undefined
(``docs/internals.md``); NaN in those cells, and only there, is accepted (and ``+inf``
where the module says so):

- trajectory shards: ``tv`` is NaN after the agreement chain stopped
  (where ``chain_token`` is -1);
- per-document estimates (``results/estimates/.../{split}.parquet``): standard errors and
  across-replicate variances when ``R < 2``; ``tau_mean`` when ``p_div = 0``; ``rho``,
  ``rho_lo``, ``rho_hi`` when ``E_L = 0``; ``exposure_share`` when ``E_M = 0``;
  ``var_ratio`` and ``var_ratio_tv`` (NaN or +inf) when ``R < 2`` or ``var_N_cmc = 0``;
  ``btv_lag`` at the lags where ``btv_den = 0``; a window's ``btv_<name>`` when its
  ``btv_<name>_weight = 0``.
"""

from __future__ import annotations

import os
from typing import Iterable, Mapping

import polars as pl

__all__ = [
    "NonFiniteError",
    "check_finite",
    "check_shard",
    "check_document_estimates",
    "shard_undefined",
    "document_undefined",
]


class NonFiniteError(ValueError):
    """A table holds NaN or an infinity where its contract says the value is a number."""


def _is_float(dtype: pl.DataType) -> bool:
    inner = dtype.inner if isinstance(dtype, (pl.List, pl.Array)) else dtype
    return inner.is_float()


def _where(row: Mapping) -> str:
    keys = [f"{k} {row[k]!r}" for k in ("model", "policy", "split", "doc_id", "replicate") if k in row]
    return ", ".join(keys)


def check_finite(
    frame: pl.DataFrame,
    source: str | os.PathLike,
    *,
    undefined: Mapping[str, pl.Expr] | None = None,
    inf_ok: Iterable[str] = (),
    what: str = "table",
    hint: str = "",
) -> None:
    """Raise unless every float cell of ``frame`` is finite or allowed to be undefined.

    Parameters
    ----------
    frame : polars.DataFrame
        The table as read from ``source``. Float columns (``Float32``/``Float64``) and
        lists of floats are checked; integer, string and boolean columns cannot hold NaN.
        Nulls are not checked (the table contracts say where nulls are allowed).
    source : str or os.PathLike
        The file the table was read from (named in the error).
    undefined : mapping of str to polars.Expr, optional
        Per column, a boolean expression (a list of booleans for a list column, one per
        element) that is true where the value is undefined by definition; NaN is
        accepted there and nowhere else.
    inf_ok : iterable of str
        Columns whose undefined cells may also hold ``+inf`` (e.g. ``var_ratio = a / 0``).
    what : str
        What the table is, for the error message (e.g. ``"trajectory shard"``).
    hint : str
        What to do about it, appended to the message.

    Raises
    ------
    NonFiniteError
        At the first offending column: the file, the column, how many cells, the first
        cell's row (with ``doc_id`` / ``replicate`` where present), list element and value.
    """
    undefined = dict(undefined or {})
    inf_ok = set(inf_ok)
    keys = [k for k in ("model", "policy", "split", "doc_id", "replicate") if k in frame.columns]
    indexed = frame.with_row_index("_row")
    for column, dtype in frame.schema.items():
        if not _is_float(dtype):
            continue
        is_list = isinstance(dtype, (pl.List, pl.Array))
        allowed = undefined.get(column, pl.lit(False))
        cells = indexed.select(
            "_row",
            *keys,
            pl.col(column).alias("_value"),
            allowed.alias("_allowed"),
        )
        if is_list:
            cells = cells.with_columns(pl.col("_value").cast(pl.List(dtype.inner)))
            cells = cells.with_columns(pl.int_ranges(0, pl.col("_value").list.len()).alias("_element"))
            if cells.schema["_allowed"] == pl.Boolean:
                cells = cells.with_columns(pl.col("_allowed").repeat_by(pl.col("_value").list.len()))
            cells = cells.explode(["_value", "_element", "_allowed"])
        value = pl.col("_value")
        accepted = value.is_nan() | ((value == float("inf")) if column in inf_ok else pl.lit(False))
        bad = cells.filter(~value.is_finite() & ~(pl.col("_allowed").fill_null(False) & accepted))
        if bad.height:
            first = bad.row(0, named=True)
            at = f"row {first['_row']}"
            where = _where(first)
            if where:
                at += f" ({where})"
            if is_list:
                at += f", element {first['_element']}"
            raise NonFiniteError(
                f"{os.fspath(source)}: column {column!r} of this {what} holds {bad.height} "
                f"non-finite value(s); the first is {first['_value']!r} at {at}. "
                f"NaN or infinity there comes from broken arithmetic upstream (e.g. a "
                f"float16 overflow or a broken checkpoint), and every estimate computed "
                f"from it would be wrong.{(' ' + hint) if hint else ''}"
            )


def shard_undefined() -> dict[str, pl.Expr]:
    """Cells of a trajectory shard that are NaN by definition: ``tv`` after the chain stopped."""
    return {"tv": pl.col("chain_token").list.eval(pl.element() == -1)}


def check_shard(frame: pl.DataFrame, source: str | os.PathLike) -> None:
    """:func:`check_finite` with the trajectory shard's contract (docs/internals.md).

    Raises
    ------
    NonFiniteError
        Naming the shard file and the column.
    """
    undefined = shard_undefined() if {"tv", "chain_token"} <= set(frame.columns) else {}
    check_finite(
        frame,
        source,
        undefined=undefined,
        what="trajectory shard",
        hint="Fix the model or its dtype, delete the shard and rerun: only the missing shards are regenerated.",
    )


def document_undefined(columns: list[str]) -> dict[str, pl.Expr]:
    """Cells of a per-document estimate table that are undefined by definition.

    Parameters
    ----------
    columns : list of str
        The table's columns (window columns ``btv_<name>`` are found by their
        ``btv_<name>_weight``).

    Returns
    -------
    dict
        Column -> boolean expression (see the module docstring for the rules).
    """
    few = pl.col("R") < 2
    out: dict[str, pl.Expr] = {}
    for c in columns:
        if c.endswith("_se") or c in ("var_N_naive", "var_N_cmc", "var_N_cmc_tv"):
            out[c] = few
        elif c == "tau_mean":
            out[c] = pl.col("p_div") <= 0
        elif c in ("rho", "rho_lo", "rho_hi"):
            out[c] = pl.col("E_L") <= 0
        elif c == "exposure_share":
            out[c] = pl.col("E_M") <= 0
        elif c in ("var_ratio", "var_ratio_tv"):
            out[c] = few | (pl.col("var_N_cmc") <= 0)
        elif c == "btv_lag":
            out[c] = pl.col("btv_den").list.eval(pl.element() <= 0)
        elif c.startswith("btv_") and f"{c}_weight" in columns:
            out[c] = pl.col(f"{c}_weight") <= 0
    return out


def check_document_estimates(frame: pl.DataFrame, source: str | os.PathLike) -> None:
    """:func:`check_finite` with the per-document estimate table's contract.

    Raises
    ------
    NonFiniteError
        Naming the estimate file and the column.
    """
    check_finite(
        frame,
        source,
        undefined=document_undefined(frame.columns),
        inf_ok=("var_ratio", "var_ratio_tv"),
        what="per-document estimate table",
        hint="Delete the file and rerun: the estimate stage rebuilds it from the "
        "trajectory shards (and refuses non-finite shards, naming them).",
    )
