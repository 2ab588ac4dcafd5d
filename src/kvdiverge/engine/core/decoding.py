"""The decoding transform applied to both kernels before any coupling math.

Temperature scaling then nucleus (top-p) truncation, with the semantics of
``transformers``' ``TemperatureLogitsWarper`` and ``TopPLogitsWarper``
(Holtzman et al., 2020, "The Curious Case of Neural Text Degeneration").
Temperature 0 is greedy decoding: the point mass on the arg-max token.
"""

from __future__ import annotations

import torch

__all__ = ["decode_log_probs", "nucleus"]


def decode_log_probs(
    logits: torch.Tensor, temperature: float, top_p: float = 1.0, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """Log-probabilities of the transformed next-token distribution.

    The nucleus is ranked on the raw logits (``torch.topk`` of the model's own dtype, half
    the bytes of float64 and no copy), which orders tokens exactly as the float64
    log-probabilities do; the result is bit for bit that of ranking the log-probabilities.
    Greedy decoding takes the arg-max of the raw logits without any full-vocabulary
    float64 work.

    Parameters
    ----------
    logits : torch.Tensor
        Raw model logits, shape (B, V), any float dtype, all finite (callers check:
        :func:`kvdiverge.engine.core.errors.check_logits_finite`).
    temperature : float
        Softmax temperature; 0 means greedy (point mass on the arg-max, first index
        on ties, as ``torch.argmax`` and ``model.generate`` pick).
    top_p : float
        Nucleus mass in (0, 1]; keeps the smallest set of most likely tokens whose
        mass reaches ``top_p`` (always at least one token). 1 keeps all.
    dtype : torch.dtype
        Working and output dtype: float64, or float32 on devices without float64.

    Returns
    -------
    torch.Tensor
        Log-probabilities, ``dtype``, shape (B, V), on ``logits``' device, ``-inf``
        outside the support.

    Raises
    ------
    ValueError
        If ``temperature < 0`` or ``top_p`` is outside (0, 1].
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if temperature == 0:
        out = torch.full(logits.shape, float("-inf"), dtype=dtype, device=logits.device)
        out.scatter_(-1, logits.argmax(-1, keepdim=True), 0.0)
        return out
    logp = torch.log_softmax(logits.to(dtype) / temperature, dim=-1)
    if top_p < 1:
        keep = nucleus(logp, top_p, scores=logits)
        logp = torch.log_softmax(logp.masked_fill_(~keep, float("-inf")), dim=-1)
    return logp


def nucleus(
    logp: torch.Tensor, top_p: float, candidates: int = 1024, scores: torch.Tensor | None = None
) -> torch.Tensor:
    """Tokens of the top-p nucleus: the most likely tokens until their mass reaches ``top_p``.

    A token is kept when the mass of the tokens ranked above it is below ``top_p``
    (so the most likely token is always kept), which is ``TopPLogitsWarper``'s rule.
    Only the ``candidates`` most likely tokens are ranked (``torch.topk``); rows whose
    candidates hold less than ``top_p`` of the mass fall back to a full sort, so the
    result is exact either way. Ranking the whole vocabulary costs ~10x more.

    Parameters
    ----------
    logp : torch.Tensor
        Log-probabilities, float64 (or float32), shape (B, V).
    top_p : float
        Nucleus mass in (0, 1).
    candidates : int
        Tokens ranked before falling back to a full sort.
    scores : torch.Tensor, optional
        Any tensor (B, V) that ranks tokens as ``logp`` does (the raw logits: ``logp`` is
        a strictly increasing function of them per row); ranked instead of ``logp``
        because it is cheaper. The masses always come from ``logp``.

    Returns
    -------
    torch.Tensor
        Boolean mask of kept tokens, shape (B, V).
    """
    V = logp.shape[-1]
    k = min(candidates, V)
    order = (logp if scores is None else scores).topk(k, dim=-1, sorted=True).indices
    probs = logp.gather(-1, order).exp()
    before = probs.cumsum(-1) - probs
    keep = torch.zeros(logp.shape, dtype=torch.bool, device=logp.device).scatter_(-1, order, before < top_p)
    if k < V:
        short = probs.sum(-1) < top_p  # candidates too few: rank everything
        if bool(short.any()):
            rows = short.nonzero().squeeze(1)
            top, order = logp[rows].topk(V, dim=-1, sorted=True)
            probs = top.exp()
            keep[rows] = torch.zeros_like(keep[rows]).scatter_(-1, order, probs.cumsum(-1) - probs < top_p)
    return keep
