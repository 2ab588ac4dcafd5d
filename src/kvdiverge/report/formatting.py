"""Numbers and tables as text: the report pages, the measurement summary, the frontier ranking.

- :func:`number` — 3 significant digits (``%g``), a dash for a missing value or NaN.
- :func:`with_interval` — ``value [lo, hi]`` from a row's ``c``, ``c_lo`` and ``c_hi``.
- :func:`summary_text` (``kvdiverge measure``) and :func:`frontier_text` (``--ratios``, the
  workflow's frontier log), plain-text tables of
  :func:`kvdiverge.io.render.text_table`.
- :func:`prediction_markdown`, :func:`pairwise_markdown` and :func:`accuracy_markdown`: the prediction study's tables as
  docs/task.md quotes them (:func:`kvdiverge.io.render.markdown_table`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import partial
from typing import Any

import polars as pl

from kvdiverge.io.render import markdown_table, text_table

__all__ = [
    "MISSING",
    "accuracy_markdown",
    "frontier_text",
    "number",
    "pairwise_markdown",
    "prediction_markdown",
    "summary_text",
    "task_text",
    "teacher_text",
    "with_interval",
]

#: What a missing value or NaN reads as (an en dash).
MISSING = "–"


def number(v: Any, digits: int = 3, missing: str = MISSING) -> str:
    """``v`` with ``digits`` significant digits (``%g``); ``missing`` for None or NaN.

    Parameters
    ----------
    v : float, int, str or None
        Floats (numpy floats included) are formatted, infinities read ``inf`` / ``-inf``;
        anything else is ``str(v)``.
    digits : int
        Significant digits.
    missing : str
        Text for None and NaN (the plain-text summary uses ``-``).
    """
    if v is None:
        return missing
    if isinstance(v, float):
        if math.isnan(v):
            return missing
        return str(v) if math.isinf(v) else f"{v:.{digits}g}"
    return str(v)


def with_interval(r: Mapping[str, Any], c: str, digits: int = 3, missing: str = MISSING) -> str:
    """``r[c] [r[c_lo], r[c_hi]]``, each formatted by :func:`number`."""
    return (
        f"{number(r[c], digits, missing)} "
        f"[{number(r[c + '_lo'], digits, missing)}, {number(r[c + '_hi'], digits, missing)}]"
    )


def summary_text(summary, settings: Mapping[str, Any], floor: str | None, floor_press: str) -> str:
    """A measurement's summary as a plain-text table, with notes (``kvdiverge measure`` prints it).

    One row per press: prompts, kept fraction of the prompt cache, ``p_div``, mean
    first-divergence step, ``E[M]`` and its decomposition ``p_div/T + (E[L]/T) rho``,
    and, when a noise-floor press was measured, each press's ``E[M]`` minus the floor's.
    Notes flag presses that left the cache untouched (``*``), presses whose chains never parted
    under this decoding though that does not show the cache untouched (``~``: they compressed, or
    the decoding is greedy) and, on a model with sliding-window layers,
    name the layers a press compresses (``settings["compressed_layers"]``).

    Parameters
    ----------
    summary : polars.DataFrame
        :attr:`kvdiverge.doors.results.Measurement.summary`.
    settings : mapping
        The measurement's settings (model, T, R, temperature, top_p, seed, confidence).
    floor : str or None
        Name of the noise-floor press, if one was measured.
    floor_press : str
        Class name of the noise-floor press, for the note when none was measured.
    """
    num = partial(number, missing="-")  # plain text: an ASCII dash for a missing value
    ci = partial(with_interval, missing="-")
    header = [
        "press",
        "prompts",
        "kept",
        "p_div [CI]",
        "first-div. step [CI]",
        "E[M] [CI]",
        "= p_div/T",
        "+ (E[L]/T)*rho",
        "E[L]",
        "rho",
    ] + ([] if floor is None else [f"E[M] - {floor} [CI]"])
    rows = []
    for r in summary.iter_rows(named=True):
        flag = "" if r["policy"] == floor else "*" if r["untouched"] else "~" if r["no_divergence"] else ""
        row = [
            r["policy"],
            str(r["n_docs"]),
            f"{r['kept_fraction']:.0%}{flag}",
            ci(r, "p_div"),
            ci(r, "tau_mean"),
            ci(r, "E_M"),
            num(r["first_mismatch_term"]),
            num(r["exposure_rate_term"]),
            num(r["E_L"]),
            num(r["rho"]),
        ]
        if floor is not None:
            row.append("(floor)" if r["policy"] == floor else ci(r, "E_M_minus_floor"))
        rows.append(row)
    s = settings
    out = [
        f"{s['model']}: {summary['n_docs'].max()} prompts, T={s['T']}, R={s['R']}, temperature "
        f"{s['temperature']}, top-p {s['top_p']}"
        + "".join(f", {name.replace('_', ' ')} {v}" for name, v in s.get("decoding", {}).items())
        + f", seed {s['seed']}; [CI]: {s['confidence']:.0%} document bootstrap",
        *text_table(header, rows),
    ]
    out += _flag_notes(summary, floor)
    if floor is None:
        out.append(_floor_note(s.get("presses") or {}, floor_press))
    if s.get("compressed_layers"):
        out.append(f"kept: of the prompt in the layers a press compresses, {s['compressed_layers']}")
    return "\n".join(out)


def _floor_note(presses: Mapping[str, Any], floor_press: str) -> str:
    """The note of a measurement without a noise-floor press: on llama.cpp (the presses' records say
    ``backend: llama_cpp``) the f16 control is the floor, since a kvpress press does not run there."""
    control = [
        name
        for name, p in presses.items()
        if isinstance(p, Mapping) and p.get("backend") == "llama_cpp" and p.get("type_k") == p.get("type_v") == "f16"
    ]
    if control:
        return (
            f"noise floor: the {control[0]} control (llama.cpp's full cache against itself; "
            f"a {floor_press} is a kvpress press and does not run on llama.cpp)"
        )
    return f"noise floor: not measured (add a {floor_press} to compare each press with it)"


def _flag_notes(summary, floor: str | None) -> list[str]:
    """The notes of :func:`summary_text`'s ``*`` and ``~`` marks (none for the noise ``floor``)."""
    rows = [r for r in summary.iter_rows(named=True) if r["policy"] != floor]
    untouched = [r["policy"] for r in rows if r["untouched"]]
    agreed = [r["policy"] for r in rows if r["no_divergence"]]
    out = []
    if untouched:
        out.append(
            f"* left the cache untouched (TV 0 at every step: the same kernel as the full cache): {', '.join(untouched)}"
        )
    if agreed:
        out.append(
            "~ no divergence observed under this decoding (TV 0 at every step on every prompt), which does not "
            f"show the cache untouched: the press compressed it, or greedy answers agreed: {', '.join(agreed)}"
        )
    return out


def teacher_text(table, floor: str | None = None) -> str:
    """The teacher-forced table as plain text, presses ranked by mean KLD (``kvdiverge measure --screen``).

    One row per press: prompts, positions, mean KLD ± its standard error and bootstrap
    interval, ``PPL(Q)/PPL(base)``, Same top p and RMS Δp (%), as llama.cpp's
    ``--kl-divergence`` prints them (:mod:`kvdiverge.estimation.teacher_forced`).

    Parameters
    ----------
    table : polars.DataFrame
        :func:`kvdiverge.estimation.teacher_forced.summary_table` of one model and split.
    floor : str or None
        The noise-floor press, marked ``(floor)``.
    """
    num = partial(number, missing="-")
    header = ["press", "prompts", "positions", "mean KLD ± se", "[CI]", "PPL ratio", "Same top p", "RMS Δp"]
    keyed = "n_key" in table.columns and table["n_key"].is_not_null().any()
    header += ["key pos.", "key KLD", "key Same top p"] if keyed else []
    rows = []
    for r in table.sort("kld_mean").iter_rows(named=True):
        interval = f"[{num(r.get('kld_mean_lo'))}, {num(r.get('kld_mean_hi'))}]" if "kld_mean_lo" in r else "-"
        row = [
            r["policy"] + (" (floor)" if r["policy"] == floor else ""),
            str(r["n_documents"]),
            str(int(r["n_positions"])),
            f"{num(r['kld_mean'])} ± {num(r['kld_se'], 2)}",
            interval,
            f"{r['ppl_ratio']:.4f}",
            f"{100 * r['same_top_p']:.2f} %",
            f"{100 * r['delta_p_rms']:.3f} %",
        ]
        if keyed:  # LongPPL's key tokens: "-" where no position is key
            same = r["same_top_p_key"]
            row += [str(r["n_key"]), num(r["kld_key_mean"]), "-" if same is None else f"{100 * same:.2f} %"]
        rows.append(row)
    target = table["target"][0] if "target" in table.columns and table.height else "continuation"
    note = f"teacher-forced ({target}) at temperature 1 on the raw logits; KLD = KL(full || compressed), nats"
    return "\n".join([*text_table(header, rows), note])


def _finite(v: Any) -> str:
    """:func:`number` with an ASCII dash for a missing or infinite value."""
    return "-" if isinstance(v, float) and math.isinf(v) else number(v, missing="-")


def frontier_text(points, areas, confidence: float = 0.95) -> str:
    """The frontier ranking as a plain-text table (what ``kvdiverge measure --ratios`` prints).

    One row per (model, curve), best first: the mean ``E[M]`` and ``p_div`` over the KV
    bytes per prompt token common to the ranked curves with intervals (``-`` for a curve
    that does not cover that range), the mean ``E[M]``'s difference from the best curve, the
    area under ``E[M]`` over the curve's ratios, the curve's own KV bytes per prompt token,
    the smallest ratio above the noise floor, and ``E[M]`` / ``p_div`` at each ratio (a
    cache's curve starts at ratio 0, the cache alone).

    Parameters
    ----------
    points, areas : polars.DataFrame
        The two tables of :func:`kvdiverge.estimation.frontier.frontier_tables`.
    confidence : float
        Interval coverage, for the title.
    """
    import polars as pl

    def ci(r: Mapping[str, Any], c: str) -> str:
        if r[c] is None or r[c] != r[c]:
            return "-"
        return f"{_finite(r[c])} [{_finite(r[c + '_lo'])}, {_finite(r[c + '_hi'])}]"

    header = [
        "rank",
        "model",
        "curve",
        "mean E[M] [CI]",
        "mean p_div [CI]",
        "mean E[M] - best [CI]",
        "area E[M] [CI]",
        "KV bytes/token",
        "above floor from ratio",
        "E[M] by ratio",
        "p_div by ratio",
    ]
    body = []
    for r in areas.iter_rows(named=True):
        pts = points.filter((pl.col("model") == r["model"]) & pl.col("curves").list.contains(r["curve"])).sort(
            "compression_ratio"
        )
        by = lambda m: " ".join(f"{x:g}:{_finite(v)}" for x, v in zip(pts["compression_ratio"], pts[m]))  # noqa: E731
        first = r["first_ratio_above_floor"]
        span = "-" if r["bytes_min"] != r["bytes_min"] else f"{_bytes(r['bytes_min'])}-{_bytes(r['bytes_max'])}"
        body.append(
            [
                str(r["rank"]),
                r["model"],
                r["curve"],
                ci(r, "mean_E_M"),
                ci(r, "mean_p_div"),
                "(best)" if r["rank"] == 1 else ci(r, "diff_best_mean_E_M"),
                ci(r, "area_E_M"),
                span,
                _finite(first) if first == first else "never",
                by("E_M"),
                by("p_div"),
            ]
        )
    n = areas["n_docs"].max() if areas.height else 0
    return "\n".join(
        [
            f"frontier: curves ranked by their mean over {_frontier_range(areas)}, {n} documents, "
            f"[CI]: {confidence:.0%} paired document bootstrap; smaller is more faithful",
            *text_table(header, body, left=len(header)),
        ]
    )


def _frontier_range(areas) -> str:
    """The range a frontier's curves are ranked on, in words (per model when there are several)."""
    import polars as pl

    on = areas.filter(pl.col("covers_range")) if areas.height else areas
    if not on.height:
        return "no range common to two curves (each has one ratio)"
    where = f"common to {on.height} of {areas.height} curves"
    if on["range_lo"].is_nan().all():
        return f"the retention {where}"
    spans = sorted(set(zip(on["model"], on["range_lo"], on["range_hi"])))
    words = ", ".join(f"{_bytes(a)}-{_bytes(b)}" + (f" ({m})" if len(spans) > 1 else "") for m, a, b in spans)
    off = "; mean '-': a curve not on it" if on.height < areas.height else ""
    return f"the KV bytes per prompt token {where} ({words}{off})"


def _bytes(v: float) -> str:
    """A byte count: whole bytes from 100 up, else 4 significant digits."""
    return f"{v:.0f}" if abs(v) >= 100 else number(v, 4)


def task_text(tables: Mapping[str, pl.DataFrame]) -> str:
    """The task's accuracy per press, the rank correlations and the AUC as plain-text tables (what
    ``kvdiverge measure --task`` prints), from :func:`kvdiverge.data.tasks.tables.task_tables`' tables.

    Press and measure names are printed whole (:func:`kvdiverge.io.render.text_table`), the numbers
    to three significant digits and the intervals as ``value [lo, hi]`` (:func:`with_interval`).
    """
    num = partial(number, missing="-")
    ci = partial(with_interval, missing="-")
    accuracy = [
        [r["policy"], str(r["n_docs"]), num(r["full_accuracy"]), num(r["accuracy"]), ci(r, "drop")]
        for r in tables["accuracy"].iter_rows(named=True)
    ]
    correlations = [
        [r["measure"], str(r["n_points"]), ci(r, "spearman"), num(r["kendall"])]
        for r in tables["correlations"].iter_rows(named=True)
    ]
    auc = [
        [r["measure"], str(r["n_pairs"]), str(r["n_broken"]), ci(r, "auc")] for r in tables["auc"].iter_rows(named=True)
    ]
    return "\n".join(
        [
            *text_table(["press", "prompts", "full-cache accuracy", "accuracy", "drop [CI]"], accuracy),
            "",
            *text_table(["measure", "points", "Spearman [CI]", "Kendall"], correlations),
            "",
            *text_table(["measure", "pairs", "broken", "AUC [CI]"], auc),
        ]
    )


#: The columns of :func:`prediction_markdown`: title and how a row of the prediction table fills it.
_PREDICTION_COLUMNS = (
    ("task", lambda r: f"{r['task']} ({r['placement']})"),
    ("measure", lambda r: f"`{r['measure']}`"),
    ("τ within ratio [95% CI]", lambda r: with_interval(r, "kendall_within_ratio", 2)),
    ("p Holm", lambda r: number(r["p_kendall_within_ratio_holm"], 2)),
    ("gain [95% CI]", lambda r: with_interval(r, "mae_gain", 2)),
    ("p Holm ", lambda r: number(r["p_mae_gain_holm"], 2)),
    (
        "near baseline: points, τ, gain",
        lambda r: f"{r['n_points_band']}, {number(r['kendall_within_ratio_band'], 2)}, {number(r['mae_gain_band'], 2)}",
    ),  # fmt: skip
    (
        "p Holm (τ, gain)",
        lambda r: f"{number(r['p_kendall_within_ratio_band_holm'], 2)}, {number(r['p_mae_gain_band_holm'], 2)}",
    ),  # fmt: skip
    ("ρ given ratio", lambda r: number(r["spearman_given_ratio"], 2)),
    ("CPU s / point", lambda r: number(r["cpu_s_per_point"], 2)),
)


def prediction_markdown(table: pl.DataFrame, measures=None) -> str:
    """The prediction study's table (the ``prediction`` rule's ``prediction.csv``) as a Markdown table.

    One row per task side and measure (``measures``, in their order; None: every row), with the
    within-ratio Kendall and the held-out gain with their intervals and Holm-adjusted permutation
    p-values, the near-baseline band's points and statistics, the partial Spearman given the ratio
    and the CPU seconds per point; two significant digits (:func:`number`).
    """
    if measures is not None:
        order = {m: i for i, m in enumerate(measures)}
        table = table.filter(pl.col("measure").is_in(list(measures)))
        table = table.sort(["task", "placement", pl.col("measure").replace_strict(order, return_dtype=pl.Int64)])
    rows = [[fill(r) for _, fill in _PREDICTION_COLUMNS] for r in table.iter_rows(named=True)]
    return "\n".join(markdown_table([title.strip() for title, _ in _PREDICTION_COLUMNS], rows))


def pairwise_markdown(pairwise: pl.DataFrame, pairs) -> str:
    """The prediction study's pairwise comparisons (``pairwise.csv``) of ``pairs`` (``(a, b)`` measures, each
    in the table's order or reversed) as a Markdown table: per task side and pair, the differences ``a - b``
    of the held-out gain and of the within-ratio Kendall with their intervals over the shared resamples
    (a reversed pair's differences and interval negated); two significant digits.

    Raises
    ------
    ValueError
        A pair the table does not hold.
    """
    rows = []
    for side, part in pairwise.sort("task", "placement").group_by(["task", "placement"], maintain_order=True):
        for a, b in pairs:
            found = part.filter((pl.col("measure_a") == a) & (pl.col("measure_b") == b))
            sign = 1.0
            if found.is_empty():
                found, sign = part.filter((pl.col("measure_a") == b) & (pl.col("measure_b") == a)), -1.0
            if found.is_empty():
                raise ValueError(f"the pairwise table has no pair ({a}, {b}) for task side {side}")
            r = found.row(0, named=True)
            cells = []
            for stat in ("mae_gain_difference", "kendall_within_ratio_difference"):
                lo, hi = sorted(sign * r[f"{stat}{end}"] + 0.0 for end in ("_lo", "_hi"))  # + 0.0: no -0
                cells.append(with_interval({"v": sign * r[stat] + 0.0, "v_lo": lo, "v_hi": hi}, "v", 2))
            rows.append([f"{side[0]} ({side[1]})", f"`{a}` − `{b}`", *cells])
    header = ["task", "measures", "gain difference [95% CI]", "τ within ratio difference [95% CI]"]
    return "\n".join(markdown_table(header, rows))


def accuracy_markdown(accuracy: pl.DataFrame) -> str:
    """Each task side of the prediction study's accuracy table (``accuracy.csv``) as a Markdown row: the
    documents that take it, the full cache's right answers, the lowest accuracy over the points, the chance
    level (a dash where none) and whether the side is refused (below ``min_full_accuracy``)."""
    rows = []
    for (name, placement), part in accuracy.sort("task", "placement").group_by(
        ["task", "placement"], maintain_order=True
    ):
        r = part.row(0, named=True)
        full = f"{r['n_full_right']} / {r['n_docs']} ({r['full_accuracy']:.0%})"
        refused = "no" if r["refused"] is None else f"yes: below {r['min_full_accuracy']:.0%}"
        rows.append([f"{name} ({placement})", str(part.height), full, number(r["lowest_accuracy"], 2),
                     number(r["chance_accuracy"], 2), refused])  # fmt: skip
    header = ["task", "points", "full cache right", "lowest accuracy", "chance", "refused"]
    return "\n".join(markdown_table(header, rows))
