"""Exhaustive enumeration of the coupled process on synthetic kernel pairs.

Given a pure kernel-pair function ``fn(ref_history, evicted_history) -> (p, q)`` over a
tiny vocabulary and a short horizon ``T``, :func:`enumerate_coupled` walks every
outcome of the stepwise maximal coupling (``docs/estimators.md`` §2) and
returns the exact values of every target the estimators of §5–§6 aim at:
``p_div``, ``f_t``, ``S_t``, ``E[L]``, ``E[L_win]``, ``E[L_tail]``, ``E[N]``,
``E[N_post]``, ``E[N_win]``, ``E[N_tail]``, ``E[M]``, ``rho`` and the branch-aligned TV
quantities of §6. It is the ground truth the tests compare the Monte-Carlo engine and
the estimators against, and the tool that proves the §4 interval constructions sharp.

End-of-sequence is absorbing exactly as in estimators.md §1: once a side's history ends
with an id of ``eos_ids``, that side's kernel is the point mass on that id, whatever
``fn`` returns.

The cost is the number of coupled paths, at most ``(V**2)**T``; keep ``V <= 4`` and
``T <= 5``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from kvdiverge.engine.core.pairs import History, KernelFn
from kvdiverge.estimation.decomposition import rho

__all__ = [
    "ExactResult",
    "absorbing",
    "coupling_joint",
    "enumerate_coupled",
    "tv_distance",
]


def tv_distance(p: np.ndarray, q: np.ndarray) -> float:
    """Total variation ``TV(p, q) = 1 - sum_v min(p_v, q_v)`` (estimators.md §1).

    Parameters
    ----------
    p, q : numpy.ndarray, shape (V,), float64
        Probability vectors.

    Returns
    -------
    float
        The TV distance in [0, 1].
    """
    return float(min(1.0, max(0.0, 1.0 - np.minimum(p, q).sum())))


def absorbing(fn: KernelFn, vocab_size: int, eos_ids: Sequence[int] = ()) -> KernelFn:
    """Wrap ``fn`` so that end-of-sequence is absorbing on each side (estimators.md §1).

    Parameters
    ----------
    fn : callable
        ``fn(ref_history, evicted_history) -> (p, q)``, float64 arrays of shape (V,).
    vocab_size : int
        ``V``.
    eos_ids : sequence of int
        End-of-sequence ids. After a side's history ends with one of them, that side's
        kernel is the point mass on it.

    Returns
    -------
    callable
        The wrapped kernel-pair function.
    """
    eos = frozenset(int(e) for e in eos_ids)

    def wrapped(hx: History, hy: History) -> tuple[np.ndarray, np.ndarray]:
        p, q = fn(hx, hy)
        p = np.asarray(p, dtype=np.float64)
        q = np.asarray(q, dtype=np.float64)
        if p.shape != (vocab_size,) or q.shape != (vocab_size,):
            raise ValueError(f"kernel returned shapes {p.shape}, {q.shape}; expected ({vocab_size},)")
        if hx and hx[-1] in eos:
            p = np.zeros(vocab_size)
            p[hx[-1]] = 1.0
        if hy and hy[-1] in eos:
            q = np.zeros(vocab_size)
            q[hy[-1]] = 1.0
        return p, q

    return wrapped


def coupling_joint(p: np.ndarray, q: np.ndarray) -> tuple[float, list[tuple[int, int, float]]]:
    """The maximal coupling of ``p`` and ``q`` as a list of outcomes (estimators.md §2).

    Parameters
    ----------
    p, q : numpy.ndarray, shape (V,), float64
        The two next-token distributions.

    Returns
    -------
    tv : float
        ``TV(p, q)``.
    outcomes : list of (x, y, prob)
        Every pair ``(x, y)`` of positive probability: ``min(p, q)`` on the diagonal
        and ``(p - q)^+ (q - p)^+ / tv`` off it (disjoint supports, so ``x != y``).
    """
    overlap = np.minimum(p, q)
    tv = tv_distance(p, q)
    out: list[tuple[int, int, float]] = [(int(v), int(v), float(overlap[v])) for v in np.flatnonzero(overlap > 0)]
    if tv > 0:
        dp = np.clip(p - q, 0.0, None)
        dq = np.clip(q - p, 0.0, None)
        # normalise each residual by its own mass (equal to tv up to rounding)
        dp = dp / dp.sum()
        dq = dq / dq.sum()
        for a in np.flatnonzero(dp > 0):
            for b in np.flatnonzero(dq > 0):
                out.append((int(a), int(b), tv * float(dp[a]) * float(dq[b])))
    return tv, out


@dataclass
class ExactResult:
    """Exact targets of the coupled process for one kernel pair.

    All expectations are under the stepwise maximal coupling of estimators.md §2 with
    horizon ``T`` (steps) and window width ``W`` (lags).

    Attributes
    ----------
    T, W : int
        Horizon (tokens) and window width (lags).
    p_div : float
        ``P(tau <= T)``.
    f : numpy.ndarray, shape (T,)
        ``f_t = P(tau = t)`` for ``t = 1..T`` (index ``t - 1``).
    S : numpy.ndarray, shape (T,)
        ``S_t = P(tau > t)``.
    E_L, E_L_win, E_L_tail : float
        ``E[L]``, ``E[min(W, L)]``, ``E[(L - W)^+]`` (steps), with ``L = 0`` when no
        divergence.
    E_N, E_N_post, E_N_win, E_N_tail : float
        Expected mismatches (tokens): total, after ``tau``, in the window, in the tail.
    E_M : float
        ``E[N] / T``.
    rho : float
        ``E[N_post] / E[L]`` (NaN when ``E[L] = 0``).
    E_tau_div : float
        ``E[tau 1{tau <= T}]``; ``E_tau_div / p_div`` is the mean divergence step.
    reach : numpy.ndarray, shape (T,)
        ``P(L >= k)`` for lags ``k = 1..T`` (index ``k - 1``).
    btv_num : numpy.ndarray, shape (T,)
        ``E[tv_{tau+k} 1{L >= k}]``: branch-aligned TV mass at lag ``k``.
    mismatch_lag : numpy.ndarray, shape (T,)
        ``E[D_{tau+k} 1{L >= k}]``.
    E_N_sq : float
        ``E[N^2]``, so ``Var(N) = E_N_sq - E_N**2``.
    window_law : dict
        Law of the process up to ``W`` lags past divergence: maps
        ``(tau or None, x_prefix, y_prefix)`` to its probability, prefixes running to
        step ``min(T, tau + W)`` (to ``T`` when there is no divergence).
    n_paths : int
        Number of enumerated coupled paths.
    """

    T: int
    W: int
    p_div: float
    f: np.ndarray
    S: np.ndarray
    E_L: float
    E_L_win: float
    E_L_tail: float
    E_N: float
    E_N_post: float
    E_N_win: float
    E_N_tail: float
    E_M: float
    rho: float
    E_tau_div: float
    reach: np.ndarray
    btv_num: np.ndarray
    mismatch_lag: np.ndarray
    E_N_sq: float
    window_law: dict = field(repr=False)
    n_paths: int = 0

    def btv(self, a: int, b: int) -> float:
        """Exact branch-aligned TV of lag window ``[a, b]`` (estimators.md §6).

        The §6 estimator is a ratio of two replicate means whose expectations are
        ``sum_{k=a..b} btv_num[k]`` and ``sum_{k=a..b} reach[k]``; this returns that
        ratio of expectations (NaN when no branch reaches the window).

        Parameters
        ----------
        a, b : int
            Lags, ``1 <= a <= b``.
        """
        if not 1 <= a <= b:
            raise ValueError(f"lag window must satisfy 1 <= a <= b, got [{a}, {b}]")
        hi = min(b, self.T)
        if a > hi:
            return float("nan")
        den = self.reach[a - 1 : hi].sum()
        return float(self.btv_num[a - 1 : hi].sum() / den) if den > 0 else float("nan")

    @property
    def decomposition_rhs(self) -> float:
        """``p_div / T + (E[L] / T) * rho`` (estimators.md §3)."""
        rate = 0.0 if self.E_L == 0 else self.E_L / self.T * self.rho
        return self.p_div / self.T + rate


def enumerate_coupled(
    fn: KernelFn,
    vocab_size: int,
    T: int,
    W: int = 1,
    eos_ids: Sequence[int] = (),
    tol: float = 0.0,
) -> ExactResult:
    """Exact targets of the coupled process by exhaustive enumeration.

    Every outcome of the stepwise maximal coupling (estimators.md §2) over ``T`` steps
    is visited with its probability; nothing is sampled.

    Parameters
    ----------
    fn : callable
        ``fn(ref_history, evicted_history) -> (p, q)``: float64 arrays of shape (V,)
        summing to 1 (already decoding-transformed). EOS absorption is applied here.
    vocab_size : int
        ``V``.
    T : int
        Horizon (steps, tokens), ``>= 1``.
    W : int
        Window width (lags), ``>= 0``.
    eos_ids : sequence of int
        Absorbing end-of-sequence ids.
    tol : float
        Outcomes of probability ``<= tol`` are pruned (0: none).

    Returns
    -------
    ExactResult

    Raises
    ------
    ValueError
        If ``T < 1``, ``W < 0`` or the kernel returns arrays of the wrong shape.
    """
    if T < 1:
        raise ValueError(f"T must be >= 1, got {T}")
    if W < 0:
        raise ValueError(f"W must be >= 0, got {W}")
    kern = absorbing(fn, vocab_size, eos_ids)

    totals = _Totals.zeros(T, W)
    n_paths = 0
    for path in _paths(kern, T, tol):
        n_paths += 1
        totals.add(path)

    f, acc = totals.f, totals.acc
    p_div = float(f.sum())
    S = 1.0 - np.cumsum(f)
    E_L = acc["L"]
    E_N_post = acc["N_post"]
    return ExactResult(
        T=T,
        W=W,
        p_div=p_div,
        f=f,
        S=S,
        E_L=E_L,
        E_L_win=acc["L_win"],
        E_L_tail=acc["L_tail"],
        E_N=acc["N"],
        E_N_post=E_N_post,
        E_N_win=acc["N_win"],
        E_N_tail=acc["N_post"] - acc["N_win"],
        E_M=acc["N"] / T,
        rho=rho(E_N_post, E_L),
        E_tau_div=acc["tau"],
        reach=totals.reach,
        btv_num=totals.btv_num,
        mismatch_lag=totals.mis_lag,
        E_N_sq=acc["N_sq"],
        window_law=dict(totals.window_law),
        n_paths=n_paths,
    )


@dataclass(frozen=True)
class _Path:
    """One complete coupled path of ``T`` steps (internal to :func:`enumerate_coupled`).

    ``hx``, ``hy``: the reference and evicted histories (token ids, length ``T``); ``prob``:
    the path's probability; ``tau``: its first divergence step (1-based; ``None``: none);
    ``tvs``: the TV of each step's kernels; ``ds``: each step's divergence indicator (0 or 1).
    Step ``t`` is index ``t - 1`` of the tuples.
    """

    hx: History
    hy: History
    prob: float
    tau: int | None
    tvs: tuple[float, ...]
    ds: tuple[int, ...]


def _paths(kern, T: int, tol: float):
    """Every complete coupled path of ``T`` steps (:class:`_Path`) with probability above ``tol`` at
    each step, depth first (internal to :func:`enumerate_coupled`)."""
    stack: list[tuple[History, History, float, int | None, tuple, tuple]] = [((), (), 1.0, None, (), ())]
    while stack:
        hx, hy, prob, tau, tvs, ds = stack.pop()
        t = len(hx) + 1
        if t > T:
            yield _Path(hx, hy, prob, tau, tvs, ds)
            continue
        p, q = kern(hx, hy)
        tv, outcomes = coupling_joint(p, q)
        for x, y, pr in outcomes:
            if pr <= tol:
                continue
            d = int(x != y)
            new_tau = t if (tau is None and d) else tau
            stack.append((hx + (x,), hy + (y,), prob * pr, new_tau, tvs + (tv,), ds + (d,)))


@dataclass(frozen=True)
class _Totals:
    """Probability-weighted sums over the complete paths (internal to :func:`enumerate_coupled`).

    ``f``, ``reach``, ``btv_num``, ``mis_lag``: float64 arrays of shape (T,), by divergence
    step ``tau - 1`` (``f``) or lag ``k - 1`` (the others), added to in place; ``acc``: the
    scalar sums (``N``, ``N_sq``, ``tau``, ``L``, ``L_win``, ``L_tail``, ``N_post``, ``N_win``);
    ``window_law``: probability of each ``(tau, x[:tau+W], y[:tau+W])`` (``(None, x, y)``
    for a path that never diverges).
    """

    T: int
    W: int
    f: np.ndarray
    reach: np.ndarray
    btv_num: np.ndarray
    mis_lag: np.ndarray
    acc: defaultdict
    window_law: defaultdict

    @classmethod
    def zeros(cls, T: int, W: int) -> "_Totals":
        """Empty sums for horizon ``T`` and window ``W``."""
        arrays = (np.zeros(T) for _ in range(4))
        return cls(T, W, *arrays, defaultdict(float), defaultdict(float))

    def add(self, path: _Path) -> None:
        """Add one complete path's contributions."""
        prob, tau, tvs, ds, T, W, acc = path.prob, path.tau, path.tvs, path.ds, self.T, self.W, self.acc
        n = sum(ds)
        acc["N"] += prob * n
        acc["N_sq"] += prob * n * n
        if tau is None:
            self.window_law[(None, path.hx, path.hy)] += prob
            return
        L = T - tau
        self.f[tau - 1] += prob
        acc["tau"] += prob * tau
        acc["L"] += prob * L
        acc["L_win"] += prob * min(W, L)
        acc["L_tail"] += prob * max(L - W, 0)
        post = ds[tau:]  # D_{tau+1..T}; ds is 0-indexed by step - 1
        acc["N_post"] += prob * sum(post)
        acc["N_win"] += prob * sum(post[:W])
        for k in range(1, L + 1):
            self.reach[k - 1] += prob
            self.btv_num[k - 1] += prob * tvs[tau + k - 1]
            self.mis_lag[k - 1] += prob * ds[tau + k - 1]
        end = min(T, tau + W)
        self.window_law[(tau, path.hx[:end], path.hy[:end])] += prob
