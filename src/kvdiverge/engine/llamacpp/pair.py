"""The llama.cpp kernel pair and teacher-forced pass: two contexts, full f16 and a compressed cache, fed the same tokens.

:class:`LlamaKernelPair` implements :class:`kvdiverge.engine.core.pairs.KernelPair` for one document:
the prompt is prefilled once into sequence 0 of each context and copied to the ``R`` rows
(``llama_memory_seq_cp``); row ``r`` is sequence ``r``; a step decodes one token per row in one
batch; a rewind removes the row's cells after the kept history (``llama_memory_seq_rm``). The
coupling core (:func:`kvdiverge.engine.core.coupled.run_batch`) runs on it unchanged.
:func:`forced_kld` is the teacher-forced measure: ``KL(P || Q)`` per position of a given continuation.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvdiverge.engine.core.sampling import Sampling
from kvdiverge.engine.llamacpp.caches import LlamaCache, penalty_problem
from kvdiverge.engine.llamacpp.context import LlamaContext, LoadedModel

__all__ = ["FULL", "LlamaKernelPair", "forced_kld", "log_softmax"]

#: The reference side's cache: f16 K and V, llama.cpp's default.
FULL = LlamaCache()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-softmax over the last axis of float32 logits."""
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


class LlamaKernelPair:
    """A kernel pair over two llama.cpp contexts of one model (see the module docstring).

    Parameters
    ----------
    model : LoadedModel
    cache : LlamaCache
        The compressed side's cache (the reference side is :data:`FULL`).
    prompt : sequence of int
        The document's prompt tokens (non-empty).
    T : int
        Horizon: each row holds at most ``T`` own tokens (chain or branch).
    sampling : Sampling
        Its decoding transform turns each side's logits into log-distributions; a repetition
        penalty is refused (:meth:`check`).
    threads : int
        CPU threads per context.
    """

    def __init__(
        self, model: LoadedModel, cache: LlamaCache, prompt: Sequence[int], T: int, sampling: Sampling, threads: int
    ):
        self.model, self.cache, self.prompt, self.T = model, cache, [int(t) for t in prompt], int(T)
        self.sampling, self.threads = sampling, int(threads)
        self.vocab_size = model.n_vocab
        self.eos_ids = tuple(sampling.eos_ids) if sampling.eos_ids is not None else model.eos_ids
        self.sides: tuple[LlamaContext, LlamaContext] | None = None
        self.seqs: list[int] = []
        self.hist: list[int] = []

    @staticmethod
    def check(sampling: Sampling) -> None:
        """Refuse what this pair cannot do, in one sentence.

        Raises
        ------
        ValueError
            A repetition penalty other than 1.
        """
        problem = penalty_problem("repetition_penalty", sampling.decoding.repetition_penalty)
        if problem:
            raise ValueError(problem)

    def _log_probs(self, logits: np.ndarray) -> torch.Tensor:
        return self.sampling.decoding.log_probs(torch.from_numpy(logits), torch.float64)

    def start(self, n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill the prompt into both contexts and copy it to ``n_rows`` sequences."""
        self.check(self.sampling)
        self.close()
        n_ctx = n_rows * (-(-(len(self.prompt) + self.T + 8) // 256) * 256)
        self.sides = tuple(LlamaContext(self.model, c, n_ctx, n_rows, self.threads) for c in (FULL, self.cache))
        out = []
        for side in self.sides:
            logits = side.prefill(self.prompt)
            for s in range(1, n_rows):
                side.copy_sequence(0, s)
            out.append(self._log_probs(np.repeat(logits, n_rows, axis=0)))
        self.seqs, self.hist = list(range(n_rows)), [0] * n_rows
        return out[0], out[1]

    def advance(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``x[r]`` to row ``r``'s reference sequence and ``y[r]`` to its compressed one.

        One decode per row and side, as llama.cpp generates one sequence: on Gemma 3 the CPU path of an f16
        cache gives a token decoded beside other sequences' tokens other logits than one decoded alone (up to
        0.5 nats apart in log-probability), so rows decoded together would depend on the batch."""
        pos = [len(self.prompt) + h for h in self.hist]
        logs = [
            np.concatenate([side.decode([t], [s], [p], [True]) for t, s, p in zip(tokens, self.seqs, pos)])
            for side, tokens in zip(self.sides, (x.tolist(), y.tolist()))
        ]
        self.hist = [h + 1 for h in self.hist]
        return self._log_probs(logs[0]), self._log_probs(logs[1])

    def rewind(self, length: torch.Tensor) -> None:
        """Cut row ``r``'s two sequences back to their first ``length[r]`` own tokens."""
        for row, n in enumerate(length.tolist()):
            if n != self.hist[row]:
                for side in self.sides:
                    side.cut(self.seqs[row], len(self.prompt) + n)
                self.hist[row] = n

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep ``rows`` in that order; the other rows' sequences leave both caches."""
        keep = rows.tolist()
        for row in set(range(len(self.seqs))) - set(keep):
            for side in self.sides:
                side.cut(self.seqs[row], 0)
        self.seqs = [self.seqs[i] for i in keep]
        self.hist = [self.hist[i] for i in keep]

    def close(self) -> None:
        """Free both contexts."""
        for side in self.sides or ():
            side.close()
        self.sides = None


def forced_kld(
    model: LoadedModel, cache: LlamaCache, prompt: Sequence[int], continuation: Sequence[int], threads: int
) -> np.ndarray:
    """Teacher-forced ``KL(P || Q)`` (nats) at each step of ``continuation``, on the raw logits.

    Both contexts read ``prompt + continuation[:-1]`` in one prefill; step ``k`` compares the next-token
    distributions after ``prompt + continuation[:k]``.

    Returns
    -------
    numpy.ndarray
        float64 ``(len(continuation),)``.
    """
    tokens = [int(t) for t in prompt] + [int(t) for t in continuation][:-1]
    n_ctx = -(-(len(tokens) + 8) // 256) * 256
    logs = []
    for c in (FULL, cache):
        ctx = LlamaContext(model, c, n_ctx, 1, threads)
        try:
            logs.append(log_softmax(ctx.prefill(tokens, all_logits=True)[len(prompt) - 1 :]))
        finally:
            ctx.close()
    logp, logq = logs
    return (np.exp(logp) * (logp - logq)).sum(axis=-1)
