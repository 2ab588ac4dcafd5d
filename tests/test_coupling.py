"""Maximal-coupling math on hand-enumerated distributions."""

import numpy as np
import pytest
import torch
from scipy import stats

from kvdiverge.engine.core.coupling import inverse_cdf, maximal_coupling, residual_draws, total_variation
from kvdiverge.engine.core.decoding import decode_log_probs


def t(*rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_total_variation_hand_values():
    p = t([0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [1.0, 0.0, 0.0], [0.4, 0.3, 0.3])
    q = t([0.0, 0.5, 0.5], [0.2, 0.3, 0.5], [0.0, 0.0, 1.0], [0.1, 0.2, 0.7])
    assert total_variation(p, q).tolist() == pytest.approx([0.5, 0.0, 1.0, 0.4], abs=1e-15)


def test_total_variation_is_exactly_zero_for_identical_and_one_for_disjoint():
    p = torch.softmax(torch.randn(4, 1000, dtype=torch.float64, generator=torch.Generator().manual_seed(0)), -1)
    assert (total_variation(p, p.clone()) == 0).all()
    a, b = torch.zeros(1, 6, dtype=torch.float64), torch.zeros(1, 6, dtype=torch.float64)
    a[0, :3], b[0, 3:] = 1 / 3, 1 / 3
    assert total_variation(a, b).item() == 1.0


def test_inverse_cdf_hand_values_and_never_zero_weight():
    w = t(*[[0.0, 0.2, 0.3, 0.0, 0.5]] * 5)
    u = torch.tensor([0.0, 0.1, 0.2, 0.6, 1 - 1e-17], dtype=torch.float64)
    assert inverse_cdf(w, u).tolist() == [1, 1, 2, 4, 4]
    # unnormalised weights give the same draws
    assert inverse_cdf(3 * w, u).tolist() == [1, 1, 2, 4, 4]


def test_residual_draws_have_disjoint_supports():
    p, q = t([0.4, 0.3, 0.2, 0.1]), t([0.1, 0.2, 0.3, 0.4])
    for u in np.linspace(0, 0.999, 50):
        uu = torch.tensor([u], dtype=torch.float64)
        x, y = residual_draws(p, q, uu, uu)
        assert x.item() in (0, 1) and y.item() in (2, 3)


def test_maximal_coupling_joint_law_matches_enumeration():
    # p - q = (.3, .1, -.1, -.3): tv = .4, overlap (.1, .2, .2, .1),
    # X-residual (.75, .25, 0, 0), Y-residual (0, 0, .25, .75).
    exact = {
        (0, 0): 0.1,
        (1, 1): 0.2,
        (2, 2): 0.2,
        (3, 3): 0.1,
        (0, 2): 0.4 * 0.75 * 0.25,
        (0, 3): 0.4 * 0.75 * 0.75,
        (1, 2): 0.4 * 0.25 * 0.25,
        (1, 3): 0.4 * 0.25 * 0.75,
    }
    n = 200_000
    gen = torch.Generator().manual_seed(1234)
    u = torch.rand(4, n, dtype=torch.float64, generator=gen)
    p = t([0.4, 0.3, 0.2, 0.1]).expand(n, -1)
    q = t([0.1, 0.2, 0.3, 0.4]).expand(n, -1)
    x, y, tv = maximal_coupling(p, q, *u)
    assert tv[0].item() == pytest.approx(0.4, abs=1e-15)
    pairs = list(zip(x.tolist(), y.tolist()))
    assert set(pairs) == set(exact)  # nothing outside the coupling's support
    keys = sorted(exact)
    observed = np.array([sum(1 for pr in pairs if pr == k) for k in keys])
    expected = np.array([exact[k] * n for k in keys])
    assert stats.chisquare(observed, expected).pvalue > 1e-3
    assert np.mean(x.numpy() != y.numpy()) == pytest.approx(0.4, abs=4 * np.sqrt(0.24 / n))


def test_decoding_greedy_is_point_mass_on_argmax():
    logp = decode_log_probs(torch.tensor([[0.1, 2.0, 2.0, -1.0]]), temperature=0.0)
    assert logp.exp().tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_decoding_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]], dtype=torch.float64)
    out = decode_log_probs(probs.log(), temperature=1.0, top_p=0.75).exp()
    assert out.tolist()[0] == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0])
    out = decode_log_probs(probs.log(), temperature=1.0, top_p=0.9).exp()
    assert out.tolist()[0] == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0])


def test_decoding_rejects_bad_parameters():
    from kvdiverge.engine.core.sampling import Decoding

    with pytest.raises(ValueError, match=r"^temperature must be a finite number >= 0, got -1$"):
        Decoding(temperature=-1)
    with pytest.raises(ValueError, match=r"^top_p must be a finite number > 0 and <= 1, got 0$"):
        Decoding(top_p=0)


def test_nucleus_with_few_candidates_equals_full_ranking():
    from kvdiverge.engine.core.decoding import nucleus

    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 5000, dtype=torch.float64, generator=gen) * torch.tensor([[0.1], [0.5], [1], [2], [4], [8]])
    logp = torch.log_softmax(logits, -1)
    for top_p in (0.5, 0.9, 0.95, 0.999):
        full = nucleus(logp, top_p, candidates=5000)
        assert torch.equal(nucleus(logp, top_p, candidates=16), full)
        # the kept set is the smallest prefix of the ranking reaching top_p
        mass = (logp.exp() * full).sum(-1)
        assert (mass >= top_p - 1e-12).all()
        smallest_kept = torch.where(full, logp, torch.inf).amin(-1)
        assert ((mass - smallest_kept.exp()) < top_p).all()


def test_residual_draws_when_tv_is_rounding_alone_draw_from_the_sides_own_distribution():
    """``p <= q`` everywhere with ``tv > 0`` from rounding only: ``(p - q)^+`` is all zero, so
    that side draws from ``p`` itself, never the invalid index -1."""
    ulp = 2.0**-53
    p = t([0.25, 0.75 - ulp, 0.0], [0.5, 0.5, 0.0])
    q = t([0.25, 0.75, 0.0], [0.5, 0.5 - ulp, 0.0])  # row 1: the other side is the empty one
    tv = total_variation(p, q)
    assert (tv > 0).all() and (tv < 1e-15).all()
    u = t(0.1, 0.9)
    x, y = residual_draws(p, q, u, u)
    assert x.tolist() == [0, 1]  # row 0: X ~ p by inverse CDF (0.1 -> 0); row 1: X ~ (p - q)^+ = token 1
    assert y.tolist() == [1, 1]  # row 0: Y ~ (q - p)^+ = token 1; row 1: Y ~ q (0.9 -> 1)
    # through the coupling: a coin at 1 (not below 1 - tv) takes the residual move, with valid tokens
    x, y, _ = maximal_coupling(p, q, t(1.0, 1.0), u, u, u)
    assert x.tolist() == [0, 1] and y.tolist() == [1, 1]
