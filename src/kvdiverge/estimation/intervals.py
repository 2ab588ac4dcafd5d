"""Sharp interval for cumulative disagreement from a finite window (estimators.md §4).

Knowing only the law of the first divergence ``tau`` and ``E[N_win]`` (the first ``W``
lags after divergence were observed, the tail was not), the set of possible ``E[N]``
over unrestricted autoregressive kernel pairs that agree with ``P``, ``Q`` on shared
prefixes and on the first ``W`` post-divergence steps is exactly

    [ p_div + E[N_win],  p_div + E[N_win] + E[L_tail] ].

:func:`sharp_interval` evaluates the ends (and the implied ones for ``E[M]`` and ``rho``);
the constructions that attain them are in :mod:`kvdiverge.testing.constructions`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvdiverge.estimation.decomposition import rho

__all__ = ["sharp_interval"]


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
    rho_lo = rho(E_N_win, E_L)
    rho_hi = rho(E_N_win + E_L_tail, E_L)
    out = {
        "E_N_lo": lo,
        "E_N_hi": hi,
        "E_M_lo": lo / T,
        "E_M_hi": hi / T,
        "rho_lo": rho_lo,
        "rho_hi": rho_hi,
    }
    return {k: (float(v) if np.ndim(v) == 0 else v) for k, v in out.items()}
