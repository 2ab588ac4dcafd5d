"""The survival figures: ``S_t`` of first divergence per policy and model
(:func:`~kvdiverge.report.survival.plot_survival`),
and the length figure, the EOS time's survival per side (:func:`~kvdiverge.report.survival.plot_length`), the noise
floor drawn
grey and dashed; :func:`~kvdiverge.report.survival.render_survival` draws the first into given Axes, to a path or
as a new
figure (:class:`kvdiverge.doors.results.Measurement`).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import polars as pl
import seaborn as sns
from matplotlib.lines import Line2D

from kvdiverge.report.coincide import legend_with_coinciding
from kvdiverge.report.drawing import (
    empty_figure,
    facets,
    palette,
    run_labels,
    runs_with_bands,
    save_figure,
)

__all__ = ["draw_survival", "length_figure", "plot_length", "plot_survival", "render_survival", "survival_figure"]


def draw_survival(ax, survival: pl.DataFrame, title: str | None = None, floor: str | None = None) -> None:
    """Draw survival curves ``S_t`` (steps ``t = 0..T``) with their bands on one axes.

    Curves that coincide (the controls at ``S_t = 1``, two policies that agree) get offset
    markers and a legend entry naming them (:func:`kvdiverge.report.coincide.legend_with_coinciding`).

    Parameters
    ----------
    ax : matplotlib.axes.Axes
        Target axes.
    survival : polars.DataFrame
        :func:`kvdiverge.estimation.pooling.survival_curve` rows of one model (any runs).
    title : str, optional
        Axes title (default: the model).
    floor : str, optional
        The noise-floor policy (config ``runs.floor.policy``): drawn grey and dashed,
        labelled "noise floor".
    """
    s = run_labels(survival, floor)
    multi = s["split"].n_unique() > 1
    floor_runs = s.filter(pl.col("policy") == floor)["run"].unique().to_list() if floor else []
    d = s.to_pandas()
    lines = runs_with_bands(ax, d, "t", "S", step="post", floor_runs=floor_runs, drawstyle="steps-post")
    ax.set(
        title=title if title is not None else ", ".join(sorted(s["model"].unique().to_list())),
        xlabel="step t (tokens generated)",
        ylabel="S_t = P(no divergence by t)",
        ylim=(0, 1.02),
    )
    legend_with_coinciding(
        ax,
        lines,
        title="policy (split)" if multi else "policy",
        fontsize="small",
        loc="upper center",
        bbox_to_anchor=(0.5, -0.16),
        ncol=2,
    )


def survival_figure(survival: pl.DataFrame, floor: str | None = None) -> plt.Figure:
    """Survival of first divergence per policy, one panel per model (:func:`draw_survival`).

    Parameters
    ----------
    survival : polars.DataFrame
        :func:`kvdiverge.estimation.pooling.survival_curve` output; bands are the bootstrap intervals.
    floor : str, optional
        The noise-floor policy, drawn grey and dashed.
    """
    sns.set_theme(style="whitegrid", context="paper")
    if survival.height == 0:
        return empty_figure("no runs")
    models = sorted(survival["model"].unique().to_list())
    fig, axes = facets(len(models))
    for ax, model in zip(axes, models):
        draw_survival(ax, survival.filter(pl.col("model") == model), title=model, floor=floor)
    fig.suptitle("Survival of first divergence")
    return fig


def plot_survival(survival: pl.DataFrame, png, pdf, floor: str | None = None) -> None:
    """Write :func:`survival_figure` as PNG and PDF.

    Parameters
    ----------
    survival : polars.DataFrame
        :func:`kvdiverge.estimation.pooling.survival_curve` output.
    png, pdf : path
        Outputs.
    floor : str, optional
        The noise-floor policy (config ``runs.floor.policy``), drawn grey and dashed.
    """
    save_figure(survival_figure(survival, floor), png, pdf)


def length_figure(survival: pl.DataFrame, floor: str | None = None) -> plt.Figure:
    """The EOS time's survival ``P(EOS step > t)`` per policy on each side, one panel per model: the
    compressed side solid, the paired full-cache side dashed, in the policy's colour.

    Curves that coincide (both sides of the `none` control, runs that never stop within the
    horizon) get offset markers and a legend entry naming them
    (:func:`kvdiverge.report.coincide.legend_with_coinciding`).

    Parameters
    ----------
    survival : polars.DataFrame
        :func:`kvdiverge.estimation.drift.length_survival` output.
    floor : str, optional
        The noise-floor policy, labelled "noise floor" and drawn grey.
    """
    sns.set_theme(style="whitegrid", context="paper")
    if survival.height == 0:
        return empty_figure("no runs")
    models = sorted(survival["model"].unique().to_list())
    fig, axes = facets(len(models))
    sides = (("compressed", "-"), ("full", (0, (4, 2))))
    for ax, model in zip(axes, models):
        s = run_labels(survival.filter(pl.col("model") == model), floor)
        runs = sorted(s["run"].unique().to_list())
        pal = palette(runs, s.filter(pl.col("policy") == floor)["run"].unique().to_list() if floor else [])
        lines = []
        for run in runs:
            for side, ls in sides:
                g = s.filter((pl.col("run") == run) & (pl.col("side") == side)).sort("t")
                lines += ax.plot(
                    g["t"], g["survival"], ls=ls, color=pal[run], drawstyle="steps-post", label=f"{run}, {side}"
                )
        ax.set(title=model, xlabel="step t (tokens generated)", ylabel="P(no EOS by t)", ylim=(0, 1.02))
        handles = [Line2D([], [], color=pal[r], label=r) for r in runs]
        handles += [Line2D([], [], color="black", ls=ls, label=f"{side} side") for side, ls in sides]
        legend_with_coinciding(
            ax,
            lines,
            handles,
            describe=_sides_merged,
            title="policy (split)" if s["split"].n_unique() > 1 else "policy",
            fontsize="small",
            loc="upper center",
            bbox_to_anchor=(0.5, -0.16),
            ncol=2,
        )
    fig.suptitle("Output length: survival of the end-of-sequence time (paired sides)")
    return fig


def _sides_merged(labels: list[str]) -> list[str]:
    """A group's ``"run, side"`` labels with a run's two sides as one, ``"run, both sides"``."""
    sides: dict[str, list[str]] = {}
    for label in labels:
        run, side = label.rsplit(", ", 1)
        sides.setdefault(run, []).append(side)
    return [f"{run}, both sides" if len(s) == 2 else f"{run}, {s[0]} side" for run, s in sides.items()]


def plot_length(survival: pl.DataFrame, png, pdf, floor: str | None = None) -> None:
    """Write :func:`length_figure` as PNG and PDF."""
    save_figure(length_figure(survival, floor), png, pdf)


def render_survival(survival: pl.DataFrame, target=None, title: str | None = None):
    """The survival figure into Axes, to a file or as a new figure.

    ``target`` Axes: :func:`draw_survival` into it (with ``title``), returns it; a path:
    :func:`survival_figure` written there (format from the suffix), returns the path; None:
    returns a new :func:`survival_figure`.
    """
    if hasattr(target, "plot") and hasattr(target, "figure"):
        draw_survival(target, survival, title=title)
        return target
    fig = survival_figure(survival)
    if target is None:
        return fig
    save_figure(fig, target)
    return Path(target)
