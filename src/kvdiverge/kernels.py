"""Kernel pairs: the reference kernel ``P`` and the evicted kernel ``Q`` (estimators.md §1).

The trajectory engine only talks to the :class:`KernelPair` interface. A pair holds
``n_rows`` rows; each row has two histories (reference side, evicted side) of
generated tokens. The interface is incremental so that a language model can keep
its KV caches between calls:

- ``start(n_rows)`` — every row at the empty history; returns both next-token
  log-distributions.
- ``advance(x, y)`` — append ``x[r]`` to row ``r``'s reference history and ``y[r]``
  to its evicted history; returns both next-token log-distributions.
- ``rewind(length)`` — cut both histories of row ``r`` back to their first
  ``length[r]`` tokens (which must be shared by the two sides).

Log-distributions are float64 tensors of shape (n_rows, vocab_size), already through
the decoding transform (:mod:`kvdiverge.decoding`). End-of-sequence is absorbing;
the engine (:mod:`kvdiverge.trajectories`) enforces that for every pair.

Two implementations: :class:`TableKernelPair` (small synthetic probability tables
keyed by history, for exact tests) and :class:`LLMKernelPair` (one language model,
two caches: the full prompt cache and the prompt cache compressed by a kvpress press).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch

from kvdiverge.decoding import decode_log_probs

__all__ = ["KernelPair", "TableKernelPair", "LLMKernelPair", "CompressionError"]

History = tuple[int, ...]
#: A synthetic kernel pair as a pure function: ``(ref_history, evicted_history) -> (p, q)``.
KernelFn = Callable[[History, History], tuple[np.ndarray, np.ndarray]]


class KernelPair(Protocol):
    """Interface of a kernel pair (see the module docstring)."""

    vocab_size: int
    eos_ids: tuple[int, ...]

    def start(self, n_rows: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def advance(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def rewind(self, length: torch.Tensor) -> None: ...


class TableKernelPair:
    """A synthetic kernel pair given by a pure function of the two histories.

    Parameters
    ----------
    fn : callable
        ``fn(ref_history, evicted_history) -> (p, q)``: two float64 arrays of shape
        (vocab_size,), each summing to 1; histories are tuples of token ids.
    vocab_size : int
        Number of tokens V.
    eos_ids : sequence of int
        End-of-sequence ids (absorbing, enforced by the engine).
    """

    def __init__(self, fn: KernelFn, vocab_size: int, eos_ids: Sequence[int] = ()):
        self.fn = fn
        self.vocab_size = int(vocab_size)
        self.eos_ids = tuple(int(e) for e in eos_ids)
        self._ref: list[list[int]] = []
        self._ev: list[list[int]] = []

    def _evaluate(self) -> tuple[torch.Tensor, torch.Tensor]:
        ps, qs = zip(*(self.fn(tuple(a), tuple(b)) for a, b in zip(self._ref, self._ev)))
        with np.errstate(divide="ignore"):
            logp = torch.from_numpy(np.log(np.asarray(ps, dtype=np.float64)))
            logq = torch.from_numpy(np.log(np.asarray(qs, dtype=np.float64)))
        return logp, logq

    def start(self, n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._ref = [[] for _ in range(n_rows)]
        self._ev = [[] for _ in range(n_rows)]
        return self._evaluate()

    def advance(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for row, (a, b) in enumerate(zip(x.tolist(), y.tolist())):
            self._ref[row].append(a)
            self._ev[row].append(b)
        return self._evaluate()

    def rewind(self, length: torch.Tensor) -> None:
        for row, n in enumerate(length.tolist()):
            if self._ref[row][:n] != self._ev[row][:n]:
                raise ValueError(f"row {row}: the first {n} tokens are not shared by the two sides")
            del self._ref[row][n:]
            del self._ev[row][n:]


class CompressionError(RuntimeError):
    """The evicted cache does not have the length the policy promises."""


class _CacheSide:
    """A batched KV cache plus per-row bookkeeping.

    ``valid`` (n_rows, cache_len) marks the cache columns each row attends to;
    ``step`` (n_rows, cache_len) holds, for generated columns, the 0-based index of
    the generated token stored there (-1 for prompt columns), so ``rewind`` can mask
    a row's abandoned suffix without touching other rows.
    """

    def __init__(self, cache, valid: torch.Tensor, prompt_len: int):
        self.cache = cache
        self.valid = valid
        self.step = torch.full(valid.shape, -1, dtype=torch.long, device=valid.device)
        self.n_gen = torch.zeros(valid.shape[0], dtype=torch.long, device=valid.device)
        self.prompt_len = prompt_len
        self.all_valid = bool(valid.all())

    def forward(self, model, tokens: torch.Tensor) -> torch.Tensor:
        n_rows = tokens.shape[0]
        self.valid = torch.cat([self.valid, self.valid.new_ones(n_rows, 1)], dim=1)
        self.step = torch.cat([self.step, self.n_gen.unsqueeze(1)], dim=1)
        # RoPE positions continue from the *uncompressed* prompt length (estimators.md §1),
        # as kvpress's own pipeline does, whatever the cache length.
        position_ids = (self.prompt_len + self.n_gen).unsqueeze(1)
        out = model(
            input_ids=tokens.unsqueeze(1),
            past_key_values=self.cache,
            attention_mask=None if self.all_valid else self.valid.long(),
            position_ids=position_ids,
            use_cache=True,
        )
        self.n_gen += 1
        return out.logits[:, -1, :]

    def rewind(self, length: torch.Tensor) -> None:
        self.valid = self.valid & (self.step < length.unsqueeze(1))
        self.n_gen = length.clone()
        self.all_valid = bool(self.valid.all())


class LLMKernelPair:
    """One language model, two KV caches: full prompt cache (``P``) and evicted (``Q``).

    The evicted cache is the prompt prefilled under a kvpress press, which compresses
    each layer's cache once, during prefill (kvpress semantics: the prefill's own
    last-position logits use the full attention, so ``q_1 = p_1``; compression acts
    from the first generated token on). Generated tokens are appended to both caches
    and never evicted; their RoPE positions continue from the uncompressed prompt
    length on both sides. This is exactly what ``with press(model): model.generate(...)``
    and kvpress's pipeline do.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A causal LM supported by kvpress, in eval mode.
    input_ids : sequence of int
        The chat-rendered prompt, length ``prompt_len`` (tokens).
    press : kvpress.BasePress or None
        The eviction press; ``None`` leaves the evicted cache equal to the full one.
    temperature, top_p : float
        Decoding transform (:func:`kvdiverge.decoding.decode_log_probs`).
    expected_kept : int or None
        Prompt positions every layer must keep after compression (tokens). Checked
        after prefill; ``None`` only checks that a compressing press shortened the cache.
    eos_ids : sequence of int or None
        End-of-sequence ids; defaults to ``model.generation_config.eos_token_id``.

    Raises
    ------
    CompressionError
        From :meth:`start`, when a layer's evicted cache length is not the policy's
        kept count (a silently skipped compression).
    """

    def __init__(
        self,
        model,
        input_ids: Sequence[int],
        press=None,
        *,
        temperature: float,
        top_p: float = 1.0,
        expected_kept: int | None = None,
        eos_ids: Sequence[int] | None = None,
    ):
        self.model = model
        self.device = next(model.parameters()).device
        self.input_ids = torch.as_tensor(list(input_ids), dtype=torch.long, device=self.device)
        self.prompt_len = int(self.input_ids.numel())
        self.press = press
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.expected_kept = expected_kept
        if eos_ids is None:
            from kvdiverge.models import eos_ids as model_eos_ids

            eos_ids = model_eos_ids(model)
        self.eos_ids = tuple(int(e) for e in eos_ids)
        self.vocab_size = int(model.config.vocab_size)
        self.kept_len: int | None = None
        self._ref: _CacheSide | None = None
        self._ev: _CacheSide | None = None

    def _transform(self, logits: torch.Tensor) -> torch.Tensor:
        return decode_log_probs(logits, self.temperature, self.top_p)

    def _prefill(self, press) -> tuple[object, torch.Tensor]:
        from transformers import DynamicCache

        cache = DynamicCache()
        ids = self.input_ids.unsqueeze(0)
        if press is None:
            out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        else:
            with press(self.model):
                out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return cache, out.logits[:, -1, :]

    def _check_compression(self, cache) -> int:
        lengths = {layer.keys.shape[-2] for layer in cache.layers}
        if len(lengths) != 1:
            raise CompressionError(f"evicted cache layers differ in length: {sorted(lengths)}")
        kept = lengths.pop()
        if self.expected_kept is not None and kept != self.expected_kept:
            raise CompressionError(
                f"evicted cache keeps {kept} of {self.prompt_len} prompt positions per layer, "
                f"the policy promises {self.expected_kept}: the press did not compress as configured"
            )
        ratio = getattr(self.press, "compression_ratio", 0.0) or 0.0
        if self.expected_kept is None and ratio > 0 and kept >= self.prompt_len:
            raise CompressionError(
                f"press {type(self.press).__name__} (compression_ratio={ratio}) left the cache "
                f"at the full {self.prompt_len} positions"
            )
        return kept

    @torch.inference_mode()
    def start(self, n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill both caches, check the compression, expand to ``n_rows`` rows.

        The two caches stay separate, each decoded by its own forward pass per step:
        batching them into one pass would let the rows' batch positions perturb the
        logits (~1e-6 on CPU), and ratio 0 must give a TV of exactly 0.

        Returns
        -------
        (torch.Tensor, torch.Tensor)
            ``log p_1`` and ``log q_1``, float64, shape (n_rows, vocab_size).
        """
        ref_cache, ref_logits = self._prefill(None)
        ev_cache, ev_logits = self._prefill(self.press)
        self.kept_len = self._check_compression(ev_cache)
        if n_rows > 1:
            ref_cache.batch_repeat_interleave(n_rows)
            ev_cache.batch_repeat_interleave(n_rows)
        self._ref = _CacheSide(ref_cache, torch.ones(n_rows, self.prompt_len, dtype=torch.bool,
                                                     device=self.device), self.prompt_len)
        self._ev = _CacheSide(ev_cache, torch.ones(n_rows, self.kept_len, dtype=torch.bool,
                                                   device=self.device), self.prompt_len)
        logp = self._transform(ref_logits).cpu().expand(n_rows, -1)
        logq = self._transform(ev_logits).cpu().expand(n_rows, -1)
        return logp, logq

    @torch.inference_mode()
    def advance(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``x`` (reference) and ``y`` (evicted), int64 shape (n_rows,); return next log-dists."""
        ref_logits = self._ref.forward(self.model, x.to(self.device))
        ev_logits = self._ev.forward(self.model, y.to(self.device))
        return self._transform(ref_logits).cpu(), self._transform(ev_logits).cpu()

    @torch.inference_mode()
    def rewind(self, length: torch.Tensor) -> None:
        """Keep each row's first ``length[r]`` generated tokens on both sides (int64, shape (n_rows,))."""
        length = length.to(self.device)
        self._ref.rewind(length)
        self._ev.rewind(length)
