"""kvdiverge.estimation.bootstrap (document resamples, percentile intervals) and decomposition.rho."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvdiverge.estimation.bootstrap import (
    Bootstrap,
    bootstrap_rng,
    percentile_interval,
    resample_counts,
    resample_indices,
    resampled_nanmean,
)
from kvdiverge.estimation.decomposition import rho


def test_resamples_are_fixed_by_seed_and_purpose():
    # the draws every table's intervals rest on: changing them changes every published interval
    assert resample_indices(5, 3, 20261129, "pooled", "m", "p", "s").tolist() == [
        [1, 0, 0, 1, 3],
        [3, 4, 1, 4, 3],
        [2, 3, 2, 1, 3],
    ]
    assert bootstrap_rng(1, "x").integers(0, 1000, 4).tolist() == [833, 741, 606, 551]
    a = resample_indices(50, 4, 1, "gap", "m", "a", "b", "s")
    assert np.array_equal(a, resample_indices(50, 4, 1, "gap", "m", "a", "b", "s"))
    assert not np.array_equal(a, resample_indices(50, 4, 1, "gap", "m", "b", "a", "s"))
    assert not np.array_equal(a, resample_indices(50, 4, 2, "gap", "m", "a", "b", "s"))
    assert resample_indices(0, 4, 1, "floor").shape == (4, 0)


def test_counts_are_the_multiplicities_of_the_indices():
    idx = resample_indices(7, 40, 3, "t")
    counts = resample_counts(idx)
    assert counts.shape == (40, 7) and counts.dtype == np.float64
    assert np.array_equal(counts, np.stack([np.bincount(row, minlength=7) for row in idx]))
    X = np.arange(14, dtype=np.float64).reshape(7, 2) ** 1.5
    np.testing.assert_allclose(counts @ X / 7, X[idx].mean(axis=1), rtol=1e-13)


def test_resampled_nanmean_leaves_out_non_finite_entries():
    counts = np.array([[2.0, 1.0, 0.0], [0.0, 0.0, 3.0]])
    X = np.array([[1.0, np.nan], [4.0, 2.0], [np.inf, np.nan]])
    out = resampled_nanmean(counts, X)
    assert out[0].tolist() == [2.0, 2.0]  # (2*1 + 4) / 3; only document 1 is finite in column 1
    assert np.isnan(out[1]).all()  # document 2 alone: no finite entry in either column


def test_percentile_interval():
    s = np.arange(101, dtype=np.float64)
    lo, hi = percentile_interval(s, 0.9)
    assert (float(lo), float(hi)) == pytest.approx((5.0, 95.0), abs=1e-12)
    lo, hi = percentile_interval(np.array([[np.nan, 1.0], [np.nan, 3.0]]), 0.5)
    assert np.isnan(lo[0]) and (lo[1], hi[1]) == (1.5, 2.5)
    with pytest.raises(ValueError, match="confidence"):
        percentile_interval(s, 1.0)


def test_rho_is_undefined_where_E_L_is_zero():
    assert rho(1.0, 4.0) == 0.25 and isinstance(rho(1.0, 4.0), float)
    assert math.isnan(rho(0.0, 0.0)) and rho(0.0, 0.0, 0.0) == 0.0
    out = rho(np.array([1.0, 0.0, 3.0]), np.array([2.0, 0.0, 3.0]))
    assert out[0] == 0.5 and np.isnan(out[1]) and out[2] == 1.0
    assert rho(np.array([0.0]), np.array([0.0]), 0.0).tolist() == [0.0]


def test_an_interval_fills_its_three_columns_in_order():
    from kvdiverge.estimation.bootstrap import interval_columns, put_interval

    assert interval_columns("E_M") == ("E_M", "E_M_lo", "E_M_hi")
    row = {"model": "m"}
    put_interval(row, "p_div", np.float64(0.5), 0.25, np.array(0.75))
    assert list(row.items()) == [("model", "m"), ("p_div", 0.5), ("p_div_lo", 0.25), ("p_div_hi", 0.75)]
    assert all(type(row[c]) is float for c in interval_columns("p_div"))


def test_bootstrap_settings_default_and_convert():
    assert Bootstrap() == Bootstrap(2000, 0.95, 0)
    b = Bootstrap(np.int64(50), 0.9, np.int64(3))  # numpy integers (a config read through numpy) become int
    assert (b.n_boot, b.confidence, b.seed) == (50, 0.9, 3) and type(b.n_boot) is int and type(b.seed) is int
    assert Bootstrap.of({"bootstrap": 50, "confidence": 0.9, "seed": 3, "split": "x"}) == b
    # the settings draw exactly the low-level functions' resamples and intervals
    assert np.array_equal(b.indices(7, "pooled", "m"), resample_indices(7, 50, 3, "pooled", "m"))
    x = np.arange(20.0)
    assert b.interval(x) == percentile_interval(x, 0.9)
    assert Bootstrap(0).indices(4, "x").shape == (0, 4)  # no resamples: allowed (intervals left out)
    with pytest.raises(AttributeError):
        b.n_boot = 3  # frozen


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n_boot": -1}, "Bootstrap.n_boot must be an integer >= 0, got -1"),
        ({"n_boot": 2.5}, "Bootstrap.n_boot must be an integer >= 0, got 2.5"),
        ({"n_boot": True}, "Bootstrap.n_boot must be an integer >= 0, got True"),
        ({"confidence": 1.0}, r"Bootstrap.confidence must be a number in \(0, 1\), got 1.0"),
        ({"confidence": 0}, r"Bootstrap.confidence must be a number in \(0, 1\), got 0"),
        ({"confidence": "0.9"}, r"Bootstrap.confidence must be a number in \(0, 1\), got '0.9'"),
        ({"confidence": math.nan}, r"Bootstrap.confidence must be a number in \(0, 1\), got nan"),
        ({"seed": -2}, "Bootstrap.seed must be an integer >= 0, got -2"),
        ({"seed": 1.0}, "Bootstrap.seed must be an integer >= 0, got 1.0"),
    ],
)
def test_bootstrap_settings_out_of_range_are_named(kwargs, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        Bootstrap(**kwargs)
