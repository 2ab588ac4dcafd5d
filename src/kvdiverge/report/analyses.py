"""The figures of the analysis tables (``docs/estimators.md`` §5–§8).

- :func:`~kvdiverge.report.analyses.plot_gaps` — stacked gap decomposition (first-mismatch, exposure, rate) with
  paired-bootstrap intervals (§7).
- :func:`~kvdiverge.report.analyses.plot_branch_tv` — branch-aligned TV against lag since divergence, with the
  confirmatory early/late windows shaded (§6, §8).
- :func:`~kvdiverge.report.analyses.plot_confirmatory` — per-document late − early differences (§8), with the noise
  floor's mean difference beside them.
- :func:`~kvdiverge.report.analyses.plot_variance` — naive vs conditional Monte Carlo variance per document (§5).
"""

from __future__ import annotations

from typing import Sequence

import matplotlib.pyplot as plt
import numpy as np
import polars as pl
import seaborn as sns

from kvdiverge.report.coincide import legend_with_coinciding
from kvdiverge.report.drawing import (
    FLOOR_COLORS,
    empty_figure,
    facets,
    runs_with_bands,
    save_figure,
)

__all__ = ["plot_branch_tv", "plot_confirmatory", "plot_gaps", "plot_variance"]


TERM_LABELS = {"first_mismatch": "first mismatch", "exposure": "exposure", "rate": "rate"}
TERM_COLORS = {"first_mismatch": "#4c72b0", "exposure": "#dd8452", "rate": "#55a868"}


def plot_gaps(gaps: pl.DataFrame, png, pdf) -> None:
    """Stacked gap decomposition with paired-bootstrap intervals (the table's coverage), one panel per model.

    Each bar stacks the first-mismatch, exposure and rate terms (positive terms upward,
    negative downward from 0); the black diamond is the gap ``Delta`` (tokens) with its
    interval; small error bars beside the bar are each term's interval.

    Parameters
    ----------
    gaps : polars.DataFrame
        :func:`kvdiverge.estimation.gap.gap_decomposition` rows (any number of gaps and models).
    """
    sns.set_theme(style="whitegrid", context="paper")
    if gaps.height == 0:
        return save_figure(empty_figure("no gaps configured"), png, pdf)
    models = sorted(gaps["model"].unique().to_list())
    fig, axes = facets(len(models), width=5.0, height=4.0)
    for ax, model in zip(axes, models):
        g = gaps.filter(pl.col("model") == model)
        pairs = g.select("policy_a", "policy_b").unique(maintain_order=True).rows()
        for i, (a, b) in enumerate(pairs):
            rows = {
                r["term"]: r
                for r in g.filter((pl.col("policy_a") == a) & (pl.col("policy_b") == b)).iter_rows(named=True)
            }
            pos, neg = 0.0, 0.0
            for j, term in enumerate(("first_mismatch", "exposure", "rate")):
                r = rows[term]
                v = r["value"]
                bottom = pos if v >= 0 else neg
                ax.bar(
                    i, v, bottom=bottom, width=0.5, color=TERM_COLORS[term], label=TERM_LABELS[term] if i == 0 else None
                )
                if v >= 0:
                    pos += v
                else:
                    neg += v
                x = i + 0.3 + 0.07 * j
                ax.errorbar(
                    x,
                    v,
                    yerr=[[max(v - r["value_lo"], 0)], [max(r["value_hi"] - v, 0)]],
                    fmt="o",
                    ms=3,
                    color=TERM_COLORS[term],
                    capsize=2,
                )
            d = rows["delta"]
            ax.errorbar(
                i,
                d["value"],
                yerr=[[max(d["value"] - d["value_lo"], 0)], [max(d["value_hi"] - d["value"], 0)]],
                fmt="D",
                color="black",
                ms=5,
                capsize=3,
                label="gap Δ" if i == 0 else None,
            )
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xticks(range(len(pairs)))
        ax.set_xticklabels([f"{a}\nminus\n{b}" for a, b in pairs], fontsize="small")
        ax.set(title=model, ylabel="Δ E[N] (tokens)")
        ax.legend(fontsize="small")
    fig.suptitle("Gap in expected token loss: first-mismatch + exposure + rate")
    save_figure(fig, png, pdf)


def plot_branch_tv(
    curve: pl.DataFrame, png, pdf, early: Sequence[int] | None = None, late: Sequence[int] | None = None
) -> None:
    """Branch-aligned TV against lag since divergence per policy, one panel per model.

    Curves that coincide get offset markers and a legend entry naming them
    (:func:`kvdiverge.report.coincide.legend_with_coinciding`).

    Parameters
    ----------
    curve : polars.DataFrame
        :func:`kvdiverge.estimation.pooling.branch_tv_curve` output (lags with no document are NaN).
    early, late : (a, b), optional
        Confirmatory lag windows, shaded.
    """
    sns.set_theme(style="whitegrid", context="paper")
    c = curve.filter(pl.col("btv").is_not_nan() & pl.col("btv").is_not_null()) if curve.height else curve
    if c.height == 0:
        return save_figure(empty_figure("no branch reached any lag"), png, pdf)
    c = c.with_columns((pl.col("policy") + " (" + pl.col("split") + ")").alias("run"))
    models = sorted(c["model"].unique().to_list())
    fig, axes = facets(len(models))
    for ax, model in zip(axes, models):
        d = c.filter(pl.col("model") == model).to_pandas()
        lines = runs_with_bands(ax, d, "lag", "btv", marker="o", ms=3)
        for win, name, col in ((early, "early", "#999999"), (late, "late", "#cc9999")):
            if win is not None:
                ax.axvspan(win[0] - 0.5, win[1] + 0.5, color=col, alpha=0.15, lw=0)
                ax.text(
                    (win[0] + win[1]) / 2,
                    0.02,
                    f"{name} [{win[0]}, {win[1]}]",
                    ha="center",
                    va="bottom",
                    transform=ax.get_xaxis_transform(),
                    fontsize="small",
                )
        ax.set(title=model, xlabel="lag k since first divergence (steps)", ylabel="branch TV", ylim=(0, 1))
        legend_with_coinciding(
            ax, lines, title="policy (split)", fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2
        )
    fig.suptitle("Kernel disagreement after divergence")
    save_figure(fig, png, pdf)


def plot_confirmatory(per_doc: pl.DataFrame, result: pl.DataFrame, png, pdf) -> None:
    """Per-document late − early branch TV differences per model, with mean and interval.

    Parameters
    ----------
    per_doc, result : polars.DataFrame
        :func:`kvdiverge.estimation.confirmatory.confirmatory_analysis` outputs.
    """
    sns.set_theme(style="whitegrid", context="paper")
    floor_res = result.filter(pl.col("role") == "floor") if "role" in result.columns else result.clear()
    if "role" in result.columns:
        result = result.filter(pl.col("role") == "plan")
    if "policy" in per_doc.columns and result.height:
        per_doc = per_doc.filter(pl.col("policy") == result["policy"][0])
    d = per_doc.filter(pl.col("d").is_not_null())
    if d.height == 0:
        return save_figure(empty_figure("no document reached both windows"), png, pdf)
    models = sorted(per_doc["model"].unique().to_list())
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(models), 3.8))
    rng = np.random.default_rng(0)
    for i, m in enumerate(models):
        y = d.filter(pl.col("model") == m)["d"].to_numpy()
        ax.scatter(i - 0.1 + rng.uniform(-0.12, 0.12, y.size), y, alpha=0.6, s=18, color=sns.color_palette()[0])
        fr = floor_res.filter(pl.col("model") == m)
        if fr.height and np.isfinite(fr["mean_diff"][0]):
            mu, lo, hi = fr["mean_diff"][0], fr["mean_diff_lo"][0], fr["mean_diff_hi"][0]
            ax.errorbar(
                i + 0.45,
                mu,
                yerr=[[mu - lo], [hi - mu]],
                fmt="s",
                color=FLOOR_COLORS[0],
                capsize=3,
                label="noise floor (mean [CI])" if i == 0 else None,
            )
        r = result.filter(pl.col("model") == m)
        if r.height and np.isfinite(r["mean_diff"][0]):
            mu, lo, hi = r["mean_diff"][0], r["mean_diff_lo"][0], r["mean_diff_hi"][0]
            ax.errorbar(i + 0.3, mu, yerr=[[mu - lo], [hi - mu]], fmt="D", color="black", capsize=3)
            ax.text(
                i,
                ax.get_ylim()[1],
                f"n={r['n_used'][0]} (excl. {r['n_excluded'][0]})\np_adj={r['p_adjusted'][0]:.3g}: {r['decision'][0]}",
                ha="center",
                va="bottom",
                fontsize="x-small",
            )
    if floor_res.height:
        ax.legend(fontsize="x-small", loc="lower right")
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xticks(range(len(models)))
    ax.set_xticklabels(models)
    ax.set_xlim(-0.6, len(models) - 0.2)
    ax.set(xlabel="model", ylabel="btv[late] − btv[early] per document")
    fig.suptitle("Confirmatory: late minus early branch TV", y=1.08)
    save_figure(fig, png, pdf)


def plot_variance(variance: pl.DataFrame, png, pdf) -> None:
    """Naive vs conditional Monte Carlo variance of the token loss ``N``, per run.

    Bars: within-document variance across replicates, averaged over documents, of the
    naive estimator, the conditional Monte Carlo one (§5, never larger in expectation)
    and its compensator variant; the label above each group is
    ``Var(N_naive) / Var(N_cmc)``.

    Parameters
    ----------
    variance : polars.DataFrame
        :func:`kvdiverge.estimation.timing.variance_table` output.
    """
    sns.set_theme(style="whitegrid", context="paper")
    v = (
        variance.filter(pl.col("var_N_naive").is_finite() & pl.col("var_N_cmc").is_finite())
        if variance.height
        else variance
    )
    if v.height == 0:
        return save_figure(empty_figure("no run with replicate variance (R >= 2 needed)"), png, pdf)
    v = v.sort(["model", "split", "policy"]).with_columns(
        (pl.col("model") + "\n" + pl.col("policy") + " (" + pl.col("split").str.slice(0, 5) + ".)").alias("run")
    )
    long = v.unpivot(
        index=["run", "var_ratio"],
        on=["var_N_naive", "var_N_cmc", "var_N_cmc_tv"],
        variable_name="estimator",
        value_name="variance",
    ).with_columns(
        pl.col("estimator").replace(
            {"var_N_naive": "naive", "var_N_cmc": "conditional MC", "var_N_cmc_tv": "compensator (TV)"}
        )
    )
    fig, ax = plt.subplots(figsize=(1.5 + 1.6 * v.height, 4))
    sns.barplot(data=long.to_pandas(), x="run", y="variance", hue="estimator", ax=ax, order=v["run"].to_list())
    top = float(long["variance"].max() or 0.0)
    for i, r in enumerate(v.iter_rows(named=True)):
        ax.text(
            i,
            top * 1.04,
            f"×{r['var_ratio']:.2f}" if np.isfinite(r["var_ratio"]) else "–",
            ha="center",
            va="bottom",
            fontsize="small",
        )
    ax.set_ylim(0, top * 1.15 if top > 0 else 1)
    ax.set(xlabel="", ylabel="Var across replicates, mean over documents (tokens²)")
    ax.set_title("Estimator variance of the token loss N (label: naive / conditional)")
    ax.legend(fontsize="small")
    save_figure(fig, png, pdf)
