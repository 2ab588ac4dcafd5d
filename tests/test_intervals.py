"""The §4 sharp interval: formulas, and both ends attained exactly by the constructions."""

import numpy as np
import polars as pl
import pytest

from kvdiverge.estimation.estimators import document_estimates, replicate_estimates
from kvdiverge.estimation.intervals import sharp_interval
from kvdiverge.testing.constructions import (
    ConstructedPair,
    divergence_lag,
    lower_construction,
    upper_construction,
    wrap_pair,
)
from kvdiverge.testing.exact import enumerate_coupled


def test_sharp_interval_formula_by_hand():
    iv = sharp_interval(p_div=0.875, E_N_win=0.75, E_L_tail=0.5, E_L=1.25, T=3)
    assert iv["E_N_lo"] == pytest.approx(1.625)
    assert iv["E_N_hi"] == pytest.approx(2.125)
    assert iv["E_M_lo"] == pytest.approx(1.625 / 3)
    assert iv["E_M_hi"] == pytest.approx(2.125 / 3)
    assert iv["rho_lo"] == pytest.approx(0.6)
    assert iv["rho_hi"] == pytest.approx(1.0)
    none = sharp_interval(0.0, 0.0, 0.0, 0.0, 3)
    assert none["E_N_lo"] == none["E_N_hi"] == 0.0
    assert np.isnan(none["rho_lo"]) and np.isnan(none["rho_hi"])
    arr = sharp_interval(np.array([0.5, 0.2]), np.array([0.1, 0.0]), np.array([1.0, 2.0]), np.array([2.0, 4.0]), 4)
    np.testing.assert_allclose(arr["E_N_hi"], [1.6, 2.2])


def test_divergence_lag():
    assert divergence_lag((), ()) is None
    assert divergence_lag((0, 1), (0, 1)) is None
    assert divergence_lag((0,), (1,)) == 1  # diverged at step 1, next step is lag 1
    assert divergence_lag((0, 1, 2), (0, 2, 2)) == 2  # diverged at step 2, next step 4: lag 2
    with pytest.raises(ValueError):
        divergence_lag((0,), ())


@pytest.mark.parametrize("T,W", [(3, 1), (4, 1), (4, 2), (3, 0)])
def test_constructions_attain_both_ends_with_window_law_unchanged(kernel, T, W):
    base = enumerate_coupled(kernel, 3, T=T, W=W)
    lo = enumerate_coupled(lower_construction(kernel, 3, W, token=1), 3, T=T, W=W)
    hi = enumerate_coupled(upper_construction(kernel, 3, W, tokens=(0, 2)), 3, T=T, W=W)
    iv = sharp_interval(base.p_div, base.E_N_win, base.E_L_tail, base.E_L, T)
    assert base.E_L_tail > 0 or W >= T - 1
    # the window law (tau and both histories up to W lags past it) is unchanged
    for other in (lo, hi):
        assert set(other.window_law) == set(base.window_law)
        for key, prob in base.window_law.items():
            assert other.window_law[key] == pytest.approx(prob, abs=1e-14)
        np.testing.assert_allclose(other.f, base.f, atol=1e-14)
        assert other.E_N_win == pytest.approx(base.E_N_win, abs=1e-14)
        assert other.E_L_tail == pytest.approx(base.E_L_tail, abs=1e-14)
        np.testing.assert_allclose(other.btv_num[:W], base.btv_num[:W], atol=1e-14)
    # both ends attained exactly
    assert lo.E_N == pytest.approx(iv["E_N_lo"], abs=1e-12)
    assert hi.E_N == pytest.approx(iv["E_N_hi"], abs=1e-12)
    assert lo.E_N_tail == pytest.approx(0.0, abs=1e-12)
    assert hi.E_N_tail == pytest.approx(base.E_L_tail, abs=1e-12)
    assert lo.E_M == pytest.approx(iv["E_M_lo"], abs=1e-12)
    assert hi.E_M == pytest.approx(iv["E_M_hi"], abs=1e-12)
    if base.E_L > 0:
        assert lo.rho == pytest.approx(iv["rho_lo"], abs=1e-12)
        assert hi.rho == pytest.approx(iv["rho_hi"], abs=1e-12)
    # and the true value lies inside
    assert iv["E_N_lo"] - 1e-12 <= base.E_N <= iv["E_N_hi"] + 1e-12


def test_interval_is_strict_for_a_nontrivial_tail(kernel):
    base = enumerate_coupled(kernel, 3, T=4, W=1)
    iv = sharp_interval(base.p_div, base.E_N_win, base.E_L_tail, base.E_L, 4)
    assert iv["E_N_lo"] < base.E_N < iv["E_N_hi"]


def test_constructions_reject_bad_tokens(kernel):
    with pytest.raises(ValueError):
        lower_construction(kernel, 3, 1, token=3)
    with pytest.raises(ValueError):
        upper_construction(kernel, 3, 1, tokens=(1, 1))
    with pytest.raises(ValueError):
        upper_construction(kernel, 3, -1)


def test_wrapped_pairs_through_the_engine(kernel):
    """The engine on the constructed pairs: the lower end has no tail mismatch at all."""
    from kvdiverge.engine.core.coupled import simulate
    from kvdiverge.engine.core.pairs import TableKernelPair

    T, W = 4, 1
    pair = TableKernelPair(kernel, 3)
    lo_pair = wrap_pair(pair, W, "lower", token=0)
    hi_pair = wrap_pair(pair, W, "upper", tokens=(1, 2))
    with pytest.raises(ValueError):
        wrap_pair(pair, W, "middle")
    lo = replicate_estimates(simulate(lo_pair, T, 400, seed=5), W)
    hi = replicate_estimates(simulate(hi_pair, T, 400, seed=5), W)
    assert (lo["N_tail_cmc"].abs() < 1e-12).all()
    # upper end: every tail step of every branch mismatches, so N_tail = w * (L_branch - W)^+
    expect = hi["w"] * (hi["L_branch"] - W).clip(lower_bound=0)
    np.testing.assert_allclose(hi["N_tail_cmc"].to_numpy(), expect.to_numpy(), atol=1e-12)
    d = document_estimates(hi.with_columns(pl.lit("hi").alias("doc_id")))
    assert d["E_N_lo"][0] <= d["E_N_hi"][0]


@pytest.mark.parametrize("end,kw", [("lower", {"token": 2}), ("upper", {"tokens": (2, 0)})])
def test_construction_around_any_incremental_pair(kernel, end, kw):
    """ConstructedPair (for LLM pairs too) draws exactly what the function construction draws."""
    from kvdiverge.engine.core.coupled import simulate
    from kvdiverge.engine.core.pairs import TableKernelPair

    T, W = 5, 1
    pair = TableKernelPair(kernel, 3)
    a = simulate(ConstructedPair(pair, W, end, **kw), T, 50, seed=8).drop("seconds")
    b = simulate(wrap_pair(pair, W, end, **kw), T, 50, seed=8).drop("seconds")
    assert a.equals(b)
    assert not a.equals(simulate(pair, T, 50, seed=8).drop("seconds"))  # the tail did change
    with pytest.raises(ValueError):
        ConstructedPair(pair, W, "both")
