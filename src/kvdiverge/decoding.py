"""The decoding transform applied to both kernels before any coupling math.

Temperature scaling then nucleus (top-p) truncation, with the semantics of
``transformers``' ``TemperatureLogitsWarper`` and ``TopPLogitsWarper``
(Holtzman et al., 2020, "The Curious Case of Neural Text Degeneration").
Temperature 0 is greedy decoding: the point mass on the arg-max token.
"""

from __future__ import annotations

import torch

__all__ = ["decode_log_probs"]


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
        # As TopPLogitsWarper: sort ascending, drop tokens whose cumulative mass
        # (from the least likely) is <= 1 - top_p, keep the most likely one.
        sorted_logp, order = logp.sort(dim=-1, descending=False)
        cumulative = sorted_logp.exp().cumsum(-1)
        drop_sorted = cumulative <= (1 - top_p)
        drop_sorted[..., -1] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logp = torch.log_softmax(logp.masked_fill(drop, float("-inf")), dim=-1)
    return logp
