"""The self-speculative reading of the survival curve: accepted tokens of a first draft block.

Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) drafts ``k`` tokens from a
draft kernel ``Q`` and checks them with one forward of the target ``P``: the drafted token
``y ~ q_t`` is accepted with probability ``min(1, p_t(y) / q_t(y))``, so it is accepted
with probability ``sum_v min(p_t(v), q_t(v)) = 1 - tv_t`` and, given acceptance, it is
distributed as the normalised overlap ``min(p_t, q_t) / (1 - tv_t)``. That is the step of
the agreement chain of ``estimators.md`` §5. With ``Q`` the evicted (or otherwise
compressed) cache and ``P`` the full cache — self-speculative decoding — the chance that
the first ``j`` drafted tokens of the first block are all accepted is therefore the
survival ``S_j = P(tau > j)``, and the expected number of accepted tokens of a block of
length ``k`` is

    A_k = E[accepted] = sum_{j=1..k} P(accepted >= j) = sum_{j=1..k} S_j.

Every verification forward yields one more token (the target's correction after a
rejection, or its bonus token after ``k`` acceptances), so a first block gives ``A_k + 1``
tokens per target forward.

What is exact and what is not: ``A_k`` is exact for the *first* block, drafted from the
prompt (both caches in the state the prompt leads to, the drafted prefix on the chain).
Later blocks start after a rejection, from histories distributed as the target's output
(the corrected token is drawn from ``(p - q)^+``), not as the agreement chain; their
acceptance is not ``S_j`` and this module does not estimate it.

Per document the survival is the replicate mean of the chain survival
``prod_{s<=t} (1 - tv_s)`` (Rao-Blackwellised, unbiased;
:func:`kvdiverge.estimation.estimators.document_estimates`), so ``A_k`` per document is
unbiased too; documents are pooled with equal weight and get percentile document-bootstrap
intervals (:mod:`kvdiverge.estimation.bootstrap`).

The serving engines' own terms, read off the same curve (each a column of :func:`speculative_table`):

- vLLM's mean acceptance length ``1 + accepted / steps`` (its per-request speculative
  metrics: ``num_accepted_tokens / num_drafts + 1``): for a first block of depth ``k``,
  ``1 + A_k`` (``acceptance_length``, equal to ``tokens_per_forward``); its draft acceptance
  rate ``accepted / drafted`` is ``A_k / k`` (``accepted_fraction``);
- the distribution of accepted lengths (vLLM's histogram of accepted draft tokens):
  ``P(accepted = j) = S_j - S_{j+1}`` for ``j < k`` and ``P(accepted = k) = S_k``
  (``S_0 = 1``; :func:`accepted_distribution`, the list column ``accepted_hist``);
- the conditional acceptance at draft position ``k`` (NeMo-Skills' per-position rate):
  ``S_k / S_{k-1}``, the chance that token ``k`` is accepted given the ``k - 1`` before it were
  (``conditional_acceptance``, the ratio of the pooled survivals);
- MagicDec's and TriForce's single acceptance rate ``alpha`` (the mean per-step acceptance
  ``1 - tv`` along the chain) and the i.i.d. predictions it implies beside the curve's own:
  ``alpha^k`` for ``S_k`` (``iid_S_k``), ``alpha`` for every conditional acceptance, and
  ``(1 - alpha^{k+1}) / (1 - alpha)`` for ``1 + A_k`` (``iid_tokens_per_forward``).

- :func:`accepted_tokens` — ``A_k`` per document for ``k = 1..K``.
- :func:`accepted_distribution` — ``P(accepted = j)``, ``j = 0..k``.
- :func:`iid_tokens_per_forward` — the i.i.d. approximation ``(1 - alpha^{k+1}) / (1 - alpha)``
  of Leviathan et al., quoted beside the estimate.
- :func:`speculative_table` — one row per (model, policy, split, k).
- :func:`format_speculative_line` — the one line the command line's summary prints.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import polars as pl

from kvdiverge.estimation.bootstrap import Bootstrap, resample_counts

__all__ = [
    "MAX_BLOCK",
    "SPECULATIVE_SCHEMA",
    "accepted_distribution",
    "accepted_tokens",
    "format_speculative_line",
    "iid_tokens_per_forward",
    "speculative_table",
]

#: Longest draft block reported by default (tokens); capped at the horizon ``T``.
MAX_BLOCK = 8

_RUN = ["model", "policy", "split"]

#: Columns of :func:`speculative_table` (``_lo``/``_hi``: document-bootstrap bounds).
SPECULATIVE_SCHEMA = {
    "model": pl.String,
    "policy": pl.String,
    "split": pl.String,
    "n_docs": pl.Int64,
    "T": pl.Int64,
    "k": pl.Int64,
    "S_k": pl.Float64,
    "S_k_lo": pl.Float64,
    "S_k_hi": pl.Float64,
    "A": pl.Float64,
    "A_lo": pl.Float64,
    "A_hi": pl.Float64,
    "accepted_fraction": pl.Float64,
    "accepted_fraction_lo": pl.Float64,
    "accepted_fraction_hi": pl.Float64,
    "tokens_per_forward": pl.Float64,
    "tokens_per_forward_lo": pl.Float64,
    "tokens_per_forward_hi": pl.Float64,
    "alpha": pl.Float64,
    "alpha_lo": pl.Float64,
    "alpha_hi": pl.Float64,
    "iid_tokens_per_forward": pl.Float64,
    "iid_tokens_per_forward_lo": pl.Float64,
    "iid_tokens_per_forward_hi": pl.Float64,
    "acceptance_length": pl.Float64,
    "acceptance_length_lo": pl.Float64,
    "acceptance_length_hi": pl.Float64,
    "conditional_acceptance": pl.Float64,
    "conditional_acceptance_lo": pl.Float64,
    "conditional_acceptance_hi": pl.Float64,
    "iid_S_k": pl.Float64,
    "iid_S_k_lo": pl.Float64,
    "iid_S_k_hi": pl.Float64,
    "accepted_hist": pl.List(pl.Float64),
}


def accepted_tokens(S: np.ndarray, K: int) -> np.ndarray:
    """Expected accepted tokens ``A_k = sum_{j<=k} S_j`` of a first draft block, ``k = 1..K``.

    Parameters
    ----------
    S : numpy.ndarray, shape (n, T) or (T,)
        Survival ``S_t = P(tau > t)`` for ``t = 1..T`` (index ``t - 1``), per row.
    K : int
        Longest block, ``1 <= K <= T`` (tokens).

    Returns
    -------
    numpy.ndarray, float64, shape (n, K) or (K,)
        ``A_k`` in tokens, index ``k - 1``.

    Raises
    ------
    ValueError
        If ``K`` is not in ``[1, T]``.
    """
    S = np.asarray(S, dtype=np.float64)
    T = S.shape[-1]
    if not 1 <= K <= T:
        raise ValueError(f"block length K must be in [1, T={T}], got {K}")
    return np.cumsum(S[..., :K], axis=-1)


def accepted_distribution(S: np.ndarray, k: int) -> np.ndarray:
    """Distribution of the accepted tokens of a first draft block of depth ``k``.

    ``P(accepted = j) = S_j - S_{j+1}`` for ``j = 0..k-1`` (``S_0 = 1``: the block stops at
    its first rejection) and ``P(accepted = k) = S_k`` (every draft accepted). Its mean is
    ``A_k`` (:func:`accepted_tokens`).

    Parameters
    ----------
    S : numpy.ndarray, shape (..., T)
        Survival ``S_t`` for ``t = 1..T`` (non-increasing, in [0, 1]).
    k : int
        Block depth, ``1 <= k <= T``.

    Returns
    -------
    numpy.ndarray, float64, shape (..., k + 1)
        Probabilities summing to 1, index ``j``.

    Raises
    ------
    ValueError
        If ``k`` is not in ``[1, T]``.
    """
    S = np.asarray(S, dtype=np.float64)
    if not 1 <= k <= S.shape[-1]:
        raise ValueError(f"block length k must be in [1, T={S.shape[-1]}], got {k}")
    full = np.concatenate([np.ones(S.shape[:-1] + (1,)), S[..., :k]], axis=-1)  # S_0 .. S_k
    return np.concatenate([full[..., :-1] - full[..., 1:], full[..., -1:]], axis=-1)


def iid_tokens_per_forward(alpha: np.ndarray | float, k: np.ndarray | int) -> np.ndarray:
    """Tokens per target forward under i.i.d. acceptance: ``(1 - alpha^{k+1}) / (1 - alpha)``.

    Leviathan, Kalman & Matias (2023), "Fast inference from transformers via speculative
    decoding", eq. (1): with every drafted token accepted independently with probability
    ``alpha``, a block of ``k`` yields ``1 + alpha + ... + alpha^k`` tokens per target forward
    (so ``alpha + ... + alpha^k`` accepted). ``alpha = 1`` gives ``k + 1``.

    Parameters
    ----------
    alpha : float or numpy.ndarray
        Per-step acceptance probability in ``[0, 1]``.
    k : int or numpy.ndarray
        Block length (tokens), ``>= 1``.

    Returns
    -------
    numpy.ndarray, float64
        Broadcast of ``alpha`` and ``k``.
    """
    alpha = np.asarray(alpha, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    powers = np.arange(0, int(np.max(k)) + 1)
    a, kk = np.broadcast_arrays(alpha, k)
    terms = np.where(powers <= kk[..., None], a[..., None] ** powers, 0.0)
    return terms.sum(axis=-1)


def _run_rows(g: pl.DataFrame, key: tuple, K: int, T: int, boot: Bootstrap) -> dict:
    """Columns of one run's rows (internal; see :func:`speculative_table`)."""
    n = g.height
    S = np.asarray(g["S"].to_list(), dtype=np.float64).reshape(n, T)[:, :K]
    A = accepted_tokens(S, K)
    alpha = 1.0 - g["tv_mean"].to_numpy().astype(np.float64)
    X = np.column_stack([S, A, alpha])  # (n, 2K + 1)
    counts = resample_counts(boot.indices(n, "speculative", *key))
    B = counts @ X / n
    mean = X.mean(axis=0)
    lo, hi = boot.interval(B)
    k = np.arange(1, K + 1)
    cond = _conditional(mean[None, :K])[0]
    cond_lo, cond_hi = boot.interval(_conditional(B[:, :K]))
    a, a_lo, a_hi = mean[-1], lo[-1], hi[-1]
    cols = {
        "k": k,
        "S_k": mean[:K],
        "S_k_lo": lo[:K],
        "S_k_hi": hi[:K],
        "A": mean[K : 2 * K],
        "A_lo": lo[K : 2 * K],
        "A_hi": hi[K : 2 * K],
    }
    for c in ("", "_lo", "_hi"):
        cols["accepted_fraction" + c] = cols["A" + c] / k
        cols["tokens_per_forward" + c] = cols["A" + c] + 1.0
    cols.update(
        {
            "alpha": np.full(K, a),
            "alpha_lo": np.full(K, a_lo),
            "alpha_hi": np.full(K, a_hi),
            # increasing in alpha: the interval's ends map to the formula's ends
            "iid_tokens_per_forward": iid_tokens_per_forward(a, k),
            "iid_tokens_per_forward_lo": iid_tokens_per_forward(a_lo, k),
            "iid_tokens_per_forward_hi": iid_tokens_per_forward(a_hi, k),
            "acceptance_length": cols["tokens_per_forward"],
            "acceptance_length_lo": cols["tokens_per_forward_lo"],
            "acceptance_length_hi": cols["tokens_per_forward_hi"],
            "conditional_acceptance": cond,
            "conditional_acceptance_lo": cond_lo,
            "conditional_acceptance_hi": cond_hi,
            "iid_S_k": a**k,
            "iid_S_k_lo": a_lo**k,
            "iid_S_k_hi": a_hi**k,
            "accepted_hist": [accepted_distribution(mean[:K], int(j)).tolist() for j in k],
        }
    )
    return cols


def _conditional(S: np.ndarray) -> np.ndarray:
    """``S_k / S_{k-1}`` along the last axis (``S_0 = 1``); NaN where ``S_{k-1} = 0``."""
    prev = np.concatenate([np.ones(S.shape[:-1] + (1,)), S[..., :-1]], axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(prev > 0, S / np.where(prev > 0, prev, 1.0), np.nan)


def speculative_table(docs: pl.DataFrame, boot: Bootstrap, max_block: int = MAX_BLOCK) -> pl.DataFrame:
    """Accepted tokens of a first self-speculative draft block, per run and block length.

    Parameters
    ----------
    docs : polars.DataFrame
        Per-document estimates (:func:`kvdiverge.estimation.estimators.document_estimates`),
        any number of runs; reads ``T``, ``S`` (list, length T) and ``tv_mean``.
    boot : kvdiverge.estimation.bootstrap.Bootstrap
        Settings of the document bootstrap; each run's resamples derive from (seed,
        "speculative", model, policy, split).
    max_block : int
        Longest block ``K``; rows ``k = 1..min(max_block, T)``.

    Returns
    -------
    polars.DataFrame
        :data:`SPECULATIVE_SCHEMA`, one row per (model, policy, split, k): ``S_k``
        (all ``k`` drafted tokens accepted), ``A`` (``A_k``, expected accepted tokens),
        ``accepted_fraction = A_k / k``, ``tokens_per_forward = A_k + 1``, ``alpha`` (mean
        per-step acceptance ``1 - tv_t`` along the agreement chain, over its ``T`` steps,
        the same for every ``k`` of a run) and ``iid_tokens_per_forward`` (Leviathan et al.'s
        ``(1 - alpha^{k+1}) / (1 - alpha)`` at that ``alpha``), each with document-bootstrap
        bounds ``_lo``/``_hi``; the serving engines' terms (module docstring):
        ``acceptance_length`` (vLLM's ``1 + accepted / steps``), ``conditional_acceptance``
        (``S_k / S_{k-1}``), ``iid_S_k`` (``alpha^k``), each with bounds, and
        ``accepted_hist`` (list of ``k + 1`` probabilities ``P(accepted = j)``, of the pooled
        survival). Units: tokens, except ``S_k``, ``accepted_fraction``, ``alpha``,
        ``conditional_acceptance``, ``iid_S_k`` and ``accepted_hist`` (probabilities).

    Raises
    ------
    ValueError
        If ``max_block < 1`` or ``T`` varies across a run's documents.
    """
    if max_block < 1:
        raise ValueError(f"max_block must be >= 1, got {max_block}")
    frames = []
    for key, g in docs.group_by(_RUN, maintain_order=True):
        if g["T"].n_unique() != 1:
            raise ValueError(f"{'/'.join(key)}: T varies across documents")
        T = int(g["T"][0])
        K = min(int(max_block), T)
        cols = _run_rows(g, key, K, T, boot)
        base = {
            "model": [key[0]] * K,
            "policy": [key[1]] * K,
            "split": [key[2]] * K,
            "n_docs": [g.height] * K,
            "T": [T] * K,
        }
        frames.append(pl.DataFrame({**base, **cols}).cast(SPECULATIVE_SCHEMA))
    if not frames:
        return pl.DataFrame(schema=SPECULATIVE_SCHEMA)
    return pl.concat(frames).select(list(SPECULATIVE_SCHEMA))


def format_speculative_line(table: pl.DataFrame, policies: Sequence[str], k: int = 4) -> str:
    """One line: tokens per target forward ``A_k + 1`` of a first draft block, per policy.

    Parameters
    ----------
    table : polars.DataFrame
        :func:`speculative_table` rows of one model and split.
    policies : sequence of str
        Policies in print order (those absent from ``table`` are left out).
    k : int
        Block length; the longest block in the table when shorter.

    Returns
    -------
    str
        ``"self-speculative first block (k=4): tokens per target forward A_k+1 [CI], i.i.d.
        (1-a^(k+1))/(1-a): snapkv 4.1 [3.9, 4.3] (iid 4.6); ..."``; a note when the table is empty.
    """
    if table.height == 0:
        return "self-speculative first block: no runs"
    k = min(int(k), int(table["k"].max()))
    rows = {r["policy"]: r for r in table.filter(pl.col("k") == k).iter_rows(named=True)}
    cells = [
        f"{p} {rows[p]['tokens_per_forward']:.2f} [{rows[p]['tokens_per_forward_lo']:.2f}, "
        f"{rows[p]['tokens_per_forward_hi']:.2f}] (iid {rows[p]['iid_tokens_per_forward']:.2f})"
        for p in policies
        if p in rows
    ]
    return (
        f"self-speculative first block (k={k}, draft = evicted cache, target = full cache): "
        f"tokens per target forward A_k+1 [CI] (i.i.d. (1-a^(k+1))/(1-a)): " + "; ".join(cells)
    )
