"""Whether a task-agnostic fidelity measure predicts a task's accuracy drop, beyond the compression ratio.

Fidelity and task are measured on *disjoint* documents: a point of a frontier (a press at a
ratio, a cache, a press with a cache) has a fidelity measure ``x_p``, its mean over the fidelity
documents (plain prompts, no task), and an accuracy drop ``y_p = mean(correct_full - correct)``
over the task documents. Nothing on the fidelity side sees a task prompt, so a correlation is a
prediction, not the answer's own divergence (:mod:`kvdiverge.estimation.task` holds that one).

Each measure is oriented by its direction (:func:`kvdiverge.estimation.task.direction`: ``+1``
when a larger value predicts a larger drop, ``-1`` for the survival ``S_<t>``, ``same_top_p`` and
``tau_first``), so every statistic below is positive when the measure predicts in its expected
direction.

- Across points: Spearman's rho and Kendall's tau (``scipy.stats``) of ``x`` and ``y``.
- Given the compression ratio ``r`` (the fraction of KV bytes a point removes), the baseline every
  user already has:

  - ``spearman_given_ratio``: the partial Spearman correlation, Pearson's correlation of the
    ranks of ``x`` and ``y`` after the ranks of ``r`` are removed linearly,
    ``(r_xy - r_xr r_yr) / sqrt((1 - r_xr^2)(1 - r_yr^2))`` (Kendall & Stuart, *The Advanced
    Theory of Statistics*, vol. 2, §27);
  - ``kendall_within_ratio``: Kendall's tau-a over the pairs of points at the same ratio only,
    (concordant - discordant) / pairs: whether the measure ranks the presses of one ratio by
    their drop.

- Leave one press out: for each press, an increasing isotonic regression of ``y`` on ``x``
  (``scipy.optimize.isotonic_regression``, points with equal ``x`` pooled, predictions
  interpolated linearly and clipped at the ends, as scikit-learn's ``IsotonicRegression``)
  fitted on the other presses' points predicts the held-out press's points; ``mae_held_out`` is
  the mean absolute error over every point. ``mae_ratio_only`` is the same with ``r`` in place
  of ``x``, and ``mae_gain = mae_ratio_only - mae_held_out`` what the measure adds (positive: it
  predicts better than the ratio).

Intervals: the paired bootstrap resamples both sides' documents independently (the fidelity
documents, and the task documents) and recomputes every point's ``x`` and ``y``, then every
statistic (:class:`kvdiverge.estimation.bootstrap.Bootstrap`, percentile intervals).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import polars as pl
from scipy import stats
from scipy.optimize import isotonic_regression

from kvdiverge.estimation.bootstrap import Bootstrap, put_interval, resample_counts, resampled_nanmean
from kvdiverge.estimation.task import direction

__all__ = [
    "STATISTICS",
    "PredictionInputError",
    "fidelity_documents",
    "frontier_points_table",
    "full_accuracy_problem",
    "held_out_predictions",
    "measure_problems",
    "prediction_problems",
    "prediction_statistics",
    "prediction_study",
    "prediction_tables",
    "survival_columns",
]

#: The statistics of one (measure, task, placement), in the table's order.
STATISTICS = (
    "spearman",
    "kendall",
    "spearman_given_ratio",
    "kendall_within_ratio",
    "mae_held_out",
    "mae_ratio_only",
    "mae_gain",
)
#: Two ratios closer than this are the same ratio (the within-ratio pairs).
RATIO_TOLERANCE = 1e-9


class PredictionInputError(ValueError):
    """Input the predictive analysis cannot use, in one sentence per problem."""


# --------------------------------------------------------------------------- the inputs

_KEYS = ["policy", "doc_id"]


def survival_columns(T: int) -> list[str]:
    """The survival columns of :func:`fidelity_documents` at horizon ``T``: ``S_1`` to ``S_<T>``."""
    return [f"S_{t}" for t in range(1, int(T) + 1)]


def measure_problems(measures: Sequence[str], T: int, key: str = "prediction.measures") -> list[str]:
    """One sentence per fidelity measure the coupled run at horizon ``T`` cannot give: a survival
    ``S_<t>`` past the horizon (:func:`survival_columns`), named by its config ``key``."""
    have = set(survival_columns(T))
    return [
        f"{key}: {m!r} is the agreement chain's survival after {m[2:]} steps, past the horizon "
        f"decoding.max_new_tokens = {T}; allowed: S_1 to S_{T} (or raise the horizon)"
        for m in measures
        if m.startswith("S_") and m not in have
    ]


def fidelity_documents(
    estimates: pl.DataFrame, teacher: pl.DataFrame | None = None, positions: pl.DataFrame | None = None
) -> pl.DataFrame:
    """The fidelity side's measures per (``point``, ``doc_id``), from the workflow's tables.

    Parameters
    ----------
    estimates : polars.DataFrame
        The coupled run's per-document estimates (``results/analysis/documents.parquet``): ``policy``,
        ``doc_id``, ``T``, ``E_M``, ``p_div``, ``E_tau_div`` and ``S`` (list of ``T`` floats, the
        agreement chain's survival after steps ``1..T``).
    teacher : polars.DataFrame, optional
        The teacher-forced documents (``teacher_forced_documents.parquet``): ``kld_mean``,
        ``kld_max``, ``same_top_p``, ``ppl_ratio``, ``delta_p_rms``.
    positions : polars.DataFrame, optional
        The teacher-forced positions (``results/teacher_forced/...``): ``policy``, ``doc_id`` and
        ``kld`` per position, for ``kld_p99``, each document's 99th percentile of the per-position
        KL divergence (linear interpolation between order statistics; llama.cpp's ``--kl-divergence``
        reports the same percentile pooled over positions).

    Returns
    -------
    polars.DataFrame
        ``point`` (the policy), ``doc_id``, ``E_M``, ``p_div``, ``tau_first = E_tau_div + (1 -
        p_div)(T + 1)`` (steps; ``T + 1`` when the sides never diverge), ``S_<t>`` for ``t = 1..T``,
        and the teacher-forced columns given (left join: null where a document has none).
    """
    T = int(estimates["T"].max())
    out = estimates.select(
        *_KEYS,
        "E_M",
        "p_div",
        (pl.col("E_tau_div") + (1 - pl.col("p_div")) * (pl.col("T") + 1)).alias("tau_first"),
        *(pl.col("S").list.get(t - 1, null_on_oob=True).alias(c) for t, c in enumerate(survival_columns(T), 1)),
    )
    if teacher is not None:
        cols = [c for c in ("kld_mean", "kld_max", "same_top_p", "ppl_ratio", "delta_p_rms") if c in teacher.columns]
        out = out.join(teacher.select(*_KEYS, *cols), on=_KEYS, how="left")
    if positions is not None:
        p99 = positions.group_by(_KEYS).agg(pl.col("kld").quantile(0.99, interpolation="linear").alias("kld_p99"))
        out = out.join(p99, on=_KEYS, how="left")
    return out.rename({"policy": "point"}).sort("point", "doc_id")


def frontier_points_table(frontier: pl.DataFrame) -> pl.DataFrame:
    """The frontier's points with the press left out together and the compression ratio in KV bytes.

    Parameters
    ----------
    frontier : polars.DataFrame
        One model's frontier table (``POINT_SCHEMA`` of :mod:`kvdiverge.estimation.frontier`: ``policy``,
        ``press``, ``cache``, ``kv_bytes_per_token``, ``retention``).

    Returns
    -------
    polars.DataFrame
        ``point``, ``press`` (the press; a quantized cache alone is its own group, by its label)
        and ``ratio = 1 - kv_bytes_per_token / full`` (the fraction of the full cache's KV bytes per
        prompt token the point removes; ``full`` from the full-precision points, bytes / retention).

    Raises
    ------
    PredictionInputError
        Without a full-precision point, or without the bytes (a frontier table made without the
        model's KV sizes).
    """
    if frontier["kv_bytes_per_token"].null_count() or frontier.filter(pl.col("cache").is_null()).is_empty():
        raise PredictionInputError(
            "the frontier table has no KV bytes per token at full precision: the compression ratio in bytes needs them"
        )
    plain = frontier.filter(pl.col("cache").is_null())
    full = float((plain["kv_bytes_per_token"] / plain["retention"]).median())
    return frontier.select(
        pl.col("policy").alias("point"),
        pl.coalesce("press", "cache").alias("press"),
        (1 - pl.col("kv_bytes_per_token") / full).alias("ratio"),
    )


# --------------------------------------------------------------------------- input checks


def full_accuracy_problem(side: pl.DataFrame, min_full_accuracy: float = 0.7) -> str | None:
    """The sentence refusing one task side (``task``, ``placement``, ``doc_id``, ``correct_full``)
    whose full cache answers fewer than ``min_full_accuracy`` of its documents, else None."""
    full = side.unique("doc_id")["correct_full"].cast(pl.Float64).mean()
    if full is not None and full >= min_full_accuracy:
        return None
    name, placement = side["task"][0], side["placement"][0]
    return (
        f"task {name} ({placement}): the full cache answers {full or 0:.0%} of the documents, below "
        f"{min_full_accuracy:.0%}: too few right answers to measure a press's drop"
    )


def prediction_problems(
    fidelity: pl.DataFrame,
    task: pl.DataFrame,
    points: pl.DataFrame,
    *,
    min_full_accuracy: float = 0.7,
    min_presses: int = 3,
) -> list[str]:
    """One sentence per reason the analysis cannot run on these tables; empty when it can.

    Refused: fidelity and task documents that overlap (a fidelity measure would have seen a task
    prompt), fewer than ``min_presses`` presses among the points (the held-out analysis leaves
    one out and fits on the rest), a task and placement whose full-cache accuracy is below
    ``min_full_accuracy`` (too few right answers for a press to lose), a point on one side only.
    Columns as :func:`prediction_tables`.
    """
    problems = []
    shared = set(fidelity["doc_id"].unique().to_list()) & set(task["doc_id"].unique().to_list())
    if shared:
        problems.append(
            f"the fidelity and task documents overlap in {len(shared)} documents (e.g. {sorted(shared)[0]!r}): "
            "a fidelity measure must not see a task prompt"
        )
    presses = points["press"].unique().to_list()
    if len(presses) < min_presses:
        problems.append(
            f"the frontier has {len(presses)} presses ({', '.join(map(str, sorted(presses)))}); "
            f"leaving one press out needs at least {min_presses}"
        )
    for _, part in task.group_by(["task", "placement"], maintain_order=True):
        problems += [p for p in [full_accuracy_problem(part, min_full_accuracy)] if p]
    known = set(points["point"].to_list())
    for side, frame in (("fidelity", fidelity), ("task", task)):
        missing = sorted(known - set(frame["point"].unique().to_list()))
        if missing:
            problems.append(f"the {side} side has no documents at point {missing[0]!r} ({len(missing)} points missing)")
    return problems


# --------------------------------------------------------------------------- the statistics


def _ranks_correlation(a: np.ndarray, b: np.ndarray) -> float:
    if np.ptp(a) == 0 or np.ptp(b) == 0:
        return float("nan")
    return float(np.corrcoef(a, b)[0, 1])


def _partial_spearman(x: np.ndarray, y: np.ndarray, r: np.ndarray) -> float:
    rx, ry, rr = (stats.rankdata(v) for v in (x, y, r))
    xy = _ranks_correlation(rx, ry)
    if np.ptp(rr) == 0:  # one ratio: nothing to remove
        return xy
    xr, yr = _ranks_correlation(rx, rr), _ranks_correlation(ry, rr)
    denominator = np.sqrt((1 - xr**2) * (1 - yr**2))
    return float((xy - xr * yr) / denominator) if denominator > 0 else float("nan")


def _kendall_within_ratio(x: np.ndarray, y: np.ndarray, r: np.ndarray) -> float:
    i, j = np.triu_indices(len(x), k=1)
    same = np.abs(r[i] - r[j]) <= RATIO_TOLERANCE
    if not same.any():
        return float("nan")
    i, j = i[same], j[same]
    return float(np.mean(np.sign(x[i] - x[j]) * np.sign(y[i] - y[j])))


def _isotonic_predict(x_fit: np.ndarray, y_fit: np.ndarray, x_new: np.ndarray) -> np.ndarray:
    """The increasing isotonic regression of ``y_fit`` on ``x_fit``, evaluated at ``x_new``."""
    knots, inverse, counts = np.unique(x_fit, return_inverse=True, return_counts=True)
    means = np.bincount(inverse, weights=y_fit) / counts
    fitted = isotonic_regression(means, weights=counts.astype(float), increasing=True).x
    return np.interp(x_new, knots, fitted)


def held_out_predictions(x: np.ndarray, y: np.ndarray, presses: np.ndarray) -> np.ndarray:
    """Leave-one-press-out predictions of ``y`` (points,) from ``x`` (points,): each press's points
    predicted by the isotonic regression fitted on every other press's points (float64, points,)."""
    predicted = np.empty(len(y))
    for press in np.unique(presses):
        out = presses == press
        predicted[out] = _isotonic_predict(x[~out], y[~out], x[out])
    return predicted


def prediction_statistics(x: np.ndarray, y: np.ndarray, ratio: np.ndarray, presses: np.ndarray) -> np.ndarray:
    """The :data:`STATISTICS` of one oriented measure ``x``, drops ``y`` and ratios, over the points.

    Parameters
    ----------
    x, y, ratio : numpy.ndarray of float, shape (points,)
        The oriented measure's mean, the accuracy drop (fraction of documents) and the
        compression ratio of each point. Points with a non-finite ``x`` or ``y`` are left out.
    presses : numpy.ndarray, shape (points,)
        Each point's press: the group the held-out analysis leaves out.

    Returns
    -------
    numpy.ndarray of float64, shape (7,)
        In :data:`STATISTICS` order; NaN where a statistic is undefined (a constant side,
        fewer than 3 points, no two points at one ratio).
    """
    ok = np.isfinite(x) & np.isfinite(y)
    x, y, ratio, presses = x[ok], y[ok], ratio[ok], presses[ok]
    if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        rho = tau = partial = float("nan")
    else:
        rho = float(stats.spearmanr(x, y).statistic)
        tau = float(stats.kendalltau(x, y).statistic)
        partial = _partial_spearman(x, y, ratio)
    within = _kendall_within_ratio(x, y, ratio) if len(x) else float("nan")
    if len(np.unique(presses)) < 2:
        return np.array([rho, tau, partial, within, np.nan, np.nan, np.nan])
    held = float(np.mean(np.abs(held_out_predictions(x, y, presses) - y)))
    ratio_only = float(np.mean(np.abs(held_out_predictions(ratio, y, presses) - y)))
    return np.array([rho, tau, partial, within, held, ratio_only, ratio_only - held])


# --------------------------------------------------------------------------- tables


@dataclass(frozen=True)
class _Side:
    """One side's (points, documents) matrix of a value, documents every point has, and its resampled point means."""

    values: np.ndarray
    docs: list[str]

    @classmethod
    def of(cls, frame: pl.DataFrame, points: Sequence[str], column: pl.Expr) -> _Side:
        docs = sorted(set.intersection(*(set(frame.filter(pl.col("point") == p)["doc_id"].to_list()) for p in points)))
        wide = (
            frame.filter(pl.col("doc_id").is_in(docs))
            .select("point", "doc_id", column.cast(pl.Float64).fill_null(np.nan).alias("value"))
            .pivot(on="doc_id", index="point", values="value", aggregate_function="mean")
        )
        order = {p: k for k, p in enumerate(wide["point"].to_list())}
        matrix = wide.select(docs).to_numpy()[[order[p] for p in points]]
        return cls(matrix, docs)

    def means(self) -> np.ndarray:
        with np.errstate(invalid="ignore"):
            return np.nanmean(self.values, axis=1) if self.values.size else np.full(len(self.values), np.nan)

    def resampled(self, boot: Bootstrap, *purpose: object) -> np.ndarray:
        """(n_boot, points) means over ``boot``'s resamples of the documents (finite entries only)."""
        return resampled_nanmean(resample_counts(boot.indices(len(self.docs), *purpose)), self.values.T)


def _row(x: _Side, y: _Side, ratio, presses, sign: int, boot: Bootstrap, purpose: tuple) -> dict:
    point = prediction_statistics(sign * x.means(), y.means(), ratio, presses)
    xb = sign * x.resampled(boot, "prediction-fidelity", *purpose)
    yb = y.resampled(boot, "prediction-task", *purpose)
    draws = np.array([prediction_statistics(xb[b], yb[b], ratio, presses) for b in range(len(xb))])
    lo, hi = boot.interval(draws)
    row = {"n_points": len(ratio), "n_presses": len(np.unique(presses))}
    row.update(n_fidelity_docs=len(x.docs), n_task_docs=len(y.docs), direction=sign)
    for k, name in enumerate(STATISTICS):
        put_interval(row, name, point[k], lo[k], hi[k])
    return row


def prediction_tables(
    fidelity: pl.DataFrame,
    task: pl.DataFrame,
    points: pl.DataFrame,
    measures: Sequence[str],
    *,
    boot: Bootstrap = Bootstrap(),
    directions: Mapping[str, int] | None = None,
    min_full_accuracy: float = 0.7,
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The predictive analysis of every fidelity measure against every task and question placement.

    Parameters
    ----------
    fidelity : polars.DataFrame
        One row per (``point``, ``doc_id``) of the fidelity documents, with a float column per
        measure (e.g. ``E_M``, ``p_div``, ``kld_mean``); nulls and NaN are left out of means.
    task : polars.DataFrame
        One row per (``task``, ``placement``, ``point``, ``doc_id``) of the task documents, with
        booleans ``correct_full`` (the full cache's answer is right) and ``correct`` (the point's).
    points : polars.DataFrame
        One row per point: ``point``, ``press`` (the group left out together), ``ratio`` (the
        compression ratio: the fraction of the KV bytes per prompt token the point removes).
        Controls (the ``none`` policy, the noise floor) are not points.
    measures : sequence of str
        The fidelity columns to test.
    boot : kvdiverge.estimation.bootstrap.Bootstrap
        Resamples, confidence and seed of the paired bootstrap (purposes ``"prediction-fidelity"``
        and ``"prediction-task"`` with the task, placement and measure).
    directions : mapping of str to int, optional
        ``+1`` or ``-1`` per measure, over :func:`kvdiverge.estimation.task.direction`.
    min_full_accuracy : float
        A task and placement whose full cache answers fewer of its documents is refused.

    Returns
    -------
    table : polars.DataFrame
        One row per (``measure``, ``task``, ``placement``): ``n_points``, ``n_presses``,
        ``n_fidelity_docs``, ``n_task_docs`` (documents every point has), ``direction``, and each of
        :data:`STATISTICS` with ``_lo``/``_hi``.
    predictions : polars.DataFrame
        One row per (``measure``, ``task``, ``placement``, ``point``): ``press``, ``ratio``, the
        oriented measure ``x``, the ``drop``, the held-out prediction ``predicted`` and the
        ratio-only one ``predicted_ratio_only`` (the figure's marks).

    Raises
    ------
    PredictionInputError
        For each of :func:`prediction_problems`' reasons, in one message.
    """
    problems = prediction_problems(fidelity, task, points, min_full_accuracy=min_full_accuracy)
    if problems:
        raise PredictionInputError("; ".join(problems))
    directions = dict(directions or {})
    names = points["point"].to_list()
    ratio = points["ratio"].cast(pl.Float64).to_numpy()
    presses = np.asarray(points["press"].to_list())
    rows, marks = [], []
    for (name, placement), part in task.sort("task", "placement").group_by(["task", "placement"], maintain_order=True):
        y = _Side.of(part, names, pl.col("correct_full").cast(pl.Float64) - pl.col("correct").cast(pl.Float64))
        for measure in measures:
            x = _Side.of(fidelity, names, pl.col(measure))
            sign = int(directions.get(measure, direction(measure)))
            keys = {"measure": measure, "task": name, "placement": placement}
            rows.append({**keys, **_row(x, y, ratio, presses, sign, boot, (name, placement, measure))})
            xs, ys = sign * x.means(), y.means()
            marks.append(
                pl.DataFrame({"point": names, "press": presses.tolist(), "ratio": ratio, "x": xs, "drop": ys})
                .with_columns(
                    predicted=pl.Series(held_out_predictions(xs, ys, presses)),
                    predicted_ratio_only=pl.Series(held_out_predictions(ratio, ys, presses)),
                )
                .select(*(pl.lit(v).alias(k) for k, v in keys.items()), pl.all())
            )
    return pl.DataFrame(rows), pl.concat(marks)


def prediction_study(
    fidelity: pl.DataFrame,
    task: pl.DataFrame,
    points: pl.DataFrame,
    measures: Sequence[str],
    *,
    boot: Bootstrap = Bootstrap(),
    min_full_accuracy: float = 0.7,
) -> dict[str, pl.DataFrame]:
    """:func:`prediction_tables` of each task side on the points it ran, and every side's accuracy per point.

    A side runs a subset of the frontier's points when some cannot take its question placement
    (a quantized cache cannot take a question prefilled after compression); each side is compared
    on its own points. A side whose full cache is too weak (:func:`full_accuracy_problem`) is left
    out of the prediction tables with its sentence in the accuracy table's ``refused``, so that the
    other sides still report. Columns of the inputs as :func:`prediction_tables`'; ``fidelity`` may
    hold other points (controls), which are left out.

    Returns
    -------
    dict of str to polars.DataFrame
        ``prediction`` and ``predictions`` (:func:`prediction_tables`' two tables, the sides that
        report stacked), and ``accuracy``: per (``task``, ``placement``, ``point``) ``n_docs``,
        ``full_accuracy``, ``accuracy``, ``drop`` (fractions of the documents) and ``refused`` (the
        side's sentence, or null).

    Raises
    ------
    PredictionInputError
        As :func:`prediction_tables`, for any side; and when every side is refused, naming each.
    """
    tables, marks, refused = [], [], {}
    for (name, placement), side in task.sort("task", "placement").group_by(["task", "placement"], maintain_order=True):
        reason = full_accuracy_problem(side, min_full_accuracy)
        if reason:
            refused[(name, placement)] = reason
            continue
        side = side.filter(pl.col("point").is_in(points["point"].to_list()))
        at = points.filter(pl.col("point").is_in(side["point"].unique().to_list()))
        fid = fidelity.filter(pl.col("point").is_in(at["point"].to_list()))
        table, predictions = prediction_tables(fid, side, at, measures, boot=boot, min_full_accuracy=min_full_accuracy)
        tables.append(table)
        marks.append(predictions)
    if not tables:
        raise PredictionInputError("; ".join(refused.values()))
    accuracy = (
        task.group_by("task", "placement", "point")
        .agg(
            n_docs=pl.len(),
            full_accuracy=pl.col("correct_full").cast(pl.Float64).mean(),
            accuracy=pl.col("correct").cast(pl.Float64).mean(),
        )
        .with_columns(drop=pl.col("full_accuracy") - pl.col("accuracy"))
        .with_columns(
            refused=pl.struct("task", "placement").map_elements(
                lambda key: refused.get((key["task"], key["placement"])), return_dtype=pl.String
            )
        )
        .sort("task", "placement", "point")
    )
    return {
        "prediction": pl.concat(tables, how="diagonal_relaxed"),
        "predictions": pl.concat(marks, how="diagonal_relaxed"),
        "accuracy": accuracy,
    }
