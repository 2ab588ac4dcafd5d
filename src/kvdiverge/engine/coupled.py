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
from typing import Any

import numpy as np
import polars as pl
import torch
from tqdm.auto import tqdm

from kvdiverge.engine.coupling import (
    coupling_dtype,
    inverse_cdf,
    maximal_coupling,
    overlap_draw,
    probabilities,
    residual_draws,
    total_variation,
)
from kvdiverge.engine.errors import NonFiniteLogitsError
from kvdiverge.engine.pairs import KernelPair
from kvdiverge.engine.streams import PURPOSES, uniform_streams
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
        :data:`TRAJECTORY_SCHEMA` (without ``model``, ``policy``, ``split``,
        ``doc_id``, ``prompt_len``, ``kept_len``, ``seconds``).
    """
    return run_batch(pair, T, replicates, seed, model, [doc_id], progress=progress)


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

    Each row runs its own state machine: agreement chain (steps ``t = 1..T``), then its
    residual branch (lags ``k = 1..T-t*``). A chain is done at ``T``, when it stops
    (``tv_t = 1``), or when it emits EOS (the rest of the chain is then known: ``tv = 0``,
    EOS, constant survival); its ``t*`` is then drawn and its branch starts at once, by
    rewinding that row alone, while other rows go on with their chains. A branch is done
    at its horizon or when both sides have emitted EOS. Done rows leave the pair
    (``pair.keep_rows``; pairs without it carry them along unused), so later steps run
    on fewer rows. All coupling math runs on the pair's device, in the dtype of its
    log-distributions (float64; float32 on mps); per step only control flags go to the
    host, and the outputs are copied to the CPU once at the end.

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
        trajectory columns of :data:`TRAJECTORY_SCHEMA` (without ``model``, ``policy``,
        ``split``, ``doc_id``, ``prompt_len``, ``kept_len``, ``seconds``).

    Raises
    ------
    kvdiverge.engine.errors.NonFiniteLogitsError
        When the pair's model returns NaN/±inf logits; the message names the model,
        document, replicate, 1-based step and side.
    """
    R, B, T = int(replicates), len(doc_ids), int(T)
    N = B * R
    eos = tuple(pair.eos_ids)

    def checked(call, *args):
        """``call(*args)``, with a NonFiniteLogitsError completed by model, document, replicate, step."""
        try:
            return call(*args)
        except NonFiniteLogitsError as err:
            if err.doc_id is not None:
                raise
            g = int(act[err.rows[0]])
            in_branch = bool(phase[g] == 1)
            # the logits are for the step after the row's history (+ the token being appended)
            step = int(t_star[g] + kk[g] + 1) if in_branch else int(hist[g]) + (1 if call == pair.start else 2)
            raise NonFiniteLogitsError(err.side, err.rows, err.kind, model=model, doc_id=doc_ids[g // R],
                                       replicate=g % R, step=step,
                                       phase="residual branch" if in_branch else "agreement chain") from None

    act = torch.arange(N)
    phase = torch.zeros(N, dtype=torch.long)
    hist = torch.zeros(N, dtype=torch.long)
    t_star = torch.zeros(N, dtype=torch.long)
    kk = torch.zeros(N, dtype=torch.long)
    logp, logq = checked(pair.start, N)
    dev, fdt = logp.device, coupling_dtype(logp.device)
    streams = [uniform_streams(seed, model, doc_ids[g // R], g % R, T) for g in range(N)]
    U = {k: torch.from_numpy(np.stack([s[k] for s in streams])).to(dev, fdt) for k in PURPOSES}  # (N, T)
    eos_t = torch.tensor(eos, dtype=torch.long, device=dev)
    act, phase, hist, t_star, kk = (a.to(dev) for a in (act, phase, hist, t_star, kk))

    def full(shape, value, dtype):
        return torch.full(shape, value, dtype=dtype, device=dev)

    tv = full((N, T), float("nan"), fdt)
    survival = full((N, T), 0.0, fdt)
    chain, res_x, res_y = (full((N, T), -1, torch.long) for _ in range(3))
    tau_naive = full((N,), T + 1, torch.long)  # T + 1 stands for inf
    S = full((N,), 1.0, fdt)
    x_star, y_star = full((N,), -1, torch.long), full((N,), -1, torch.long)
    lags = full((N,), 0, torch.long)
    bx, by = full((N, T), -1, torch.long), full((N, T), -1, torch.long)
    btv = full((N, T), float("nan"), fdt)
    last_x, last_y = full((N,), -1, torch.long), full((N,), -1, torch.long)
    can_drop = hasattr(pair, "keep_rows")

    for t in range(2 * T):
        n = act.numel()
        ph = phase[act]
        logp = _absorb_eos(logp, last_x[act], eos_t)
        logq = _absorb_eos(logq, last_y[act], eos_t)
        p, q = probabilities(logp), probabilities(logq)
        diff, low = p - q, torch.minimum(p, q)  # computed once, shared by TV and the draws
        tv_all = total_variation(p, q, diff, low)
        x_in, y_in = last_x[act].clamp(min=0), last_y[act].clamp(min=0)  # rows that ride along
        go_on = torch.zeros(n, dtype=torch.bool, device=dev)
        rewind_to = None

        # ---- chain rows: step t (0-based) of the agreement chain ------------------------
        ic = (ph == 0).nonzero().squeeze(1)
        if ic.numel():
            gc = act[ic]
            pc, qc, tvc = _rows(p, ic), _rows(q, ic), tv_all[ic]
            tv[gc, t] = tvc
            S[gc] = S[gc] * (1.0 - tvc)
            survival[gc, t] = S[gc]
            newly = (tau_naive[gc] > T) & (U["divergence"][gc, t] < tvc)
            tau_naive[gc[newly]] = t + 1
            split = (tvc > 0).nonzero().squeeze(1)
            if split.numel():
                gs = gc[split]
                res_x[gs, t], res_y[gs, t] = residual_draws(
                    _rows(pc, split), _rows(qc, split), U["residual_x"][gs, t], U["residual_y"][gs, t],
                    diff=_rows(_rows(diff, ic), split))
            go = tvc < 1
            ig = go.nonzero().squeeze(1)
            if ig.numel():
                chain[gc[ig], t] = overlap_draw(_rows(pc, ig), _rows(qc, ig), U["chain"][gc[ig], t],
                                                low=_rows(_rows(low, ic), ig))
            tok = chain[gc, t]
            at_eos = go & torch.isin(tok, eos_t)
            done = ~go | at_eos | (t == T - 1)
            if t < T - 1 and bool(at_eos.any()):  # EOS is absorbing: the rest of the chain is known
                ge = gc[at_eos]
                tv[ge, t + 1:] = 0.0
                chain[ge, t + 1:] = tok[at_eos].unsqueeze(1)
                survival[ge, t + 1:] = S[ge].unsqueeze(1)
            cont = ic[~done]
            x_in[cont] = y_in[cont] = tok[~done]
            go_on[cont] = True
            last_x[gc[~done]] = last_y[gc[~done]] = tok[~done]
            if bool(done.any()):
                i_f, gf = ic[done], gc[done]
                S_T = survival[gf, T - 1]
                ts = torch.where(tau_naive[gf] <= T, tau_naive[gf], torch.zeros_like(gf))
                draw = ((tau_naive[gf] > T) & (S_T < 1)).nonzero().squeeze(1)
                if draw.numel():
                    gd = gf[draw]
                    S_prev = torch.cat([torch.ones(gd.numel(), 1, dtype=fdt, device=dev), survival[gd, :-1]], dim=1)
                    f_hat = (S_prev - survival[gd]).clamp(min=0.0)
                    ts[draw] = inverse_cdf(f_hat, U["t_star"][gd, 0]) + 1
                t_star[gf] = ts
                hb = ts > 0
                idx = (ts - 1).clamp(min=0)
                x_star[gf] = torch.where(hb, res_x[gf, idx], x_star[gf])
                y_star[gf] = torch.where(hb, res_y[gf, idx], y_star[gf])
                lags[gf] = torch.where(hb, T - ts, torch.zeros_like(ts))
                starts = hb & (lags[gf] > 0)
                if bool(starts.any()):
                    i_s, g_s = i_f[starts], gf[starts]
                    phase[g_s] = 1
                    kk[g_s] = 0
                    x_in[i_s], y_in[i_s] = x_star[g_s], y_star[g_s]
                    last_x[g_s], last_y[g_s] = x_star[g_s], y_star[g_s]
                    go_on[i_s] = True
                    rewind_to = hist[act].clone()
                    rewind_to[i_s] = ts[starts] - 1
                phase[gf[~starts]] = 2

        # ---- branch rows: lag kk (0-based) of the residual branch -----------------------
        ib = (ph == 1).nonzero().squeeze(1)
        if ib.numel():
            gb = act[ib]
            k = kk[gb]
            x, y, b = maximal_coupling(
                _rows(p, ib), _rows(q, ib), U["coin"][gb, k], U["overlap"][gb, k],
                U["branch_x"][gb, k], U["branch_y"][gb, k], tv=tv_all[ib], diff=_rows(diff, ib), low=_rows(low, ib))
            bx[gb, k], by[gb, k], btv[gb, k] = x, y, b
            kk[gb] = k + 1
            done = k + 1 >= lags[gb]
            absorbed = ~done & torch.isin(x, eos_t) & torch.isin(y, eos_t)
            if bool(absorbed.any()):  # both sides at EOS: the rest of the branch is known
                for g, xa, ya in zip(gb[absorbed].tolist(), x[absorbed].tolist(), y[absorbed].tolist()):
                    k0, end = int(kk[g]), int(lags[g])
                    bx[g, k0:end], by[g, k0:end] = xa, ya
                    btv[g, k0:end] = 0.0 if xa == ya else 1.0
                done = done | absorbed
            cont = ib[~done]
            x_in[cont], y_in[cont] = x[~done], y[~done]
            last_x[gb], last_y[gb] = x, y
            go_on[cont] = True
            phase[gb[done]] = 2

        if progress is not None:
            progress.update(B)
        if not bool(go_on.any()):
            break
        if can_drop and not bool(go_on.all()):
            keep = go_on.nonzero().squeeze(1)
            pair.keep_rows(keep)
            act, x_in, y_in = act[keep], x_in[keep], y_in[keep]
            rewind_to = None if rewind_to is None else rewind_to[keep]
        if rewind_to is not None:
            pair.rewind(rewind_to)
            hist[act] = rewind_to
        logp, logq = checked(pair.advance, x_in, y_in)
        hist[act] += 1

    # ---- outputs: one copy to the CPU ------------------------------------------------
    cpu = {name: a.cpu() for name, a in dict(
        tv=tv, survival=survival, chain=chain, tau_naive=tau_naive, t_star=t_star, x_star=x_star,
        y_star=y_star, lags=lags, bx=bx, by=by, btv=btv).items()}
    out = []
    for g in range(N):
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


def to_frame(records: Sequence[dict[str, Any]]) -> pl.DataFrame:
    """Trajectory records as a polars table with :data:`TRAJECTORY_SCHEMA`."""
    return pl.DataFrame(list(records), schema=TRAJECTORY_SCHEMA)


def simulate(pair: KernelPair, T: int, replicates: int, seed: int, doc_id: str = "synthetic") -> pl.DataFrame:
    """Run the engine on any kernel pair and return rows in the shard schema.

    ``model``, ``policy`` and ``split`` are ``"synthetic"``; ``prompt_len`` and
    ``kept_len`` are 0.

    Parameters
    ----------
    pair : KernelPair
        E.g. a :class:`kvdiverge.engine.pairs.TableKernelPair`.
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
        ``replicates`` rows, :data:`TRAJECTORY_SCHEMA`.
    """
    start = time.perf_counter()
    records = run_document(pair, T, replicates, seed, "synthetic", doc_id)
    seconds = time.perf_counter() - start
    meta = {"model": "synthetic", "policy": "synthetic", "split": "synthetic", "doc_id": doc_id,
            "prompt_len": 0, "kept_len": 0, "seconds": seconds}
    return to_frame([{**meta, **rec} for rec in records])
