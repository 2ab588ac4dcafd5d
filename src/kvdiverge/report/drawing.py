"""What every figure of the report shares: the headless backend, saving (PNG, PDF, atomically),
facets, the runs' palette with the noise floor grey and dashed, lines with their interval bands."""

from __future__ import annotations

import os
from typing import Sequence

import matplotlib

if not os.environ.get("MPLBACKEND"):  # headless by default; a notebook's inline backend stays
    matplotlib.use("Agg")
import matplotlib.pyplot as plt
import polars as pl
import seaborn as sns

from kvdiverge.io.files import atomic_path

__all__ = ["FLOOR_COLORS", "empty_figure", "facets", "palette", "run_labels", "runs_with_bands", "save_figure"]


def save_figure(fig: plt.Figure, *paths: str | os.PathLike) -> None:
    """Write ``fig`` to each path atomically (temporary file, then rename) and close it.

    The format follows each path's suffix (``.png``, ``.pdf``, ``.svg``, ...).
    """
    for path in paths:
        fmt = os.path.splitext(os.fspath(path))[1].lstrip(".").lower() or "png"
        with atomic_path(path, suffix=f".{fmt}") as tmp:
            # no creation date in the PDF: the same data give the same bytes
            meta = {"CreationDate": None} if fmt == "pdf" else None
            fig.savefig(tmp, format=fmt, dpi=150, bbox_inches="tight", metadata=meta)
    plt.close(fig)


def empty_figure(message: str) -> plt.Figure:
    """A small figure without axes that says ``message`` (a figure with nothing to draw)."""
    fig, ax = plt.subplots(figsize=(5, 2))
    ax.axis("off")
    ax.text(0.5, 0.5, message, ha="center", va="center")
    return fig


def facets(n: int, width: float = 4.5, height: float = 3.5):
    """A figure of ``max(n, 1)`` panels in one row sharing the y axis (each ``width`` x ``height`` inches):
    (figure, axes)."""
    fig, axes = plt.subplots(1, max(n, 1), figsize=(width * max(n, 1), height), squeeze=False, sharey=True)
    return fig, axes[0]


#: Colours of the noise-floor control's runs (greys, dashed), apart from the policies'.
FLOOR_COLORS = ("#555555", "#999999")


def palette(runs: Sequence[str], floor_runs: Sequence[str] = ()) -> dict[str, tuple]:
    """Each run's colour: seaborn's palette for the policies in order, greys (``FLOOR_COLORS``) for the noise floor."""
    policies = [r for r in runs if r not in floor_runs]
    pal = dict(zip(policies, sns.color_palette(n_colors=max(len(policies), 1))))
    pal.update({r: FLOOR_COLORS[i % len(FLOOR_COLORS)] for i, r in enumerate(r for r in runs if r in floor_runs)})
    return pal


def runs_with_bands(ax, d, x: str, y: str, step: str | None = None, floor_runs: Sequence[str] = (), **line_kw) -> list:
    """One line per ``run`` with its interval band (columns ``<y>_lo``, ``<y>_hi``), line and band in the same colour.

    ``d`` is a pandas frame with a ``run`` column; ``step`` is passed to
    ``fill_between`` (e.g. ``"post"`` for step curves), ``line_kw`` to ``Axes.plot``.
    Runs in ``floor_runs`` (the noise floor) are drawn grey and dashed. Returns the lines, in
    the runs' sorted order, each labelled with its run.
    """
    runs = sorted(d["run"].unique())
    pal = palette(runs, floor_runs)
    if "marker" in line_kw:
        line_kw = {"mec": "white", "mew": 0.6, **line_kw}
    lines = []
    for run in runs:
        g = d[d["run"] == run].sort_values(x)
        dashes = (0, (4, 2)) if run in floor_runs else "-"
        lines += ax.plot(g[x], g[y], color=pal[run], ls=dashes, label=run, **line_kw)
        ax.fill_between(g[x], g[f"{y}_lo"], g[f"{y}_hi"], step=step, alpha=0.15, color=pal[run])
    return lines


def run_labels(frame: pl.DataFrame, floor: str | None = None) -> pl.DataFrame:
    """Add the legend label ``run``: ``policy (split)``, or ``policy`` when there is one split.

    The noise-floor policy ``floor`` is labelled "noise floor".
    """
    name = pl.col("policy")
    if floor:
        floor_label = "noise floor" if floor == "noise-floor" else f"noise floor ({floor})"
        name = pl.when(pl.col("policy") == pl.lit(floor)).then(pl.lit(floor_label)).otherwise(pl.col("policy"))
    if frame["split"].n_unique() > 1:
        return frame.with_columns((name + " (" + pl.col("split") + ")").alias("run"))
    return frame.with_columns(name.alias("run"))
