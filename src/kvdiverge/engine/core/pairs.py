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
  ``length[r]`` tokens (which must be shared by the two sides); a row whose
  ``length[r]`` is its current length is left as it is.
- ``keep_rows(rows)`` — keep only the given (distinct) rows, in that order; the engine calls
  it when rows finish, so that later steps run on fewer rows.

Log-distributions are float64 tensors of shape (n_rows, vocab_size), already through
the decoding transform (:mod:`kvdiverge.engine.core.decoding`), on the pair's device (float32 on
devices without float64). End-of-sequence is absorbing;
the engine (:mod:`kvdiverge.engine.core.coupled`) enforces that for every pair.

This module holds the interface and :class:`TableKernelPair` (small synthetic probability
tables keyed by history, for exact tests); :class:`kvdiverge.engine.llm.llm_pair.LLMKernelPair`
is the language-model pair (one model, two caches).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch

__all__ = ["History", "KernelFn", "KernelPair", "PhaseTracker", "TableKernelPair"]

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

    def keep_rows(self, rows: torch.Tensor) -> None: ...


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
            if n == len(self._ref[row]) == len(self._ev[row]):
                continue  # a row at its own length is left as it is (its sides may differ)
            if self._ref[row][:n] != self._ev[row][:n]:
                raise ValueError(f"row {row}: the first {n} tokens are not shared by the two sides")
            del self._ref[row][n:]
            del self._ev[row][n:]

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (int64 indices into the current rows), in that order."""
        self._ref = [self._ref[i] for i in rows.tolist()]
        self._ev = [self._ev[i] for i in rows.tolist()]


class PhaseTracker:
    """A kernel pair that remembers which of its calls runs: where an error came from.

    Delegates everything to ``pair``; ``phase`` names the call in progress (or the
    last one): ``"during the prefill"`` (``start``), ``"while decoding (forward k after
    the prefill)"`` (``advance``), ``"while rewinding rows to their branch start"``
    (``rewind``, which replays the evicted side's history for a decode-time press),
    ``"while dropping finished rows"`` (``keep_rows``).
    """

    def __init__(self, pair):
        self._pair, self.phase, self._forwards = pair, "before the run", 0

    def __getattr__(self, name):
        return getattr(self._pair, name)

    def start(self, n_rows: int):
        self.phase, self._forwards = "during the prefill", 0
        return self._pair.start(n_rows)

    def advance(self, x, y):
        self._forwards += 1
        self.phase = f"while decoding (forward {self._forwards} after the prefill)"
        return self._pair.advance(x, y)

    def rewind(self, length):
        self.phase = "while rewinding rows to their branch start"
        return self._pair.rewind(length)

    def keep_rows(self, rows):
        self.phase = "while dropping finished rows"
        return self._pair.keep_rows(rows)
