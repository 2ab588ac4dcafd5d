"""A kernel pair wrapper that records every evicted log-distribution by row and evicted history.

The decode-time pair's tests and ``benchmarks/decode_press_drift.py`` compare what a pair
returned after each evicted history with an independent replay of that history (a fresh
press on a fresh twin, one token per forward); :class:`RecordingPair` collects the pair's
side of that comparison while the coupled run drives it.
"""

from __future__ import annotations

import torch

__all__ = ["RecordingPair"]


class RecordingPair:
    """Wraps a :class:`kvdiverge.engine.core.pairs.KernelPair`; records ``log q`` by (row, evicted history).

    The coupled run calls it as it calls the pair (``start``, ``advance``, ``rewind``,
    ``keep_rows``); each call is passed on, and every evicted log-distribution it returns is
    kept under ``(row, history)``: the row's index at :meth:`start` (rows keep it when others
    are dropped) and the tuple of evicted tokens the row holds.

    Parameters
    ----------
    pair : KernelPair
        The pair to drive (``vocab_size`` and ``eos_ids`` are read through).

    Attributes
    ----------
    seen : dict of (int, tuple of int) to torch.Tensor
        ``log q`` (vocab,) after each row's history, cloned.
    """

    def __init__(self, pair):
        self.pair, self.vocab_size, self.eos_ids = pair, pair.vocab_size, pair.eos_ids
        self.seen: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
        self.ids: list[int] = []
        self.hist: list[list[int]] = []

    def _record(self, logq: torch.Tensor) -> None:
        for i, g in enumerate(self.ids):
            self.seen[(g, tuple(self.hist[i]))] = logq[i].clone()

    def start(self, n: int):
        """The pair's ``start(n)``; rows ``0..n-1`` with empty histories."""
        self.ids, self.hist = list(range(n)), [[] for _ in range(n)]
        logp, logq = self.pair.start(n)
        self._record(logq)
        return logp, logq

    def advance(self, x: torch.Tensor, y: torch.Tensor):
        """The pair's ``advance(x, y)``; ``y`` appended to each row's evicted history."""
        for i, tok in enumerate(y.tolist()):
            self.hist[i].append(tok)
        logp, logq = self.pair.advance(x, y)
        self._record(logq)
        return logp, logq

    def rewind(self, length: torch.Tensor) -> None:
        """The pair's ``rewind(length)``; each row's history cut to its first ``length[r]`` tokens."""
        for i, n in enumerate(length.tolist()):
            del self.hist[i][n:]
        self.pair.rewind(length)

    def keep_rows(self, rows: torch.Tensor) -> None:
        """The pair's ``keep_rows(rows)``; the rows' indices and histories follow."""
        self.ids = [self.ids[i] for i in rows.tolist()]
        self.hist = [self.hist[i] for i in rows.tolist()]
        self.pair.keep_rows(rows)
