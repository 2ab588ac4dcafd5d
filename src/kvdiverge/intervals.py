"""Sharp interval for cumulative disagreement from a finite window (estimators.md §4).

Knowing only the law of the first divergence ``tau`` and ``E[N_win]`` (the first ``W``
lags after divergence were observed, the tail was not), the set of possible ``E[N]``
over unrestricted autoregressive kernel pairs that agree with ``P``, ``Q`` on shared
prefixes and on the first ``W`` post-divergence steps is exactly

    [ p_div + E[N_win],  p_div + E[N_win] + E[L_tail] ].

:func:`sharp_interval` evaluates the ends (and the implied ones for ``E[M]`` and
``rho``). :func:`lower_construction` and :func:`upper_construction` are the two
kernel-pair constructions that attain them: they wrap a pure kernel-pair function and
change it only on history pairs more than ``W`` steps past their divergence.
:func:`wrap_pair` applies them to a :class:`kvdiverge.kernels.TableKernelPair`.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

History = tuple[int, ...]
KernelFn = Callable[[History, History], tuple[np.ndarray, np.ndarray]]

__all__ = [
    "divergence_lag",
    "lower_construction",
    "sharp_interval",
    "upper_construction",
    "wrap_pair",
]


def sharp_interval(p_div, E_N_win, E_L_tail, E_L, T) -> dict[str, Any]:
    """Ends of the §4 sharp interval for ``E[N]``, ``E[M]`` and ``rho``.

    Works elementwise on floats or numpy arrays.

    Parameters
    ----------
    p_div : float or array
        ``P(tau <= T)``.
    E_N_win : float or array
        Expected window mismatches ``E[N_win]`` (tokens).
    E_L_tail : float or array
        Expected tail exposure ``E[(L - W)^+]`` (steps), identified by the law of tau.
    E_L : float or array
        Expected exposure ``E[L]`` (steps).
    T : int or array
        Horizon (tokens).

    Returns
    -------
    dict
        ``E_N_lo = p_div + E_N_win``, ``E_N_hi = E_N_lo + E_L_tail``,
        ``E_M_lo/hi = E_N_lo/hi / T``, ``rho_lo = E_N_win / E_L``,
        ``rho_hi = (E_N_win + E_L_tail) / E_L`` (NaN where ``E_L = 0``).
    """
    p_div = np.asarray(p_div, dtype=np.float64)
    E_N_win = np.asarray(E_N_win, dtype=np.float64)
    E_L_tail = np.asarray(E_L_tail, dtype=np.float64)
    E_L = np.asarray(E_L, dtype=np.float64)
    lo = p_div + E_N_win
    hi = lo + E_L_tail
    with np.errstate(divide="ignore", invalid="ignore"):
        rho_lo = np.where(E_L > 0, E_N_win / E_L, np.nan)
        rho_hi = np.where(E_L > 0, (E_N_win + E_L_tail) / E_L, np.nan)
    out = {
        "E_N_lo": lo,
        "E_N_hi": hi,
        "E_M_lo": lo / T,
        "E_M_hi": hi / T,
        "rho_lo": rho_lo,
        "rho_hi": rho_hi,
    }
    return {k: (float(v) if np.ndim(v) == 0 else v) for k, v in out.items()}


def divergence_lag(hx: History, hy: History) -> int | None:
    """Lag, in steps past the first divergence, of the step about to be drawn.

    Both histories have length ``t - 1`` before step ``t``. If they first differ at
    step ``tau`` (1-based), the next step ``t`` is at lag ``k = t - tau``.

    Parameters
    ----------
    hx, hy : tuple of int
        Reference and evicted histories of equal length.

    Returns
    -------
    int or None
        ``k >= 1``, or None when the histories are identical (no divergence yet).

    Raises
    ------
    ValueError
        If the histories have different lengths.
    """
    if len(hx) != len(hy):
        raise ValueError(f"histories of different lengths {len(hx)} and {len(hy)}")
    for s, (a, b) in enumerate(zip(hx, hy), start=1):
        if a != b:
            return len(hx) + 1 - s
    return None


def _point(v: int, vocab_size: int) -> np.ndarray:
    e = np.zeros(vocab_size)
    e[v] = 1.0
    return e


def lower_construction(fn: KernelFn, vocab_size: int, W: int, token: int = 0) -> KernelFn:
    """Lower-end construction of §4: from lag ``W + 1`` on, both kernels emit ``token``.

    The stepwise maximal coupling of two identical point masses never mismatches, so
    ``N_tail = 0`` and ``E[N] = p_div + E[N_win]``. History pairs with no divergence or
    at lag ``<= W`` are passed to ``fn`` unchanged, so the law of ``tau`` and of the
    window is the original one.

    Parameters
    ----------
    fn : callable
        ``fn(ref_history, evicted_history) -> (p, q)``.
    vocab_size : int
        ``V``.
    W : int
        Window width (lags), ``>= 0``.
    token : int
        The shared deterministic token, ``0 <= token < V``.

    Returns
    -------
    callable
        The constructed kernel-pair function.
    """
    if not 0 <= token < vocab_size:
        raise ValueError(f"token {token} outside the vocabulary [0, {vocab_size})")
    if W < 0:
        raise ValueError(f"W must be >= 0, got {W}")

    def g(hx: History, hy: History):
        k = divergence_lag(hx, hy)
        if k is not None and k > W:
            e = _point(token, vocab_size)
            return e, e.copy()
        return fn(hx, hy)

    return g


def upper_construction(
    fn: KernelFn, vocab_size: int, W: int, tokens: tuple[int, int] = (0, 1)
) -> KernelFn:
    """Upper-end construction of §4: from lag ``W + 1`` on, the kernels emit two
    different deterministic tokens (reference ``tokens[0]``, evicted ``tokens[1]``).

    The coupling of two disjoint point masses always mismatches, so
    ``N_tail = L_tail`` and ``E[N] = p_div + E[N_win] + E[L_tail]``. Unchanged on
    shared prefixes and at lags ``<= W``.

    With absorbing end-of-sequence ids, a side whose history already ended in EOS before
    lag ``W + 1`` stays on it (estimators.md §1), which can only lower the tail; the end
    is attained exactly for pairs without EOS, or whenever no side has ended in EOS
    within the window.

    Parameters
    ----------
    fn : callable
        ``fn(ref_history, evicted_history) -> (p, q)``.
    vocab_size : int
        ``V``, ``>= 2``.
    W : int
        Window width (lags), ``>= 0``.
    tokens : (int, int)
        Two different tokens in ``[0, V)``.

    Returns
    -------
    callable
        The constructed kernel-pair function.
    """
    a, b = tokens
    if a == b or not (0 <= a < vocab_size and 0 <= b < vocab_size):
        raise ValueError(f"tokens must be two different ids in [0, {vocab_size}), got {tokens}")
    if W < 0:
        raise ValueError(f"W must be >= 0, got {W}")

    def g(hx: History, hy: History):
        k = divergence_lag(hx, hy)
        if k is not None and k > W:
            return _point(a, vocab_size), _point(b, vocab_size)
        return fn(hx, hy)

    return g


def wrap_pair(pair: Any, W: int, end: str, **kwargs: Any) -> Any:
    """Apply a §4 construction to a synthetic kernel pair object.

    Parameters
    ----------
    pair : kvdiverge.kernels.TableKernelPair
        Must expose ``fn``, ``vocab_size`` and ``eos_ids``.
    W : int
        Window width (lags).
    end : {"lower", "upper"}
        Which construction.
    **kwargs
        ``token=`` for the lower end, ``tokens=`` for the upper end.

    Returns
    -------
    kvdiverge.kernels.TableKernelPair
        A new pair with the constructed function and the same vocabulary and EOS ids.

    Raises
    ------
    ValueError
        If ``end`` is not "lower" or "upper".
    """
    from kvdiverge.kernels import TableKernelPair

    if end == "lower":
        g = lower_construction(pair.fn, pair.vocab_size, W, **kwargs)
    elif end == "upper":
        g = upper_construction(pair.fn, pair.vocab_size, W, **kwargs)
    else:
        raise ValueError(f"end must be 'lower' or 'upper', got {end!r}")
    return TableKernelPair(g, pair.vocab_size, eos_ids=tuple(pair.eos_ids))
