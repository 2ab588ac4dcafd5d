"""Sample size of the confirmatory test: Noether's formula on hand-enumerated pilots."""

from __future__ import annotations

import math

import pytest
from scipy import stats

from kvdiverge.estimation.power import confirmatory_size, noether_size, pair_probability, simulated_power


def test_pair_probability_counts_walsh_pairs_with_ties_as_half():
    # pairs of (0.02, 0.05, -0.01, 0.03, 0, 0.04): only -0.01 + 0 < 0, of 15
    assert pair_probability([0.02, 0.05, -0.01, 0.03, 0.0, 0.04]) == pytest.approx(14 / 15)
    # (1, -1, 0): sums 0, 1, -1 -> (0.5 + 1 + 0) / 3 greater, (0.5 + 0 + 1) / 3 less
    assert pair_probability([1.0, -1.0, 0.0]) == pytest.approx(0.5)
    assert pair_probability([1.0, -2.0, float("nan"), 0.5], "less") == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="at least two"):
        pair_probability([1.0, float("nan")])


def test_noether_size_by_hand():
    z = stats.norm.ppf(0.95) + stats.norm.ppf(0.8)  # 1.6449 + 0.8416
    assert noether_size(0.75, 0.05, 0.8) == pytest.approx(z * z / (3 * 0.25**2))  # 32.97
    assert noether_size(0.75, 0.05, 0.8, "two-sided") == pytest.approx(
        (stats.norm.ppf(0.975) + stats.norm.ppf(0.8)) ** 2 / (3 * 0.0625)
    )
    assert math.isinf(noether_size(0.5, 0.05, 0.8))


def test_confirmatory_size_inflates_by_the_documents_without_a_difference():
    d = [0.02, 0.05, -0.01, 0.03, 0.0, 0.04]  # p' = 14/15
    out = confirmatory_size(d, n_docs=8, alpha=0.05, power=0.8, n_sim=500)
    n = math.ceil(noether_size(14 / 15, 0.05, 0.8))
    assert out["n_used"] == n == 11
    assert out["documents"] == math.ceil(11 / 0.75) == 15
    assert 0.5 < out["simulated_power"] <= 1.0
    assert confirmatory_size([-1.0, -2.0, 0.5], 3, 0.05)["documents"] is None


def test_simulated_power_of_a_sure_and_of_a_null_effect():
    assert simulated_power([1.0, 2.0, 3.0], 10, 0.05, n_sim=200) == 1.0  # all positive: p = 2^-10
    assert simulated_power([1.0, 2.0, 3.0], 2, 0.05, n_sim=200) == 0.0  # n = 2: no rejection at 5 %
    assert simulated_power([-1.0, 1.0], 20, 0.05, n_sim=2000) < 0.1  # symmetric: about alpha
