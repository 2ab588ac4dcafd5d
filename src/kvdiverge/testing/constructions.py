"""The §4 constructions that attain both ends of the sharp interval (estimators.md §4).

:func:`lower_construction` and :func:`upper_construction` wrap a pure kernel-pair function
and change it only on history pairs more than ``W`` steps past their divergence.
:func:`wrap_pair` applies them to a :class:`kvdiverge.engine.core.pairs.TableKernelPair`, and
:class:`ConstructedPair` to any pair of the incremental :class:`kvdiverge.engine.core.pairs.KernelPair`
interface (e.g. the LLM pair). The interval itself: :func:`kvdiverge.estimation.intervals.sharp_interval`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvdiverge.engine.core.pairs import History, KernelFn, TableKernelPair

__all__ = ["ConstructedPair", "divergence_lag", "lower_construction", "upper_construction", "wrap_pair"]


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


def _beyond_window(fn: KernelFn, W: int, p: np.ndarray, q: np.ndarray) -> KernelFn:
    """``fn``, except on histories more than ``W`` lags past divergence, where the pair
    is the fixed ``(p, q)`` (fresh copies each call)."""

    def g(hx: History, hy: History):
        k = divergence_lag(hx, hy)
        if k is not None and k > W:
            return p.copy(), q.copy()
        return fn(hx, hy)

    return g


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

    e = _point(token, vocab_size)
    return _beyond_window(fn, W, e, e)


def upper_construction(fn: KernelFn, vocab_size: int, W: int, tokens: tuple[int, int] = (0, 1)) -> KernelFn:
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

    return _beyond_window(fn, W, _point(a, vocab_size), _point(b, vocab_size))


def wrap_pair(pair: Any, W: int, end: str, **kwargs: Any) -> Any:
    """Apply a §4 construction to a synthetic kernel pair object.

    Parameters
    ----------
    pair : kvdiverge.engine.core.pairs.TableKernelPair
        Must expose ``fn``, ``vocab_size`` and ``eos_ids``.
    W : int
        Window width (lags).
    end : {"lower", "upper"}
        Which construction.
    **kwargs
        ``token=`` for the lower end, ``tokens=`` for the upper end.

    Returns
    -------
    kvdiverge.engine.core.pairs.TableKernelPair
        A new pair with the constructed function and the same vocabulary and EOS ids.

    Raises
    ------
    ValueError
        If ``end`` is not "lower" or "upper".
    """
    if end == "lower":
        g = lower_construction(pair.fn, pair.vocab_size, W, **kwargs)
    elif end == "upper":
        g = upper_construction(pair.fn, pair.vocab_size, W, **kwargs)
    else:
        raise ValueError(f"end must be 'lower' or 'upper', got {end!r}")
    return TableKernelPair(g, pair.vocab_size, eos_ids=tuple(pair.eos_ids))


class ConstructedPair:
    """A §4 construction around any kernel pair of the incremental interface.

    Tracks each row's two histories through ``start`` / ``advance`` / ``rewind`` /
    ``keep_rows`` and, on rows more than ``W`` steps past their divergence, replaces the inner pair's
    log-distributions by point masses: the same token on both sides (``end="lower"``) or
    ``tokens[0]`` on the reference side and ``tokens[1]`` on the evicted side
    (``end="upper"``). Every other row gets the inner pair's output unchanged, so the law
    of the first divergence and of the window is the inner pair's.

    Parameters
    ----------
    pair : kvdiverge.engine.core.pairs.KernelPair
        The inner pair (``vocab_size``, ``eos_ids``, ``start``, ``advance``, ``rewind``,
        ``keep_rows``).
    W : int
        Window width (lags), ``>= 0``.
    end : {"lower", "upper"}
        Which end of the interval to attain.
    token : int
        Lower end: the shared deterministic token.
    tokens : (int, int)
        Upper end: two different deterministic tokens (reference, evicted).

    Raises
    ------
    ValueError
        On an unknown ``end``, ``W < 0`` or tokens outside the vocabulary.
    """

    def __init__(self, pair: Any, W: int, end: str, token: int = 0, tokens: tuple[int, int] = (0, 1)):
        V = int(pair.vocab_size)
        if end == "lower":
            lower_construction(lambda hx, hy: None, V, W, token=token)  # argument checks
            self._tokens = (int(token), int(token))
        elif end == "upper":
            upper_construction(lambda hx, hy: None, V, W, tokens=tokens)
            self._tokens = (int(tokens[0]), int(tokens[1]))
        else:
            raise ValueError(f"end must be 'lower' or 'upper', got {end!r}")
        self.pair = pair
        self.W = int(W)
        self.end = end
        self.vocab_size = V
        self.eos_ids = tuple(getattr(pair, "eos_ids", ()))
        self._hx: list[list[int]] = []
        self._hy: list[list[int]] = []

    def _override(self, logp, logq):
        rows = [
            r
            for r in range(len(self._hx))
            if (k := divergence_lag(tuple(self._hx[r]), tuple(self._hy[r]))) is not None and k > self.W
        ]
        if not rows:
            return logp, logq
        logp, logq = logp.clone(), logq.clone()
        a, b = self._tokens
        logp[rows] = float("-inf")
        logq[rows] = float("-inf")
        logp[rows, a] = 0.0
        logq[rows, b] = 0.0
        return logp, logq

    def start(self, n_rows: int):
        """Every row at the empty history; both log-distributions, shape (n_rows, V)."""
        self._hx = [[] for _ in range(n_rows)]
        self._hy = [[] for _ in range(n_rows)]
        return self._override(*self.pair.start(n_rows))

    def advance(self, x, y):
        """Append ``x[r]``, ``y[r]`` to row ``r``; both log-distributions, shape (n_rows, V)."""
        for r, (a, b) in enumerate(zip(x.tolist(), y.tolist())):
            self._hx[r].append(int(a))
            self._hy[r].append(int(b))
        return self._override(*self.pair.advance(x, y))

    def rewind(self, length) -> None:
        """Cut row ``r``'s histories back to their first ``length[r]`` tokens."""
        self.pair.rewind(length)
        for r, n in enumerate(length.tolist()):
            del self._hx[r][n:]
            del self._hy[r][n:]

    def keep_rows(self, rows) -> None:
        """Keep only ``rows`` (int64 indices into the current rows), in that order, here and in the inner pair."""
        self.pair.keep_rows(rows)
        self._hx = [self._hx[i] for i in rows.tolist()]
        self._hy = [self._hy[i] for i in rows.tolist()]
