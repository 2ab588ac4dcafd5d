"""Seaborn figures of the study, each written as PNG and PDF (atomically).

- :func:`plot_survival` — survival ``S_t`` of first divergence per policy and model, the
  noise floor drawn grey and dashed.
- :func:`plot_gaps` — stacked gap decomposition (first-mismatch, exposure, rate) with
  paired-bootstrap intervals (§7).
- :func:`plot_branch_tv` — branch-aligned TV against lag since divergence, with the
  confirmatory early/late windows shaded (§6, §8).
- :func:`plot_confirmatory` — per-document late − early differences (§8), with the noise
  floor's mean difference beside them.
- :func:`plot_variance` — naive vs conditional Monte Carlo variance per document (§5).
- :func:`plot_frontier` — ``p_div``, ``E[M]`` and the mean first-divergence step against
  retention, one line per press, or, with quantized-cache points, against the KV bytes
  stored per prompt token, one line per curve; the noise floor as a grey band
  (:func:`kvdiverge.estimation.frontier.frontier_tables`).
- :func:`plot_speculative` — the self-speculative reading: tokens per target forward
  ``A_k + 1`` of a first draft block against its length ``k``, beside the i.i.d. formula,
  and the accepted fraction ``A_k / k`` (:func:`kvdiverge.estimation.speculative.speculative_table`).
- :func:`render_survival`, :func:`render_frontier` — those figures into given Axes, to a path
  or as a new figure (:class:`kvdiverge.doors.results.Measurement`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import matplotlib

if not os.environ.get("MPLBACKEND"):  # headless by default; a notebook's inline backend stays
    matplotlib.use("Agg")
import matplotlib.pyplot as plt
import matplotlib.ticker
import numpy as np
import polars as pl
import seaborn as sns
from matplotlib.lines import Line2D

from kvdiverge.io.files import atomic_path
from kvdiverge.report.coincide import legend_with_coinciding

__all__ = [
    "length_figure",
    "plot_length",
    "draw_frontier",
    "draw_speculative",
    "frontier_figure",
    "frontier_panels",
    "plot_frontier",
    "plot_speculative",
    "speculative_figure",
    "draw_survival",
    "plot_branch_tv",
    "plot_confirmatory",
    "plot_gaps",
    "plot_survival",
    "plot_variance",
    "render_frontier",
    "render_survival",
    "save_figure",
    "survival_figure",
]

TERM_LABELS = {"first_mismatch": "first mismatch", "exposure": "exposure", "rate": "rate"}
TERM_COLORS = {"first_mismatch": "#4c72b0", "exposure": "#dd8452", "rate": "#55a868"}


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


def _empty(message: str) -> plt.Figure:
    fig, ax = plt.subplots(figsize=(5, 2))
    ax.axis("off")
    ax.text(0.5, 0.5, message, ha="center", va="center")
    return fig


def _facets(n: int, width: float = 4.5, height: float = 3.5):
    fig, axes = plt.subplots(1, max(n, 1), figsize=(width * max(n, 1), height), squeeze=False, sharey=True)
    return fig, axes[0]


#: Colours of the noise-floor control's runs (greys, dashed), apart from the policies'.
FLOOR_COLORS = ("#555555", "#999999")


def _palette(runs: Sequence[str], floor_runs: Sequence[str] = ()) -> dict[str, tuple]:
    """Each run's colour: seaborn's palette for the policies in order, greys (``FLOOR_COLORS``) for the noise floor."""
    policies = [r for r in runs if r not in floor_runs]
    pal = dict(zip(policies, sns.color_palette(n_colors=max(len(policies), 1))))
    pal.update({r: FLOOR_COLORS[i % len(FLOOR_COLORS)] for i, r in enumerate(r for r in runs if r in floor_runs)})
    return pal


def _runs_with_bands(ax, d, x: str, y: str, step: str | None = None, floor_runs: Sequence[str] = (), **line_kw) -> list:
    """One line per ``run`` with its interval band (columns ``<y>_lo``, ``<y>_hi``), line and band in the same colour.

    ``d`` is a pandas frame with a ``run`` column; ``step`` is passed to
    ``fill_between`` (e.g. ``"post"`` for step curves), ``line_kw`` to ``Axes.plot``.
    Runs in ``floor_runs`` (the noise floor) are drawn grey and dashed. Returns the lines, in
    the runs' sorted order, each labelled with its run.
    """
    runs = sorted(d["run"].unique())
    pal = _palette(runs, floor_runs)
    if "marker" in line_kw:
        line_kw = {"mec": "white", "mew": 0.6, **line_kw}
    lines = []
    for run in runs:
        g = d[d["run"] == run].sort_values(x)
        dashes = (0, (4, 2)) if run in floor_runs else "-"
        lines += ax.plot(g[x], g[y], color=pal[run], ls=dashes, label=run, **line_kw)
        ax.fill_between(g[x], g[f"{y}_lo"], g[f"{y}_hi"], step=step, alpha=0.15, color=pal[run])
    return lines


def _run_labels(frame: pl.DataFrame, floor: str | None = None) -> pl.DataFrame:
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


def draw_survival(ax, survival: pl.DataFrame, title: str | None = None, floor: str | None = None) -> None:
    """Draw survival curves ``S_t`` (steps ``t = 0..T``) with their bands on one axes.

    Curves that coincide (the controls at ``S_t = 1``, two policies that agree) get offset
    markers and a legend entry naming them (:func:`kvdiverge.report.coincide.legend_with_coinciding`).

    Parameters
    ----------
    ax : matplotlib.axes.Axes
        Target axes.
    survival : polars.DataFrame
        :func:`kvdiverge.estimation.estimators.survival_curve` rows of one model (any runs).
    title : str, optional
        Axes title (default: the model).
    floor : str, optional
        The noise-floor policy (config ``runs.floor.policy``): drawn grey and dashed,
        labelled "noise floor".
    """
    s = _run_labels(survival, floor)
    multi = s["split"].n_unique() > 1
    floor_runs = s.filter(pl.col("policy") == floor)["run"].unique().to_list() if floor else []
    d = s.to_pandas()
    lines = _runs_with_bands(ax, d, "t", "S", step="post", floor_runs=floor_runs, drawstyle="steps-post")
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
        :func:`kvdiverge.estimation.estimators.survival_curve` output; bands are the bootstrap intervals.
    floor : str, optional
        The noise-floor policy, drawn grey and dashed.
    """
    sns.set_theme(style="whitegrid", context="paper")
    if survival.height == 0:
        return _empty("no runs")
    models = sorted(survival["model"].unique().to_list())
    fig, axes = _facets(len(models))
    for ax, model in zip(axes, models):
        draw_survival(ax, survival.filter(pl.col("model") == model), title=model, floor=floor)
    fig.suptitle("Survival of first divergence")
    return fig


def plot_survival(survival: pl.DataFrame, png, pdf, floor: str | None = None) -> None:
    """Write :func:`survival_figure` as PNG and PDF.

    Parameters
    ----------
    survival : polars.DataFrame
        :func:`kvdiverge.estimation.estimators.survival_curve` output.
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
        return _empty("no runs")
    models = sorted(survival["model"].unique().to_list())
    fig, axes = _facets(len(models))
    sides = (("compressed", "-"), ("full", (0, (4, 2))))
    for ax, model in zip(axes, models):
        s = _run_labels(survival.filter(pl.col("model") == model), floor)
        runs = sorted(s["run"].unique().to_list())
        pal = _palette(runs, s.filter(pl.col("policy") == floor)["run"].unique().to_list() if floor else [])
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
        return save_figure(_empty("no gaps configured"), png, pdf)
    models = sorted(gaps["model"].unique().to_list())
    fig, axes = _facets(len(models), width=5.0, height=4.0)
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
        :func:`kvdiverge.estimation.estimators.branch_tv_curve` output (lags with no document are NaN).
    early, late : (a, b), optional
        Confirmatory lag windows, shaded.
    """
    sns.set_theme(style="whitegrid", context="paper")
    c = curve.filter(pl.col("btv").is_not_nan() & pl.col("btv").is_not_null()) if curve.height else curve
    if c.height == 0:
        return save_figure(_empty("no branch reached any lag"), png, pdf)
    c = c.with_columns((pl.col("policy") + " (" + pl.col("split") + ")").alias("run"))
    models = sorted(c["model"].unique().to_list())
    fig, axes = _facets(len(models))
    for ax, model in zip(axes, models):
        d = c.filter(pl.col("model") == model).to_pandas()
        lines = _runs_with_bands(ax, d, "lag", "btv", marker="o", ms=3)
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
        return save_figure(_empty("no document reached both windows"), png, pdf)
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
        return save_figure(_empty("no run with replicate variance (R >= 2 needed)"), png, pdf)
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
        return _empty("no frontier points")
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
    s = _run_labels(table, floor)
    floor_runs = s.filter(pl.col("policy") == floor)["run"].unique().to_list() if floor else []
    d = s.to_pandas()
    title = title if title is not None else ", ".join(sorted(s["model"].unique().to_list()))
    for ax, (metric, label) in zip(axes, SPECULATIVE_PANELS):
        _runs_with_bands(ax, d, "k", metric, floor_runs=floor_runs, marker="o")
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
        return _empty("no runs")
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
