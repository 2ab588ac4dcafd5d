"""The prediction figure: a task's accuracy drop against a fidelity measure taken on other documents.

One panel per measure (rows) and task with its question placement (columns); one point per
frontier point, coloured by press (the group the held-out analysis leaves out), at its oriented
measure (``x``) and its drop; the held-out prediction of each point (the isotonic fit on the other
presses) as a black cross on the same vertical. The panel's title gives the within-ratio Kendall
concordance and the held-out gain over the ratio alone, each with its Holm-adjusted permutation
p-value, the gain with its interval (:func:`kvdiverge.estimation.prediction.prediction_tables`).
"""

from __future__ import annotations

import os

import matplotlib.pyplot as plt
import polars as pl
import seaborn as sns

from kvdiverge.report.drawing import save_figure
from kvdiverge.report.task import LABELS

__all__ = ["plot_prediction", "prediction_figure"]


def _title(row: dict) -> str:
    return (
        f"{row['task']} ({row['placement']}): tau within ratio {row['kendall_within_ratio']:.2f} "
        f"(p {row['p_kendall_within_ratio_holm']:.3f} Holm)\n"
        f"gain over the ratio {row['mae_gain']:.3f} [{row['mae_gain_lo']:.3f}, {row['mae_gain_hi']:.3f}] "
        f"(p {row['p_mae_gain_holm']:.3f} Holm)"
    )


def _panel(ax, marks: pl.DataFrame, row: dict, legend: bool) -> None:
    frame = marks.to_pandas()
    sns.scatterplot(data=frame, x="x", y="drop", hue="press", ax=ax, s=28, legend=legend)
    ax.scatter(
        frame["x"], frame["predicted"], marker="x", color="black", s=18, lw=0.8, label="held out" if legend else None
    )
    ax.axhline(0, color="0.5", lw=0.6, ls=":")
    sign = "" if row["direction"] > 0 else "minus "
    ax.set_xlabel(sign + LABELS.get(row["measure"], row["measure"]) + " (fidelity documents)")
    ax.set_ylabel("accuracy drop (task documents)")
    ax.set_title(_title(row), fontsize=8)


def prediction_figure(table: pl.DataFrame, predictions: pl.DataFrame) -> plt.Figure:
    """The figure of :func:`kvdiverge.estimation.prediction.prediction_tables`' two tables: one panel
    per (measure, task, placement), measures as rows in the table's order."""
    measures = list(dict.fromkeys(table["measure"].to_list()))
    sides = list(dict.fromkeys(zip(table["task"].to_list(), table["placement"].to_list())))
    fig, axes = plt.subplots(
        len(measures), len(sides), figsize=(3.8 * len(sides), 3.2 * len(measures)), squeeze=False, layout="constrained"
    )
    for row in table.iter_rows(named=True):
        i, j = measures.index(row["measure"]), sides.index((row["task"], row["placement"]))
        keys = (pl.col("measure") == row["measure"]) & (pl.col("task") == row["task"])
        marks = predictions.filter(keys & (pl.col("placement") == row["placement"]))
        _panel(axes[i][j], marks, row, legend=(i, j) == (0, 0))
    if axes[0][0].get_legend() is not None:
        sns.move_legend(axes[0][0], "upper left", fontsize=6, title_fontsize=7)
    fig.suptitle("task accuracy drop against fidelity measured on other documents, one point per press and ratio")
    return fig


def plot_prediction(table: pl.DataFrame, predictions: pl.DataFrame, png: str | os.PathLike, pdf=None) -> None:
    """:func:`prediction_figure` written to ``png`` (and ``pdf``), atomically."""
    save_figure(prediction_figure(table, predictions), *[p for p in (png, pdf) if p])
