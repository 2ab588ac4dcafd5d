"""The frontier figure: ``p_div``, ``E[M]`` and the mean first-divergence step against
retention, one line per press, or, with quantized-cache points, against the KV bytes stored per
prompt token, one line per curve; the noise floor as a grey band
(:func:`kvdiverge.estimation.frontier.frontier_tables`; :func:`~kvdiverge.report.frontier.plot_frontier`).
:func:`~kvdiverge.report.frontier.render_frontier`
draws it into given Axes, to a path or as a new figure.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import matplotlib.ticker
import numpy as np
import polars as pl
import seaborn as sns

from kvdiverge.report.drawing import (
    FLOOR_COLORS,
    empty_figure,
    save_figure,
)

__all__ = ["FRONTIER_PANELS", "draw_frontier", "frontier_figure", "frontier_panels", "plot_frontier", "render_frontier"]


#: Panels of the frontier figure: metric column and axis label.
FRONTIER_PANELS = (
    ("p_div", "p_div = P(divergence within T)"),
    ("E_M", "E[M] (mismatch fraction of T)"),
    ("tau_mean", "mean first-divergence step (given divergence)"),
)

#: The frontier figure's optional panel, drawn where the points carry the teacher-forced mean KLD.
TEACHER_PANEL = ("kld_mean", "teacher-forced mean KLD (nats per token)")


#: The frontier figure's optional panel, drawn where the points carry the length ratio (length drift).
LENGTH_PANEL = ("length_ratio", "mean length, compressed / full (paired)")


def frontier_panels(points: pl.DataFrame) -> tuple[tuple[str, str], ...]:
    """``FRONTIER_PANELS``, ``TEACHER_PANEL`` where ``points`` has a non-null ``kld_mean`` and ``LENGTH_PANEL``
    where it has a non-null ``length_ratio``."""
    teacher = "kld_mean" in points.columns and points["kld_mean"].is_not_null().any()
    length = "length_ratio" in points.columns and points["length_ratio"].is_not_null().any()
    return FRONTIER_PANELS + ((TEACHER_PANEL,) if teacher else ()) + ((LENGTH_PANEL,) if length else ())


def draw_frontier(axes, points: pl.DataFrame, title: str | None = None) -> None:
    """Draw one model's frontier on three to five axes (:func:`frontier_panels`).

    Without quantized-cache points, each press is a line over retention ``1 -
    compression_ratio`` with its interval band, in rank order (legend: rank, press);
    fixed-budget points are open markers at their mean kept fraction, with error bars.
    With cache points, every curve is drawn against the KV bytes stored per prompt token
    (log scale, ``_draw_byte_curves``): full-precision eviction and quantized curves
    together. The noise floor (the same metric of the permutation control on the same
    documents) is a grey band with a grey dashed line.

    Parameters
    ----------
    axes : sequence of matplotlib Axes
        One per panel of :func:`frontier_panels`.
    points : polars.DataFrame
        :func:`kvdiverge.estimation.frontier.frontier_tables` points of one model, with the
        teacher-forced columns or without them.
    title : str, optional
        Prefix of the panel titles (default: the model).
    """
    title = title if title is not None else ", ".join(sorted(points["model"].unique().to_list()))
    in_bytes = "cache" in points.columns and points["cache"].is_not_null().any()
    for ax, (metric, label) in zip(axes, frontier_panels(points)):
        _floor_band(ax, points, metric)
        if in_bytes:
            _draw_byte_curves(ax, points, metric)
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
            ax.set(xlabel="KV bytes stored per prompt token (log scale)")
        else:
            _draw_ratio_curves(ax, points, metric)
            ax.set(xlabel="retention = 1 − compression ratio")
        ax.set(ylabel=label, title=f"{title}: {metric}")
        if metric in ("p_div", "E_M", "kld_mean"):
            ax.set_ylim(bottom=0)
        if metric == "length_ratio":
            ax.axhline(1.0, color="black", lw=0.8, ls=":")  # no change of length
    axes[0].legend(fontsize="small", loc="best")


def _floor_band(ax, points: pl.DataFrame, metric: str) -> None:
    """The noise floor's ``metric`` on the frontier's documents: grey band and dashed line."""
    if f"floor_{metric}" not in points.columns:
        return
    floor = points.filter(pl.col(f"floor_{metric}").is_not_null() & pl.col(f"floor_{metric}").is_not_nan())
    if floor.height:
        f = floor.row(0, named=True)
        if f"floor_{metric}_lo" in f:
            ax.axhspan(f[f"floor_{metric}_lo"], f[f"floor_{metric}_hi"], color="#bbbbbb", alpha=0.5, lw=0)
        ax.axhline(
            f[f"floor_{metric}"], color=FLOOR_COLORS[0], ls=(0, (4, 2)), lw=1, label=f"noise floor ({f['floor']})"
        )


def _error_marker(ax, x, r, metric, color, **style) -> None:
    """``r[metric]`` at ``x`` with its interval (``<metric>_lo``, ``<metric>_hi``) as an error bar; ``style``:
    ``marker`` (default ``"o"``), ``face`` (the marker's fill, default white), ``label``."""
    v = r[metric]
    if v is not None and np.isfinite(v):
        ax.errorbar(
            x,
            v,
            yerr=[[max(v - r[f"{metric}_lo"], 0)], [max(r[f"{metric}_hi"] - v, 0)]],
            fmt=style.get("marker", "o"),
            mfc=style.get("face", "white"),
            color=color,
            ms=5,
            capsize=2,
            label=style.get("label"),
        )


def _draw_ratio_curves(ax, points: pl.DataFrame, metric: str) -> None:
    """Each press over retention with its band, in rank order; budget points as open markers."""
    presses = points.sort(["rank", "press"])["press"].unique(maintain_order=True).to_list()
    pal = dict(zip(presses, sns.color_palette(n_colors=max(len(presses), 1))))
    for press in presses:
        g = points.filter(pl.col("press") == press)
        curve = g.filter(pl.col("budget").is_null()).sort("retention")
        if curve.height:
            ax.plot(
                curve["retention"],
                curve[metric],
                marker="o",
                ms=4,
                color=pal[press],
                label=f"{curve['rank'][0]}. {press}",
            )
            ax.fill_between(
                curve["retention"], curve[f"{metric}_lo"], curve[f"{metric}_hi"], color=pal[press], alpha=0.15, lw=0
            )
        for r in g.filter(pl.col("budget").is_not_null()).iter_rows(named=True):
            _error_marker(ax, r["retention"], r, metric, pal[press])


#: Line styles and markers of the quantized caches, in cache order (full precision: solid, circles).
_CACHE_STYLES = (((0, (5, 2)), "s"), ((0, (1, 1.5)), "^"), ((0, (5, 2, 1, 2)), "D"), ((0, (3, 1, 1, 1, 1, 1)), "v"))


def _draw_byte_curves(ax, points: pl.DataFrame, metric: str) -> None:
    """Every curve against KV bytes per prompt token: a press's colour, a cache's line style and
    marker; a cache alone (one point) a filled marker of its own; budget points open markers."""
    presses = [p for p in points.sort("rank")["press"].unique(maintain_order=True).to_list() if p is not None]
    caches = [c for c in points["cache"].unique(maintain_order=True).to_list() if c is not None]
    pal = dict(zip(presses, sns.color_palette(n_colors=max(len(presses), 1))))
    style = {None: ("-", "o"), **{c: _CACHE_STYLES[i % len(_CACHE_STYLES)] for i, c in enumerate(caches)}}
    rank = dict(zip(points["curve"], points["rank"]))
    labels = points.sort("rank")["curves"].explode().drop_nulls().unique(maintain_order=True).to_list()
    for label in sorted(labels, key=lambda c: rank.get(c) or 0):
        curve = points.filter(pl.col("curves").list.contains(label)).sort("kv_bytes_per_token")
        own = points.filter(pl.col("curve") == label).row(0, named=True)
        ls, marker = style[own["cache"]]
        if own["press"] is None:  # a cache alone
            alone = {"marker": marker, "face": "black", "label": f"{rank.get(label)}. {label} (alone)"}
            _error_marker(ax, own["kv_bytes_per_token"], own, metric, "black", **alone)
            continue
        color = pal[own["press"]]
        ax.plot(
            curve["kv_bytes_per_token"],
            curve[metric],
            ls=ls,
            marker=marker,
            ms=4,
            color=color,
            label=f"{rank.get(label)}. {label}",
        )
        ax.fill_between(
            curve["kv_bytes_per_token"], curve[f"{metric}_lo"], curve[f"{metric}_hi"], color=color, alpha=0.12, lw=0
        )
    for r in points.filter(pl.col("budget").is_not_null()).iter_rows(named=True):
        _error_marker(ax, r["kv_bytes_per_token"], r, metric, pal[r["press"]])


def frontier_figure(points: pl.DataFrame) -> plt.Figure:
    """The frontier figure: one row of panels per model (:func:`draw_frontier`, :func:`frontier_panels`).

    Parameters
    ----------
    points : polars.DataFrame
        :func:`kvdiverge.estimation.frontier.frontier_tables` points (any models).
    """
    sns.set_theme(style="whitegrid", context="paper")
    if points.height == 0:
        return empty_figure("no frontier points")
    models = sorted(points["model"].unique().to_list())
    n = len(frontier_panels(points))
    fig, axes = plt.subplots(len(models), n, figsize=(14 * n / 3, 4.2 * len(models)), squeeze=False)
    for row, model in zip(axes, models):
        draw_frontier(row, points.filter(pl.col("model") == model), title=model)
    in_bytes = "cache" in points.columns and points["cache"].is_not_null().any()
    fig.suptitle(
        "Frontier: divergence against KV bytes stored per prompt token, eviction and quantized caches "
        "(bands: bootstrap intervals; grey: noise floor)"
        if in_bytes
        else "Frontier: divergence against retention, press by press (bands: bootstrap intervals; grey: noise floor)"
    )
    fig.tight_layout()
    return fig


def plot_frontier(points: pl.DataFrame, png, pdf=None) -> None:
    """Write :func:`frontier_figure` as PNG (and PDF).

    Parameters
    ----------
    points : polars.DataFrame
        :func:`kvdiverge.estimation.frontier.frontier_tables` points.
    png, pdf : path
        Outputs (``pdf`` optional).
    """
    save_figure(frontier_figure(points), *[p for p in (png, pdf) if p is not None])


def render_frontier(points: pl.DataFrame, target=None, title: str | None = None):
    """The frontier figure into three Axes, to a file or as a new figure.

    ``target`` a sequence (or array) of Axes: :func:`draw_frontier` into them (with ``title``),
    returns ``target``; a path: :func:`frontier_figure` written there, returns the path;
    None: returns a new :func:`frontier_figure`.
    """
    if isinstance(target, (list, tuple)) or hasattr(target, "flat"):
        draw_frontier(list(getattr(target, "flat", target)), points, title=title)
        return target
    fig = frontier_figure(points)
    if target is None:
        return fig
    save_figure(fig, target)
    return Path(target)
