"""The per-row state of one batched coupled run: every row's chain, branch and uniforms as tensors.

Row ``g = d*R + r`` of a :class:`BatchState` is replicate ``r`` of the batch's document ``d``;
:meth:`BatchState.new` starts every row on its agreement chain with its uniforms drawn
(:func:`kvdiverge.engine.core.streams.uniform_streams`), and :meth:`BatchState.to` moves it to the
pair's device and coupling dtype. :func:`kvdiverge.engine.core.coupled.run_batch` advances it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch

from kvdiverge.engine.core.streams import PURPOSES, uniform_streams

__all__ = ["BatchState"]


@dataclass(eq=False)
class BatchState:
    """Per-row state of one batched coupled run (:func:`kvdiverge.engine.core.coupled.run_batch`).

    Row ``g = d*R + r`` is replicate ``r`` of document ``doc_ids[d]``; ``N = B*R`` rows.
    Every tensor lives on the pair's device; float tensors are in the coupling dtype
    (:func:`kvdiverge.engine.core.coupling.coupling_dtype`), index tensors int64.

    Attributes
    ----------
    T, R : int
        Horizon (steps) and replicates per document.
    model : str
        Model name (enters the seeds; named in errors).
    doc_ids : tuple of str
        The ``B`` documents.
    uniforms : dict of str to torch.Tensor
        ``(N, T)`` uniforms per purpose of :data:`kvdiverge.engine.core.streams.PURPOSES`.
    eos : torch.Tensor
        End-of-sequence ids, int64.
    act : torch.Tensor
        ``(n,)`` the rows the pair holds now, in its row order.
    phase : torch.Tensor
        ``(N,)`` 0 on the agreement chain, 1 on the residual branch, 2 done.
    hist : torch.Tensor
        ``(N,)`` length of each row's history in the pair (tokens).
    t_star, kk, lags : torch.Tensor
        ``(N,)`` branch start ``t*`` (0: no branch), lags done so far, lags ``T - t*``.
    tv, survival, chain : torch.Tensor
        ``(N, T)`` ``tv_t``, ``S_t`` and the chain token ``h_t`` (-1: not drawn).
    residuals : tuple of torch.Tensor
        ``(N, T)`` each: the divergent pair ``(X_t, Y_t)`` drawn at every chain step with ``tv_t > 0``.
    tau_naive : torch.Tensor
        ``(N,)`` ``tau_naive`` (``T + 1`` stands for infinity).
    S : torch.Tensor
        ``(N,)`` running survival ``S_t``.
    x_star, y_star : torch.Tensor
        ``(N,)`` the divergent pair the branch starts with (-1: no branch).
    bx, by, btv : torch.Tensor
        ``(N, T)`` branch tokens of both sides and ``branch_tv`` per lag.
    last_x, last_y : torch.Tensor
        ``(N,)`` last token of each side's history (-1: empty).
    """

    T: int
    R: int
    model: str
    doc_ids: tuple[str, ...]
    uniforms: dict[str, torch.Tensor]
    eos: torch.Tensor
    act: torch.Tensor
    phase: torch.Tensor
    hist: torch.Tensor
    t_star: torch.Tensor
    kk: torch.Tensor
    lags: torch.Tensor
    tv: torch.Tensor
    survival: torch.Tensor
    chain: torch.Tensor
    residuals: tuple[torch.Tensor, torch.Tensor]
    tau_naive: torch.Tensor
    S: torch.Tensor
    x_star: torch.Tensor
    y_star: torch.Tensor
    bx: torch.Tensor
    by: torch.Tensor
    btv: torch.Tensor
    last_x: torch.Tensor
    last_y: torch.Tensor

    @classmethod
    def new(cls, T: int, R: int, seed: int, model: str, doc_ids: Sequence[str], eos: Sequence[int]) -> "BatchState":
        """Every row at the start of its chain, with its uniforms drawn; on the CPU, float64."""
        N = len(doc_ids) * R
        streams = [uniform_streams(seed, model, doc_ids[g // R], g % R, T) for g in range(N)]
        uniforms = {k: torch.from_numpy(np.stack([s[k] for s in streams])) for k in PURPOSES}

        def full(shape, value, dt=torch.long):
            return torch.full(shape, value, dtype=dt)

        f64 = torch.float64
        return cls(
            T=T,
            R=R,
            model=model,
            doc_ids=tuple(doc_ids),
            uniforms=uniforms,
            eos=torch.tensor(tuple(eos), dtype=torch.long),
            act=torch.arange(N),
            phase=full((N,), 0),
            hist=full((N,), 0),
            t_star=full((N,), 0),
            kk=full((N,), 0),
            lags=full((N,), 0),
            tv=full((N, T), float("nan"), f64),
            survival=full((N, T), 0.0, f64),
            chain=full((N, T), -1),
            residuals=(full((N, T), -1), full((N, T), -1)),
            tau_naive=full((N,), T + 1),
            S=full((N,), 1.0, f64),
            x_star=full((N,), -1),
            y_star=full((N,), -1),
            bx=full((N, T), -1),
            by=full((N, T), -1),
            btv=full((N, T), float("nan"), f64),
            last_x=full((N,), -1),
            last_y=full((N,), -1),
        )

    def to(self, device: torch.device, dtype: torch.dtype) -> "BatchState":
        """The state on ``device``, its float tensors in ``dtype`` (index tensors stay int64)."""

        def move(x):
            if isinstance(x, torch.Tensor):
                return x.to(device, dtype) if x.is_floating_point() else x.to(device)
            if isinstance(x, dict):
                return {k: move(v) for k, v in x.items()}
            if isinstance(x, tuple):
                return tuple(move(v) for v in x)
            return x

        return BatchState(**{f.name: move(getattr(self, f.name)) for f in fields(self)})
