"""Whether a task-agnostic fidelity measure predicts a task's accuracy drop, beyond the compression ratio.

Fidelity and task are measured on *disjoint* documents: a point of a frontier (a press at a
ratio, a cache, a press with a cache) has a fidelity measure ``x_p``, its mean over the fidelity
documents (plain prompts, no task), and an accuracy drop ``y_p = mean(correct_full - correct)``
over the task documents. Nothing on the fidelity side sees a task prompt, so a correlation is a
prediction, not the answer's own divergence (:mod:`kvdiverge.estimation.task` holds that one).

Each measure is oriented by its direction (:func:`kvdiverge.estimation.task.direction`: ``+1``
when a larger value predicts a larger drop, ``-1`` for the survival ``S_<t>``, ``same_top_p`` and
``tau_first``), so every statistic is positive when the measure predicts in its expected
direction. Measures are columns of the fidelity table taken by name: a new one needs no change here.

The statistics (:mod:`kvdiverge.estimation.beyond_ratio`) take the ratio as a factor: the
within-ratio Kendall concordance pooled over the ratios and the leave-one-press-out gain over the
ratio alone, over every point and near the baseline (``|drop| <= band``), each with a
within-ratio permutation p-value and Holm's adjustment across the measures of one task side;
Spearman, Kendall and the partial Spearman given the ratio are secondary.

Intervals: the paired bootstrap resamples both sides' documents independently (the fidelity
documents, and the task documents) and recomputes every point's ``x`` and ``y``, then every
statistic (:class:`kvdiverge.estimation.bootstrap.Bootstrap`, percentile intervals). Every
measure of a task side uses the *same* resamples, so two measures are compared draw by draw (the
pairwise table: the difference of their gains and of their within-ratio Kendall, with intervals).

The inputs from the workflow's tables and their checks: :mod:`kvdiverge.estimation.prediction_inputs`.
"""

from __future__ import annotations

import dataclasses
import itertools
import numbers
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from kvdiverge.estimation.beyond_ratio import (
    DEFAULT_BAND,
    STATISTICS,
    TESTED,
    Baseline,
    held_out_predictions,
    within_ratio_permutation,
)
from kvdiverge.estimation.bootstrap import (
    Bootstrap,
    bootstrap_rng,
    put_interval,
    resample_counts,
    resampled_nanmean,
)
from kvdiverge.estimation.confirmatory import holm
from kvdiverge.estimation.prediction_inputs import (
    PredictionInputError,
    full_accuracy_problem,
    prediction_problems,
)
from kvdiverge.estimation.task import direction

__all__ = [
    "PAIRWISE",
    "PredictionSettings",
    "PredictionStudy",
    "PredictionTables",
    "prediction_study",
    "prediction_tables",
    "press_errors",
]

#: The statistics compared between two measures of one task side (the pairwise table's differences).
PAIRWISE = ("mae_gain", "kendall_within_ratio")


def _settings_iv(boot: Any, n_perm: Any, band: Any, min_full_accuracy: Any) -> None:
    """Raise ValueError naming the first field of :class:`PredictionSettings` out of range."""
    if not isinstance(boot, Bootstrap):
        raise ValueError(f"PredictionSettings.boot must be a Bootstrap, got {boot!r}")
    if isinstance(n_perm, bool) or not isinstance(n_perm, numbers.Integral) or n_perm < 0:
        raise ValueError(f"PredictionSettings.n_perm must be an integer >= 0, got {n_perm!r}")
    if isinstance(band, bool) or not isinstance(band, numbers.Real) or not 0 <= band < np.inf:
        raise ValueError(f"PredictionSettings.band must be a finite number >= 0, got {band!r}")
    if isinstance(min_full_accuracy, bool) or not isinstance(min_full_accuracy, numbers.Real):
        raise ValueError(f"PredictionSettings.min_full_accuracy must be a number in [0, 1], got {min_full_accuracy!r}")
    if not 0 <= min_full_accuracy <= 1:
        raise ValueError(f"PredictionSettings.min_full_accuracy must be a number in [0, 1], got {min_full_accuracy!r}")


@dataclass(frozen=True)
class PredictionSettings:
    """The settings of the predictive analysis.

    Parameters
    ----------
    boot : kvdiverge.estimation.bootstrap.Bootstrap
        Resamples, confidence and seed of the paired bootstrap; the seed also seeds the permutations.
    n_perm : int
        Permutations of each within-ratio test (``>= 0``; 0 tests nothing and gives NaN p-values).
        The smallest p-value is ``1 / (1 + n_perm)``.
    band : float
        The near-baseline band, prespecified: the ``_band`` statistics use the points whose
        accuracy drop is at most ``band`` in absolute value (a fraction of the documents).
    min_full_accuracy : float
        A task side whose full cache answers fewer of its documents (a fraction in [0, 1]) is refused.

    Raises
    ------
    ValueError
        Naming the field out of range (``PredictionSettings.n_perm must be an integer >= 0, got -1``).
    """

    boot: Bootstrap = Bootstrap()
    n_perm: int = 999
    band: float = DEFAULT_BAND
    min_full_accuracy: float = 0.7

    def __post_init__(self) -> None:
        _settings_iv(self.boot, self.n_perm, self.band, self.min_full_accuracy)
        object.__setattr__(self, "n_perm", int(self.n_perm))
        object.__setattr__(self, "band", float(self.band))
        object.__setattr__(self, "min_full_accuracy", float(self.min_full_accuracy))


# --------------------------------------------------------------------------- the config's measures


# --------------------------------------------------------------------------- one task side


@dataclass(frozen=True)
class _Side:
    """One side's (points, documents) matrix of a value over the documents every point has."""

    values: np.ndarray
    docs: list[str]

    @staticmethod
    def documents(frame: pl.DataFrame, points: Sequence[str]) -> list[str]:
        return sorted(set.intersection(*(set(frame.filter(pl.col("point") == p)["doc_id"].to_list()) for p in points)))

    @classmethod
    def of(cls, frame: pl.DataFrame, points: Sequence[str], column: pl.Expr, docs: list[str] | None = None) -> _Side:
        docs = cls.documents(frame, points) if docs is None else docs
        wide = (
            frame.filter(pl.col("doc_id").is_in(docs))
            .select("point", "doc_id", column.cast(pl.Float64).fill_null(np.nan).alias("value"))
            .pivot(on="doc_id", index="point", values="value", aggregate_function="mean")
        )
        order = {p: k for k, p in enumerate(wide["point"].to_list())}
        return cls(wide.select(docs).to_numpy()[[order[p] for p in points]], docs)

    def means(self) -> np.ndarray:
        with warnings.catch_warnings():  # a point without the value: NaN, left out downstream
            warnings.simplefilter("ignore", RuntimeWarning)
            return np.nanmean(self.values, axis=1) if self.values.size else np.full(len(self.values), np.nan)

    def resampled(self, counts: np.ndarray) -> np.ndarray:
        """(n_boot, points) means over the resamples ``counts`` (n_boot, documents), finite entries only."""
        return resampled_nanmean(counts, self.values.T)


_DROP = pl.col("correct_full").cast(pl.Float64) - pl.col("correct").cast(pl.Float64)


@dataclass(frozen=True)
class _SideDraws:
    """A task side's points, drops and shared resamples, and its baselines by (draw, finite points)."""

    keys: dict[str, str]
    names: list[str]
    ratio: np.ndarray
    presses: np.ndarray
    y: _Side
    y_draws: np.ndarray
    fidelity_docs: list[str]
    fidelity_counts: np.ndarray
    settings: PredictionSettings
    baselines: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, fidelity, task, points, settings: PredictionSettings, keys: dict[str, str]) -> _SideDraws:
        names, boot = points["point"].to_list(), settings.boot
        ratio, presses = points["ratio"].cast(pl.Float64).to_numpy(), np.asarray(points["press"].to_list())
        y, docs = _Side.of(task, names, _DROP), _Side.documents(fidelity, names)
        task_counts = resample_counts(boot.indices(len(y.docs), "prediction-task", *keys.values()))
        fidelity_counts = resample_counts(boot.indices(len(docs), "prediction-fidelity", *keys.values()))
        return cls(keys, names, ratio, presses, y, y.resampled(task_counts), docs, fidelity_counts, settings)

    def statistics(self, x: np.ndarray, draw: int | None) -> np.ndarray:
        """:data:`STATISTICS` of ``x`` against the observed drops (``draw`` None) or a resample's."""
        y = self.y.means() if draw is None else self.y_draws[draw]
        ok = np.isfinite(x) & np.isfinite(y)
        key = (draw, ok.tobytes())
        if key not in self.baselines:
            ratio, presses = self.ratio[ok], self.presses[ok]
            self.baselines[key] = Baseline.of(y[ok], ratio, presses, band=self.settings.band)
        return self.baselines[key].statistics(x[ok])


def _measure(side: _SideDraws, x: _Side, sign: int) -> tuple[dict, np.ndarray, np.ndarray, pl.DataFrame]:
    """One measure's row, observed statistics, resampled statistics (n_boot, 9) and marks."""
    s, ratio, presses = side.settings, side.ratio, side.presses
    xs, ys = sign * x.means(), side.y.means()
    point = side.statistics(xs, None)
    xb = sign * x.resampled(side.fidelity_counts)
    draws = np.array([side.statistics(xb[b], b) for b in range(len(xb))]).reshape(len(xb), len(STATISTICS))
    lo, hi = s.boot.interval(draws)
    finite = np.isfinite(xs) & np.isfinite(ys)
    row = {**side.keys, "n_points": int(finite.sum()), "n_presses": len(np.unique(presses[finite]))}
    row.update(n_fidelity_docs=len(x.docs), n_task_docs=len(side.y.docs), direction=sign, band=s.band)
    row["n_points_band"] = int(np.sum(finite & (np.abs(ys) <= s.band)))
    for k, name in enumerate(STATISTICS):
        put_interval(row, name, point[k], lo[k], hi[k])
    pvalues = np.full(len(TESTED), np.nan)
    if s.n_perm and finite.any():
        rng = bootstrap_rng(s.boot.seed, "prediction-permutation", *side.keys.values())
        test = within_ratio_permutation(xs, ys, ratio, presses, band=s.band, n_perm=s.n_perm, rng=rng)
        pvalues = test.pvalue
    row.update({f"p_{name}": float(p) for name, p in zip(TESTED, pvalues)})
    marks = pl.DataFrame({"point": side.names, "press": presses.tolist(), "ratio": ratio, "x": xs, "drop": ys})
    marks = marks.with_columns(
        near_baseline=pl.Series(np.abs(ys) <= s.band),
        predicted=pl.Series(held_out_predictions(xs, ys, presses)),
        predicted_ratio_only=pl.Series(held_out_predictions(np.where(np.isfinite(xs), ratio, np.nan), ys, presses)),
    )
    return row, point, draws, marks.select(*(pl.lit(v).alias(k) for k, v in side.keys.items()), pl.all())


def _pairwise(side: _SideDraws, observed: dict[str, np.ndarray], draws: dict[str, np.ndarray]) -> list[dict]:
    """Each pair of measures (in the given order): the differences of :data:`PAIRWISE`, draw by draw."""
    rows = []
    for a, b in itertools.combinations(observed, 2):
        row = {**side.keys, "measure_a": a, "measure_b": b}
        for name in PAIRWISE:
            k = STATISTICS.index(name)
            lo, hi = side.settings.boot.interval(draws[a][:, k] - draws[b][:, k])
            put_interval(row, f"{name}_difference", observed[a][k] - observed[b][k], lo, hi)
        rows.append(row)
    return rows


def _side_tables(side: _SideDraws, fidelity, measures, directions) -> tuple[list[dict], list[pl.DataFrame], list[dict]]:
    rows, marks, observed, draws = [], [], {}, {}
    for measure in measures:
        x = _Side.of(fidelity, side.names, pl.col(measure), docs=side.fidelity_docs)
        sign = int(directions.get(measure, direction(measure)))
        row, observed[measure], draws[measure], mark = _measure(side, x, sign)
        rows.append({"measure": measure, **row})
        marks.append(mark.select(pl.lit(measure).alias("measure"), pl.all()))
    for name in TESTED:
        adjusted = holm([row[f"p_{name}"] for row in rows])
        for row, p in zip(rows, adjusted):
            row[f"p_{name}_holm"] = float(p)
    return rows, marks, _pairwise(side, observed, draws)


# --------------------------------------------------------------------------- tables


def _frame(rows: list[dict]) -> pl.DataFrame:
    return pl.DataFrame(rows, infer_schema_length=None)


@dataclass(frozen=True)
class PredictionTables:
    """The predictive analysis of a set of task sides (:func:`prediction_tables`).

    Attributes
    ----------
    table : polars.DataFrame
        One row per (``measure``, ``task``, ``placement``): ``n_points`` (points with a finite
        measure and drop), ``n_presses``, ``n_fidelity_docs``, ``n_task_docs`` (documents every
        point has), ``direction``, ``band``, ``n_points_band`` (points with ``|drop| <= band``), each
        of :data:`kvdiverge.estimation.beyond_ratio.STATISTICS` with ``_lo``/``_hi``, and for each
        of :data:`kvdiverge.estimation.beyond_ratio.TESTED` ``p_<statistic>`` (the within-ratio
        permutation p-value) and ``p_<statistic>_holm`` (Holm's step-down adjustment over the
        measures of the task side, one family per statistic).
    predictions : polars.DataFrame
        One row per (``measure``, ``task``, ``placement``, ``point``): ``press``, ``ratio``, the
        oriented measure ``x``, the ``drop``, ``near_baseline``, the held-out prediction
        ``predicted`` and the ratio-only one ``predicted_ratio_only`` (the figure's marks; NaN at a
        point without the measure, and that point is in neither fit).
    pairwise : polars.DataFrame
        One row per task side and pair of measures (``measure_a`` before ``measure_b`` in the
        given order): ``mae_gain_difference`` and ``kendall_within_ratio_difference`` (a minus b)
        with ``_lo``/``_hi``, percentile intervals of the differences over the shared resamples.
    """

    table: pl.DataFrame
    predictions: pl.DataFrame
    pairwise: pl.DataFrame


def prediction_tables(
    fidelity: pl.DataFrame,
    task: pl.DataFrame,
    points: pl.DataFrame,
    measures: Sequence[str],
    *,
    settings: PredictionSettings = PredictionSettings(),
    directions: Mapping[str, int] | None = None,
) -> PredictionTables:
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
        The fidelity columns to test, by name.
    settings : PredictionSettings
        Bootstrap (purposes ``"prediction-fidelity"`` and ``"prediction-task"`` with the task and
        placement: every measure of a side shares them), permutations (purpose
        ``"prediction-permutation"``), band and the full-accuracy bar.
    directions : mapping of str to int, optional
        ``+1`` or ``-1`` per measure, over :func:`kvdiverge.estimation.task.direction`.

    Returns
    -------
    PredictionTables

    Raises
    ------
    PredictionInputError
        For each of :func:`~kvdiverge.estimation.prediction_inputs.prediction_problems`' reasons, in one message.
    """
    problems = prediction_problems(fidelity, task, points, min_full_accuracy=settings.min_full_accuracy)
    if problems:
        raise PredictionInputError("; ".join(problems))
    directions = dict(directions or {})
    rows, marks, pairs = [], [], []
    for (name, placement), part in task.sort("task", "placement").group_by(["task", "placement"], maintain_order=True):
        side = _SideDraws.of(fidelity, part, points, settings, {"task": name, "placement": placement})
        side_rows, side_marks, side_pairs = _side_tables(side, fidelity, measures, directions)
        rows += side_rows
        marks += side_marks
        pairs += side_pairs
    return PredictionTables(_frame(rows), pl.concat(marks, how="diagonal_relaxed"), _frame(pairs))


def press_errors(predictions: pl.DataFrame) -> pl.DataFrame:
    """Each press's held-out error, from :class:`PredictionTables`' ``predictions``.

    Returns
    -------
    polars.DataFrame
        One row per (``measure``, ``task``, ``placement``, ``press``): ``n_points`` (its points
        with a prediction), ``mae_held_out`` and ``mae_ratio_only`` (mean absolute errors of the
        held-out and ratio-only predictions of its points, fractions of documents) and ``mae_gain``
        (their difference: positive where the measure predicts the press better than the ratio).
    """
    keys = ["measure", "task", "placement", "press"]
    error = (pl.col("predicted") - pl.col("drop")).abs().fill_nan(None)
    ratio_error = (pl.col("predicted_ratio_only") - pl.col("drop")).abs().fill_nan(None)
    return (
        predictions.group_by(keys, maintain_order=True)
        .agg(n_points=error.count(), mae_held_out=error.mean(), mae_ratio_only=ratio_error.mean())
        .with_columns(mae_gain=pl.col("mae_ratio_only") - pl.col("mae_held_out"))
    )


def _accuracy(task: pl.DataFrame, refused: Mapping, chance: Mapping[str, float], bar: float) -> pl.DataFrame:
    correct, full = pl.col("correct").cast(pl.Float64), pl.col("correct_full")
    side = ["task", "placement"]
    return (
        task.group_by(*side, "point")
        .agg(
            n_docs=pl.len(),
            full_accuracy=full.cast(pl.Float64).mean(),
            accuracy=correct.mean(),
            n_full_right=full.cast(pl.Int64).sum(),
            drop_full_right=(1 - correct).filter(full).mean(),
        )
        .with_columns(drop=pl.col("full_accuracy") - pl.col("accuracy"))
        .with_columns(
            lowest_accuracy=pl.col("accuracy").min().over(side),
            chance_accuracy=pl.col("task").replace_strict(dict(chance), default=None, return_dtype=pl.Float64),
            min_full_accuracy=pl.lit(bar),
            refused=pl.struct(side).map_elements(
                lambda k: refused.get((k["task"], k["placement"])), return_dtype=pl.String
            ),
        )
        .sort(*side, "point")
    )


@dataclass(frozen=True)
class PredictionStudy:
    """The prediction study of one model (:func:`prediction_study`): :class:`PredictionTables`' three
    tables (the sides that report stacked), each press's errors and the accuracy per point.

    Attributes
    ----------
    prediction, predictions, pairwise : polars.DataFrame
        :class:`PredictionTables`' ``table``, ``predictions`` and ``pairwise``.
    presses : polars.DataFrame
        :func:`press_errors` of ``predictions``.
    accuracy : polars.DataFrame
        Per (``task``, ``placement``, ``point``): ``n_docs``, ``full_accuracy``, ``accuracy``,
        ``drop`` (fractions of the documents), ``n_full_right`` (documents the full cache answers
        right) and ``drop_full_right`` (the fraction of those the point answers wrong), and per
        side ``lowest_accuracy`` (over its points), ``chance_accuracy``
        (:func:`kvdiverge.estimation.prediction_review.chance_accuracy`, null where not given),
        ``min_full_accuracy`` (the bar) and ``refused`` (the side's sentence, or null).
    """

    prediction: pl.DataFrame
    predictions: pl.DataFrame
    pairwise: pl.DataFrame
    presses: pl.DataFrame
    accuracy: pl.DataFrame

    def tables(self) -> dict[str, pl.DataFrame]:
        """The tables by name (the workflow's files ``<name>.parquet``)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def prediction_study(
    fidelity: pl.DataFrame,
    task: pl.DataFrame,
    points: pl.DataFrame,
    measures: Sequence[str],
    *,
    settings: PredictionSettings = PredictionSettings(),
    directions: Mapping[str, int] | None = None,
    chance: Mapping[str, float] | None = None,
) -> PredictionStudy:
    """:func:`prediction_tables` of each task side on the points it ran, and every side's accuracy per point.

    A side runs a subset of the frontier's points when some cannot take its question placement
    (a quantized cache cannot take a question prefilled after compression); each side is compared
    on its own points. A side whose full cache is too weak
    (:func:`~kvdiverge.estimation.prediction_inputs.full_accuracy_problem`) is left
    out of the prediction tables with its sentence in the accuracy table's ``refused``, so that the
    other sides still report. Columns of the inputs as :func:`prediction_tables`'; ``fidelity`` may
    hold other points (controls), which are left out. ``chance`` gives each task's
    :func:`kvdiverge.estimation.prediction_review.chance_accuracy` by task name.

    Raises
    ------
    PredictionInputError
        As :func:`prediction_tables`, for any side; and when every side is refused, naming each.
    """
    parts, refused = [], {}
    for (name, placement), side in task.sort("task", "placement").group_by(["task", "placement"], maintain_order=True):
        reason = full_accuracy_problem(side, settings.min_full_accuracy)
        if reason:
            refused[(name, placement)] = reason
            continue
        side = side.filter(pl.col("point").is_in(points["point"].to_list()))
        at = points.filter(pl.col("point").is_in(side["point"].unique().to_list()))
        fid = fidelity.filter(pl.col("point").is_in(at["point"].to_list()))
        parts.append(prediction_tables(fid, side, at, measures, settings=settings, directions=directions))
    if not parts:
        raise PredictionInputError("; ".join(refused.values()))
    tables = {
        f: pl.concat([getattr(p, f) for p in parts], how="diagonal_relaxed")
        for f in ("table", "predictions", "pairwise")
    }
    return PredictionStudy(
        prediction=tables["table"],
        predictions=tables["predictions"],
        pairwise=tables["pairwise"],
        presses=press_errors(tables["predictions"]),
        accuracy=_accuracy(task, refused, chance or {}, settings.min_full_accuracy),
    )
