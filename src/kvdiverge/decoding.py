"""The decoding transform applied to both kernels before any coupling math.

Temperature scaling then nucleus (top-p) truncation, with the semantics of
``transformers``' ``TemperatureLogitsWarper`` and ``TopPLogitsWarper``
(Holtzman et al., 2020, "The Curious Case of Neural Text Degeneration").
Temperature 0 is greedy decoding: the point mass on the arg-max token.
"""

from __future__ import annotations

import torch

__all__ = ["decode_log_probs", "nucleus"]


def decode_log_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """Log-probabilities of the transformed next-token distribution.

    Parameters
    ----------
    logits : torch.Tensor
        Raw model logits, shape (B, V), any float dtype.
    temperature : float
        Softmax temperature; 0 means greedy (point mass on the arg-max, first index
        on ties, as ``torch.argmax`` and ``model.generate`` pick).
    top_p : float
        Nucleus mass in (0, 1]; keeps the smallest set of most likely tokens whose
        mass reaches ``top_p`` (always at least one token). 1 keeps all.

    Returns
    -------
    torch.Tensor
        Log-probabilities, float64, shape (B, V), ``-inf`` outside the support.

    Raises
    ------
    ValueError
        If ``temperature < 0`` or ``top_p`` is outside (0, 1].
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    logits = logits.to(torch.float64)
    if temperature == 0:
        out = torch.full_like(logits, float("-inf"))
        out.scatter_(-1, logits.argmax(-1, keepdim=True), 0.0)
        return out
    logp = torch.log_softmax(logits / temperature, dim=-1)
    if top_p < 1:
        logp = torch.log_softmax(logp.masked_fill(~nucleus(logp, top_p), float("-inf")), dim=-1)
    return logp


def nucleus(logp: torch.Tensor, top_p: float, candidates: int = 1024) -> torch.Tensor:
    """Tokens of the top-p nucleus: the most likely tokens until their mass reaches ``top_p``.

    A token is kept when the mass of the tokens ranked above it is below ``top_p``
    (so the most likely token is always kept), which is ``TopPLogitsWarper``'s rule.
    Only the ``candidates`` most likely tokens are ranked (``torch.topk``); rows whose
    candidates hold less than ``top_p`` of the mass fall back to a full sort, so the
    result is exact either way. Ranking the whole vocabulary costs ~10x more.

    Parameters
    ----------
    logp : torch.Tensor
        Log-probabilities, float64, shape (B, V).
    top_p : float
        Nucleus mass in (0, 1).
    candidates : int
        Tokens ranked before falling back to a full sort.

    Returns
    -------
    torch.Tensor
        Boolean mask of kept tokens, shape (B, V).
    """
    keep = torch.zeros_like(logp, dtype=torch.bool)
    rows = torch.arange(logp.shape[0], device=logp.device)
    for k in (min(candidates, logp.shape[-1]), logp.shape[-1]):
        top, order = logp[rows].topk(k, dim=-1, sorted=True)
        probs = top.exp()
        before = probs.cumsum(-1) - probs
        keep[rows] = keep[rows].scatter(-1, order, before < top_p)
        rows = rows[probs.sum(-1) < top_p]  # candidates too few: rank everything
        if rows.numel() == 0:
            break
    return keep
