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

import hashlib
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import polars as pl
import torch
from tqdm.auto import tqdm

from kvdiverge.coupling import (
    inverse_cdf,
    maximal_coupling,
    overlap_draw,
    probabilities,
    residual_draws,
    total_variation,
)
from kvdiverge.kernels import KernelPair

__all__ = [
    "PURPOSES",
    "TRAJECTORY_SCHEMA",
    "uniform_streams",
    "run_document",
    "simulate",
]

log = logging.getLogger(__name__)

#: Purposes of the uniform streams; the code is part of each generator's seed.
PURPOSES = {
    "chain": 0,        # overlap draw of the agreement chain, per step
    "divergence": 1,   # U_t of tau_naive, per step
    "residual_x": 2,   # divergent pair at each chain step, reference side
    "residual_y": 3,   # divergent pair at each chain step, evicted side
    "t_star": 4,       # t* drawn from f_hat when tau_naive > T (first entry)
    "coin": 5,         # branch: agree (overlap) or split (residuals), per lag
    "overlap": 6,      # branch: overlap draw, per lag
    "branch_x": 7,     # branch: reference residual draw, per lag
    "branch_y": 8,     # branch: evicted residual draw, per lag
}

#: Column types of a trajectory shard (docs/internals.md).
TRAJECTORY_SCHEMA: dict[str, pl.DataType] = {
    "model": pl.String,
    "policy": pl.String,
    "split": pl.String,
    "doc_id": pl.String,
    "replicate": pl.Int32,
    "T": pl.Int32,
    "prompt_len": pl.Int32,
    "kept_len": pl.Int32,
    "chain_token": pl.List(pl.Int32),
    "tv": pl.List(pl.Float64),
    "survival": pl.List(pl.Float64),
    "tau_naive": pl.Int32,
    "t_star": pl.Int32,
    "x_star": pl.Int32,
    "y_star": pl.Int32,
    "branch_x": pl.List(pl.Int32),
    "branch_y": pl.List(pl.Int32),
    "branch_tv": pl.List(pl.Float64),
    "branch_mismatch": pl.List(pl.Int8),
    "seconds": pl.Float64,
}


def _stable_int(text: str) -> int:
    """A 64-bit integer from a string, stable across runs and machines (BLAKE2b)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def uniform_streams(seed: int, model: str, doc_id: str, replicate: int, T: int) -> dict[str, np.ndarray]:
    """All uniforms one replicate uses, by purpose.

    Each purpose has its own generator, seeded by
    ``SeedSequence(seed, spawn_key=(hash(model), hash(doc_id), replicate, purpose))``,
    so a shard reproduces alone, in any order, and the policy does not enter.

    Returns
    -------
    dict[str, numpy.ndarray]
        Purpose name -> uniforms in [0, 1), float64, shape (T,).
    """
    streams = {}
    for purpose, code in PURPOSES.items():
        seq = np.random.SeedSequence(
            entropy=int(seed), spawn_key=(_stable_int(model), _stable_int(doc_id), int(replicate), code)
        )
        streams[purpose] = np.random.default_rng(seq).random(T)
    return streams


def _absorb_eos(logd: torch.Tensor, last: torch.Tensor, eos_ids: tuple[int, ...]) -> torch.Tensor:
    """Point mass on EOS for rows whose history ends in an EOS id (estimators.md §1)."""
    if not eos_ids:
        return logd
    done = torch.isin(last, torch.tensor(eos_ids, dtype=last.dtype))
    if not done.any():
        return logd
    logd = logd.clone()
    logd[done] = float("-inf")
    logd[done, last[done]] = 0.0
    return logd


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
    R = int(replicates)
    streams = [uniform_streams(seed, model, doc_id, r, T) for r in range(R)]
    U = {k: torch.from_numpy(np.stack([s[k] for s in streams])) for k in PURPOSES}  # (R, T) each
    eos = tuple(pair.eos_ids)

    # ---- 1-2. agreement chain, tau_naive, residual pairs at every step -------------
    tv = torch.full((R, T), float("nan"), dtype=torch.float64)
    survival = torch.zeros(R, T, dtype=torch.float64)
    chain = torch.full((R, T), -1, dtype=torch.long)
    res_x = torch.full((R, T), -1, dtype=torch.long)
    res_y = torch.full((R, T), -1, dtype=torch.long)
    tau_naive = torch.full((R,), T + 1, dtype=torch.long)  # T + 1 stands for inf
    alive = torch.ones(R, dtype=torch.bool)
    S = torch.ones(R, dtype=torch.float64)
    last = torch.full((R,), -1, dtype=torch.long)

    logp, logq = pair.start(R)
    for t in range(T):
        logp, logq = _absorb_eos(logp, last, eos), _absorb_eos(logq, last, eos)
        p, q = probabilities(logp), probabilities(logq)
        tv_t = total_variation(p, q)
        rows = alive.nonzero().squeeze(1)
        tv[rows, t] = tv_t[rows]
        S = torch.where(alive, S * (1.0 - tv_t), S)
        survival[:, t] = S
        newly = (tau_naive > T) & alive & (U["divergence"][:, t] < tv_t)
        tau_naive[newly] = t + 1
        split = alive & (tv_t > 0)
        if split.any():
            res_x[split, t], res_y[split, t] = residual_draws(
                p[split], q[split], U["residual_x"][split, t], U["residual_y"][split, t]
            )
        go_on = alive & (tv_t < 1)
        if go_on.any():
            chain[go_on, t] = overlap_draw(p[go_on], q[go_on], U["chain"][go_on, t])
        alive = go_on
        if progress is not None:
            progress.update(1)
        if not alive.any() or t == T - 1:
            break
        token = torch.where(alive, chain[:, t], last.clamp(min=0))
        last = torch.where(alive, chain[:, t], last)
        logp, logq = pair.advance(token, token)
    survival[:, t + 1 :] = 0.0  # the loop only ends early once every chain has stopped

    # ---- 3. branch start t* ---------------------------------------------------------
    S_T = survival[:, -1]
    t_star = torch.where(tau_naive <= T, tau_naive, torch.zeros_like(tau_naive))
    draw = (tau_naive > T) & (S_T < 1)
    if draw.any():
        S_prev = torch.cat([torch.ones(R, 1, dtype=torch.float64), survival[:, :-1]], dim=1)
        f_hat = (S_prev - survival).clamp(min=0.0)
        t_star[draw] = inverse_cdf(f_hat[draw], U["t_star"][draw, 0]) + 1
    has_branch = t_star > 0

    # ---- 4. residual branch ------------------------------------------------------------
    records_branch: list[dict[str, list]] = [
        {"branch_x": [], "branch_y": [], "branch_tv": [], "branch_mismatch": []} for _ in range(R)
    ]
    x_star = torch.full((R,), -1, dtype=torch.long)
    y_star = torch.full((R,), -1, dtype=torch.long)
    if has_branch.any():
        idx = (t_star - 1).clamp(min=0)
        x_star = torch.where(has_branch, res_x.gather(1, idx[:, None]).squeeze(1), x_star)
        y_star = torch.where(has_branch, res_y.gather(1, idx[:, None]).squeeze(1), y_star)
        # Rows without a branch ride along on an arbitrary rewind; their output is dropped.
        pair.rewind(torch.where(has_branch, t_star - 1, torch.zeros_like(t_star)))
        x_last, y_last = x_star.clamp(min=0), y_star.clamp(min=0)
        lags = torch.where(has_branch, T - t_star, torch.zeros_like(t_star))
        if int(lags.max()) > 0:
            logp, logq = pair.advance(x_last, y_last)
        for k in range(int(lags.max())):
            logp, logq = _absorb_eos(logp, x_last, eos), _absorb_eos(logq, y_last, eos)
            x, y, btv = maximal_coupling(
                probabilities(logp), probabilities(logq),
                U["coin"][:, k], U["overlap"][:, k], U["branch_x"][:, k], U["branch_y"][:, k],
            )
            for r in (lags > k).nonzero().squeeze(1).tolist():
                rec = records_branch[r]
                rec["branch_x"].append(int(x[r]))
                rec["branch_y"].append(int(y[r]))
                rec["branch_tv"].append(float(btv[r]))
                rec["branch_mismatch"].append(int(x[r] != y[r]))
            if progress is not None:
                progress.update(1)
            x_last, y_last = x, y
            if k + 1 < int(lags.max()):
                logp, logq = pair.advance(x, y)

    out = []
    for r in range(R):
        out.append(
            {
                "replicate": r,
                "T": T,
                "chain_token": chain[r].tolist(),
                "tv": tv[r].tolist(),
                "survival": survival[r].tolist(),
                "tau_naive": int(tau_naive[r]) if tau_naive[r] <= T else None,
                "t_star": int(t_star[r]) if has_branch[r] else None,
                "x_star": int(x_star[r]) if has_branch[r] else None,
                "y_star": int(y_star[r]) if has_branch[r] else None,
                **records_branch[r],
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
        E.g. a :class:`kvdiverge.kernels.TableKernelPair`.
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


def shard_documents(prompts: pl.DataFrame, config: dict[str, Any], policy: str, split: str,
                    shard: int) -> pl.DataFrame:
    """The prompt rows one shard runs: usable documents of ``split``, by ``doc_id``.

    Documents with an ``exclusion_reason`` are skipped (the prompts table reports
    them). The ``none`` control (config ``runs.control``) runs on the first
    ``runs.control.documents`` usable documents of its split only, unless the same
    policy is also scheduled on that split in full; the noise floor (``runs.floor``)
    likewise on the first ``runs.floor.documents`` when given (all otherwise). Shard
    ``i`` of ``n`` takes every ``n``-th document starting at ``i``.

    Raises
    ------
    ValueError
        If ``shard`` is not in ``[0, shards)``.
    """
    n_shards = int(config["shards"])
    if not 0 <= shard < n_shards:
        raise ValueError(f"shard {shard} out of range: config 'shards' is {n_shards}")
    from kvdiverge.config import control_documents

    docs = prompts.filter((pl.col("split") == split) & pl.col("exclusion_reason").is_null()).sort("doc_id")
    limit = control_documents(config, policy, split)
    if limit is not None:
        docs = docs.head(limit)
    return docs.gather_every(n_shards, offset=shard)


def run_shard(
    config: dict[str, Any],
    model_name: str,
    policy_name: str,
    split: str,
    shard: int,
    prompts_path: str,
    output_path: str,
    model=None,
    model_spec: dict[str, Any] | None = None,
) -> pl.DataFrame:
    """Generate the coupled trajectories of one shard and write them atomically.

    Parameters
    ----------
    config : dict
        Validated workflow config (``seed``, ``models``, ``policies``, ``runs``,
        ``decoding``, ``replicates``, ``shards``).
    model_name, policy_name, split : str
        Keys of ``config['models']`` and ``config['policies']``; ``"exploratory"`` or
        ``"confirmatory"``.
    shard : int
        Shard index in ``[0, config['shards'])``.
    prompts_path : str
        ``results/prompts/{model}.parquet`` (docs/internals.md).
    output_path : str
        Destination ``shard-{i}.parquet``; written only once the shard is complete.
    model : transformers.PreTrainedModel, optional
        Already loaded model (tests, benchmarks); loaded otherwise.
    model_spec : dict, optional
        Model entry to load from (e.g. a converted local directory); defaults to
        ``config['models'][model_name]``.

    Returns
    -------
    polars.DataFrame
        The shard table (:data:`TRAJECTORY_SCHEMA`), one row per (document, replicate).
        The file also records the settings it was made with and the library versions
        (:func:`kvdiverge.provenance.shard_metadata`, parquet key-value metadata).
    """
    from kvdiverge.io import write_parquet_atomic
    from kvdiverge.provenance import shard_metadata, shard_settings
    from kvdiverge.policies import Policy
    from kvdiverge.runner import Document, run_documents

    policy = Policy.from_config(policy_name, config["policies"][policy_name])
    prompts = pl.read_parquet(prompts_path)
    docs = shard_documents(prompts, config, policy_name, split, shard)
    T = int(config["decoding"]["max_new_tokens"])
    R = int(config["replicates"])
    log.info("%s / %s / %s shard %d: %d documents, T=%d, R=%d",
             model_name, policy_name, split, shard, docs.height, T, R)
    if model is None and docs.height:
        from kvdiverge.models import load_model

        model, _ = load_model(model_spec or config["models"][model_name], model_name)
    documents = [Document(row["doc_id"], row["input_ids"]) for row in docs.iter_rows(named=True)]
    with tqdm(total=docs.height * (2 * T - 1), desc=f"{policy_name}/{split}/shard-{shard}",
              unit="step", mininterval=5.0) as bar:
        recs = run_documents(
            model, documents, policy, T=T, replicates=R,
            temperature=float(config["decoding"]["temperature"]),
            top_p=float(config["decoding"].get("top_p", 1.0)),
            seed=int(config["seed"]), model_name=model_name, progress=bar,
        )
    meta = {"model": model_name, "policy": policy_name, "split": split}
    records = [{**meta, **rec} for rec in recs]
    frame = to_frame(records)
    provenance = shard_metadata(shard_settings(config, model_name, policy_name, split), model=model_name,
                                policy=policy_name, split=split, shard=shard)
    write_parquet_atomic(frame, output_path, metadata=provenance)
    return frame
