"""Frontiers: divergence against compression ratio, press by press, beside the noise floor.

A frontier runs each named press at several compression ratios (and optionally fixed
token budgets) on the same documents with common random numbers. Each (press, ratio) is an
ordinary policy named ``<press>@<ratio>`` (``snapkv@0.5``) or ``<press>@b<budget>``
(``snapkv@b128``): :func:`frontier_grid` makes the names, the config
(:func:`kvdiverge.study.config.expand_frontier`), the command line and
:func:`kvdiverge.measure` expand through it.

:func:`frontier_tables` turns the per-document estimates of those policies
(:func:`kvdiverge.estimation.estimators.document_estimates`) into

- one row per (model, press, point): ``p_div``, the mean and median first-divergence step,
  ``E[M]`` with its two terms ``p_div / T`` and ``(E[L] / T) rho`` and ``rho``, each with a
  document-bootstrap interval, the noise floor's values on the same documents and
  ``above_floor`` (:func:`kvdiverge.estimation.analysis.floor_comparison`);
- one row per (model, press): the trapezoid area under its ``p_div`` and ``E[M]`` curves
  over the compression ratios run, with intervals, ranked by the ``E[M]`` area (smallest
  first: the most faithful press), and each area's paired difference from the best press.

Every interval resamples documents with replacement, one set of resamples per model shared
by every press, ratio and the floor (paired): the documents and random numbers are common
to all of them, so the differences between presses are measured on equal footing.
Symbols are those of ``estimators.md`` (§2, §3).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import polars as pl

from kvdiverge.estimation.bootstrap import percentile_interval, resample_counts, resample_indices
from kvdiverge.estimation.decomposition import check_decomposition

__all__ = ["POINT_METRICS", "frontier_grid", "frontier_name", "frontier_tables", "measured_frontier", "trapezoid_area"]

#: Per-point metrics of the frontier table (each with ``_lo`` and ``_hi``).
POINT_METRICS = ("p_div", "tau_mean", "tau_median", "E_M", "first_mismatch_term", "exposure_rate_term", "rho")

#: Per-document columns a frontier reads.
_DOC_COLUMNS = ("p_div", "E_tau_div", "E_L", "E_N_post", "E_N", "E_M")


# --------------------------------------------------------------------------- the grid


def frontier_name(press: str, ratio: float | None = None, budget: int | None = None) -> str:
    """Policy name of one frontier point: ``press@<ratio>`` or ``press@b<budget>``.

    The ratio is written in the shortest ``%g`` form (``0.5``, ``0.25``, ``0``).

    Raises
    ------
    ValueError
        If not exactly one of ``ratio`` and ``budget`` is given.
    """
    if (ratio is None) == (budget is None):
        raise ValueError(f"frontier point of {press!r}: give exactly one of ratio or budget")
    return f"{press}@{float(ratio):g}" if ratio is not None else f"{press}@b{int(budget)}"


def frontier_grid(presses: Iterable[str], ratios: Sequence[float] = (),
                  budgets: Sequence[int] = ()) -> list[dict[str, Any]]:
    """Every (press, ratio) and (press, budget) point, in press order, then ratios, then budgets.

    Parameters
    ----------
    presses : iterable of str
        Press labels (config ``frontier.presses`` keys).
    ratios : sequence of float
        Compression ratios, fractions of prompt positions evicted, in ``[0, 1)``.
    budgets : sequence of int
        Fixed numbers of prompt positions kept (tokens), ``>= 1``.

    Returns
    -------
    list of dict
        ``{"policy", "press", "compression_ratio", "budget"}`` (the unused one None).

    Raises
    ------
    ValueError
        A ratio outside ``[0, 1)``, a budget below 1, or two points with the same name.
    """
    out: list[dict[str, Any]] = []
    for r in ratios:
        if not (isinstance(r, (int, float)) and not isinstance(r, bool) and 0 <= float(r) < 1):
            raise ValueError(f"compression ratio {r!r} is outside [0, 1)")
    for b in budgets:
        if not (isinstance(b, int) and not isinstance(b, bool) and b >= 1):
            raise ValueError(f"budget {b!r} is not an integer >= 1")
    for press in presses:
        out += [{"policy": frontier_name(press, ratio=r), "press": press, "compression_ratio": float(r),
                 "budget": None} for r in ratios]
        out += [{"policy": frontier_name(press, budget=b), "press": press, "compression_ratio": None,
                 "budget": int(b)} for b in budgets]
    names = [p["policy"] for p in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"frontier points share the names {dup}: give ratios that differ in %g form")
    return out


# --------------------------------------------------------------------------- statistics


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


def _median_step(f: np.ndarray) -> np.ndarray:
    """Median step of the conditional law ``f_t / p_div`` (rows of ``f``: steps 1..T); NaN without mass."""
    f = np.atleast_2d(f)
    mass = f.sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        c = np.cumsum(f, axis=1) / mass[:, None]
    step = (c < 0.5 - 1e-12).sum(axis=1) + 1.0
    return np.where(mass > 0, step, np.nan)


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def _point(g: pl.DataFrame, counts: np.ndarray, T: int) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """Pooled metrics of one point (documents in ``g``, sorted as ``counts``' columns) and their resamples."""
    X = {c: g[c].to_numpy().astype(np.float64) for c in _DOC_COLUMNS}
    F = np.asarray(g["f"].to_list(), dtype=np.float64).reshape(g.height, T)
    n = g.height

    def pooled(weights: np.ndarray) -> dict[str, np.ndarray]:
        m = {c: weights @ X[c] / n for c in _DOC_COLUMNS}
        return {"p_div": m["p_div"], "tau_mean": _ratio(m["E_tau_div"], m["p_div"]),
                "tau_median": _median_step(weights @ F / n), "E_M": m["E_M"],
                "first_mismatch_term": m["p_div"] / T, "exposure_rate_term": m["E_M"] - m["p_div"] / T,
                "rho": _ratio(m["E_N_post"], m["E_L"]), "E_L": m["E_L"], "E_N_post": m["E_N_post"]}

    point = {k: float(np.asarray(v).reshape(-1)[0]) for k, v in pooled(np.ones((1, n))).items()}
    check_decomposition(point["E_M"], point["p_div"], point["E_L"], point["E_N_post"], T,
                        where="frontier point")
    return point, pooled(counts)


def _with_intervals(row: dict[str, Any], point: Mapping[str, float], boot: Mapping[str, np.ndarray],
                    confidence: float, prefix: str = "") -> None:
    for m in POINT_METRICS:
        lo, hi = percentile_interval(boot[m], confidence)
        row[prefix + m], row[prefix + m + "_lo"], row[prefix + m + "_hi"] = point[m], float(lo), float(hi)


#: Column types of the per-point frontier table.
POINT_SCHEMA: dict[str, Any] = {
    "model": pl.String, "split": pl.String, "press": pl.String, "policy": pl.String,
    "compression_ratio": pl.Float64, "budget": pl.Int64, "retention": pl.Float64,
    "kept_fraction": pl.Float64, "n_docs": pl.Int64, "T": pl.Int64, "rank": pl.Int64,
    **{f"{m}{s}": pl.Float64 for m in POINT_METRICS for s in ("", "_lo", "_hi")},
    "floor": pl.String, "floor_n_docs": pl.Int64,
    **{f"floor_{m}{s}": pl.Float64 for m in POINT_METRICS for s in ("", "_lo", "_hi")},
    "above_floor_p_div": pl.Boolean, "above_floor_E_M": pl.Boolean, "above_floor": pl.Boolean,
}

#: Column types of the per-press area table.
AREA_SCHEMA: dict[str, Any] = {
    "model": pl.String, "split": pl.String, "press": pl.String, "rank": pl.Int64, "n_docs": pl.Int64,
    "T": pl.Int64, "n_ratios": pl.Int64, "ratio_min": pl.Float64, "ratio_max": pl.Float64,
    **{f"{pre}{m}{s}": pl.Float64 for pre in ("area_", "diff_best_area_") for m in ("E_M", "p_div")
       for s in ("", "_lo", "_hi")},
    "first_ratio_above_floor": pl.Float64, "above_floor_everywhere": pl.Boolean,
}


def frontier_tables(docs: pl.DataFrame, grid: Sequence[Mapping[str, Any]], floor: str | None, n_boot: int,
                    confidence: float, seed: int, split: str | None = None) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The frontier of every model: per-point table and per-press area ranking.

    Parameters
    ----------
    docs : polars.DataFrame
        Per-document estimates (:func:`kvdiverge.estimation.estimators.document_estimates`) of
        the grid's policies and the floor on one split (other rows are ignored); needs
        ``p_div``, ``E_tau_div``, ``E_L``, ``E_N_post``, ``E_N``, ``E_M``, ``tv_mean``,
        ``f`` (list, length T), ``prompt_len``, ``kept_len``.
    grid : sequence of mapping
        :func:`frontier_grid` rows (``policy``, ``press``, ``compression_ratio``, ``budget``).
    floor : str or None
        The noise-floor policy (``PermutationPress``); None: floor columns null and
        ``above_floor`` false.
    n_boot : int
        Bootstrap resamples.
    confidence : float
        Interval coverage in (0, 1).
    seed : int
        Master seed (the resamples derive from it, the model and the split).
    split : str, optional
        The frontier's split; default the only split of the grid's rows in ``docs``.

    Returns
    -------
    points : polars.DataFrame
        :data:`POINT_SCHEMA`: one row per (model, press, point), sorted by model, press rank,
        ratio (budgets after the ratios). ``retention = 1 - compression_ratio`` (a budget's:
        the mean kept fraction ``kept_len / prompt_len`` over documents); ``tau_mean`` and
        ``tau_median`` in steps (given divergence; NaN when nothing diverged); ``E_M`` a
        fraction of T; ``floor_*`` the floor's same metrics on the same documents;
        ``above_floor_p_div`` / ``above_floor_E_M``: the lower end of the paired interval of
        (point - floor) is above 0 (``floor_comparison``, its ``E_N`` for ``E_M``);
        ``above_floor`` both.
    areas : polars.DataFrame
        :data:`AREA_SCHEMA`: one row per (model, press), ranked by ``area_E_M``: the trapezoid
        areas over the ratio points (budgets do not enter; NaN with fewer than 2 ratios)
        with intervals, ``diff_best_area_*`` (area minus the rank-1 press's area, paired
        resamples), ``first_ratio_above_floor`` (smallest ratio above the floor; NaN if none)
        and ``above_floor_everywhere``.

    Raises
    ------
    ValueError
        No grid, a grid policy without estimates, policies of one model that do not share
        their documents, or more than one horizon T.
    kvdiverge.estimation.estimators.DecompositionError
        If the pooled §3 identity fails at a point.
    """
    from kvdiverge.estimation.analysis import floor_comparison

    if not grid:
        raise ValueError("a frontier needs at least one (press, ratio) point")
    names = [p["policy"] for p in grid]
    rows = docs.filter(pl.col("policy").is_in(names))
    if split is None:
        splits = rows["split"].unique().to_list()
        if len(splits) != 1:
            raise ValueError(f"frontier policies must run on one split, found {sorted(splits)}")
        split = splits[0]
    rows = rows.filter(pl.col("split") == split)
    fl_rows = docs.filter((pl.col("policy") == floor) & (pl.col("split") == split)) if floor else docs.clear()
    above = {}
    if floor and fl_rows.height:
        cmp = floor_comparison(pl.concat([rows, fl_rows], how="diagonal_relaxed"), floor, n_boot, confidence, seed)
        above = {(r["model"], r["policy"]): (r["above_floor_p_div"], r["above_floor_E_N"])
                 for r in cmp.iter_rows(named=True)}
    points, areas = [], []
    for model in rows["model"].unique(maintain_order=True).to_list():
        p, a = _model_frontier(rows.filter(pl.col("model") == model), fl_rows.filter(pl.col("model") == model),
                               grid, model, split, floor, above, n_boot, confidence, seed)
        points += p
        areas += a
    return (pl.DataFrame(points, schema=POINT_SCHEMA) if points else pl.DataFrame(schema=POINT_SCHEMA),
            pl.DataFrame(areas, schema=AREA_SCHEMA) if areas else pl.DataFrame(schema=AREA_SCHEMA))


def _model_frontier(rows: pl.DataFrame, fl_rows: pl.DataFrame, grid, model: str, split: str, floor,
                    above, n_boot: int, confidence: float, seed: int):
    """Per-point rows and per-press area rows of one model (see :func:`frontier_tables`)."""
    doc_sets = {}
    for p in grid:
        g = rows.filter(pl.col("policy") == p["policy"])
        if g.height == 0:
            raise ValueError(f"no per-document estimates for frontier policy {model}/{p['policy']}/{split}")
        doc_sets[p["policy"]] = tuple(sorted(g["doc_id"].to_list()))
    first = next(iter(doc_sets.values()))
    odd = [n for n, d in doc_sets.items() if d != first]
    if odd:
        raise ValueError(f"frontier policies of {model} must share their documents; {odd} differ from "
                         f"{grid[0]['policy']}")
    if rows["T"].n_unique() != 1:
        raise ValueError(f"frontier policies of {model} ran with different horizons T: {rows['T'].unique().to_list()}")
    T, n = int(rows["T"][0]), len(first)
    counts = resample_counts(resample_indices(n, n_boot, seed, "frontier", model, split))
    out, boots = [], {}
    for p in grid:
        g = rows.filter(pl.col("policy") == p["policy"]).sort("doc_id")
        point, boot = _point(g, counts, T)
        kept = float((g["kept_len"] / g["prompt_len"]).mean())
        r = {"model": model, "split": split, "press": p["press"], "policy": p["policy"],
             "compression_ratio": p["compression_ratio"], "budget": p["budget"],
             "retention": 1.0 - p["compression_ratio"] if p["budget"] is None else kept,
             "kept_fraction": kept, "n_docs": n, "T": T}
        _with_intervals(r, point, boot, confidence)
        ab = above.get((model, p["policy"]))
        r.update(floor=floor, above_floor_p_div=bool(ab and ab[0]), above_floor_E_M=bool(ab and ab[1]),
                 above_floor=bool(ab and ab[0] and ab[1]))
        out.append(r)
        boots[p["policy"]] = boot
    fl = fl_rows.filter(pl.col("doc_id").is_in(list(first))).sort("doc_id")
    if fl.height:
        fl_counts = counts if fl.height == n else resample_counts(
            resample_indices(fl.height, n_boot, seed, "frontier-floor", model, split))
        fpoint, fboot = _point(fl, fl_counts, T)
        for r in out:
            _with_intervals(r, fpoint, fboot, confidence, prefix="floor_")
            r["floor_n_docs"] = fl.height
    areas = _areas(out, boots, grid, model, split, n, T, confidence)
    rank = {a["press"]: a["rank"] for a in areas}
    for r in out:
        r["rank"] = rank[r["press"]]
    out.sort(key=lambda r: (r["rank"], r["budget"] is not None, r["compression_ratio"] or 0.0, r["budget"] or 0))
    return out, areas


def _areas(points, boots, grid, model, split, n, T, confidence):
    """Per-press area rows of one model, ranked by ``area_E_M`` (then ``area_p_div``, then name)."""
    presses = list(dict.fromkeys(p["press"] for p in grid))
    rows, curves = [], {}
    for press in presses:
        pts = sorted((r for r in points if r["press"] == press and r["budget"] is None),
                     key=lambda r: r["compression_ratio"])
        x = np.array([r["compression_ratio"] for r in pts])
        curves[press] = {m: (trapezoid_area(x, np.array([r[m] for r in pts])),
                             trapezoid_area(x, np.column_stack([boots[r["policy"]][m] for r in pts])
                                            if pts else np.zeros((1, 0))))
                         for m in ("E_M", "p_div")}
        above = [r["compression_ratio"] for r in pts if r["above_floor"]]
        rows.append({"model": model, "split": split, "press": press, "n_docs": n, "T": T, "n_ratios": len(pts),
                     "ratio_min": float(x.min()) if x.size else math.nan,
                     "ratio_max": float(x.max()) if x.size else math.nan,
                     "first_ratio_above_floor": min(above) if above else math.nan,
                     "above_floor_everywhere": bool(pts) and len(above) == len(pts)})

    def key(r):
        e, p = float(curves[r["press"]]["E_M"][0]), float(curves[r["press"]]["p_div"][0])
        return (math.isnan(e), e, math.isnan(p), p, r["press"])

    rows.sort(key=key)
    best = rows[0]["press"]
    for i, r in enumerate(rows, start=1):
        r["rank"] = i
        for m in ("E_M", "p_div"):
            val, boot = curves[r["press"]][m]
            bval, bboot = curves[best][m]
            lo, hi = percentile_interval(boot, confidence)
            r[f"area_{m}"], r[f"area_{m}_lo"], r[f"area_{m}_hi"] = float(val), float(lo), float(hi)
            dlo, dhi = percentile_interval(boot - bboot, confidence)
            r[f"diff_best_area_{m}"] = float(val - bval)
            r[f"diff_best_area_{m}_lo"], r[f"diff_best_area_{m}_hi"] = float(dlo), float(dhi)
    return rows


def measured_frontier(docs: pl.DataFrame, settings: Mapping[str, Any],
                      floor: str | None) -> tuple[pl.DataFrame, pl.DataFrame]:
    """:func:`frontier_tables` of a measurement made with ratios (its ``settings["frontier"]`` grid,
    ``bootstrap``, ``confidence``, ``seed`` and ``split``).

    Raises
    ------
    ValueError
        If the measurement has no frontier grid.
    """
    grid = settings.get("frontier")
    if not grid:
        raise ValueError("not a frontier: measure with ratios=[...] (kvdiverge measure --ratios ...)")
    s = settings
    return frontier_tables(docs, grid, floor, s["bootstrap"], s["confidence"], s["seed"], split=s["split"])
