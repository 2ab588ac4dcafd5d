"""The ranking of a frontier's curves (:func:`kvdiverge.estimation.frontier.frontier_tables`' second table).

- :func:`~kvdiverge.estimation.frontier_ranking.common_range` — the range of KV bytes per prompt token common to
  the most curves;
- :func:`~kvdiverge.estimation.frontier_ranking.range_mean` — a curve's mean over that range, linear in bytes;
- :func:`~kvdiverge.estimation.frontier_ranking.trapezoid_area` — the area under a curve over its compression ratios;
- :func:`~kvdiverge.estimation.frontier_ranking.curve_rows` — one row per curve: those means and areas with
  document-bootstrap
  intervals, ranked by the mean ``E[M]``, with each one's paired difference from the best curve.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from kvdiverge.estimation.bootstrap import Bootstrap, put_interval

__all__ = ["common_range", "curve_rows", "range_mean", "trapezoid_area"]


def trapezoid_area(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Trapezoid area under ``y`` over ``x`` (the last axis), ``x`` ascending.

    Parameters
    ----------
    x : numpy.ndarray, shape (K,)
        Compression ratios, ascending.
    y : numpy.ndarray, shape (..., K)
        Curve values (resamples along the leading axes).

    Returns
    -------
    numpy.ndarray, shape (...)
        ``sum_k (x_{k+1} - x_k) (y_k + y_{k+1}) / 2``; NaN for fewer than 2 points.
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.size < 2:
        return np.full(y.shape[:-1], np.nan)
    return np.sum(np.diff(x) * (y[..., 1:] + y[..., :-1]) / 2, axis=-1)


def common_range(spans: Mapping[str, tuple[float, float]]) -> tuple[float, float, list[str]] | None:
    """The range of x common to the most curves: ``(lo, hi, members)``, or None without a span.

    Each curve spans ``[min x, max x]`` of its points. The members are the largest set of
    curves whose spans share an interval of positive width (every span of positive width
    when they all overlap); among sets of that size, the one whose shared interval is
    widest (then the one lowest in x). Curves outside the set do not cover the range.

    Parameters
    ----------
    spans : mapping of str to (float, float)
        Curve label -> ``(lo, hi)``; spans with ``hi <= lo`` (one point) never cover a range.

    Returns
    -------
    (float, float, list of str) or None
        The shared interval ``[lo, hi]`` and its members in the mapping's order.
    """
    spans = {k: (float(a), float(b)) for k, (a, b) in spans.items() if b > a}
    if not spans:
        return None
    edges = sorted({e for span in spans.values() for e in span})
    best = None
    for a, b in zip(edges[:-1], edges[1:]):
        members = [k for k, (lo, hi) in spans.items() if lo <= a and b <= hi]
        if not members:
            continue
        lo, hi = max(spans[k][0] for k in members), min(spans[k][1] for k in members)
        key = (len(members), hi - lo, -lo)
        if best is None or key > best[0]:
            best = (key, (lo, hi, members))
    return best[1]


def range_mean(x: np.ndarray, y: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """Mean over ``[lo, hi]`` of the piecewise-linear interpolant of ``y`` over ``x`` (the last axis).

    Parameters
    ----------
    x : numpy.ndarray, shape (K,)
        Strictly ascending abscissae (KV bytes per prompt token) with ``x[0] <= lo`` and
        ``hi <= x[-1]``.
    y : numpy.ndarray, shape (..., K)
        Curve values (resamples along the leading axes).
    lo, hi : float
        The range; ``lo == hi`` gives the interpolated value there.

    Returns
    -------
    numpy.ndarray, shape (...)
        ``integral_lo^hi y(x) dx / (hi - lo)``, exactly (trapezoids between ``lo``, the
        points inside the range and ``hi``).

    Raises
    ------
    ValueError
        If the range lies outside ``[x[0], x[-1]]``.
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if not (x[0] <= lo <= hi <= x[-1]):
        raise ValueError(f"range [{lo:g}, {hi:g}] lies outside the curve's [{x[0]:g}, {x[-1]:g}]")
    at = np.unique(np.concatenate([[lo, hi], x[(x > lo) & (x < hi)]]))
    seg = np.clip(np.searchsorted(x, at, side="right") - 1, 0, x.size - 2) if x.size > 1 else np.zeros(at.size, int)
    weights = np.zeros((at.size, x.size))
    if x.size == 1:
        weights[:, 0] = 1.0
    else:
        t = (at - x[seg]) / (x[seg + 1] - x[seg])
        weights[np.arange(at.size), seg] = 1 - t
        weights[np.arange(at.size), seg + 1] += t
    values = y @ weights.T
    if at.size == 1:
        return values[..., 0]
    return trapezoid_area(at, values) / (hi - lo)


def _curve_values(pts, resampled, x, span, metric, boot: Bootstrap):
    """``(value, resamples)`` of the curve's mean over ``span = (lo, hi)`` (None: NaN) and of its area
    over the ratios (``pts`` in the order of ``x``; ``resampled``: policy -> metric -> resamples)."""
    nan = (np.float64(np.nan), np.full(boot.n_boot, np.nan))
    if not pts:
        return {"mean": nan, "area": nan}
    y = np.array([r[metric] for r in pts])
    yb = np.column_stack([resampled[r["policy"]][metric] for r in pts])
    order = np.argsort([r["compression_ratio"] for r in pts])
    ratios = np.array([pts[i]["compression_ratio"] for i in order])
    mean = nan if span is None else (range_mean(x, y, *span), range_mean(x, yb, *span))
    return {"mean": mean, "area": (trapezoid_area(ratios, y[order]), trapezoid_area(ratios, yb[:, order]))}


def _with_differences(rows, values, boot: Bootstrap):
    """``mean_*``, ``area_*`` with intervals, and their paired differences from the rank-1 curve."""
    best = rows[0]
    for r in rows:
        for m in ("E_M", "p_div"):
            for kind in ("mean", "area"):
                val, samples = values[r["curve"]][m][kind]
                bval, bsamples = values[best["curve"]][m][kind]
                lo, hi = boot.interval(samples)
                put_interval(r, f"{kind}_{m}", val, lo, hi)
                comparable = kind == "mean" or r["_ratios"] == best["_ratios"]
                dlo, dhi = boot.interval(samples - bsamples) if comparable else (math.nan, math.nan)
                r[f"diff_best_{kind}_{m}"] = float(val - bval) if comparable else math.nan
                r[f"diff_best_{kind}_{m}_lo"], r[f"diff_best_{kind}_{m}_hi"] = float(dlo), float(dhi)
    for r in rows:
        del r["_ratios"]


def curve_rows(points, resampled, xs, curves, head: Mapping[str, Any], boot: Bootstrap, in_bytes: bool):
    """Per-curve rows of one model, ranked by the mean ``E[M]`` over the common range.

    Parameters
    ----------
    points : list of dict
        The model's per-point rows (``policy``, ``compression_ratio``, ``above_floor``, ``E_M``, ``p_div``, ...).
    resampled : mapping
        Policy -> metric -> bootstrap resamples, shape ``(n_boot,)``, the same resamples for every policy.
    xs : mapping of str to float
        Policy -> abscissa: KV bytes per prompt token when ``in_bytes``, else retention.
    curves : mapping
        :func:`~kvdiverge.estimation.frontier.frontier_curves` of the grid (its order is the grid's).
    head : mapping
        The model's ``model``, ``split``, ``n_docs`` and ``T``.
    boot : kvdiverge.estimation.bootstrap.Bootstrap
        The intervals' settings.
    in_bytes : bool
        Whether ``xs`` are bytes (the ``bytes_*`` and ``range_*`` columns are NaN otherwise).

    Returns
    -------
    list of dict
        One per curve, the columns of ``AREA_SCHEMA`` in
        :func:`~kvdiverge.estimation.frontier.frontier_tables`' second table, ranked (``rank`` from 1).
    """
    by_policy = {r["policy"]: r for r in points}
    members = {
        label: sorted((by_policy[p] for p in c["policies"]), key=lambda r: xs[r["policy"]])
        for label, c in curves.items()
    }
    spans = {label: (xs[pts[0]["policy"]], xs[pts[-1]["policy"]]) for label, pts in members.items() if pts}
    common = common_range(spans)
    lo, hi, covering = common if common else (None, None, [])
    rows, values = [], {}
    for label, pts in members.items():
        x = np.array([xs[r["policy"]] for r in pts])
        inside = label in covering
        span = (lo, hi) if inside else None
        values[label] = {m: _curve_values(pts, resampled, x, span, m, boot) for m in ("E_M", "p_div")}
        ratios = sorted(r["compression_ratio"] for r in pts)
        above = [r["compression_ratio"] for r in pts if r["above_floor"]]
        rows.append(
            {
                "model": head["model"],
                "split": head["split"],
                "curve": label,
                "press": curves[label]["press"],
                "cache": curves[label]["cache"],
                "covers_range": inside,
                "n_docs": head["n_docs"],
                "T": head["T"],
                "n_ratios": len(pts),
                "ratio_min": ratios[0] if pts else math.nan,
                "ratio_max": ratios[-1] if pts else math.nan,
                "_ratios": ratios,
                "bytes_min": float(x[0]) if in_bytes and pts else math.nan,
                "bytes_max": float(x[-1]) if in_bytes and pts else math.nan,
                "range_lo": lo if in_bytes and lo is not None else math.nan,
                "range_hi": hi if in_bytes and hi is not None else math.nan,
                "first_ratio_above_floor": min(above) if above else math.nan,
                "above_floor_everywhere": bool(pts) and len(above) == len(pts),
            }
        )

    order = {label: i for i, label in enumerate(curves)}

    def key(r):
        if not r["covers_range"]:  # after the ranked curves, in grid order
            return (1, 0.0, 0.0, "", order[r["curve"]])
        e, p = (float(values[r["curve"]][m]["mean"][0]) for m in ("E_M", "p_div"))
        return (0, e, p, r["curve"], 0)

    rows.sort(key=key)
    for i, r in enumerate(rows, start=1):
        r["rank"] = i
    if rows:
        _with_differences(rows, values, boot)
    return rows
