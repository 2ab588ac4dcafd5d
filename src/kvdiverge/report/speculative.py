"""The speculative figure: tokens per target forward ``A_k + 1`` of a first draft block against
its length ``k``, beside the i.i.d. formula, and the accepted fraction ``A_k / k``
(:func:`kvdiverge.estimation.speculative.speculative_table`; :func:`~kvdiverge.report.speculative.plot_speculative`).
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import polars as pl
import seaborn as sns

from kvdiverge.report.drawing import (
    empty_figure,
    run_labels,
    runs_with_bands,
    save_figure,
)

__all__ = ["SPECULATIVE_PANELS", "draw_speculative", "plot_speculative", "speculative_figure"]


#: Panels of the speculative figure: column and axis label.
SPECULATIVE_PANELS = (
    ("tokens_per_forward", "tokens per target forward A_k + 1"),
    ("accepted_fraction", "accepted fraction of the block A_k / k"),
)


def draw_speculative(axes, table: pl.DataFrame, title: str | None = None, floor: str | None = None) -> None:
    """Draw one model's speculative reading on two axes (``SPECULATIVE_PANELS``).

    One line per run over the block length ``k`` with its document-bootstrap band; on the
    first panel the i.i.d. formula ``(1 - alpha^{k+1}) / (1 - alpha)`` of the same run is a
    thin dotted line of the same colour. The noise floor is grey and dashed.

    Parameters
    ----------
    axes : sequence of 2 matplotlib Axes
    table : polars.DataFrame
        :func:`kvdiverge.estimation.speculative.speculative_table` rows of one model.
    title : str, optional
        Panel title prefix (default: the model).
    floor : str, optional
        The noise-floor policy.
    """
    s = run_labels(table, floor)
    floor_runs = s.filter(pl.col("policy") == floor)["run"].unique().to_list() if floor else []
    d = s.to_pandas()
    title = title if title is not None else ", ".join(sorted(s["model"].unique().to_list()))
    for ax, (metric, label) in zip(axes, SPECULATIVE_PANELS):
        runs_with_bands(ax, d, "k", metric, floor_runs=floor_runs, marker="o")
        ax.set(xlabel="draft block length k (tokens)", ylabel=label, title=f"{title}: {metric}")
        ax.legend(fontsize="small", loc="best")
    colors = {line.get_label(): line.get_color() for line in axes[0].get_lines()}
    for run, g in d.groupby("run"):
        axes[0].plot(g["k"], g["iid_tokens_per_forward"], ls=":", lw=1, color=colors.get(run, "black"))
    axes[0].plot([], [], ls=":", lw=1, color="black", label="i.i.d. (1 − α^(k+1)) / (1 − α)")
    axes[0].legend(fontsize="small", loc="best")
    axes[1].set_ylim(0, 1.02)


def speculative_figure(table: pl.DataFrame, floor: str | None = None) -> plt.Figure:
    """The speculative figure: one row of two panels per model (:func:`draw_speculative`)."""
    sns.set_theme(style="whitegrid", context="paper")
    if table.height == 0:
        return empty_figure("no runs")
    models = sorted(table["model"].unique().to_list())
    fig, axes = plt.subplots(len(models), 2, figsize=(10, 4.0 * len(models)), squeeze=False)
    for row, model in zip(axes, models):
        draw_speculative(row, table.filter(pl.col("model") == model), title=model, floor=floor)
    fig.suptitle("Self-speculative reading: first draft block from the evicted cache, verified by the full cache")
    fig.tight_layout()
    return fig


def plot_speculative(table: pl.DataFrame, png, pdf=None, floor: str | None = None) -> None:
    """Write :func:`speculative_figure` as PNG (and PDF).

    Parameters
    ----------
    table : polars.DataFrame
        :func:`kvdiverge.estimation.speculative.speculative_table` output.
    png, pdf : path
        Outputs (``pdf`` optional).
    floor : str, optional
        The noise-floor policy, drawn grey and dashed.
    """
    save_figure(speculative_figure(table, floor), *[p for p in (png, pdf) if p is not None])
