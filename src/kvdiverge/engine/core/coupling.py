"""Maximal coupling of two next-token distributions: pure tensor math, no model code.

Notation follows ``estimators.md`` §1–§2. ``p`` is the reference kernel's
distribution, ``q`` the evicted kernel's, both already through the decoding
transform. Everything runs in float64: probabilities come from log-probabilities
by ``exp`` in float64, never from fp16 probabilities.

The maximal coupling (Lindvall, *Lectures on the Coupling Method*, 1992, §I.5;
Thorisson, *Coupling, Stationarity, and Regeneration*, 2000) draws ``X ~ p`` and
``Y ~ q`` with ``P(X != Y) = TV(p, q)``, the least possible. Draws use the inverse
CDF of given uniforms, so two runs that share uniforms share randomness (common
random numbers).
"""

from __future__ import annotations

import torch

__all__ = [
    "coupling_dtype",
    "probabilities",
    "total_variation",
    "inverse_cdf",
    "overlap_draw",
    "residual_draws",
    "maximal_coupling",
]


def coupling_dtype(device: torch.device | str) -> torch.dtype:
    """Dtype of the coupling math on ``device``: float64, or float32 where the device has
    no float64 (Apple ``mps``)."""
    return torch.float32 if torch.device(device).type == "mps" else torch.float64


def probabilities(logp: torch.Tensor) -> torch.Tensor:
    """Probabilities in float64 (float32 on devices without float64) from log-probabilities.

    Parameters
    ----------
    logp : torch.Tensor
        Log-probabilities, shape (B, V), any float dtype; ``-inf`` for impossible tokens.

    Returns
    -------
    torch.Tensor
        ``exp(logp)`` in :func:`coupling_dtype` of ``logp``'s device, shape (B, V), on that device.
    """
    return logp.to(coupling_dtype(logp.device)).exp()


def total_variation(
    p: torch.Tensor, q: torch.Tensor, diff: torch.Tensor | None = None, low: torch.Tensor | None = None
) -> torch.Tensor:
    """Total variation ``tv = 1/2 sum_v |p(v) - q(v)| = 1 - sum_v min(p(v), q(v))``.

    Parameters
    ----------
    p, q : torch.Tensor
        Probabilities, float64, shape (B, V), rows summing to 1.
    diff, low : torch.Tensor, optional
        ``p - q`` and ``torch.minimum(p, q)`` when the caller has them (reused, same result).

    Returns
    -------
    torch.Tensor
        ``tv`` per row, float64, shape (B,), clipped to [0, 1]. Exactly 0 when
        ``p == q`` and exactly 1 when the supports are disjoint: computed as
        ``1/2 sum |p - q|`` (which rounding cannot push off 0), set to 1 where the
        overlap mass ``sum min(p, q)`` is 0.
    """
    tv = 0.5 * (p - q if diff is None else diff).abs().sum(-1)
    disjoint = (torch.minimum(p, q) if low is None else low).sum(-1) == 0
    return torch.where(disjoint, torch.ones_like(tv), tv).clamp_(0.0, 1.0)


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Draw one index per row from unnormalised non-negative weights by inverse CDF.

    Returns the index ``i`` with ``c_{i-1} <= u * c_V < c_i`` where ``c`` is the
    cumulative sum, so an index of zero weight is never returned.

    Parameters
    ----------
    weights : torch.Tensor
        Non-negative weights, float64, shape (B, V); each row must have positive sum.
    u : torch.Tensor
        Uniforms in [0, 1), float64, shape (B,).

    Returns
    -------
    torch.Tensor
        Indices, int64, shape (B,).
    """
    cdf = weights.cumsum(-1)
    x = (u * cdf[:, -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, x, right=True).squeeze(-1)
    # Round-off can put x at the very top of the cdf (idx == V): fall back to the
    # last index of positive weight (never a zero-weight index).
    top = idx == weights.shape[-1]
    if top.any():
        vocab = torch.arange(weights.shape[-1], device=weights.device)
        idx[top] = torch.where(weights[top] > 0, vocab, -1).amax(-1)
    return idx


def overlap_draw(p: torch.Tensor, q: torch.Tensor, u: torch.Tensor, low: torch.Tensor | None = None) -> torch.Tensor:
    """Draw ``Z ~ overlap = min(p, q) / (1 - tv)`` (the agreement move).

    Parameters
    ----------
    p, q : torch.Tensor
        Probabilities, float64, shape (B, V); every row must have ``tv < 1``.
    u : torch.Tensor
        Uniforms, float64, shape (B,).
    low : torch.Tensor, optional
        ``torch.minimum(p, q)`` when the caller has it.

    Returns
    -------
    torch.Tensor
        Tokens, int64, shape (B,).
    """
    return inverse_cdf(torch.minimum(p, q) if low is None else low, u)


def residual_draws(
    p: torch.Tensor, q: torch.Tensor, u_x: torch.Tensor, u_y: torch.Tensor, diff: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw the divergent pair ``X ~ (p - q)^+ / tv`` and ``Y ~ (q - p)^+ / tv``.

    The two residuals have disjoint supports, so ``X != Y``.

    A row can have ``tv > 0`` from rounding alone: ``p <= q`` everywhere (so ``p = q``
    in exact arithmetic, both summing to 1) with ``(p - q)^+`` all zero, or the other
    way round. A side whose residual has no mass then draws from its own distribution
    (``X ~ p`` by inverse CDF with ``u_x``; ``Y ~ q`` with ``u_y``) instead of the empty
    residual, so every token is one the side can emit, and the coupling keeps its
    marginals: with ``(p - q)^+ = 0`` the overlap ``min(p, q)`` is ``p``, so ``X ~ p``
    whichever branch of the coupling drew it. Such a pair may agree, an event of
    probability at most that rounding-sized ``tv``.

    Parameters
    ----------
    p, q : torch.Tensor
        Probabilities, float64, shape (B, V); every row must have ``tv > 0``.
    u_x, u_y : torch.Tensor
        Uniforms, float64, shape (B,).
    diff : torch.Tensor, optional
        ``p - q`` when the caller has it.

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        Tokens ``X`` and ``Y``, int64, shape (B,) each, valid token ids.
    """
    if diff is None:
        diff = p - q
    return _residual_or_own(diff.clamp(min=0.0), p, u_x), _residual_or_own((-diff).clamp(min=0.0), q, u_y)


def _residual_or_own(residual: torch.Tensor, own: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws from ``residual``; rows whose residual has no mass draw from ``own``."""
    empty = ~(residual > 0).any(-1)
    if bool(empty.any()):
        residual = torch.where(empty.unsqueeze(-1), own, residual)
    return inverse_cdf(residual, u)


def maximal_coupling(
    p: torch.Tensor,
    q: torch.Tensor,
    u_coin: torch.Tensor,
    u_overlap: torch.Tensor,
    u_x: torch.Tensor,
    u_y: torch.Tensor,
    tv: torch.Tensor | None = None,
    diff: torch.Tensor | None = None,
    low: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One draw ``(X, Y)`` from the maximal coupling of ``p`` and ``q``.

    With probability ``1 - tv`` (``u_coin < 1 - tv``) both take ``Z ~ overlap``;
    otherwise ``X`` and ``Y`` come from the two residuals (estimators.md §2).

    Parameters
    ----------
    p, q : torch.Tensor
        Probabilities, float64, shape (B, V).
    u_coin, u_overlap, u_x, u_y : torch.Tensor
        Independent uniforms in [0, 1), float64, shape (B,).
    tv, diff, low : torch.Tensor, optional
        ``total_variation(p, q)``, ``p - q`` and ``torch.minimum(p, q)`` when the caller has
        them already (reused; the result is the same).

    Returns
    -------
    (torch.Tensor, torch.Tensor, torch.Tensor)
        ``X``, ``Y`` (int64, shape (B,)) and ``tv`` (float64, shape (B,)).
    """
    if tv is None:
        tv = total_variation(p, q, diff, low)
    agree = u_coin < 1.0 - tv
    x = torch.empty(p.shape[0], dtype=torch.int64, device=p.device)
    y = torch.empty_like(x)
    if agree.any():
        z = overlap_draw(p[agree], q[agree], u_overlap[agree], None if low is None else low[agree])
        x[agree] = z
        y[agree] = z
    split = ~agree
    if split.any():
        x[split], y[split] = residual_draws(
            p[split], q[split], u_x[split], u_y[split], None if diff is None else diff[split]
        )
    return x, y, tv
