"""The decoding transform applied to both kernels before any coupling math.

An optional repetition penalty on the raw logits (CTRL, Keskar et al., 2019, with the
semantics of ``transformers``' ``RepetitionPenaltyLogitsProcessor``: :func:`penalize_repeats`,
each side's context kept by :class:`RepeatHistory`), then temperature scaling, top-k, nucleus
(top-p) and min-p truncation, with the semantics of ``transformers``' ``TemperatureLogitsWarper``,
``TopKLogitsWarper`` (Fan et al., 2018, "Hierarchical Neural Story Generation"),
``TopPLogitsWarper`` (Holtzman et al., 2020, "The Curious Case of Neural Text Degeneration") and
``MinPLogitsWarper`` (Nguyen et al., 2024), applied in that order as ``model.generate`` does.
Temperature 0 is greedy decoding: the point mass on the arg-max token.
"""

from __future__ import annotations

import math

import torch

__all__ = ["RepeatHistory", "decode_log_probs", "nucleus", "penalize_repeats"]


def decode_log_probs(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_p: float = 1.0,
    dtype: torch.dtype = torch.float64,
    *,
    top_k: int = 0,
    min_p: float = 0.0,
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
    top_k : int
        Top-k truncation (>= 0), after temperature and before top-p, as ``transformers``'
        ``TopKLogitsWarper``: tokens whose logit is below the ``top_k``-th largest are dropped
        (ties with it stay). 0 keeps all.
    min_p : float
        Min-p truncation in [0, 1] (Nguyen et al., 2024, "Turning Up the Heat: Min-p
        Sampling"), after top-p, as ``transformers``' ``MinPLogitsWarper``: a token is kept
        when its probability is at least ``min_p`` times the most likely token's. 0 keeps all.
    dtype : torch.dtype
        Working and output dtype: float64, or float32 on devices without float64.

    Returns
    -------
    torch.Tensor
        Log-probabilities, ``dtype``, shape (B, V), on ``logits``' device, ``-inf``
        outside the support.

    The settings' ranges are :class:`kvdiverge.engine.core.sampling.Decoding`'s, checked when it is
    built (:meth:`~kvdiverge.engine.core.sampling.Decoding.log_probs` calls this function).
    """
    if temperature == 0:
        out = torch.full(logits.shape, float("-inf"), dtype=dtype, device=logits.device)
        out.scatter_(-1, logits.argmax(-1, keepdim=True), 0.0)
        return out
    logp = torch.log_softmax(logits.to(dtype) / temperature, dim=-1)
    if 0 < top_k < logits.shape[-1]:  # ranked on the raw logits, as the scaled ones rank
        kth = logits.topk(int(top_k), dim=-1).values[..., -1:]
        logp = torch.log_softmax(logp.masked_fill_(logits < kth, float("-inf")), dim=-1)
    if top_p < 1:
        keep = nucleus(logp, top_p, scores=logits)
        logp = torch.log_softmax(logp.masked_fill_(~keep, float("-inf")), dim=-1)
    if min_p > 0:  # p >= min_p * p_max, in logs; the arg-max always stays
        floor = logp.amax(-1, keepdim=True) + math.log(min_p)
        logp = torch.log_softmax(logp.masked_fill_(logp < floor, float("-inf")), dim=-1)
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


def penalize_repeats(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's repetition penalty (Keskar et al., 2019) on raw logits, as ``transformers``'
    ``RepetitionPenaltyLogitsProcessor``.

    Parameters
    ----------
    logits : torch.Tensor
        Raw logits, shape (B, V), any float dtype.
    seen : torch.Tensor
        bool, shape (B, V): the tokens in each row's context (prompt and generated tokens).
    penalty : float
        ``> 0``; a seen token's logit is divided by it when positive, multiplied when negative.

    Returns
    -------
    torch.Tensor
        A new tensor, ``logits``' shape and dtype; unseen tokens unchanged.
    """
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


class RepeatHistory:
    """Each row's context on both sides of a kernel pair, for :func:`penalize_repeats`.

    A row's context is its document's prompt and the tokens its side generated, which differ
    between the sides after the generations part. The pair reports what it does to its rows
    (:meth:`begin`, :meth:`append`, :meth:`rewind`, :meth:`keep_rows`) and asks for the
    penalized logits (:meth:`penalize`).

    Parameters
    ----------
    prompts : sequence of torch.Tensor
        Each document's prompt ids, int64, 1-D.
    vocab_size : int
        ``V``; every id must be below it.
    penalty : float
        The repetition penalty (``> 0``).
    """

    SIDES = ("reference", "evicted")

    def __init__(self, prompts, vocab_size: int, penalty: float) -> None:
        device = prompts[0].device
        self.penalty = float(penalty)
        self.prompt_seen = torch.zeros(len(prompts), int(vocab_size), dtype=torch.bool, device=device)
        for d, ids in enumerate(prompts):
            self.prompt_seen[d, ids] = True
        self.doc = None  # (rows,) int64: each row's document, once begun
        self.tokens = {side: None for side in self.SIDES}  # (rows, steps) int64 per side
        self.length = None  # (rows,) int64: generated tokens each row keeps

    def reset(self) -> None:
        """Back to one row per document and no row begun (before a pair's prefill)."""
        self.doc = None

    def begin(self, rows_per_document: int) -> None:
        """Start ``rows_per_document`` rows per document (documents in order), no token generated."""
        n = self.prompt_seen.shape[0]
        device = self.prompt_seen.device
        self.doc = torch.arange(n, device=device).repeat_interleave(int(rows_per_document))
        self.tokens = {side: torch.zeros(len(self.doc), 0, dtype=torch.long, device=device) for side in self.SIDES}
        self.length = torch.zeros(len(self.doc), dtype=torch.long, device=device)

    def append(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """One more generated token per row: ``x`` on the reference side, ``y`` on the evicted side ((rows,) int64)."""
        for side, tok in zip(self.SIDES, (x, y)):
            buf = self.tokens[side]
            if int(self.length.max()) >= buf.shape[1]:
                more = torch.zeros(buf.shape[0], max(8, buf.shape[1]), dtype=buf.dtype, device=buf.device)
                buf = torch.cat([buf, more], 1)
            buf[torch.arange(len(tok), device=buf.device), self.length] = tok.to(buf.device)
            self.tokens[side] = buf
        self.length = self.length + 1

    def rewind(self, length: torch.Tensor) -> None:
        """Keep each row's first ``length[r]`` generated tokens ((rows,) int64)."""
        self.length = torch.minimum(self.length, length.to(self.length.device))

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (int64 indices into the current rows), in this order."""
        rows = rows.to(self.doc.device)
        self.doc, self.length = self.doc[rows], self.length[rows]
        self.tokens = {side: buf[rows] for side, buf in self.tokens.items()}

    def seen(self, side: str) -> torch.Tensor:
        """bool (rows, V): each row's context on ``side``; before :meth:`begin`, one row per document (its prompt)."""
        if self.doc is None:
            return self.prompt_seen
        seen = self.prompt_seen[self.doc]
        buf = self.tokens[side]
        live = torch.arange(buf.shape[1], device=buf.device) < self.length[:, None]
        rows = torch.arange(len(self.doc), device=buf.device)[:, None].expand_as(buf)
        seen[rows[live], buf[live]] = True
        return seen

    def penalize(self, logits: torch.Tensor, side: str) -> torch.Tensor:
        """``logits`` (rows, V) of ``side`` with the penalty applied (:func:`penalize_repeats`).

        Raises
        ------
        ValueError
            When the penalty turns a finite logit non-finite in ``logits``' dtype (it overflows
            or underflows there), naming the setting.
        """
        out = penalize_repeats(logits, self.seen(side), self.penalty)
        if not bool(torch.isfinite(out).all()):
            raise ValueError(
                f"repetition_penalty: {self.penalty!r} turns the {side} side's {str(logits.dtype).removeprefix('torch.')} "
                f"logits non-finite; use a penalty nearer 1 (CTRL uses 1.2)"
            )
        return out
