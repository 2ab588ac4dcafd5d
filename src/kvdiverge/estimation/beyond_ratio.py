"""What a fidelity measure says about a task's accuracy drop beyond the compression ratio, over a frontier's points.

A point ``p`` of a frontier (a press at a ratio, a cache) has an oriented measure ``x_p`` (larger
predicts a larger drop), an accuracy drop ``y_p`` and a compression ratio ``r_p``; its press is
the group left out together. The ratio is the baseline every user has, so it enters as a
*factor*: points are compared within their ratio, never through a line fitted on the ratio.

Primary statistics (:data:`PRIMARY`):

- ``kendall_within_ratio``: the stratified Kendall concordance over the ratios' strata ``s``
  (points whose ratios differ by at most :data:`RATIO_TOLERANCE`),
  ``tau_w = sum_s (C_s - D_s) / sum_s n_s (n_s - 1) / 2``, with ``C_s`` and ``D_s`` the concordant and
  discordant pairs of stratum ``s`` (a pair tied in ``x`` or ``y`` counts in neither). It is the
  average of the strata's Kendall tau-a weighted by their pairs. A ratio held by one point (a
  quantized cache alone at its ratio) has no pair and no weight. Positive: within a ratio the
  measure orders the points by their drop.
- ``mae_gain = mae_ratio_only - mae_held_out``: leave one press out; an increasing isotonic
  regression of ``y`` on ``x`` (``scipy.optimize.isotonic_regression``, points with equal ``x``
  pooled, predictions interpolated linearly and clipped at the ends, as scikit-learn's
  ``IsotonicRegression``), fitted on the other presses' points, predicts the held-out press's
  points; ``mae_held_out`` is the mean absolute error over every point, ``mae_ratio_only`` the
  same with ``r`` in place of ``x``. Positive: the measure predicts better than the ratio.

Both again over the points near the baseline (``_band``): those with ``|y| <= band`` (a
prespecified band, :data:`DEFAULT_BAND`), where "Displacement Is Not Direction" (arXiv
2606.19558, 2026) finds the KL divergence tracking benchmark scores across quantized models but
not near the baseline.

Each is tested by permuting the measure within each ratio (:func:`within_ratio_permutation`): under
the null that, within a ratio, the measure's values are exchangeable among the points whatever
their drops, every permutation is as likely as the observed one, and the one-sided p-value
``(1 + #{null >= observed}) / (1 + n_perm)`` is calibrated (Phipson & Smyth 2010; scipy's
``permutation_test`` counts the same way, within a relative tolerance of 100 machine epsilons).
The permutation also breaks a press's consistency across ratios, so for the held-out gain the
null is that of no within-ratio order and no press structure in the measure.

Secondary statistics, across every point: Spearman's rho and Kendall's tau-b of ``x`` and ``y``,
and the partial Spearman correlation given the ratio, Pearson's correlation of the ranks of
``x`` and ``y`` after the ranks of ``r`` are removed linearly, ``(r_xy - r_xr r_yr) / sqrt((1 -
r_xr^2)(1 - r_yr^2))`` (Kendall & Stuart, *The Advanced Theory of Statistics*, vol. 2, §27). It
removes the ratio's ranks with a straight line and comes with no calibrated test: whether it is
centred on 0 under a null depends on how the measure and the drop bend with the ratio, its spread
under a null is about 0.2 (one standard deviation on 24 points, simulated), and a single point
alone at its ratio, high ratio and low drop (a 4-bit cache), can move it by 0.6 while the
within-ratio Kendall does not move (``tests/test_prediction.py``). It is reported beside the
primary statistics, not as a test.
"""

from __future__ import annotations

import functools
import numbers
from dataclasses import dataclass

import numpy as np
from scipy.optimize import isotonic_regression

__all__ = [
    "DEFAULT_BAND",
    "Baseline",
    "PRIMARY",
    "RATIO_TOLERANCE",
    "STATISTICS",
    "TESTED",
    "WithinRatioPermutation",
    "held_out_predictions",
    "prediction_statistics",
    "ratio_strata",
    "within_ratio_permutation",
]

#: The statistics of one measure over a frontier's points, in the order of :func:`prediction_statistics`.
STATISTICS = (
    "kendall_within_ratio",
    "mae_held_out",
    "mae_ratio_only",
    "mae_gain",
    "kendall_within_ratio_band",
    "mae_gain_band",
    "spearman",
    "kendall",
    "spearman_given_ratio",
)
#: The primary statistics: whether the measure says something beyond the ratio.
PRIMARY = ("kendall_within_ratio", "mae_gain")
#: The statistics tested by the within-ratio permutation: the primary ones, over every point and near the baseline.
TESTED = ("kendall_within_ratio", "mae_gain", "kendall_within_ratio_band", "mae_gain_band")
#: The near-baseline band: points whose accuracy drop is at most this in absolute value (a fraction of documents).
DEFAULT_BAND = 0.10
#: Two ratios closer than this are the same ratio (one stratum).
RATIO_TOLERANCE = 1e-9
_EPS = 100 * np.finfo(np.float64).eps


def ratio_strata(ratio: np.ndarray) -> np.ndarray:
    """Each point's stratum: points whose sorted ratios are within :data:`RATIO_TOLERANCE` of their
    neighbour share one (int64, points,; strata numbered from 0 in increasing ratio)."""
    ratio = np.asarray(ratio, dtype=np.float64)
    order = np.argsort(ratio, kind="stable")
    labels = np.empty(len(ratio), dtype=np.int64)
    labels[order] = np.concatenate([[0], np.cumsum(np.diff(ratio[order]) > RATIO_TOLERANCE)])[: len(ratio)]
    return labels


def _pairs_within(strata: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    i, j = _upper_pairs(len(strata))
    same = strata[i] == strata[j]
    return i[same], j[same]


def _concordance(x: np.ndarray, sign_y: np.ndarray, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """Mean of ``sign(x_i - x_j) sign(y_i - y_j)`` over the pairs, for ``x`` of shape (points,) or (draws, points)."""
    if not len(i):
        return np.full(x.shape[:-1], np.nan)
    return np.sign(x[..., i] - x[..., j]) @ sign_y / len(i)


def _isotonic_fit(xs: list[float], ys: list[float], skip: list[bool]) -> tuple[list[float], np.ndarray]:
    """The increasing isotonic regression of the points not skipped (``xs`` sorted): its knots (the
    distinct ``x``, ties pooled with their count as weight) and its values there."""
    knots: list[float] = []
    sums: list[float] = []
    counts: list[float] = []
    for x, y, out in zip(xs, ys, skip):
        if out:
            continue
        if knots and x == knots[-1]:
            sums[-1] += y
            counts[-1] += 1.0
        else:
            knots.append(x)
            sums.append(y)
            counts.append(1.0)
    means = [total / n for total, n in zip(sums, counts)]
    return knots, isotonic_regression(means, weights=counts, increasing=True).x


def held_out_predictions(x: np.ndarray, y: np.ndarray, presses: np.ndarray) -> np.ndarray:
    """Leave-one-press-out predictions of ``y`` (points,) from ``x`` (points,): each press's points
    predicted by the isotonic regression fitted on every other press's points, interpolated
    linearly between its knots and clipped at the ends (float64, points,). Points with a
    non-finite ``x`` or ``y`` are neither fitted nor predicted (NaN)."""
    x, y, presses = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64), np.asarray(presses)
    predicted = np.full(len(y), np.nan)
    ok = np.flatnonzero(np.isfinite(x) & np.isfinite(y))
    order = ok[np.argsort(x[ok], kind="stable")]
    xs, ys, groups = x[order].tolist(), y[order].tolist(), presses[order].tolist()
    if len(set(groups)) < 2:
        return predicted
    for group in dict.fromkeys(groups):
        held = [g == group for g in groups]
        knots, fitted = _isotonic_fit(xs, ys, held)
        at = order[held]
        predicted[at] = np.interp(x[at], knots, fitted)
    return predicted


def _held_out_error(x: np.ndarray, y: np.ndarray, presses: np.ndarray) -> float:
    """The mean absolute error of :func:`held_out_predictions` (finite ``x``, ``y``); NaN with fewer than 2 presses."""
    return float(np.mean(np.abs(held_out_predictions(x, y, presses) - y))) if len(y) else float("nan")


@functools.cache
def _upper_pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    return np.triu_indices(n, k=1)


def _ranks(v: np.ndarray) -> np.ndarray:
    """Average ranks from 1, ties sharing their mean rank (``scipy.stats.rankdata``'s default), for few points."""
    return (v[:, None] > v[None, :]).sum(axis=1) + ((v[:, None] == v[None, :]).sum(axis=1) + 1) / 2


def _pearson(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a - a.mean(), b - b.mean()
    denominator = np.sqrt((a @ a) * (b @ b))
    return float(a @ b / denominator) if denominator > 0 else float("nan")


def _across(x: np.ndarray, y: np.ndarray, ratio: np.ndarray) -> list[float]:
    """Spearman, Kendall tau-b and the partial Spearman given the ratio, across every point."""
    if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return [np.nan] * 3
    rx, ry, rr = _ranks(x), _ranks(y), _ranks(ratio)
    rho = _pearson(rx, ry)
    i, j = _upper_pairs(len(x))
    dx, dy = np.sign(x[i] - x[j]), np.sign(y[i] - y[j])
    tau = float(dx @ dy / np.sqrt(np.count_nonzero(dx)) / np.sqrt(np.count_nonzero(dy)))
    if np.ptp(rr) == 0:  # one ratio: nothing to remove
        return [rho, tau, rho]
    xr, yr = _pearson(rx, rr), _pearson(ry, rr)
    denominator = np.sqrt((1 - xr**2) * (1 - yr**2))
    return [rho, tau, float((rho - xr * yr) / denominator) if denominator > 0 else np.nan]


@dataclass(frozen=True)
class Baseline:
    """A frontier's points with what does not depend on the measure: drops, ratios, presses, the
    within-ratio pairs, the near-baseline band and the ratio-only held-out errors.

    Build it with :meth:`Baseline.of` on points whose drop is finite; :meth:`Baseline.statistics`
    then gives any measure's :data:`STATISTICS` at those points (a measure finite at every one of
    them), so that the measures of one set of drops share the ratio-only fits.
    """

    y: np.ndarray
    ratio: np.ndarray
    presses: np.ndarray
    pairs: tuple[np.ndarray, np.ndarray]
    near: np.ndarray
    pairs_near: tuple[np.ndarray, np.ndarray]
    mae_ratio_only: tuple[float, float]

    @classmethod
    def of(cls, y: np.ndarray, ratio: np.ndarray, presses: np.ndarray, *, band: float = DEFAULT_BAND) -> Baseline:
        """The baseline of drops ``y``, ratios and presses (each shape (points,)), band ``|y| <= band``."""
        y, ratio, presses = np.asarray(y, dtype=np.float64), np.asarray(ratio, dtype=np.float64), np.asarray(presses)
        strata = ratio_strata(ratio)
        near = np.abs(y) <= band
        ratio_only = (_held_out_error(ratio, y, presses), _held_out_error(ratio[near], y[near], presses[near]))
        return cls(y, ratio, presses, _pairs_within(strata), near, _pairs_within(strata[near]), ratio_only)

    def tested(self, x: np.ndarray) -> list[float]:
        """:data:`TESTED` and ``mae_held_out`` of the measure ``x`` (points,) at these points."""
        i, j = self.pairs
        tau = float(_concordance(x, np.sign(self.y[i] - self.y[j]), i, j))
        held = _held_out_error(x, self.y, self.presses)
        yn, (i, j) = self.y[self.near], self.pairs_near
        tau_near = float(_concordance(x[self.near], np.sign(yn[i] - yn[j]), i, j))
        held_near = _held_out_error(x[self.near], yn, self.presses[self.near])
        return [tau, self.mae_ratio_only[0] - held, tau_near, self.mae_ratio_only[1] - held_near, held]

    def statistics(self, x: np.ndarray) -> np.ndarray:
        """The :data:`STATISTICS` of the measure ``x`` (points,) at these points (float64, shape (9,))."""
        tau, gain, tau_near, gain_near, held = self.tested(x)
        across = _across(x, self.y, self.ratio)
        return np.array([tau, held, self.mae_ratio_only[0], gain, tau_near, gain_near, *across])


def _finite(x, y, ratio, presses) -> tuple[np.ndarray, ...]:
    x, y, ratio = (np.asarray(v, dtype=np.float64) for v in (x, y, ratio))
    ok = np.isfinite(x) & np.isfinite(y)
    return x[ok], y[ok], ratio[ok], np.asarray(presses)[ok]


def prediction_statistics(
    x: np.ndarray, y: np.ndarray, ratio: np.ndarray, presses: np.ndarray, *, band: float = DEFAULT_BAND
) -> np.ndarray:
    """The :data:`STATISTICS` of one oriented measure ``x``, drops ``y`` and ratios, over the points.

    Parameters
    ----------
    x, y, ratio : numpy.ndarray of float, shape (points,)
        The oriented measure's mean, the accuracy drop (fraction of documents) and the
        compression ratio of each point. Points with a non-finite ``x`` or ``y`` are left out.
    presses : numpy.ndarray, shape (points,)
        Each point's press: the group the held-out analysis leaves out.
    band : float
        The near-baseline band of the ``_band`` statistics: points with ``|y| <= band``.

    Returns
    -------
    numpy.ndarray of float64, shape (9,)
        In :data:`STATISTICS` order; NaN where a statistic is undefined (no two points at one
        ratio, a single press, a constant side or fewer than 3 points for the correlations).
    """
    x, y, ratio, presses = _finite(x, y, ratio, presses)
    return Baseline.of(y, ratio, presses, band=band).statistics(x)


@dataclass(frozen=True)
class WithinRatioPermutation:
    """The within-ratio permutation test of one measure (:func:`within_ratio_permutation`).

    Attributes
    ----------
    statistic : numpy.ndarray of float64, shape (4,)
        The observed :data:`TESTED` statistics.
    pvalue : numpy.ndarray of float64, shape (4,)
        One-sided: ``(1 + #{null >= statistic}) / (1 + n_perm)``; NaN where the statistic is.
    null_distribution : numpy.ndarray of float64, shape (n_perm, 4)
        The statistics of the measure permuted within each ratio.
    """

    statistic: np.ndarray
    pvalue: np.ndarray
    null_distribution: np.ndarray


def _permutation_iv(x, y, ratio, presses, band, n_perm) -> tuple:
    """The inputs of :func:`within_ratio_permutation` checked, as float arrays of the finite points."""
    shapes = {name: np.shape(v) for name, v in (("x", x), ("y", y), ("ratio", ratio), ("presses", presses))}
    if len(set(shapes.values())) != 1 or len(shapes["x"]) != 1:
        raise ValueError(f"x, y, ratio and presses must be 1-D of one length, got shapes {shapes}")
    if isinstance(n_perm, bool) or not isinstance(n_perm, numbers.Integral) or n_perm < 1:
        raise ValueError(f"n_perm must be an integer >= 1, got {n_perm!r}")
    if isinstance(band, bool) or not isinstance(band, numbers.Real) or not 0 <= band < np.inf:
        raise ValueError(f"band must be a finite number >= 0, got {band!r}")
    if not np.all(np.isfinite(np.asarray(ratio, dtype=np.float64))):
        raise ValueError("ratio must be finite at every point")
    return (*_finite(x, y, ratio, presses), float(band), int(n_perm))


def _within_strata_permutations(strata: np.ndarray, n_perm: int, rng: np.random.Generator) -> np.ndarray:
    """(n_perm, points) indices: row ``b`` maps each point to a point of its stratum, uniformly at random."""
    base = np.argsort(strata, kind="stable")
    keys = strata[base][None, :] + rng.random((n_perm, len(strata)))
    out = np.empty((n_perm, len(strata)), dtype=np.int64)
    out[:, base] = base[np.argsort(keys, axis=1)]
    return out


def within_ratio_permutation(
    x: np.ndarray,
    y: np.ndarray,
    ratio: np.ndarray,
    presses: np.ndarray,
    *,
    band: float = DEFAULT_BAND,
    n_perm: int = 999,
    rng: np.random.Generator | int = 0,
) -> WithinRatioPermutation:
    """The permutation test of the :data:`TESTED` statistics, the measure permuted within each ratio.

    Parameters
    ----------
    x, y, ratio, presses : numpy.ndarray, shape (points,)
        As :func:`prediction_statistics`; points with a non-finite ``x`` or ``y`` are left out.
    band : float
        The near-baseline band (``|y| <= band``), a fraction of documents.
    n_perm : int
        Permutations drawn (``>= 1``); the smallest p-value is ``1 / (1 + n_perm)``.
    rng : numpy.random.Generator or int
        The permutations' generator, or its seed.

    Returns
    -------
    WithinRatioPermutation

    Raises
    ------
    ValueError
        Arrays of different lengths, ``n_perm`` not an integer >= 1, ``band`` negative or not finite,
        a non-finite ratio.
    """
    x, y, ratio, presses, band, n_perm = _permutation_iv(x, y, ratio, presses, band, n_perm)
    rng = np.random.default_rng(rng)
    points = Baseline.of(y, ratio, presses, band=band)
    observed = np.array(points.tested(x)[:4])
    permuted = x[_within_strata_permutations(ratio_strata(ratio), n_perm, rng)]
    null = np.array([points.tested(row)[:4] for row in permuted]).reshape(n_perm, 4)
    with np.errstate(invalid="ignore"):
        extreme = (null >= observed - _EPS * np.abs(observed)).sum(axis=0)
    pvalue = np.where(np.isfinite(observed), (1 + extreme) / (1 + n_perm), np.nan)
    return WithinRatioPermutation(observed, pvalue, null)
