"""Sample size of the confirmatory test from a pilot's per-document differences.

The prespecified confirmatory test (``estimators.md`` §8,
:func:`kvdiverge.estimation.confirmatory.confirmatory_analysis`) is a one-sample Wilcoxon
signed-rank test of the per-document differences ``d = btv[late] - btv[early]``. Its
power depends on ``p' = P(D + D' > 0)`` for two independent documents' differences ``D``,
``D'`` (for ``alternative = "greater"``; ``P(D + D' < 0)`` for ``"less"``). Noether's
formula (Noether 1987, "Sample size determination for some common nonparametric tests",
JASA 82:645-647) gives the number of documents with a difference for a one-sided level
``alpha`` and power ``1 - beta``:

    n = (z_{1-alpha} + z_{1-beta})^2 / (3 (p' - 1/2)^2),

with ``alpha / 2`` in place of ``alpha`` for a two-sided test. ``p'`` is estimated from a
pilot by the U-statistic over its pairs of documents ``i < j`` (the Walsh averages;
ties count one half). Documents whose branches reach only one window have no ``d``
(``n_excluded`` of the confirmatory table), so the documents to generate are
``ceil(n / usable)`` with ``usable`` the pilot's share of documents with a difference.

:func:`simulated_power` checks the formula by resampling the pilot's differences with
replacement (``n`` at a time) and running the test itself; with a small pilot both are
rough guides, not guarantees, and the resampled power is optimistic when the pilot
overstates the effect.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Sequence

import numpy as np
from scipy import stats

from kvdiverge.estimation.bootstrap import bootstrap_rng

__all__ = ["pair_probability", "noether_size", "simulated_power", "confirmatory_size"]


def pair_probability(d: Sequence[float], alternative: str = "greater") -> float:
    """``p' = P(D + D' > 0)`` (``"greater"``) or ``P(D + D' < 0)`` (``"less"``, ``"two-sided"``
    takes the larger of the two) estimated over the pilot's pairs ``i < j``.

    Parameters
    ----------
    d : sequence of float, length n >= 2
        Per-document differences (NaN entries are dropped).
    alternative : {"greater", "less", "two-sided"}

    Returns
    -------
    float
        In [0, 1]; ties (``d_i + d_j == 0``) count one half.

    Raises
    ------
    ValueError
        Fewer than two finite differences, or an unknown alternative.
    """
    x = np.asarray(d, dtype=np.float64)
    x = x[np.isfinite(x)]
    if x.size < 2:
        raise ValueError(f"a pilot needs at least two documents with a difference, got {x.size}")
    i, j = np.triu_indices(x.size, k=1)
    s = x[i] + x[j]
    up, down = float(np.mean((s > 0) + 0.5 * (s == 0))), float(np.mean((s < 0) + 0.5 * (s == 0)))
    if alternative == "greater":
        return up
    if alternative == "less":
        return down
    if alternative == "two-sided":
        return max(up, down)
    raise ValueError(f"alternative {alternative!r} is not one of greater, less, two-sided")


def noether_size(p_prime: float, alpha: float, power: float, alternative: str = "greater") -> float:
    """Noether's number of documents with a difference for the signed-rank test.

    Parameters
    ----------
    p_prime : float
        :func:`pair_probability`.
    alpha : float
        Level in (0, 1) (split in two for ``"two-sided"``).
    power : float
        Target power ``1 - beta`` in (0, 1).
    alternative : {"greater", "less", "two-sided"}

    Returns
    -------
    float
        ``(z_{1-alpha} + z_{power})^2 / (3 (p' - 1/2)^2)`` (not rounded); ``inf`` when
        ``p' <= 1/2`` (the pilot shows no effect in the test's direction).
    """
    if not (0 < alpha < 1 and 0 < power < 1):
        raise ValueError(f"alpha {alpha!r} and power {power!r} must lie in (0, 1)")
    a = alpha / 2 if alternative == "two-sided" else alpha
    if p_prime <= 0.5:
        return math.inf
    z = stats.norm.ppf(1 - a) + stats.norm.ppf(power)
    return float(z * z / (3 * (p_prime - 0.5) ** 2))


def simulated_power(
    d: Sequence[float], n: int, alpha: float, alternative: str = "greater", n_sim: int = 2000, seed: int = 0
) -> float:
    """Share of ``n_sim`` resamples of ``n`` pilot differences (with replacement) that the
    one-sample Wilcoxon signed-rank test rejects at ``alpha``.

    Parameters
    ----------
    d : sequence of float
        The pilot's per-document differences (NaN dropped).
    n : int
        Documents with a difference per simulated study, ``>= 1``.
    alpha : float
        Level of the test.
    alternative : {"greater", "less", "two-sided"}
    n_sim : int
        Simulated studies.
    seed : int
        Seed of the resamples (:func:`kvdiverge.estimation.bootstrap.bootstrap_rng`).

    Returns
    -------
    float
        In [0, 1]. A resample whose differences are all zero counts as not rejected, as
        in the confirmatory table (``not tested``). The p-values are scipy's normal
        approximation with its tie and zero corrections: resamples drawn with replacement
        carry ties, where the exact null distribution does not apply.
    """
    x = np.asarray(d, dtype=np.float64)
    x = x[np.isfinite(x)]
    if x.size == 0 or n < 1:
        raise ValueError(f"need a pilot with differences and n >= 1, got {x.size} differences and n = {n}")
    draws = x[bootstrap_rng(seed, "power", n).integers(0, x.size, size=(n_sim, n))]
    nonzero = np.any(draws != 0, axis=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = stats.wilcoxon(
            draws[nonzero], alternative=alternative, zero_method="wilcox", axis=1, method="approx"
        ).pvalue
    return float(np.sum(np.asarray(p) < alpha) / n_sim)


def confirmatory_size(
    d: Sequence[float],
    n_docs: int,
    alpha: float,
    power: float = 0.8,
    alternative: str = "greater",
    n_sim: int = 2000,
    seed: int = 0,
) -> dict[str, Any]:
    """Documents the confirmatory split needs for ``power``, from a pilot of ``n_docs`` documents.

    Parameters
    ----------
    d : sequence of float
        The pilot's per-document differences, one per document with a difference
        (the confirmatory table's ``d``, nulls dropped).
    n_docs : int
        The pilot's documents, those without a difference included.
    alpha, power, alternative
        The plan's level and direction, and the target power.
    n_sim, seed
        :func:`simulated_power` of the result.

    Returns
    -------
    dict
        ``p_prime``, ``usable`` (share of documents with a difference), ``n_used``
        (Noether, rounded up), ``documents`` (``ceil(n_used / usable)``), and
        ``simulated_power`` at ``n_used`` differences; ``n_used`` and ``documents`` are
        ``None`` when the pilot shows no effect in the test's direction.
    """
    x = np.asarray(d, dtype=np.float64)
    x = x[np.isfinite(x)]
    usable = x.size / n_docs if n_docs else 0.0
    pp = pair_probability(x, alternative)
    n = noether_size(pp, alpha, power, alternative)
    if not math.isfinite(n):
        return {"p_prime": pp, "usable": usable, "n_used": None, "documents": None, "simulated_power": None}
    n_used = max(int(math.ceil(n)), 1)
    return {
        "p_prime": pp,
        "usable": usable,
        "n_used": n_used,
        "documents": int(math.ceil(n_used / usable)),
        "simulated_power": simulated_power(x, n_used, alpha, alternative, n_sim, seed),
    }
