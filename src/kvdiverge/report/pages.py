"""HTML pages of the report: the confirmatory test and the headline numbers.

Rendering only; the numbers come from :mod:`kvdiverge.estimation.confirmatory`,
:mod:`kvdiverge.estimation.gap`, :mod:`kvdiverge.estimation.floor` (statistics) and
:mod:`kvdiverge.estimation.estimators`. Each page is a standalone HTML document (inline style)
that ``snakemake --report`` embeds.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import polars as pl

from kvdiverge.estimation.confirmatory import PLAN_FIELDS, plan_hash
from kvdiverge.io.render import html_table
from kvdiverge.report.formatting import number, with_interval

__all__ = [
    "CONFIRMATORY_HEADER",
    "ci_label",
    "confirmatory_html",
    "floor_html",
    "frontier_html",
    "provenance_html",
    "speculative_html",
    "summary_html",
]


_STYLE = (
    "<style>body{font-family:sans-serif;font-size:14px;margin:1em}"
    "table{border-collapse:collapse;margin:0.5em 0 1.5em}"
    "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
    "th{background:#f3f3f3}code{background:#f6f6f6}</style>"
)


def _page(title: str, body: str) -> str:
    """A standalone HTML document: ``title`` and the shared style in its head, ``body`` (HTML) as its body."""
    return f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{title}</title>{_STYLE}</head><body>{body}</body></html>"


def ci_label(confidence: float) -> str:
    """The interval label of a coverage: ``0.95`` gives ``"95% CI"``, ``0.9`` ``"90% CI"``, ``0.975`` ``"97.5% CI"``."""
    return f"{float(confidence) * 100:g}% CI"


def _labelled(header: Sequence[str], confidence: float) -> list[str]:
    """``header`` with each ``[CI]`` spelled with its coverage (:func:`ci_label`)."""
    return [h.replace("[CI]", f"[{ci_label(confidence)}]") for h in header]


def _plan_block(plan: Mapping[str, Any]) -> str:
    import html

    rows = [(k, json.dumps(plan.get(k))) for k in PLAN_FIELDS]
    return (
        html_table(["plan field", "value"], rows)
        + f"<p>SHA-256 of the config section <code>confirmatory</code> (canonical JSON): "
        f"<code>{html.escape(plan_hash(plan))}</code></p>"
    )


def _confirmatory_rows(result: pl.DataFrame) -> list[list[str]]:
    def policy(r):
        return f"{r['policy']} (noise floor)" if r.get("role") == "floor" else r["policy"]

    return [
        [
            r["model"],
            policy(r),
            r["n_docs"],
            r["n_excluded"],
            r["n_used"],
            with_interval(r, "mean_diff"),
            with_interval(r, "median_diff"),
            number(r["statistic"]),
            number(r["p_raw"]),
            number(r["p_adjusted"]),
            r["decision"],
        ]
        for r in result.iter_rows(named=True)
    ]


CONFIRMATORY_HEADER = [
    "model",
    "policy",
    "documents",
    "excluded (no window reached)",
    "tested",
    "mean late − early [CI]",
    "median [CI]",
    "W statistic",
    "p raw",
    "p adjusted",
    "decision",
]


def confirmatory_html(plan: Mapping[str, Any], result: pl.DataFrame, *, confidence: float = 0.95) -> str:
    """HTML page of the confirmatory plan (with its hash) and the per-model results.

    Parameters
    ----------
    plan : mapping
        Config section ``confirmatory``.
    result : polars.DataFrame
        First output of :func:`~kvdiverge.estimation.confirmatory.confirmatory_analysis`.
    confidence : float
        Coverage of the intervals (``analysis.confidence``): the headers' label.

    Returns
    -------
    str
        A standalone HTML document.
    """
    return _page(
        "Confirmatory test",
        f"<h2>Prespecified plan</h2>{_plan_block(plan)}"
        "<h2>Result per model</h2>"
        f"{html_table(_labelled(CONFIRMATORY_HEADER, confidence), _confirmatory_rows(result))}"
        "<p>Per document d = btv[late] − btv[early] (branch-aligned TV, estimators.md §6); "
        "documents whose branches reach neither window, or only one, have no d and are "
        "counted as excluded. A noise-floor row (the permutation control, equal kernels "
        "in exact arithmetic) shows the same difference produced by rounding alone; it "
        "is not part of the tested family.</p>",
    )


FLOOR_HEADER = [
    "model",
    "split",
    "policy",
    "documents (paired)",
    "p_div [CI]",
    "floor p_div [CI]",
    "E[N] tokens [CI]",
    "floor E[N] [CI]",
    "mean TV per step [CI]",
    "floor mean TV per step [CI]",
    "p_div − floor [CI]",
    "E[N] − floor [CI]",
    "above floor (p_div / E[N])",
]


def _yes(v) -> str:
    return "yes" if v else "no"


def _floor_rows(floor: pl.DataFrame) -> list[list[str]]:
    return [
        [
            r["model"],
            r["split"],
            r["policy"],
            r["n_docs"],
            with_interval(r, "p_div"),
            with_interval(r, "floor_p_div"),
            with_interval(r, "E_N"),
            with_interval(r, "floor_E_N"),
            with_interval(r, "tv_mean"),
            with_interval(r, "floor_tv_mean"),
            with_interval(r, "diff_p_div"),
            with_interval(r, "diff_E_N"),
            f"{_yes(r['above_floor_p_div'])} / {_yes(r['above_floor_E_N'])}",
        ]
        for r in floor.sort(["model", "split", "policy"]).iter_rows(named=True)
    ]


FLOOR_NOTE = (
    "<p>The noise floor is the permutation control: it keeps every prompt position "
    "and only changes their order in each layer's cache, so its two kernels are equal "
    "in exact arithmetic and whatever it measures is floating-point rounding. A policy "
    "lies above the floor in a metric when the lower end of the paired "
    "document-bootstrap interval of (policy − floor), on the documents both ran, is "
    "above 0.</p>"
)


def floor_html(floor: pl.DataFrame, *, confidence: float = 0.95) -> str:
    """HTML table of every policy beside the noise floor (:func:`kvdiverge.estimation.floor.floor_comparison`),
    its intervals labelled with their coverage ``confidence``."""
    if floor.height == 0:
        return "<p>No noise-floor control ran (config <code>runs.floor</code>).</p>"
    return html_table(_labelled(FLOOR_HEADER, confidence), _floor_rows(floor)) + FLOOR_NOTE


_RUN_HEADER = [
    "model",
    "policy",
    "split",
    "documents",
    "T",
    "occurrence p_div [CI]",
    "mean first-divergence step [CI]",
    "mismatch fraction E[M] [CI]",
    "exposure share of E[M]",
    "rho",
    "§4 interval of E[M] from window W",
    "Var(N_naive)/Var(N_cmc)",
    "above noise floor (paired bootstrap)",
]
_GAP_HEADER = [
    "model",
    "gap A − B",
    "documents",
    "Δ E[N] tokens [CI]",
    "first-mismatch share",
    "exposure share",
    "rate share",
]


def _run_rows(pooled: pl.DataFrame, floor: pl.DataFrame | None) -> list[list]:
    """Rows of the headline table (:data:`_RUN_HEADER`): one per run, with its floor decision if ``floor`` is given."""
    above = {}
    if floor is not None:
        for r in floor.iter_rows(named=True):
            above[(r["model"], r["split"], r["policy"])] = (
                f"p_div {_yes(r['above_floor_p_div'])}, E[N] {_yes(r['above_floor_E_N'])}"
            )
    return [
        [
            r["model"],
            r["policy"],
            r["split"],
            r["n_docs"],
            r["T"],
            with_interval(r, "p_div"),
            with_interval(r, "tau_mean"),
            with_interval(r, "E_M"),
            number(r["exposure_share"]),
            number(r["rho"]),
            f"[{number(r['interval_E_M_lo'])}, {number(r['interval_E_M_hi'])}]",
            number(r["var_ratio"]),
            above.get((r["model"], r["split"], r["policy"]), "–"),
        ]
        for r in pooled.sort(["model", "split", "policy"]).iter_rows(named=True)
    ]


def _gap_rows(gaps: pl.DataFrame) -> list[list]:
    """Rows of the gap table (:data:`_GAP_HEADER`): one per (model, A, B), the gap and its terms' shares."""
    gap_rows = []
    for (model, a, b), g in gaps.group_by(["model", "policy_a", "policy_b"], maintain_order=True):
        t = {r["term"]: r for r in g.iter_rows(named=True)}

        def share(term):
            r = t[term]
            return f"{number(r['share'])} [{number(r['share_lo'])}, {number(r['share_hi'])}]"

        gap_rows.append(
            [
                model,
                f"{a} − {b}",
                t["delta"]["n_docs"],
                with_interval(t["delta"], "value"),
                share("first_mismatch"),
                share("exposure"),
                share("rate"),
            ]
        )
    return gap_rows


def provenance_html(table: pl.DataFrame, study_hash: str | None) -> str:
    """An HTML section (``<h2>`` + paragraph + table) of the provenance table.

    Parameters
    ----------
    table : polars.DataFrame
        :func:`kvdiverge.config.provenance.provenance_table` rows: ``model``, ``policy``,
        ``split``, ``shards``, ``settings_hash``, ``compressed_layers`` (if present) and a column per
        library version (those present).
    study_hash : str or None
        :func:`kvdiverge.config.provenance.study_hash` of ``table`` (``None``: no runs).
    """
    fixed = ("model", "policy", "split", "shards", "settings_hash", "settings", "compressed_layers")
    libs = [c for c in table.columns if c not in fixed]
    layers = "compressed_layers" in table.columns
    head = ["model", "policy", "split", "shards", "settings hash", *(["compressed layers"] * layers), *libs]
    rows = [
        [
            r["model"],
            r["policy"],
            r["split"],
            r["shards"],
            r["settings_hash"],
            *([r["compressed_layers"]] * layers),
            *(r[c] for c in libs),
        ]
        for r in table.iter_rows(named=True)
    ]
    return (
        "<h2>Provenance</h2><p>Study settings hash <code>"
        f"{study_hash or 'none'}</code>. Every trajectory shard records "
        "the settings it was made with (model and policy entries, decoding, replicates, seed, "
        "shards, control documents) and the library versions of the process that made it; "
        "the estimate stage refuses shards whose settings differ from the config. Full "
        "settings per run: <code>analysis/provenance.csv</code>.</p>"
        f"{html_table(head, rows)}"
    )


def summary_html(
    pooled: pl.DataFrame,
    gaps: pl.DataFrame,
    confirmatory: pl.DataFrame,
    plan: Mapping[str, Any],
    *,
    floor: pl.DataFrame | None = None,
    provenance: str | None = None,
    confidence: float = 0.95,
) -> str:
    """HTML page of the headline numbers: occurrence, timing, decomposition, gaps, decisions.

    Parameters
    ----------
    pooled : polars.DataFrame
        :func:`kvdiverge.estimation.pooling.pooled_estimates` output.
    gaps : polars.DataFrame
        :func:`~kvdiverge.estimation.gap.gap_decomposition` rows.
    confirmatory : polars.DataFrame
        :func:`~kvdiverge.estimation.confirmatory.confirmatory_analysis` result.
    plan : mapping
        Config section ``confirmatory``.
    floor : polars.DataFrame, optional
        :func:`kvdiverge.estimation.floor.floor_comparison` output: adds the column "above noise
        floor" to the headline table and the floor table below it.
    provenance : str, optional
        :func:`provenance_html`'s section, the page's last.
    confidence : float
        Coverage of the intervals (``analysis.confidence``): the headers' label.

    Returns
    -------
    str
        A standalone HTML document.
    """
    runs, gap_rows = _run_rows(pooled, floor), _gap_rows(gaps)
    return _page(
        "Headline numbers",
        f"<h2>Divergence and token loss per run</h2>"
        f"{html_table(_labelled(_RUN_HEADER, confidence), runs)}"
        "<h2>Noise floor beside each policy</h2>"
        f"{floor_html(floor, confidence=confidence) if floor is not None else '<p>No noise-floor comparison given.</p>'}"
        "<h2>Gap decomposition (exploratory)</h2>"
        f"{html_table(_labelled(_GAP_HEADER, confidence), gap_rows) if gap_rows else '<p>No gap configured.</p>'}"
        f"<h2>Confirmatory test</h2>{_plan_block(plan)}"
        f"{html_table(_labelled(CONFIRMATORY_HEADER, confidence), _confirmatory_rows(confirmatory))}"
        f"{provenance or ''}",
    )


AREA_HEADER = [
    "model",
    "rank",
    "curve",
    "on the common range",
    "KV bytes per prompt token",
    "ratios",
    "mean E[M] over the range [CI]",
    "mean p_div over the range [CI]",
    "mean E[M] − best [CI]",
    "mean p_div − best [CI]",
    "area under E[M] over the ratios [CI]",
    "area under p_div [CI]",
    "above noise floor from ratio",
]
POINT_HEADER = [
    "model",
    "curve",
    "policy",
    "compression ratio",
    "cache",
    "retention",
    "kept fraction",
    "bits per element",
    "KV bytes per prompt token",
    "documents",
    "p_div [CI]",
    "mean first-divergence step [CI]",
    "median step [CI]",
    "E[M] [CI]",
    "= p_div/T",
    "+ (E[L]/T) rho",
    "rho [CI]",
    "floor p_div [CI]",
    "floor E[M] [CI]",
    "above floor (p_div / E[M])",
]


def _span(lo, hi) -> str:
    return "–" if lo is None or not math.isfinite(lo) else f"{number(lo)}–{number(hi)}"


def _area_rows(areas: pl.DataFrame) -> list[list]:
    """Rows of the frontier ranking (:data:`AREA_HEADER`): one per curve, in the table's order."""

    def first(r):
        v = r["first_ratio_above_floor"]
        return "never" if v is None or not math.isfinite(v) else number(v)

    best = lambda r, c: "(best)" if r["rank"] == 1 else with_interval(r, c)  # noqa: E731
    return [
        [
            r["model"],
            r["rank"],
            r["curve"],
            _yes(r["covers_range"]),
            _span(r["bytes_min"], r["bytes_max"]),
            f"{_span(r['ratio_min'], r['ratio_max'])} ({r['n_ratios']})",
            with_interval(r, "mean_E_M"),
            with_interval(r, "mean_p_div"),
            best(r, "diff_best_mean_E_M"),
            best(r, "diff_best_mean_p_div"),
            with_interval(r, "area_E_M"),
            with_interval(r, "area_p_div"),
            first(r),
        ]
        for r in areas.iter_rows(named=True)
    ]


#: The frontier page's teacher-forced columns, where the points carry them
#: (:func:`kvdiverge.estimation.teacher_forced.with_teacher_columns`).
POINT_TEACHER_HEADER = ["teacher-forced mean KLD [CI]", "PPL ratio", "Same top p", "RMS Δp"]


def _teacher_cells(r) -> list:
    return [with_interval(r, "kld_mean"), number(r["ppl_ratio"]), number(r["same_top_p"]), number(r["delta_p_rms"])]


def _point_rows(points: pl.DataFrame) -> list[list]:
    """Rows of the frontier's points (:data:`POINT_HEADER`, then :data:`POINT_TEACHER_HEADER` where the
    points carry the teacher-forced columns): one per point, in the table's order."""
    teacher = "kld_mean" in points.columns
    return [
        [
            r["model"],
            r["curve"],
            r["policy"],
            number(r["compression_ratio"]) if r["budget"] is None else f"budget {r['budget']}",
            r["cache"] or "full precision",
            number(r["retention"]),
            number(r["kept_fraction"]),
            number(r["bits_per_element"]),
            number(r["kv_bytes_per_token"]),
            r["n_docs"],
            with_interval(r, "p_div"),
            with_interval(r, "tau_mean"),
            with_interval(r, "tau_median"),
            with_interval(r, "E_M"),
            number(r["first_mismatch_term"]),
            number(r["exposure_rate_term"]),
            with_interval(r, "rho"),
            with_interval(r, "floor_p_div"),
            with_interval(r, "floor_E_M"),
            f"{_yes(r['above_floor_p_div'])} / {_yes(r['above_floor_E_M'])}",
        ]
        + (_teacher_cells(r) if teacher else [])
        for r in points.iter_rows(named=True)
    ]


def frontier_html(points: pl.DataFrame, areas: pl.DataFrame, confidence: float = 0.95) -> str:
    """HTML page of the frontier: the ranking of the curves, then every point.

    Parameters
    ----------
    points, areas : polars.DataFrame
        :func:`kvdiverge.estimation.frontier.frontier_tables` outputs.
    confidence : float
        Interval coverage (for the caption).

    Returns
    -------
    str
        A standalone HTML document.
    """
    area_rows, point_rows = _area_rows(areas), _point_rows(points)
    point_header = POINT_HEADER + (POINT_TEACHER_HEADER if "kld_mean" in points.columns else [])
    pct = f"{confidence:.0%}"
    ranged = areas.filter(pl.col("covers_range")) if areas.height else areas
    common = _span(ranged["range_lo"][0], ranged["range_hi"][0]) if ranged.height else "–"
    return _page(
        "Frontier",
        f"<h2>Ranking: each curve's mean over the KV bytes common to the curves</h2>"
        f"{html_table(_labelled(AREA_HEADER, confidence), area_rows)}"
        f"<p>A curve is one press at full precision over the compression ratios, one quantized cache "
        f"alone, or one press with one cache over the cache ratios (from the cache alone at ratio 0). "
        f"Each is ranked by the mean of E[M] (then p_div) over the KV bytes stored per prompt token "
        f"common to the ranked curves ({common} bytes per token; linear in bytes between its points); "
        f"a curve that does not cover that range is listed after them, unranked by it. Smaller means "
        f"the curve changes generation less at the same memory. The areas are the trapezoid areas "
        f"under E[M] and p_div against the compression ratio, over the curve's own ratios. Brackets: "
        f"{pct} document bootstrap; every point and the floor are resampled with the same documents "
        f"(paired), so a difference from the best curve whose interval excludes 0 separates the two.</p>"
        f"<h2>Every point</h2>{html_table(_labelled(point_header, confidence), point_rows)}"
        "<p>E[M] = p_div/T + (E[L]/T) rho (estimators.md §3). KV bytes per prompt token = retention × "
        "layers × kv heads × head dim × 2 × bytes per element (the model's dtype; a quantized cache's "
        "nbits/8 + 2 × dtype bytes / q_group_size, a scale and a zero point per group). The floor columns "
        "are the noise-floor control (permutation press, equal kernels in exact arithmetic) on the same "
        "documents; above floor: the lower end of the paired interval of (point − floor) is above 0. "
        "The teacher-forced columns, where present, are llama.cpp's --kl-divergence statistics of the "
        "same point on a continuation fed to both caches (the teacher_forced table).</p>",
    )


SPECULATIVE_HEADER = [
    "model",
    "policy",
    "split",
    "documents",
    "k",
    "S_k: all k accepted [CI]",
    "A_k accepted tokens [CI]",
    "A_k / k [CI]",
    "tokens per target forward A_k + 1 [CI]",
    "mean acceptance per step α [CI]",
    "i.i.d. (1 − α^(k+1)) / (1 − α) [CI]",
]


def speculative_html(table: pl.DataFrame, confidence: float = 0.95) -> str:
    """HTML page of the self-speculative reading (:func:`kvdiverge.estimation.speculative.speculative_table`).

    Parameters
    ----------
    table : polars.DataFrame
        One row per (model, policy, split, k).
    confidence : float
        Interval coverage (for the caption).

    Returns
    -------
    str
        A standalone HTML document.
    """
    rows = [
        [
            r["model"],
            r["policy"],
            r["split"],
            r["n_docs"],
            r["k"],
            with_interval(r, "S_k"),
            with_interval(r, "A"),
            with_interval(r, "accepted_fraction"),
            with_interval(r, "tokens_per_forward"),
            with_interval(r, "alpha"),
            with_interval(r, "iid_tokens_per_forward"),
        ]
        for r in table.sort(["model", "split", "policy", "k"]).iter_rows(named=True)
    ]
    return _page(
        "Self-speculative reading",
        f"<h2>First draft block: evicted cache drafts, full cache verifies</h2>"
        f"{html_table(_labelled(SPECULATIVE_HEADER, confidence), rows)}"
        "<p>Speculative sampling accepts a drafted token with probability 1 − TV(p_t, q_t) and, given "
        "acceptance, the token follows the normalised overlap: the agreement chain's step. So the chance "
        "that the first k drafted tokens are all accepted is the survival S_k, and the expected number "
        "accepted is A_k = S_1 + … + S_k. This is exact for the first block, drafted from the prompt. "
        "Later blocks start after a rejection, from histories distributed as the target's output rather "
        "than as the agreement chain, and are not estimated here. α is the mean of 1 − tv_t over the "
        "chain's T steps; the i.i.d. column is Leviathan et al.'s formula at that α, the figure the "
        f"speculative-decoding papers quote. Brackets: {confidence:.0%} document bootstrap.</p>",
    )
