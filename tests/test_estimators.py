"""Estimators of estimators.md §3, §5, §6, §7: hand-built tables and exact enumeration."""

import math

import numpy as np
import polars as pl
import pytest

from kvdiverge.engine.core.coupled import simulate
from kvdiverge.engine.core.pairs import TableKernelPair
from kvdiverge.estimation.bootstrap import Bootstrap
from kvdiverge.estimation.decomposition import DecompositionError, check_decomposition
from kvdiverge.estimation.estimators import btv_window, document_estimates, replicate_estimates
from kvdiverge.estimation.pooling import branch_tv_curve, pooled_estimates, survival_curve
from kvdiverge.estimation.schema import TRAJECTORY_SCHEMA
from kvdiverge.testing.exact import enumerate_coupled


def row(rep, survival, tau_naive, t_star, btv, bmis, doc="d0", T=3):
    tv = [1 - survival[0]] + [1 - b / a if a > 0 else float("nan") for a, b in zip(survival, survival[1:])]
    L = len(btv)
    return {
        "model": "m",
        "policy": "p",
        "split": "exploratory",
        "doc_id": doc,
        "replicate": rep,
        "T": T,
        "prompt_len": 100,
        "kept_len": 50,
        "chain_token": [0] * T,
        "tv": tv,
        "survival": survival,
        "tau_naive": tau_naive,
        "t_star": t_star,
        "x_star": None if t_star is None else 0,
        "y_star": None if t_star is None else 1,
        "branch_x": [0] * L,
        "branch_y": [1] * L,
        "branch_tv": btv,
        "branch_mismatch": bmis,
        "seconds": 1.5,
    }


def hand_table():
    """Three replicates of one document, T = 3, worked out by hand below (W = 1)."""
    rows = [
        row(0, [0.8, 0.4, 0.2], 2, 2, [0.3], [1]),  # diverged at 2 (naive), branch mismatches
        row(1, [1.0, 1.0, 1.0], None, None, [], []),  # never diverges
        row(2, [0.5, 0.5, 0.5], None, 1, [0.2, 0.6], [0, 1]),  # naive > T, t* drawn at 1
    ]
    return pl.DataFrame(rows, schema=TRAJECTORY_SCHEMA)


def test_replicate_estimates_by_hand():
    r = replicate_estimates(hand_table(), W=1).sort("replicate")
    got = {c: r[c].to_list() for c in r.columns}
    exp = {
        "p_div_hat": [0.8, 0.0, 0.5],
        "E_L_hat": [0.2 * 2 + 0.4 * 1, 0.0, 0.5 * 2],
        "E_L_win_hat": [0.2 + 0.4, 0.0, 0.5],
        "E_L_tail_hat": [0.2, 0.0, 0.5],
        "E_tau_div_hat": [0.2 * 1 + 0.4 * 2 + 0.2 * 3, 0.0, 0.5],
        "N_post_cmc": [0.8, 0.0, 0.5],
        "N_cmc": [1.6, 0.0, 1.0],
        "N_naive": [2.0, 0.0, 0.0],
        "N_win_cmc": [0.8, 0.0, 0.0],
        "N_tail_cmc": [0.0, 0.0, 0.5],
        "N_post_cmc_tv": [0.24, 0.0, 0.4],
        "N_cmc_tv": [1.04, 0.0, 0.9],
        "L_branch": [1, 0, 2],
        "tv_mean": [(0.2 + 0.5 + 0.5) / 3, 0.0, 0.5 / 3],  # mean chain tv_t per step
        "tv_max": [0.5, 0.0, 0.5],
    }
    for c, v in exp.items():
        np.testing.assert_allclose(got[c], v, atol=1e-12, err_msg=c)
    np.testing.assert_allclose(got["f_hat"][0], [0.2, 0.4, 0.2])


def test_document_estimates_by_hand():
    d = document_estimates(replicate_estimates(hand_table(), W=1), {"early": (1, 1), "late": (2, 3), "far": (3, 3)})
    assert d.height == 1
    r = d.row(0, named=True)
    assert r["R"] == 3 and r["T"] == 3 and r["W"] == 1
    assert r["p_div"] == pytest.approx(1.3 / 3)
    assert r["p_div_se"] == pytest.approx(np.std([0.8, 0, 0.5], ddof=1) / math.sqrt(3))
    assert r["E_L"] == pytest.approx(0.6)
    assert r["E_L_tail"] == pytest.approx(0.7 / 3)
    assert r["E_N"] == pytest.approx(2.6 / 3)
    assert r["E_N_naive"] == pytest.approx(2 / 3)
    assert r["E_N_tv"] == pytest.approx(1.94 / 3)
    assert r["E_N_post"] == pytest.approx(1.3 / 3)
    assert r["E_N_win"] == pytest.approx(0.8 / 3)
    assert r["E_M"] == pytest.approx(2.6 / 9)
    assert r["rho"] == pytest.approx((1.3 / 3) / 0.6)
    assert r["tau_mean"] == pytest.approx((1.6 + 0.5) / 1.3)
    # §3 decomposition
    assert r["first_mismatch_term"] + r["exposure_rate_term"] == pytest.approx(r["E_M"], abs=1e-12)
    assert r["first_mismatch_term"] == pytest.approx(1.3 / 9)
    # §4 interval
    assert r["E_N_lo"] == pytest.approx(2.1 / 3)
    assert r["E_N_hi"] == pytest.approx(2.1 / 3 + 0.7 / 3)
    assert r["rho_lo"] == pytest.approx((0.8 / 3) / 0.6)
    # variances across replicates
    assert r["var_N_cmc"] == pytest.approx(np.var([1.6, 0, 1.0], ddof=1))
    assert r["var_ratio"] == pytest.approx(np.var([2, 0, 0], ddof=1) / np.var([1.6, 0, 1.0], ddof=1))
    # §6 branch-aligned TV, weights w = 1 - S_T = 0.8 and 0.5
    np.testing.assert_allclose(r["btv_num"], [0.8 * 0.3 + 0.5 * 0.2, 0.5 * 0.6, 0.0])
    np.testing.assert_allclose(r["btv_den"], [1.3, 0.5, 0.0])
    assert r["btv_lag"][0] == pytest.approx(0.34 / 1.3)
    assert np.isnan(r["btv_lag"][2])
    assert r["btv_early"] == pytest.approx(0.34 / 1.3)
    assert r["btv_late"] == pytest.approx(0.6)
    assert np.isnan(r["btv_far"]) and r["btv_far_weight"] == 0.0
    np.testing.assert_allclose(r["S"], [2.3 / 3, 1.9 / 3, 1.7 / 3])
    assert r["seconds"] == 1.5 and r["kept_len"] == 50


def test_btv_window_sums_lags():
    num, den = np.array([0.2, 0.3, 0.0]), np.array([1.0, 0.5, 0.0])
    assert btv_window(num, den, 1, 2) == (pytest.approx(0.5 / 1.5), 1.5)
    v, w = btv_window(num, den, 3, 10)
    assert np.isnan(v) and w == 0
    with pytest.raises(ValueError):
        btv_window(num, den, 0, 2)


def test_decomposition_failure_is_an_error():
    first, rate = check_decomposition(0.5, 0.75, 0.5, 0.25, 2)
    assert float(first) == 0.375 and float(rate) == 0.125
    with pytest.raises(DecompositionError, match="decomposition"):
        check_decomposition(0.6, 0.75, 0.5, 0.25, 2, where="doc x")
    with pytest.raises(DecompositionError):  # E[L] = 0 but post mismatches
        check_decomposition(0.5, 0.0, 0.0, 0.5, 1)
    check_decomposition(0.0, 0.0, 0.0, 0.0, 4)  # the none control: all zero


def test_shard_contract_violations_are_errors():
    t = hand_table()
    with pytest.raises(ValueError, match="lacks columns"):
        replicate_estimates(t.drop("branch_tv"), 1)
    bad = t.with_columns(
        pl.when(pl.col("replicate") == 2).then(pl.lit(2)).otherwise(pl.col("t_star")).cast(pl.Int32).alias("t_star")
    )
    with pytest.raises(ValueError, match="T - t_star"):
        replicate_estimates(bad, 1)
    with pytest.raises(ValueError, match="duplicated"):
        replicate_estimates(pl.concat([t, t]), 1)
    with pytest.raises(ValueError):
        replicate_estimates(t, -1)


# --------------------------------------------------------------------------- against exact enumeration

TARGETS = [
    ("p_div_hat", "p_div"),
    ("E_L_hat", "E_L"),
    ("E_L_win_hat", "E_L_win"),
    ("E_L_tail_hat", "E_L_tail"),
    ("E_tau_div_hat", "E_tau_div"),
    ("N_cmc", "E_N"),
    ("N_naive", "E_N"),
    ("N_cmc_tv", "E_N"),
    ("N_post_cmc", "E_N_post"),
    ("N_win_cmc", "E_N_win"),
    ("N_tail_cmc", "E_N_tail"),
]


@pytest.fixture(scope="module")
def engine_reps(kernel):
    """Engine replicates of the history-dependent kernel (T = 4, W = 1) and its exact targets."""
    history_kernel = kernel

    T, W, R = 4, 1, 4000
    exact = enumerate_coupled(history_kernel, 3, T=T, W=W)
    reps = replicate_estimates(simulate(TableKernelPair(history_kernel, 3), T, R, seed=11), W)
    return exact, reps


@pytest.mark.parametrize("est,target", TARGETS)
def test_unbiased_against_exact_enumeration(engine_reps, est, target):
    exact, reps = engine_reps
    x = reps[est].to_numpy()
    se = x.std(ddof=1) / math.sqrt(len(x))
    truth = getattr(exact, target)
    assert abs(x.mean() - truth) <= 4 * se + 1e-12, (est, x.mean(), truth, se)


def test_branch_tv_numerators_unbiased(engine_reps):
    exact, reps = engine_reps
    T = exact.T
    for k in range(1, T):
        num = np.array(
            [w * bt[k - 1] if len(bt) >= k else 0.0 for w, bt in zip(reps["w"].to_list(), reps["branch_tv"].to_list())]
        )
        den = np.array([w if len(bt) >= k else 0.0 for w, bt in zip(reps["w"].to_list(), reps["branch_tv"].to_list())])
        for x, truth in ((num, exact.btv_num[k - 1]), (den, exact.reach[k - 1])):
            se = x.std(ddof=1) / math.sqrt(len(x))
            assert abs(x.mean() - truth) <= 4 * se + 1e-12, (k, x.mean(), truth, se)
    d = document_estimates(reps, {"w": (1, 2)}).row(0, named=True)
    assert d["btv_w"] == pytest.approx(exact.btv(1, 2), abs=0.02)


def test_cmc_variance_dominates_naive(engine_reps, capsys):
    exact, reps = engine_reps
    v_naive = reps["N_naive"].var()
    v_cmc = reps["N_cmc"].var()
    v_tv = reps["N_cmc_tv"].var()
    # the naive estimator is N itself in law: its variance is Var(N) (exact)
    var_N = exact.E_N_sq - exact.E_N**2
    assert v_naive == pytest.approx(var_N, rel=0.1)
    assert v_cmc <= v_naive
    with capsys.disabled():
        print(
            f"\n[variance] Var(N_naive)={v_naive:.4f} (exact Var(N)={var_N:.4f}) "
            f"Var(N_cmc)={v_cmc:.4f} Var(N_cmc_tv)={v_tv:.4f} ratio naive/cmc={v_naive / v_cmc:.2f}"
        )


def test_eos_pair_unbiased(eos_kern):
    T, W = 3, 1
    exact = enumerate_coupled(eos_kern, 2, T=T, W=W, eos_ids=(1,))
    reps = replicate_estimates(simulate(TableKernelPair(eos_kern, 2, eos_ids=(1,)), T, 1500, seed=3), W)
    for est, target in TARGETS:
        x = reps[est].to_numpy()
        se = x.std(ddof=1) / math.sqrt(len(x))
        assert abs(x.mean() - getattr(exact, target)) <= 4 * se + 1e-12, est


# --------------------------------------------------------------------------- pooling


@pytest.fixture(scope="module")
def docs(kernel):
    history_kernel = kernel

    frames = [simulate(TableKernelPair(history_kernel, 3), 5, 4, seed=2, doc_id=f"doc{i}") for i in range(7)]
    return document_estimates(replicate_estimates(pl.concat(frames), 2))


def test_pooled_equal_weight_means_and_bootstrap(docs):
    p = pooled_estimates(docs, Bootstrap(500, 0.9, 1))
    assert p.height == 1
    r = p.row(0, named=True)
    assert r["n_docs"] == 7
    for c in ("p_div", "E_L", "E_N", "E_M", "E_N_post"):
        assert r[c] == pytest.approx(docs[c].mean())
        assert r[c + "_lo"] <= r[c] <= r[c + "_hi"]
    assert r["rho"] == pytest.approx(docs["E_N_post"].mean() / docs["E_L"].mean())
    assert r["first_mismatch_term"] + r["exposure_rate_term"] == pytest.approx(r["E_M"], abs=1e-12)
    assert r["interval_E_N_lo"] == pytest.approx(docs["E_N_lo"].mean())
    assert r["interval_E_N_hi"] == pytest.approx(docs["E_N_hi"].mean())
    assert r["var_ratio"] == pytest.approx(docs["var_N_naive"].mean() / docs["var_N_cmc"].mean())
    # deterministic given the seed, different with another
    assert pooled_estimates(docs, Bootstrap(500, 0.9, 1)).equals(p)
    assert pooled_estimates(docs, Bootstrap(500, 0.9, 2))["p_div_lo"][0] != r["p_div_lo"]


def test_survival_and_branch_curves(docs):
    s = survival_curve(docs, Bootstrap(200, 0.95, 1))
    assert s["t"].to_list() == list(range(6))
    S = s["S"].to_numpy()
    assert S[0] == 1.0 and np.all(np.diff(S) <= 1e-12)
    np.testing.assert_allclose(1 - S[-1], docs["p_div"].mean())
    np.testing.assert_allclose(s["f"].sum(), docs["p_div"].mean())
    assert (s["S_lo"] <= s["S"] + 1e-12).all() and (s["S"] <= s["S_hi"] + 1e-12).all()
    b = branch_tv_curve(docs, Bootstrap(200, 0.95, 1))
    assert b["lag"].to_list() == [1, 2, 3, 4, 5]
    assert b["n_docs"][0] == 7 and b["n_docs"][4] == 0
    v = b.filter(pl.col("n_docs") > 0)["btv"].to_numpy()
    assert np.all((v >= 0) & (v <= 1))


def test_document_stage_stops_on_a_broken_identity():
    reps = replicate_estimates(hand_table(), W=1)
    broken = reps.with_columns((pl.col("N_cmc") + 0.1).alias("N_cmc"))
    with pytest.raises(DecompositionError, match="doc 'd0'"):
        document_estimates(broken)


@pytest.mark.parametrize("which", ["always_mismatch", "eos"])
def test_cmc_variance_dominates_on_other_pairs(which, eos_kern, capsys):
    if which == "eos":
        pair, T = TableKernelPair(eos_kern, 2, eos_ids=(1,)), 3
    else:

        def fn(hx, hy):
            if hx != hy:
                return np.array([0.2, 0.3, 0.5]), np.array([0.5, 0.3, 0.2])
            return np.array([0.8, 0.1, 0.1]), np.array([0.6, 0.3, 0.1])

        pair, T = TableKernelPair(fn, 3), 5
    reps = replicate_estimates(simulate(pair, T, 2000, seed=9), 1)
    v_naive, v_cmc = reps["N_naive"].var(), reps["N_cmc"].var()
    assert v_cmc <= v_naive
    with capsys.disabled():
        print(f"\n[variance {which}] Var(N_naive)={v_naive:.4f} Var(N_cmc)={v_cmc:.4f} ratio={v_naive / v_cmc:.2f}")
