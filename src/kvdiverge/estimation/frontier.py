"""Frontiers: divergence against compression ratio and KV bytes, press by press, beside the noise floor.

A frontier runs each named press at several compression ratios (and optionally fixed
token budgets), and optionally quantized KV caches alone and after each press, on the same
documents with common random numbers. Each point (:class:`FrontierPoint`) is an ordinary
policy; its name, the grid of points and the checks of a frontier's labels and values are the
study's (:mod:`kvdiverge.config.frontier`: ``frontier_name``, ``frontier_grid``,
``FrontierSpec``, ``frontier_problems``).

The points lie on **curves**, one knob varied at a fixed way of storing the cache
(:func:`frontier_curves`): each press at full precision over ``ratios``; each quantized
cache alone (one point); each press with each cache over ``cache_ratios``, whose ratio-0
point is the cache alone (a press at ratio 0 evicts nothing).

:func:`frontier_tables` turns the per-document estimates of those policies
(:func:`kvdiverge.estimation.estimators.document_estimates`) into

- one row per (model, point): ``p_div``, the mean and median first-divergence step,
  ``E[M]`` with its two terms ``p_div / T`` and ``(E[L] / T) rho`` and ``rho``, each with a
  document-bootstrap interval, the KV bytes stored per prompt token
  (:func:`~kvdiverge.estimation.kv_bytes.kv_bytes_per_element`), the noise floor's values on the same documents and
  ``above_floor`` (:func:`kvdiverge.estimation.floor.floor_comparison`);
- one row per (model, curve): the mean of its ``E[M]`` and ``p_div`` over the range of KV
  bytes per prompt token common to the ranked curves (linear interpolation in bytes,
  :func:`~kvdiverge.estimation.frontier_ranking.common_range`,
  :func:`~kvdiverge.estimation.frontier_ranking.range_mean`), with intervals, ranked by the ``E[M]`` mean
  (smallest first: the most faithful), each mean's paired difference from the best curve,
  and the trapezoid area under each curve over its compression ratios
  (:mod:`kvdiverge.estimation.frontier_ranking`).

Every interval resamples documents with replacement, one set of resamples per model shared
by every point and the floor (paired): the documents and random numbers are common to all
of them, so the differences between curves are measured on equal footing. Symbols are
those of ``estimators.md`` (§2, §3).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import polars as pl

from kvdiverge.estimation.bootstrap import Bootstrap, interval_columns, put_interval, resample_counts
from kvdiverge.estimation.decomposition import check_decomposition
from kvdiverge.estimation.floor import floor_comparison
from kvdiverge.estimation.frontier_ranking import curve_rows
from kvdiverge.estimation.kv_bytes import kv_bytes_per_element
from kvdiverge.estimation.numeric import safe_divide

__all__ = [
    "POINT_METRICS",
    "FrontierPoint",
    "frontier_curves",
    "frontier_tables",
    "measured_frontier",
]

#: Per-point metrics of the frontier table (each with ``_lo`` and ``_hi``).
POINT_METRICS = ("p_div", "tau_mean", "tau_median", "E_M", "first_mismatch_term", "exposure_rate_term", "rho")

#: Per-document columns a frontier reads.
_DOC_COLUMNS = ("p_div", "E_tau_div", "E_L", "E_N_post", "E_N", "E_M")


# --------------------------------------------------------------------------- points and curves


@dataclass(frozen=True)
class FrontierPoint:
    """One point of a frontier: the policy it runs as, and what it varies.

    Parameters
    ----------
    policy : str
        Policy name (:func:`kvdiverge.config.frontier.frontier_name`): ``<press>@<ratio>``, ``<press>@b<budget>``,
        ``<cache>`` or ``<press>@<ratio>+<cache>``.
    press : str or None
        Press label (config ``frontier.presses`` key); None for a quantized cache alone.
    compression_ratio : float or None
        Fraction of prompt positions evicted, in ``[0, 1)``; None at a budget point.
    budget : int or None
        Prompt positions kept (tokens); None at a ratio point.
    cache : str or None
        Quantized-cache label (config ``frontier.caches`` key); None at full precision.
    cache_settings : mapping or None
        The cache's ``backend``, ``nbits``, ``q_group_size``, ``residual_length``; None at
        full precision.
    """

    policy: str
    press: str | None
    compression_ratio: float | None
    budget: int | None = None
    cache: str | None = None
    cache_settings: Mapping[str, Any] | None = None

    @classmethod
    def of(cls, point: FrontierPoint | Mapping[str, Any]) -> FrontierPoint:
        """``point`` itself, or the point of a mapping of its fields (a workflow param, a saved settings record)."""
        if isinstance(point, cls):
            return point
        return cls(**{"cache": None, "cache_settings": None, **point})

    def as_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (Snakemake params, the settings record)."""
        out = asdict(self)
        out["cache_settings"] = None if self.cache_settings is None else dict(self.cache_settings)
        return out

    @property
    def curve(self) -> str:
        """Label of the curve the point belongs to by its press and cache (:func:`frontier_curves`)."""
        if self.cache is None:
            return self.press
        return self.cache if self.press is None else f"{self.press}+{self.cache}"


def frontier_curves(grid: Sequence[FrontierPoint | Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The curves of a grid: label -> ``{"press", "cache", "policies"}`` (policies in ratio order).

    ``<press>``: the press at full precision over its ratios (budgets are not on a curve);
    ``<cache>``: the cache alone (one point); ``<press>+<cache>``: the cache alone, which is
    the press at ratio 0, then the press at each cache ratio above 0 with the cache. In
    grid order: the presses, then per cache its own curve and one per press.
    """
    grid = [FrontierPoint.of(p) for p in grid]
    curves: dict[str, dict[str, Any]] = {}
    alone = {p.cache: p.policy for p in grid if p.press is None}
    for p in grid:
        curve = curves.setdefault(p.curve, {"press": p.press, "cache": p.cache, "policies": []})
        if p.budget is not None:
            continue  # a press with budgets only has a curve without points
        if p.press is not None and p.cache is not None and not curve["policies"] and p.cache in alone:
            curve["policies"].append(alone[p.cache])
        curve["policies"].append(p.policy)
    return curves


# --------------------------------------------------------------------------- statistics


def _median_step(f: np.ndarray) -> np.ndarray:
    """Median step of the conditional law ``f_t / p_div`` (rows of ``f``: steps 1..T); NaN without mass."""
    f = np.atleast_2d(f)
    mass = f.sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        c = np.cumsum(f, axis=1) / mass[:, None]
    step = (c < 0.5 - 1e-12).sum(axis=1) + 1.0
    return np.where(mass > 0, step, np.nan)


def _point(g: pl.DataFrame, counts: np.ndarray, T: int) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """Pooled metrics of one point (documents in ``g``, sorted as ``counts``' columns) and their resamples."""
    X = {c: g[c].to_numpy().astype(np.float64) for c in _DOC_COLUMNS}
    F = np.asarray(g["f"].to_list(), dtype=np.float64).reshape(g.height, T)
    n = g.height

    def pooled(weights: np.ndarray) -> dict[str, np.ndarray]:
        m = {c: weights @ X[c] / n for c in _DOC_COLUMNS}
        return {
            "p_div": m["p_div"],
            "tau_mean": safe_divide(m["E_tau_div"], m["p_div"]),
            "tau_median": _median_step(weights @ F / n),
            "E_M": m["E_M"],
            "first_mismatch_term": m["p_div"] / T,
            "exposure_rate_term": m["E_M"] - m["p_div"] / T,
            "rho": safe_divide(m["E_N_post"], m["E_L"]),
            "E_L": m["E_L"],
            "E_N_post": m["E_N_post"],
        }

    point = {k: float(np.asarray(v).reshape(-1)[0]) for k, v in pooled(np.ones((1, n))).items()}
    check_decomposition(point["E_M"], point["p_div"], point["E_L"], point["E_N_post"], T, where="frontier point")
    return point, pooled(counts)


def _with_intervals(
    row: dict[str, Any], point: Mapping[str, float], resampled: Mapping[str, np.ndarray], boot: Bootstrap, prefix=""
) -> None:
    for m in POINT_METRICS:
        lo, hi = boot.interval(resampled[m])
        put_interval(row, prefix + m, point[m], lo, hi)


#: Column types of the per-point frontier table.
POINT_SCHEMA: dict[str, Any] = {
    "model": pl.String,
    "split": pl.String,
    "press": pl.String,
    "cache": pl.String,
    "curve": pl.String,
    "curves": pl.List(pl.String),
    "policy": pl.String,
    "compression_ratio": pl.Float64,
    "budget": pl.Int64,
    "retention": pl.Float64,
    "kept_fraction": pl.Float64,
    "bits_per_element": pl.Float64,
    "kv_bytes_per_token": pl.Float64,
    "n_docs": pl.Int64,
    "T": pl.Int64,
    "rank": pl.Int64,
    **{c: pl.Float64 for m in POINT_METRICS for c in interval_columns(m)},
    "floor": pl.String,
    "floor_n_docs": pl.Int64,
    **{c: pl.Float64 for m in POINT_METRICS for c in interval_columns(f"floor_{m}")},
    "above_floor_p_div": pl.Boolean,
    "above_floor_E_M": pl.Boolean,
    "above_floor": pl.Boolean,
}

#: Column types of the per-curve table (the ranking).
AREA_SCHEMA: dict[str, Any] = {
    "model": pl.String,
    "split": pl.String,
    "curve": pl.String,
    "press": pl.String,
    "cache": pl.String,
    "rank": pl.Int64,
    "covers_range": pl.Boolean,
    "n_docs": pl.Int64,
    "T": pl.Int64,
    "n_ratios": pl.Int64,
    "ratio_min": pl.Float64,
    "ratio_max": pl.Float64,
    "bytes_min": pl.Float64,
    "bytes_max": pl.Float64,
    "range_lo": pl.Float64,
    "range_hi": pl.Float64,
    **{
        c: pl.Float64
        for pre in ("mean_", "diff_best_mean_", "area_", "diff_best_area_")
        for m in ("E_M", "p_div")
        for c in interval_columns(pre + m)
    },
    "first_ratio_above_floor": pl.Float64,
    "above_floor_everywhere": pl.Boolean,
}


def frontier_tables(
    docs: pl.DataFrame,
    grid: Sequence[FrontierPoint | Mapping[str, Any]],
    floor: str | None,
    boot: Bootstrap,
    split: str | None = None,
    kv_sizes: Mapping[str, Mapping[str, float]] | None = None,
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The frontier of every model: per-point table and per-curve ranking.

    Parameters
    ----------
    docs : polars.DataFrame
        Per-document estimates (:func:`kvdiverge.estimation.estimators.document_estimates`) of
        the grid's policies and the floor on one split (other rows are ignored); needs
        ``p_div``, ``E_tau_div``, ``E_L``, ``E_N_post``, ``E_N``, ``E_M``, ``tv_mean``,
        ``f`` (list, length T), ``prompt_len``, ``kept_len``.
    grid : sequence of FrontierPoint or mapping
        :func:`kvdiverge.config.frontier.frontier_grid`'s points, or mappings of their fields (:meth:`FrontierPoint.of`;
        without ``cache`` and ``cache_settings``, full precision).
    floor : str or None
        The noise-floor policy (``PermutationPress``); None: floor columns null and
        ``above_floor`` false.
    boot : kvdiverge.estimation.bootstrap.Bootstrap
        Settings of the document bootstrap (the resamples derive from its seed, the model and
        the split).
    split : str, optional
        The frontier's split; default the only split of the grid's rows in ``docs``.
    kv_sizes : mapping, optional
        Model -> ``{"elements_per_token": int, "element_bytes": int}``: key and value
        elements one token stores in the full-attention layers (``layers * kv_heads *
        head_dim * 2``) and the bytes of a full-precision element (the model's dtype);
        optional ``sliding_elements_per_token`` and ``sliding_window`` (tokens) for the
        sliding-window layers, which are never compressed. Needed for quantized-cache points;
        without it the bytes columns are null and the curves (full precision only) are
        compared over retention, which is proportional to their bytes (the same ranking).

    Returns
    -------
    points : polars.DataFrame
        ``POINT_SCHEMA``: one row per (model, point), sorted by model, curve rank, ratio
        (budgets after the ratios). ``retention = 1 - compression_ratio`` (a budget's: the
        mean kept fraction ``kept_len / prompt_len`` over documents); ``bits_per_element``
        ``8 * kv_bytes_per_element`` and ``kv_bytes_per_token = retention *
        elements_per_token * kv_bytes_per_element`` (:func:`~kvdiverge.estimation.kv_bytes.kv_bytes_per_element`);
        ``curve`` the point's own curve and ``curves`` every curve it lies on
        (:func:`frontier_curves`; a cache alone lies on each press's curve with that cache);
        ``tau_mean`` and ``tau_median`` in steps (given divergence; NaN when nothing
        diverged); ``E_M`` a fraction of T; ``floor_*`` the floor's same metrics on the same
        documents; ``above_floor_p_div`` / ``above_floor_E_M``: the lower end of the paired
        interval of (point - floor) is above 0 (``floor_comparison``, its ``E_N`` for
        ``E_M``); ``above_floor`` both.
    areas : polars.DataFrame
        ``AREA_SCHEMA``: one row per (model, curve). ``range_lo``, ``range_hi``: the
        KV bytes per prompt token common to the ranked curves
        (:func:`~kvdiverge.estimation.frontier_ranking.common_range`);
        ``covers_range``: the curve is one of them; ``mean_*``: the mean of its ``E[M]``
        (``p_div``) over that range, interpolated linearly in bytes
        (:func:`~kvdiverge.estimation.frontier_ranking.range_mean`),
        with intervals; ranked by ``mean_E_M`` (then ``mean_p_div``, then the label), the
        curves that do not cover the range after the others, in grid order (their ``mean_*``
        NaN); ``diff_best_mean_*``: mean minus the rank-1 curve's mean (paired resamples);
        ``bytes_min``/``bytes_max``: the curve's own span; ``area_*``: the trapezoid area
        over the curve's compression ratios (NaN with fewer than 2), ``diff_best_area_*``
        its difference from the rank-1 curve's where both have the same ratios (else NaN);
        ``first_ratio_above_floor`` (smallest ratio above the floor; NaN if none) and
        ``above_floor_everywhere``. An eviction-only frontier (every press at the same
        ratios) ranks as by the ``E[M]`` area: the mean over the common range is the area
        divided by the span.

    Raises
    ------
    ValueError
        No grid, a grid policy without estimates, policies of one model that do not share
        their documents, more than one horizon T, or quantized-cache points without the
        model's ``kv_sizes``.
    kvdiverge.estimation.estimators.DecompositionError
        If the pooled §3 identity fails at a point.
    """
    if not grid:
        raise ValueError("a frontier needs at least one (press, ratio) point")
    grid = [FrontierPoint.of(p) for p in grid]
    names = [p.policy for p in grid]
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
        cmp = floor_comparison(pl.concat([rows, fl_rows], how="diagonal_relaxed"), floor, boot)
        above = {
            (r["model"], r["policy"]): (r["above_floor_p_div"], r["above_floor_E_N"]) for r in cmp.iter_rows(named=True)
        }
    points, areas = [], []
    for model in rows["model"].unique(maintain_order=True).to_list():
        beside = _Floor(floor, fl_rows.filter(pl.col("model") == model), above)
        sizes = (kv_sizes or {}).get(model)
        p, a = _model_frontier(rows.filter(pl.col("model") == model), grid, beside, model, split, boot, sizes)
        points += p
        areas += a
    return (
        pl.DataFrame(points, schema=POINT_SCHEMA) if points else pl.DataFrame(schema=POINT_SCHEMA),
        pl.DataFrame(areas, schema=AREA_SCHEMA) if areas else pl.DataFrame(schema=AREA_SCHEMA),
    )


def _shared_documents(rows: pl.DataFrame, grid, model: str, split: str) -> tuple[str, ...]:
    """The documents every grid policy of one model ran on (the same for all, else ValueError)."""
    doc_sets = {}
    for p in grid:
        g = rows.filter(pl.col("policy") == p.policy)
        if g.height == 0:
            raise ValueError(f"no per-document estimates for frontier policy {model}/{p.policy}/{split}")
        doc_sets[p.policy] = tuple(sorted(g["doc_id"].to_list()))
    first = next(iter(doc_sets.values()))
    odd = [n for n, d in doc_sets.items() if d != first]
    if odd:
        raise ValueError(f"frontier policies of {model} must share their documents; {odd} differ from {grid[0].policy}")
    if rows["T"].n_unique() != 1:
        raise ValueError(f"frontier policies of {model} ran with different horizons T: {rows['T'].unique().to_list()}")
    return first


def _point_row(g: pl.DataFrame, p: FrontierPoint, curves, head: Mapping[str, Any], sizes):
    """The point's identity, retention and KV bytes (:func:`~kvdiverge.estimation.kv_bytes.kv_bytes_per_element`),
    and its abscissa.

    ``head``: the model's ``model``, ``split``, ``n_docs`` and ``T``; ``sizes``: its KV sizes or None.
    """
    kept = float((g["kept_len"] / g["prompt_len"]).mean())
    retention = 1.0 - p.compression_ratio if p.budget is None else kept
    on = [label for label, c in curves.items() if p.policy in c["policies"]]
    r = {
        "model": head["model"],
        "split": head["split"],
        "press": p.press,
        "cache": p.cache,
        "curve": p.curve,
        "curves": on,
        "policy": p.policy,
        "compression_ratio": p.compression_ratio,
        "budget": p.budget,
        "retention": retention,
        "kept_fraction": kept,
        "n_docs": head["n_docs"],
        "T": head["T"],
    }
    if sizes is None:
        return r, retention
    per_element = kv_bytes_per_element(p.cache_settings, sizes["element_bytes"])
    r["bits_per_element"] = 8 * per_element
    r["kv_bytes_per_token"] = (retention * float(sizes["elements_per_token"]) + _sliding(g, sizes)) * per_element
    return r, r["kv_bytes_per_token"]


def _sliding(g: pl.DataFrame, sizes) -> float:
    """Elements per prompt token of the sliding-window layers, never compressed: each keeps
    ``min(prompt_len, sliding_window - 1)`` of a document's prompt, as transformers'
    ``DynamicSlidingWindowLayer`` does (the query is the window's last token; mean over documents)."""
    window, elements = int(sizes.get("sliding_window", 0)), float(sizes.get("sliding_elements_per_token", 0))
    if not window or not elements:
        return 0.0
    return elements * float((g["prompt_len"].clip(upper_bound=window - 1) / g["prompt_len"]).mean())


@dataclass(frozen=True)
class _Floor:
    """The noise floor beside one model's frontier (internal).

    ``name``: its policy, or None; ``rows``: its per-document estimates on the model and
    split; ``above``: ``(model, policy)`` -> whether the point lies above the floor in
    ``p_div`` and in ``E_N`` (:func:`kvdiverge.estimation.floor.floor_comparison`).
    """

    name: str | None
    rows: pl.DataFrame
    above: Mapping[tuple[str, str], tuple[bool, bool]]


def _model_frontier(rows: pl.DataFrame, grid, floor: _Floor, model: str, split: str, boot: Bootstrap, sizes=None):
    """Per-point rows and per-curve rows of one model (see :func:`frontier_tables`)."""
    if sizes is None and any(p.cache is not None for p in grid):
        raise ValueError(
            f"frontier of {model}: quantized-cache points need kv_sizes[{model!r}] "
            f"(elements_per_token and element_bytes) to count their KV bytes"
        )
    first = _shared_documents(rows, grid, model, split)
    T, n = int(rows["T"][0]), len(first)
    head = {"model": model, "split": split, "n_docs": n, "T": T}
    counts = resample_counts(boot.indices(n, "frontier", model, split))
    curves = frontier_curves(grid)
    out, resampled, xs = [], {}, {}
    for p in grid:
        g = rows.filter(pl.col("policy") == p.policy).sort("doc_id")
        point, resampled[p.policy] = _point(g, counts, T)
        r, xs[p.policy] = _point_row(g, p, curves, head, sizes)
        _with_intervals(r, point, resampled[p.policy], boot)
        ab = floor.above.get((model, p.policy))
        r.update(
            floor=floor.name,
            above_floor_p_div=bool(ab and ab[0]),
            above_floor_E_M=bool(ab and ab[1]),
            above_floor=bool(ab and ab[0] and ab[1]),
        )
        out.append(r)
    fl = floor.rows.filter(pl.col("doc_id").is_in(list(first))).sort("doc_id")
    if fl.height:
        fl_counts = (
            counts if fl.height == n else resample_counts(boot.indices(fl.height, "frontier-floor", model, split))
        )
        fpoint, fresampled = _point(fl, fl_counts, T)
        for r in out:
            _with_intervals(r, fpoint, fresampled, boot, prefix="floor_")
            r["floor_n_docs"] = fl.height
    areas = curve_rows(out, resampled, xs, curves, head, boot, sizes is not None)
    rank = {a["curve"]: a["rank"] for a in areas}
    for r in out:
        r["rank"] = rank.get(r["curve"])
    out.sort(key=lambda r: (r["rank"] or 0, r["budget"] is not None, r["compression_ratio"] or 0.0, r["budget"] or 0))
    return out, areas


def measured_frontier(
    docs: pl.DataFrame, grid, floor: str | None, boot: Bootstrap, split: str, kv_sizes=None
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """:func:`frontier_tables` of a measurement made with ratios: its frontier ``grid`` (None or empty without
    one), document bootstrap ``boot``, ``split`` and ``kv_sizes``: ``{model: {"elements_per_token",
    "element_bytes"}}``.

    Raises
    ------
    ValueError
        If the measurement has no frontier grid.
    """
    if not grid:
        raise ValueError("not a frontier: measure with ratios=[...] (kvdiverge measure --ratios ...)")
    return frontier_tables(docs, grid, floor, boot, split=split, kv_sizes=kv_sizes)
