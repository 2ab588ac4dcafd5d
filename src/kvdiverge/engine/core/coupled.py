"""The trajectory engine: agreement chain, naive divergence time and one residual
branch per replicate (estimators.md §2 and §5), over any kernel pair.

For one document the ``R`` replicates advance together as the rows of one kernel
pair (one prompt cache, expanded). Per replicate:

1. **Agreement chain.** ``h_t ~ overlap_t`` on the shared prefix, recording
   ``tv_t`` and ``S_t = prod_{s<=t} (1 - tv_s)``; the chain stops when ``tv_t = 1``.
   At every chain step the divergent pair ``(X_t, Y_t)`` is also drawn from the
   two residuals, so the branch can later start at any step without recomputing.
2. **Naive divergence time** ``tau_naive = min{t : U_t < tv_t}``.
3. **Branch start** ``t* = tau_naive`` if ``tau_naive <= T``, otherwise drawn from
   ``f_hat_t / (1 - S_T)`` (no branch when ``S_T = 1``).
4. **Residual branch.** Both histories are rewound to ``h_<t*``, the divergent pair
   is appended, and the stepwise maximal coupling continues to ``T``, recording
   ``branch_tv_k`` and ``branch_mismatch_k`` per lag ``k = 1..T-t*``.

Randomness: every uniform comes from a generator derived from (master seed, model,
document id, replicate, purpose) — not the policy — and tokens are drawn by inverse
CDF, so policies compared on one document share random numbers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import polars as pl
import torch
from tqdm.auto import tqdm

from kvdiverge.engine.core.batch_state import BatchState
from kvdiverge.engine.core.coupling import (
    coupling_dtype,
    inverse_cdf,
    maximal_coupling,
    overlap_draw,
    probabilities,
    residual_draws,
    total_variation,
)
from kvdiverge.engine.core.errors import NonFiniteLogitsError
from kvdiverge.engine.core.pairs import KernelPair
from kvdiverge.estimation.schema import TRAJECTORY_SCHEMA

__all__ = ["run_document", "run_batch", "simulate", "to_frame"]

log = logging.getLogger(__name__)


def _absorb_eos(logd: torch.Tensor, last: torch.Tensor, eos_ids: torch.Tensor) -> torch.Tensor:
    """Point mass on EOS for rows whose history ends in an EOS id (estimators.md §1).

    ``last`` (int64, (rows,)) is each row's last token (-1 for an empty history);
    ``eos_ids`` an int64 tensor on ``logd``'s device.
    """
    if not eos_ids.numel():
        return logd
    done = torch.isin(last, eos_ids)
    if not bool(done.any()):
        return logd
    logd = logd.clone()
    logd[done] = float("-inf")
    logd[done, last[done]] = 0.0
    return logd


def _rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x[idx]``, without a copy when ``idx`` is every row in order."""
    return x if idx.numel() == x.shape[0] else x[idx]


def run_document(
    pair: KernelPair,
    T: int,
    replicates: int,
    seed: int,
    model: str,
    doc_id: str,
    progress: tqdm | None = None,
) -> list[dict[str, Any]]:
    """Run ``replicates`` coupled replicates of one document on a kernel pair.

    :func:`run_batch` with one document.

    Parameters
    ----------
    pair : KernelPair
        The kernel pair (LLM or synthetic); its rows are the replicates.
    T : int
        Horizon, ``max_new_tokens`` (tokens = steps).
    replicates : int
        Number of replicates ``R``.
    seed : int
        Master seed.
    model, doc_id : str
        Enter the seeds of the uniform streams (the policy does not).
    progress : tqdm or None
        Progress bar advanced by one per decoding step.

    Returns
    -------
    list[dict]
        One record per replicate with the trajectory columns of
        :data:`~kvdiverge.estimation.schema.TRAJECTORY_SCHEMA` (without ``model``, ``policy``, ``split``,
        ``doc_id``, ``prompt_len``, ``kept_len``, ``seconds``).
    """
    return run_batch(pair, T, replicates, seed, model, [doc_id], progress=progress)


@dataclass(eq=False)
class _Step:
    """One decoding step over the pair's current rows (index ``i`` into ``state.act``).

    ``p``, ``q``, ``diff = p - q``, ``low = min(p, q)`` (n, V) and ``tv`` (n,) are shared by
    the chain and branch math; ``chain_rows`` / ``branch_rows`` index the rows in each
    phase at the start of the step; ``x_in``, ``y_in`` (n,) are the tokens to append,
    ``go_on`` (n,) the rows that continue, ``rewind_to`` (n,) the history lengths to
    rewind to when a branch starts this step (None otherwise).
    """

    p: torch.Tensor
    q: torch.Tensor
    diff: torch.Tensor
    low: torch.Tensor
    tv: torch.Tensor
    chain_rows: torch.Tensor
    branch_rows: torch.Tensor
    x_in: torch.Tensor
    y_in: torch.Tensor
    go_on: torch.Tensor
    rewind_to: torch.Tensor | None = None


def _step(state: BatchState, logp: torch.Tensor, logq: torch.Tensor) -> _Step:
    """The coupling quantities of one step, with EOS made absorbing on each side."""
    act = state.act
    logp = _absorb_eos(logp, state.last_x[act], state.eos)
    logq = _absorb_eos(logq, state.last_y[act], state.eos)
    p, q = probabilities(logp), probabilities(logq)
    diff, low = p - q, torch.minimum(p, q)  # computed once, shared by TV and the draws
    ph = state.phase[act]
    tokens = torch.zeros_like(act)  # every row that goes on gets its token; the others leave
    return _Step(
        p=p,
        q=q,
        diff=diff,
        low=low,
        tv=total_variation(p, q, diff, low),
        chain_rows=(ph == 0).nonzero().squeeze(1),
        branch_rows=(ph == 1).nonzero().squeeze(1),
        x_in=tokens,
        y_in=tokens.clone(),
        go_on=torch.zeros_like(act, dtype=torch.bool),
    )


def _chain_step(state: BatchState, step: _Step, t: int) -> None:
    """Step ``t`` (0-based) of the agreement chain on its rows: ``tv_t``, ``S_t``, ``tau_naive``,
    the divergent pair and the chain token; rows done with their chain start their branch."""
    ic = step.chain_rows
    gc = state.act[ic]
    pc, qc, tvc = _rows(step.p, ic), _rows(step.q, ic), step.tv[ic]
    U, T = state.uniforms, state.T
    state.tv[gc, t] = tvc
    state.S[gc] = state.S[gc] * (1.0 - tvc)
    state.survival[gc, t] = state.S[gc]
    newly = (state.tau_naive[gc] > T) & (U["divergence"][gc, t] < tvc)
    state.tau_naive[gc[newly]] = t + 1
    split = (tvc > 0).nonzero().squeeze(1)
    if split.numel():
        gs = gc[split]
        res_x, res_y = state.residuals
        res_x[gs, t], res_y[gs, t] = residual_draws(
            _rows(pc, split),
            _rows(qc, split),
            U["residual_x"][gs, t],
            U["residual_y"][gs, t],
            diff=_rows(_rows(step.diff, ic), split),
        )
    go = tvc < 1
    ig = go.nonzero().squeeze(1)
    if ig.numel():
        state.chain[gc[ig], t] = overlap_draw(
            _rows(pc, ig), _rows(qc, ig), U["chain"][gc[ig], t], low=_rows(_rows(step.low, ic), ig)
        )
    tok = state.chain[gc, t]
    at_eos = go & torch.isin(tok, state.eos)
    done = ~go | at_eos | (t == T - 1)
    if t < T - 1 and bool(at_eos.any()):  # EOS is absorbing: the rest of the chain is known
        ge = gc[at_eos]
        state.tv[ge, t + 1 :] = 0.0
        state.chain[ge, t + 1 :] = tok[at_eos].unsqueeze(1)
        state.survival[ge, t + 1 :] = state.S[ge].unsqueeze(1)
    cont = ic[~done]
    step.x_in[cont] = step.y_in[cont] = tok[~done]
    step.go_on[cont] = True
    state.last_x[gc[~done]] = state.last_y[gc[~done]] = tok[~done]
    if bool(done.any()):
        _branch_start(state, step, ic[done], gc[done])


def _draw_t_star(state: BatchState, rows: torch.Tensor) -> torch.Tensor:
    """``t*`` of finished chains ``rows`` (global ids): ``tau_naive`` when finite, else drawn
    from ``f_hat_t / (1 - S_T)`` (estimators.md §2); 0 when there is no branch (``S_T = 1``)."""
    T, tau = state.T, state.tau_naive[rows]
    S_T = state.survival[rows, T - 1]
    ts = torch.where(tau <= T, tau, torch.zeros_like(rows))
    draw = ((tau > T) & (S_T < 1)).nonzero().squeeze(1)
    if draw.numel():
        gd = rows[draw]
        surv = state.survival[gd]
        S_prev = torch.cat([torch.ones(gd.numel(), 1, dtype=surv.dtype, device=surv.device), surv[:, :-1]], dim=1)
        f_hat = (S_prev - surv).clamp(min=0.0)
        ts[draw] = inverse_cdf(f_hat, state.uniforms["t_star"][gd, 0]) + 1
    return ts


def _branch_start(state: BatchState, step: _Step, i_f: torch.Tensor, gf: torch.Tensor) -> None:
    """Finished chains (pair rows ``i_f``, global ids ``gf``) get ``t*`` and their divergent
    pair; those with lags left are rewound to ``h_<t*`` and append ``(x*, y*)`` next."""
    ts = _draw_t_star(state, gf)
    state.t_star[gf] = ts
    hb = ts > 0
    idx = (ts - 1).clamp(min=0)
    res_x, res_y = state.residuals
    state.x_star[gf] = torch.where(hb, res_x[gf, idx], state.x_star[gf])
    state.y_star[gf] = torch.where(hb, res_y[gf, idx], state.y_star[gf])
    state.lags[gf] = torch.where(hb, state.T - ts, torch.zeros_like(ts))
    starts = hb & (state.lags[gf] > 0)
    if bool(starts.any()):
        i_s, g_s = i_f[starts], gf[starts]
        state.phase[g_s] = 1
        state.kk[g_s] = 0
        step.x_in[i_s], step.y_in[i_s] = state.x_star[g_s], state.y_star[g_s]
        state.last_x[g_s], state.last_y[g_s] = state.x_star[g_s], state.y_star[g_s]
        step.go_on[i_s] = True
        step.rewind_to = state.hist[state.act].clone()
        step.rewind_to[i_s] = ts[starts] - 1
    state.phase[gf[~starts]] = 2


def _branch_step(state: BatchState, step: _Step) -> None:
    """Lag ``kk`` (0-based) of the residual branch on its rows: one maximal-coupling draw;
    a branch is done at its last lag or once both sides are at EOS (the rest is then known)."""
    ib = step.branch_rows
    gb = state.act[ib]
    k = state.kk[gb]
    U = state.uniforms
    x, y, b = maximal_coupling(
        _rows(step.p, ib),
        _rows(step.q, ib),
        U["coin"][gb, k],
        U["overlap"][gb, k],
        U["branch_x"][gb, k],
        U["branch_y"][gb, k],
        tv=step.tv[ib],
        diff=_rows(step.diff, ib),
        low=_rows(step.low, ib),
    )
    state.bx[gb, k], state.by[gb, k], state.btv[gb, k] = x, y, b
    state.kk[gb] = k + 1
    done = k + 1 >= state.lags[gb]
    absorbed = ~done & torch.isin(x, state.eos) & torch.isin(y, state.eos)
    if bool(absorbed.any()):  # both sides at EOS: the rest of the branch is known
        for g, xa, ya in zip(gb[absorbed].tolist(), x[absorbed].tolist(), y[absorbed].tolist()):
            k0, end = int(state.kk[g]), int(state.lags[g])
            state.bx[g, k0:end], state.by[g, k0:end] = xa, ya
            state.btv[g, k0:end] = 0.0 if xa == ya else 1.0
        done = done | absorbed
    cont = ib[~done]
    step.x_in[cont], step.y_in[cont] = x[~done], y[~done]
    state.last_x[gb], state.last_y[gb] = x, y
    step.go_on[cont] = True
    state.phase[gb[done]] = 2


def _compact(pair: KernelPair, state: BatchState, step: _Step) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop the rows that are done (``pair.keep_rows``), rewind the rows whose branch starts;
    return the tokens the remaining rows append next."""
    x_in, y_in, rewind_to = step.x_in, step.y_in, step.rewind_to
    if not bool(step.go_on.all()):
        keep = step.go_on.nonzero().squeeze(1)
        pair.keep_rows(keep)
        state.act, x_in, y_in = state.act[keep], x_in[keep], y_in[keep]
        rewind_to = None if rewind_to is None else rewind_to[keep]
    if rewind_to is not None:
        pair.rewind(rewind_to)
        state.hist[state.act] = rewind_to
    return x_in, y_in


def _checked(state: BatchState, call, *args, starting: bool = False):
    """``call(*args)`` (the pair's ``start`` or ``advance``), with a :class:`NonFiniteLogitsError`
    completed by the model, document, replicate and 1-based step of its first bad row."""
    try:
        return call(*args)
    except NonFiniteLogitsError as err:
        if err.doc_id is not None:
            raise
        g = int(state.act[err.rows[0]])
        in_branch = bool(state.phase[g] == 1)
        # the logits are for the step after the row's history (+ the token being appended)
        step = int(state.t_star[g] + state.kk[g] + 1) if in_branch else int(state.hist[g]) + (1 if starting else 2)
        raise NonFiniteLogitsError(
            err.side,
            err.rows,
            err.kind,
            model=state.model,
            doc_id=state.doc_ids[g // state.R],
            replicate=g % state.R,
            step=step,
            phase="residual branch" if in_branch else "agreement chain",
        ) from None


def _records(state: BatchState) -> list[dict[str, Any]]:
    """One record per row, document-major; the outputs are copied to the CPU once."""
    cpu = {
        name: getattr(state, name).cpu()
        for name in ("tv", "survival", "chain", "tau_naive", "t_star", "x_star", "y_star", "lags", "bx", "by", "btv")
    }
    T, R = state.T, state.R
    out = []
    for g in range(cpu["lags"].shape[0]):
        L = int(cpu["lags"][g])
        has_branch = int(cpu["t_star"][g]) > 0
        xs, ys = cpu["bx"][g, :L].tolist(), cpu["by"][g, :L].tolist()
        out.append(
            {
                "replicate": g % R,
                "T": T,
                "chain_token": cpu["chain"][g].tolist(),
                "tv": cpu["tv"][g].tolist(),
                "survival": cpu["survival"][g].tolist(),
                "tau_naive": int(cpu["tau_naive"][g]) if cpu["tau_naive"][g] <= T else None,
                "t_star": int(cpu["t_star"][g]) if has_branch else None,
                "x_star": int(cpu["x_star"][g]) if has_branch else None,
                "y_star": int(cpu["y_star"][g]) if has_branch else None,
                "branch_x": xs,
                "branch_y": ys,
                "branch_tv": cpu["btv"][g, :L].tolist(),
                "branch_mismatch": [int(a != b) for a, b in zip(xs, ys)],
            }
        )
    return out


def run_batch(
    pair: KernelPair,
    T: int,
    replicates: int,
    seed: int,
    model: str,
    doc_ids: Sequence[str],
    progress: tqdm | None = None,
) -> list[dict[str, Any]]:
    """Run ``replicates`` coupled replicates of each of ``B`` documents as the rows of one pair.

    Row ``d*R + r`` of ``pair`` is replicate ``r`` of document ``doc_ids[d]``; its
    uniforms are those of ``uniform_streams(seed, model, doc_ids[d], r, T)``, so a row's
    draws do not depend on the batch it sits in.

    Each row runs its own state machine (:class:`~kvdiverge.engine.core.batch_state.BatchState`): agreement chain (steps
    ``t = 1..T``), then its residual branch (lags ``k = 1..T-t*``). A chain is done at
    ``T``, when it stops (``tv_t = 1``), or when it emits EOS (the rest of the chain is
    then known: ``tv = 0``, EOS, constant survival); its ``t*`` is then drawn and its
    branch starts at once, by rewinding that row alone, while other rows go on with their
    chains. A branch is done at its horizon or when both sides have emitted EOS. Done rows
    leave the pair (``pair.keep_rows``), so later steps run on fewer rows. All coupling
    math runs on the pair's device, in the dtype of its log-distributions (float64;
    float32 on mps); per step only control flags go to the host, and the outputs are
    copied to the CPU once at the end.

    Parameters
    ----------
    pair : KernelPair
        The kernel pair, with ``B * replicates`` rows after ``start``.
    T : int
        Horizon, ``max_new_tokens`` (tokens = steps).
    replicates : int
        Replicates ``R`` per document.
    seed : int
        Master seed.
    model : str
        Enters the seeds (with the document id and replicate; never the policy).
    doc_ids : sequence of str
        The ``B`` documents' ids, in the pair's document order.
    progress : tqdm or None
        Advanced by ``B`` per batched decoding step.

    Returns
    -------
    list[dict]
        One record per (document, replicate), document-major, with ``replicate`` and the
        trajectory columns of :data:`~kvdiverge.estimation.schema.TRAJECTORY_SCHEMA` (without ``model``, ``policy``,
        ``split``, ``doc_id``, ``prompt_len``, ``kept_len``, ``seconds``).

    Raises
    ------
    TypeError
        If ``pair`` lacks a method of :class:`kvdiverge.engine.core.pairs.KernelPair`.
    kvdiverge.engine.core.errors.NonFiniteLogitsError
        When the pair's model returns NaN/±inf logits; the message names the model,
        document, replicate, 1-based step and side.
    """
    missing = [m for m in ("start", "advance", "rewind", "keep_rows") if not callable(getattr(pair, m, None))]
    if missing:
        raise TypeError(
            f"{type(pair).__name__} is not a kernel pair: it lacks {', '.join(missing)} "
            f"(kvdiverge.engine.core.pairs.KernelPair)"
        )
    R, B, T = int(replicates), len(doc_ids), int(T)
    state = BatchState.new(T, R, seed, model, doc_ids, tuple(pair.eos_ids))
    logp, logq = _checked(state, pair.start, B * R, starting=True)
    state = state.to(logp.device, coupling_dtype(logp.device))
    for t in range(2 * T):
        step = _step(state, logp, logq)
        if step.chain_rows.numel():
            _chain_step(state, step, t)
        if step.branch_rows.numel():
            _branch_step(state, step)
        if progress is not None:
            progress.update(B)
        if not bool(step.go_on.any()):
            break
        x_in, y_in = _compact(pair, state, step)
        logp, logq = _checked(state, pair.advance, x_in, y_in)
        state.hist[state.act] += 1
    return _records(state)


def to_frame(records: Sequence[dict[str, Any]]) -> pl.DataFrame:
    """Trajectory records as a polars table with :data:`~kvdiverge.estimation.schema.TRAJECTORY_SCHEMA`."""
    return pl.DataFrame(list(records), schema=TRAJECTORY_SCHEMA)


def simulate(pair: KernelPair, T: int, replicates: int, seed: int, doc_id: str = "synthetic") -> pl.DataFrame:
    """Run the engine on any kernel pair and return rows in the shard schema.

    ``model``, ``policy`` and ``split`` are ``"synthetic"``; ``prompt_len`` and
    ``kept_len`` are 0.

    Parameters
    ----------
    pair : KernelPair
        E.g. a :class:`kvdiverge.engine.core.pairs.TableKernelPair`.
    T : int
        Horizon (steps).
    replicates : int
        Replicates ``R`` (rows advanced together).
    seed : int
        Master seed.
    doc_id : str
        Document id entering the seeds; vary it (or ``seed``) for independent runs.

    Returns
    -------
    polars.DataFrame
        ``replicates`` rows, :data:`~kvdiverge.estimation.schema.TRAJECTORY_SCHEMA`.
    """
    start = time.perf_counter()
    records = run_document(pair, T, replicates, seed, "synthetic", doc_id)
    seconds = time.perf_counter() - start
    meta = {
        "model": "synthetic",
        "policy": "synthetic",
        "split": "synthetic",
        "doc_id": doc_id,
        "prompt_len": 0,
        "kept_len": 0,
        "seconds": seconds,
    }
    return to_frame([{**meta, **rec} for rec in records])
