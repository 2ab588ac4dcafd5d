"""Every policy beside the numerical noise floor (every split that has policies).

- :func:`~kvdiverge.estimation.floor.floor_comparison` — each policy next to the noise-floor control
  (``PermutationPress``: equal kernels in exact arithmetic) on the documents both ran:
  ``p_div``, ``E[N]`` and mean TV per step with intervals, and whether the policy lies
  above the floor (paired document bootstrap of the difference).
- :func:`~kvdiverge.estimation.floor.floor_differences` — the measurement summary's ``E[M]`` and ``p_div`` minus the
  floor's, read off each policy's gap decomposition to the floor.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np
import polars as pl

from kvdiverge.estimation.bootstrap import Bootstrap, interval_columns, put_interval

__all__ = ["FLOOR_DIFFERENCE_COLUMNS", "FLOOR_METRICS", "FLOOR_SCHEMA", "floor_comparison", "floor_differences"]

#: Per-document columns compared with the noise floor: occurrence, expected token loss
#: (tokens), mean TV per chain step.
FLOOR_METRICS = ("p_div", "E_N", "tv_mean")


def floor_comparison(docs: pl.DataFrame, floor: str, boot: Bootstrap) -> pl.DataFrame:
    """Every policy next to the numerical noise floor, per model and split.

    The floor is the ``PermutationPress`` control: its two kernels are equal in exact
    arithmetic, so what it measures is floating-point rounding. Each policy is paired
    with the floor by ``doc_id`` on the documents both ran (all of a split's, or the
    subset ``runs.floor.documents``); each bootstrap resample draws those documents
    with replacement and uses them for both. A policy lies above the floor in a metric
    when the lower end of the interval of ``policy - floor`` is above 0.

    Parameters
    ----------
    docs : polars.DataFrame
        Per-document estimates (:func:`kvdiverge.estimation.estimators.document_estimates`) of
        any runs, with ``p_div``, ``E_N`` (tokens) and ``tv_mean``.
    floor : str
        Name of the floor policy (config ``runs.floor.policy``).
    boot : kvdiverge.estimation.bootstrap.Bootstrap
        Settings of the paired document bootstrap (purpose ``("floor", model, policy, split)``).

    Returns
    -------
    polars.DataFrame
        One row per (model, split, policy) other than the floor, where the floor ran:
        model, split, policy, floor, ``n_docs`` (paired), and for each metric ``m`` of
        :data:`FLOOR_METRICS` the policy's mean ``m`` (+ ``_lo``, ``_hi``), the
        floor's ``floor_m`` (+ interval), the difference ``diff_m`` (+ interval), and
        ``above_floor_p_div``, ``above_floor_E_N`` (booleans). Empty (same columns)
        when the floor did not run.
    """
    rows = []
    metrics = list(FLOOR_METRICS)
    for (model, split), g in docs.group_by(["model", "split"], maintain_order=True):
        fl = g.filter(pl.col("policy") == floor)
        if fl.height == 0:
            continue
        fl = fl.select(["doc_id", *metrics])
        for (policy,), gp in g.group_by(["policy"], maintain_order=True):
            if policy == floor:
                continue
            j = gp.select(["doc_id", *metrics]).join(fl, on="doc_id", suffix="_floor").sort("doc_id")
            n = j.height
            r: dict[str, Any] = {"model": model, "split": split, "policy": policy, "floor": floor, "n_docs": n}
            idx = boot.indices(n, "floor", model, policy, split)
            for m in metrics:
                a = j[m].to_numpy().astype(np.float64)
                b = j[m + "_floor"].to_numpy().astype(np.float64)
                for name, x in ((m, a), (f"floor_{m}", b), (f"diff_{m}", a - b)):
                    if n == 0:
                        put_interval(r, name, math.nan, math.nan, math.nan)
                        continue
                    put_interval(r, name, x.mean(), *boot.interval(x[idx].mean(axis=1)))
            for m in ("p_div", "E_N"):
                r[f"above_floor_{m}"] = bool(n > 0 and r[f"diff_{m}_lo"] > 0)
            rows.append(r)
    return pl.DataFrame(rows, schema=FLOOR_SCHEMA) if rows else pl.DataFrame(schema=FLOOR_SCHEMA)


#: Column types of the floor comparison (also for an empty one).
FLOOR_SCHEMA: dict[str, pl.DataType] = {
    "model": pl.String,
    "split": pl.String,
    "policy": pl.String,
    "floor": pl.String,
    "n_docs": pl.Int64,
    **{c: pl.Float64 for m in FLOOR_METRICS for pre in ("", "floor_", "diff_") for c in interval_columns(pre + m)},
    "above_floor_p_div": pl.Boolean,
    "above_floor_E_N": pl.Boolean,
}


#: Columns of :func:`floor_differences` besides ``policy``.
FLOOR_DIFFERENCE_COLUMNS = (
    "E_M_minus_floor",
    "E_M_minus_floor_lo",
    "E_M_minus_floor_hi",
    "p_div_minus_floor",
    "p_div_minus_floor_lo",
    "p_div_minus_floor_hi",
)


def floor_differences(gaps_to_floor: Mapping[str, pl.DataFrame | None]) -> pl.DataFrame:
    """Each policy's ``E[M]`` and ``p_div`` minus the noise floor's, from its gap to the floor.

    The difference of ``E[M] = E[N] / T`` is the gap decomposition's ``delta`` divided by
    ``T``; that of ``p_div`` is its ``first_mismatch`` term (§7), both with the gap's paired
    document-bootstrap interval. :func:`floor_comparison` gives the workflow's table of the
    same comparison over ``p_div``, ``E_N`` and ``tv_mean``, with its own resamples.

    Parameters
    ----------
    gaps_to_floor : mapping of str to polars.DataFrame or None
        Policy -> :func:`~kvdiverge.estimation.gap.gap_decomposition` of ``policy - floor`` (four rows), or None for
        the floor itself; rows come out in this order.

    Returns
    -------
    polars.DataFrame
        ``policy`` and :data:`FLOOR_DIFFERENCE_COLUMNS` (Float64; null on the floor's row).
    """
    rows = []
    for policy, gap in gaps_to_floor.items():
        r: dict[str, Any] = {"policy": policy}
        if gap is not None:
            t = {row["term"]: row for row in gap.iter_rows(named=True)}
            delta, first, T = t["delta"], t["first_mismatch"], t["delta"]["T"]
            r.update(
                {
                    "E_M_minus_floor": delta["value"] / T,
                    "E_M_minus_floor_lo": delta["value_lo"] / T,
                    "E_M_minus_floor_hi": delta["value_hi"] / T,
                    "p_div_minus_floor": first["value"],
                    "p_div_minus_floor_lo": first["value_lo"],
                    "p_div_minus_floor_hi": first["value_hi"],
                }
            )
        rows.append(r)
    return pl.DataFrame(rows, schema={"policy": pl.String, **{c: pl.Float64 for c in FLOOR_DIFFERENCE_COLUMNS}})
