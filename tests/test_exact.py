"""Exact enumeration against values worked out by hand (estimators.md §1–§3, §6)."""

import numpy as np
import pytest

from kvdiverge.testing.exact import coupling_joint, enumerate_coupled, tv_distance


def test_coupling_joint_is_the_maximal_coupling():
    p = np.array([0.5, 0.3, 0.2])
    q = np.array([0.2, 0.3, 0.5])
    tv, out = coupling_joint(p, q)
    assert tv == pytest.approx(0.3)
    joint = np.zeros((3, 3))
    for x, y, pr in out:
        joint[x, y] += pr
    np.testing.assert_allclose(joint.sum(axis=1), p)
    np.testing.assert_allclose(joint.sum(axis=0), q)
    assert joint.sum() - np.trace(joint) == pytest.approx(tv)  # P(X != Y) = TV
    # the only off-diagonal mass moves 0 -> 2
    assert joint[0, 2] == pytest.approx(0.3)
    assert tv_distance(p, p) == 0.0


def test_two_tokens_constant_kernels_by_hand():
    # p = delta_0, q = (1/2, 1/2) at every step: tv_t = 1/2, T = 2
    r = enumerate_coupled(lambda hx, hy: (np.array([1.0, 0.0]), np.array([0.5, 0.5])), 2, T=2, W=1)
    assert r.p_div == pytest.approx(0.75)
    np.testing.assert_allclose(r.f, [0.5, 0.25])
    np.testing.assert_allclose(r.S, [0.5, 0.25])
    assert r.E_L == pytest.approx(0.5)  # tau = 1 w.p. 1/2, L = 1
    assert r.E_N == pytest.approx(1.0)  # two independent-looking halves
    assert r.E_N_post == pytest.approx(0.25)
    assert r.rho == pytest.approx(0.5)
    assert r.E_M == pytest.approx(0.5)
    assert r.E_L_tail == 0.0
    assert r.btv(1, 1) == pytest.approx(0.5)
    assert r.E_M == pytest.approx(r.decomposition_rhs)
    assert r.n_paths == 4


def always_mismatch_after(hx, hy):
    """3 tokens, p = delta_0; q = (1/2, 1/2, 0) on shared prefixes, delta_2 after divergence."""
    if hx != hy:
        return np.array([1.0, 0, 0]), np.array([0, 0, 1.0])
    return np.array([1.0, 0, 0]), np.array([0.5, 0.5, 0])


def test_three_tokens_T3_W1_by_hand():
    r = enumerate_coupled(always_mismatch_after, 3, T=3, W=1)
    np.testing.assert_allclose(r.f, [0.5, 0.25, 0.125])
    assert r.p_div == pytest.approx(0.875)
    assert r.E_L == pytest.approx(0.5 * 2 + 0.25 * 1)  # 1.25
    assert r.E_N_post == pytest.approx(1.25)  # every post step mismatches
    assert r.E_N == pytest.approx(2.125)
    assert r.E_N_win == pytest.approx(0.75)  # P(L >= 1)
    assert r.E_L_win == pytest.approx(0.75)
    assert r.E_L_tail == pytest.approx(0.5)  # tau = 1: L - W = 1
    assert r.E_N_tail == pytest.approx(0.5)
    assert r.rho == pytest.approx(1.0)
    assert r.E_tau_div / r.p_div == pytest.approx((0.5 + 0.5 + 0.375) / 0.875)
    np.testing.assert_allclose(r.reach, [0.75, 0.5, 0.0])
    np.testing.assert_allclose(r.btv_num, [0.75, 0.5, 0.0])  # tv = 1 on every branch step
    assert r.btv(1, 2) == pytest.approx(1.0)
    assert np.isnan(r.btv(3, 3))
    assert r.E_M == pytest.approx(r.decomposition_rhs)
    # E[N^2]: N = 3 (tau=1), 2 (tau=2), 1 (tau=3), 0 otherwise
    assert r.E_N_sq == pytest.approx(0.5 * 9 + 0.25 * 4 + 0.125 * 1)


def test_eos_is_absorbing(eos_kern):
    # token 1 is EOS; once q emits it, q is the point mass on it and every later step mismatches
    with_eos = enumerate_coupled(eos_kern, 2, T=3, W=1, eos_ids=(1,))
    without = enumerate_coupled(eos_kern, 2, T=3, W=1)
    np.testing.assert_allclose(with_eos.f, [0.5, 0.25, 0.125])
    assert with_eos.E_N_post == pytest.approx(1.25)
    assert with_eos.E_N == pytest.approx(2.125)
    assert without.E_N == pytest.approx(1.5)  # tv = 1/2 at each of 3 steps
    np.testing.assert_allclose(without.f, with_eos.f)


@pytest.mark.parametrize("T,W", [(3, 1), (4, 2), (4, 0)])
def test_decomposition_and_window_split_hold(kernel, T, W):
    r = enumerate_coupled(kernel, 3, T=T, W=W)
    assert r.E_M == pytest.approx(r.decomposition_rhs, abs=1e-12)
    assert r.E_N == pytest.approx(r.p_div + r.E_N_post, abs=1e-12)
    assert r.E_L == pytest.approx(r.E_L_win + r.E_L_tail, abs=1e-12)
    assert r.E_N_post == pytest.approx(r.E_N_win + r.E_N_tail, abs=1e-12)
    assert r.E_N_post == pytest.approx(r.mismatch_lag.sum(), abs=1e-12)
    assert r.E_L == pytest.approx(r.reach.sum(), abs=1e-12)
    assert sum(r.window_law.values()) == pytest.approx(1.0, abs=1e-12)
    assert 0 < r.p_div < 1
    np.testing.assert_allclose(r.S, 1 - np.cumsum(r.f))


def test_bad_arguments(kernel):
    with pytest.raises(ValueError):
        enumerate_coupled(kernel, 3, T=0)
    with pytest.raises(ValueError):
        enumerate_coupled(kernel, 3, T=2, W=-1)
    with pytest.raises(ValueError, match="shapes"):
        enumerate_coupled(kernel, 4, T=2)
