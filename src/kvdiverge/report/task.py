"""The task figure: accuracy drop against each fidelity measure, one panel per measure.

One point per press and ratio (a run of :func:`kvdiverge.estimation.task.accuracy_table`,
controls left out) with the drop's document-bootstrap interval as a vertical bar, the noise
floor's mean of the measure and its interval as a grey band, and Spearman's rho with its
interval in the panel's title (:func:`kvdiverge.estimation.task.correlation_table`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
import polars as pl
import seaborn as sns

from kvdiverge.report.drawing import save_figure

__all__ = ["plot_task", "task_figure"]

LABELS = {
    "E_M": "E[M] (mismatch fraction)",
    "p_div": "p_div",
    "tau_first": "first-divergence step",
    "S_answer": "survival at answer length",
    "kld_mean": "mean KLD (nats)",
    "same_top_p": "same top p",
    "ppl_ratio": "PPL ratio",
}


def _panel(ax, points: pl.DataFrame, corr: dict, m: str) -> None:
    if np.isfinite(corr.get("floor", np.nan)):
        ax.axvspan(corr["floor_lo"], corr["floor_hi"], color="0.85", zorder=0, label="noise floor")
    press = points["policy"].str.split("@").list.first()
    frame = points.with_columns(press.alias("press")).to_pandas()
    sns.scatterplot(data=frame, x=m, y="drop", hue="press", ax=ax, s=30, legend=ax is ax.figure.axes[0])
    x, y = points[m].to_numpy(), points["drop"].to_numpy()
    err = [y - points["drop_lo"].to_numpy(), points["drop_hi"].to_numpy() - y]
    ax.errorbar(x, y, yerr=err, fmt="none", ecolor="0.6", lw=0.8, zorder=1)
    ax.axhline(0, color="0.5", lw=0.6, ls=":")
    ax.set_xlabel(LABELS.get(m, m))
    ax.set_ylabel("accuracy drop")
    rho = corr.get("spearman", np.nan)
    ax.set_title(
        f"rho = {rho:.2f} [{corr.get('spearman_lo', np.nan):.2f}, {corr.get('spearman_hi', np.nan):.2f}]", fontsize=9
    )


def task_figure(accuracy: pl.DataFrame, correlations: pl.DataFrame, controls: Sequence[str] = ()) -> plt.Figure:
    """The figure (one model and split: the first of ``correlations``), one panel per measure."""
    measures = correlations["measure"].to_list()
    model, split = correlations["model"][0], correlations["split"][0]
    points = accuracy.filter(
        (pl.col("model") == model) & (pl.col("split") == split) & ~pl.col("policy").is_in(list(controls))
    )
    fig, axes = plt.subplots(1, len(measures), figsize=(3.6 * len(measures), 3.4), squeeze=False)
    for ax, row in zip(axes[0], correlations.iter_rows(named=True)):
        _panel(ax, points, row, row["measure"])
    fig.suptitle(f"{model} / {split}: accuracy drop against fidelity, one point per press and ratio", fontsize=10)
    if axes[0][0].get_legend() is not None:
        sns.move_legend(axes[0][0], "upper left", fontsize=6, title_fontsize=7)
    fig.tight_layout()
    return fig


def plot_task(
    accuracy: pl.DataFrame, correlations: pl.DataFrame, png: str | os.PathLike, pdf=None, controls: Sequence[str] = ()
) -> None:
    """:func:`task_figure` written to ``png`` (and ``pdf``), atomically."""
    fig = task_figure(accuracy, correlations, controls)
    save_figure(fig, *[p for p in (png, pdf) if p])
