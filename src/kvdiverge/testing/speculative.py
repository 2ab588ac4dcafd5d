"""A real speculative sampler on a language model: draft = the evicted twin, target = the full cache.

Speculative sampling (Leviathan, Kalman & Matias 2023, Algorithm 1; Chen et al. 2023): the
draft kernel ``Q`` proposes ``k`` tokens ``y_1..y_k``, one forward at a time; the target
``P`` scores them in one forward; ``y_j`` is accepted when ``u_j < p_j(y_j) / q_j(y_j)``
(``u_j`` uniform), and the block stops at the first rejection. Here ``Q`` is the model's
twin (:func:`kvdiverge.engine.llm.twin.evicted_twin`) holding the prompt cache a kvpress
press compressed at prefill, ``P`` the model with the full cache, both through the same
decoding transform (:func:`kvdiverge.engine.core.decoding.decode_log_probs`). Generated
tokens take RoPE positions ``len(prompt) + t`` on both sides, as kvpress's pipeline
numbers them.

This module is independent of the coupling engine (no agreement chain, no coupling): it
is the sampler whose first block's mean accepted length
:mod:`kvdiverge.estimation.speculative` claims to estimate by ``A_k = S_1 + ... + S_k``.

- :func:`first_block_accepted` — accepted tokens of the first draft block, for many seeds
  (:class:`DraftBlocks`: the block length, the draws, the decoding transform, the seed).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvdiverge.engine.core.decoding import decode_log_probs
from kvdiverge.engine.hf import DynamicCache
from kvdiverge.engine.llm.twin import evicted_twin

__all__ = ["DraftBlocks", "first_block_accepted"]


@dataclass(frozen=True)
class DraftBlocks:
    """The first draft blocks :func:`first_block_accepted` draws, and how.

    Parameters
    ----------
    k : int
        Block length (tokens drafted), ``>= 1``.
    n_seeds : int
        Independent first blocks, ``>= 1``.
    temperature, top_p : float
        Decoding transform of both kernels (:func:`kvdiverge.engine.core.decoding.decode_log_probs`;
        temperature > 0).
    seed : int
        Seed of the sampler's own torch generator (CPU).
    chunk : int
        Blocks drafted together (rows of a batched forward; the caches are repeated per row).

    Raises
    ------
    ValueError
        If ``k < 1``, ``n_seeds < 1`` or ``temperature <= 0`` (greedy has no acceptance ratio).
    """

    k: int
    n_seeds: int
    temperature: float = 0.7
    top_p: float = 0.95
    seed: int = 0
    chunk: int = 64

    def __post_init__(self) -> None:
        if self.k < 1 or self.n_seeds < 1:
            raise ValueError(f"k and n_seeds must be >= 1, got k={self.k}, n_seeds={self.n_seeds}")
        if self.temperature <= 0:
            raise ValueError(f"speculative sampling needs temperature > 0, got {self.temperature}")


@dataclass(frozen=True)
class _Prefilled:
    """Both kernels after the prompt's prefill (internal to :func:`first_block_accepted`).

    ``model`` with ``full`` (the full prompt cache) and ``p1`` (its last logits, (1, V)) is
    the target; ``twin`` with ``draft`` (the cache the press compressed) and ``q1`` the
    draft; ``start`` is the prompt length, the RoPE position of the first generated token.
    """

    model: Any
    full: Any
    p1: torch.Tensor
    twin: Any
    draft: Any
    q1: torch.Tensor
    start: int


def _prefill(model, ids: torch.Tensor, press=None):
    """One prompt's cache and its last-position logits (1, V); ``press`` entered around the forward."""
    cache = DynamicCache()
    if press is None:
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    else:
        with press(model):
            out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    return cache, out.logits[:, -1, :]


def _repeat(cache, n: int):
    c = copy.deepcopy(cache)
    c.batch_repeat_interleave(n)
    return c


def _block(pre: _Prefilled, n: int, blocks: DraftBlocks, gen: torch.Generator) -> np.ndarray:
    """Accepted counts of ``n`` independent first blocks of ``blocks.k`` (internal; one chunk of seeds)."""
    k, temperature, top_p, start = blocks.k, blocks.temperature, blocks.top_p, pre.start
    logq = decode_log_probs(pre.q1.expand(n, -1), temperature, top_p)
    cache_q = _repeat(pre.draft, n)
    drafted, logq_drafted = [], []
    for j in range(k):
        y = torch.multinomial(logq.exp(), 1, generator=gen)  # (n, 1)
        drafted.append(y)
        logq_drafted.append(logq.gather(1, y))
        if j + 1 < k:
            pos = torch.full((n, 1), start + j, dtype=torch.long)
            out = pre.twin(input_ids=y, past_key_values=cache_q, position_ids=pos, use_cache=True)
            logq = decode_log_probs(out.logits[:, -1, :], temperature, top_p)
    ys = torch.cat(drafted, dim=1)  # (n, k)
    pos = start + torch.arange(k - 1, dtype=torch.long).expand(n, -1)
    p1 = pre.p1
    logits = (
        pre.model(input_ids=ys[:, :-1], past_key_values=_repeat(pre.full, n), position_ids=pos, use_cache=True).logits
        if k > 1
        else p1.new_zeros(n, 0, p1.shape[-1])
    )
    logp = torch.stack(
        [decode_log_probs(p1.expand(n, -1), temperature, top_p)]
        + [decode_log_probs(logits[:, j, :], temperature, top_p) for j in range(k - 1)],
        dim=1,
    )
    logp_drafted = logp.gather(2, ys.unsqueeze(2)).squeeze(2)  # (n, k)
    ratio = (logp_drafted - torch.cat(logq_drafted, dim=1)).exp()
    u = torch.rand((n, k), generator=gen, dtype=ratio.dtype)
    accepted = (u < ratio).long().cumprod(dim=1).sum(dim=1)
    return accepted.numpy()


@torch.no_grad()
def first_block_accepted(model, input_ids, press, blocks: DraftBlocks) -> np.ndarray:
    """Accepted tokens of the first speculative draft block, for ``blocks.n_seeds`` independent draws.

    Parameters
    ----------
    model : transformers causal LM
        The target (full cache); no press entered on it.
    input_ids : sequence of int
        The prompt's token ids (rendered prompt).
    press : kvpress press
        A prefill press, entered on the model's twin around the draft's prefill.
    blocks : DraftBlocks
        Block length ``k``, draws, decoding transform, the sampler's seed and chunk.

    Returns
    -------
    numpy.ndarray of int64, shape (n_seeds,)
        Accepted tokens per block, in ``0..k``; their mean estimates ``E[accepted]``.
    """
    ids = torch.as_tensor(list(input_ids), dtype=torch.long, device=model.device).view(1, -1)
    twin = evicted_twin(model)
    full, p1 = _prefill(model, ids)
    draft, q1 = _prefill(twin, ids, press)
    pre = _Prefilled(model, full, p1, twin, draft, q1, ids.shape[1])
    gen = torch.Generator(device="cpu").manual_seed(int(blocks.seed))
    out = []
    for lo in range(0, blocks.n_seeds, blocks.chunk):
        out.append(_block(pre, min(blocks.chunk, blocks.n_seeds - lo), blocks, gen))
    return np.concatenate(out)
