"""Errors of the engine: a cache that breaks its policy's promise, non-finite logits."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["CompressionError", "NonFiniteLogitsError", "check_logits_finite"]


class CompressionError(RuntimeError):
    """The evicted cache does not have the length the policy promises."""


class NonFiniteLogitsError(FloatingPointError):
    """A language model returned NaN or infinite logits.

    Raised by :class:`LLMKernelPair` with ``side`` and the pair's ``rows`` set; the engine
    (:func:`kvdiverge.engine.coupled.run_batch`) re-raises it with the model, document,
    replicate and step of the first bad row filled in, so the message names them all.

    Attributes
    ----------
    side : str
        ``"reference"`` (full cache, ``P``) or ``"evicted"`` (``Q``).
    rows : list of int
        Rows of the pair (in its current row order) whose logits are not all finite.
    kind : str
        ``"NaN"``, ``"+inf"`` or ``"-inf"``: what the first bad row holds.
    model, doc_id, replicate, step : optional
        Filled in by the engine; ``step`` is 1-based (the token step ``t`` of the
        agreement chain, or ``t* + k`` on the residual branch).
    phase : str or None
        ``"chain"`` or ``"branch"``.
    """

    def __init__(self, side: str, rows: Sequence[int], kind: str, *, model: str | None = None,
                 doc_id: str | None = None, replicate: int | None = None, step: int | None = None,
                 phase: str | None = None):
        self.side, self.rows, self.kind = side, list(rows), kind
        self.model, self.doc_id, self.replicate, self.step, self.phase = model, doc_id, replicate, step, phase
        if doc_id is None:
            msg = f"{kind} logits on the {side} side (pair rows {self.rows})"
        else:
            msg = (f"{kind} logits from model {model!r}, document {doc_id!r}, replicate {replicate}, "
                   f"step {step} ({phase}), {side} side: the shard is not written; check the model's "
                   f"dtype (float16 overflows) and weights, then rerun")
        super().__init__(msg)


def check_logits_finite(logits: torch.Tensor, side: str) -> None:
    """Raise :class:`NonFiniteLogitsError` when any row of ``logits`` (rows, V) holds NaN or ±inf."""
    finite = torch.isfinite(logits).all(-1)
    if bool(finite.all()):
        return
    rows = (~finite).nonzero().squeeze(1).tolist()
    bad = logits[rows[0]]
    kind = "NaN" if bool(bad.isnan().any()) else ("+inf" if bool((bad == float("inf")).any()) else "-inf")
    raise NonFiniteLogitsError(side, rows, kind)
