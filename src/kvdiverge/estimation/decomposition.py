"""The §3 decomposition ``E[M] = p_div / T + (E[L] / T) rho`` and its rate ``rho``.

``rho = E[N_post] / E[L]`` is the post-divergence mismatch rate (estimators.md §3); every
table that reports it, the §4 interval's bounds on it, the §3 check and the §7 gap terms
compute it with :func:`rho`, which also decides what it is where ``E[L] = 0``.
"""

from __future__ import annotations

import numpy as np

from kvdiverge.estimation.numeric import safe_divide

__all__ = ["DECOMP_ATOL", "DECOMP_RTOL", "DecompositionError", "check_decomposition", "rho"]

#: Relative and absolute tolerance of the §3 identity check.
DECOMP_RTOL = 1e-9
DECOMP_ATOL = 1e-9


class DecompositionError(ValueError):
    """The §3 identity ``E[M] = p_div/T + (E[L]/T) rho`` failed: a bug, never noise."""


def rho(E_N_post, E_L, undefined: float = float("nan")):
    """Post-divergence mismatch rate ``rho = E[N_post] / E[L]`` (estimators.md §3).

    Parameters
    ----------
    E_N_post : float or numpy.ndarray
        ``E[N_post]`` (tokens), or resampled means of it.
    E_L : float or numpy.ndarray
        ``E[L]`` (steps), same shape.
    undefined : float
        The value where ``E[L]`` is not positive (then ``E[N_post]`` is 0 too and
        ``rho`` is undefined): NaN for a reported ``rho``, 0 inside the decomposition,
        whose exposure term ``(E[L] / T) rho`` is then 0.

    Returns
    -------
    float or numpy.ndarray of float64
        A Python float for scalar inputs, else an array of the inputs' shape.
    """
    return safe_divide(E_N_post, E_L, undefined)


def check_decomposition(E_M, p_div, E_L, E_N_post, T, where: str = "") -> tuple[np.ndarray, np.ndarray]:
    """Check the §3 identity ``E[M] = p_div/T + (E[L]/T) * rho`` with ``rho = E[N_post]/E[L]``.

    When ``E[L] = 0`` the exposure-rate term is 0 and ``E[N_post]`` must be 0 too.

    Parameters
    ----------
    E_M, p_div, E_L, E_N_post, T : float or numpy.ndarray
        Aggregates, elementwise.
    where : str
        Label for the error message.

    Returns
    -------
    first_mismatch_term, exposure_rate_term : numpy.ndarray
        ``p_div / T`` and ``(E[L] / T) * rho``.

    Raises
    ------
    DecompositionError
        If the identity fails beyond ``DECOMP_RTOL`` / ``DECOMP_ATOL``.
    """
    E_M, p_div, E_L, E_N_post, T = (np.asarray(v, dtype=np.float64) for v in (E_M, p_div, E_L, E_N_post, T))
    first = p_div / T
    with np.errstate(divide="ignore", invalid="ignore"):
        rate = np.where(E_L > 0, E_L / T * rho(E_N_post, E_L, 0.0), 0.0)
    rhs = first + rate
    bad = ~np.isclose(E_M, rhs, rtol=DECOMP_RTOL, atol=DECOMP_ATOL)
    bad |= (E_L <= 0) & ~np.isclose(E_N_post, 0.0, atol=DECOMP_ATOL)
    if np.any(bad):
        i = int(np.flatnonzero(np.atleast_1d(bad))[0])
        raise DecompositionError(
            f"decomposition E[M] = p_div/T + (E[L]/T)*rho fails{(' for ' + where) if where else ''}: "
            f"E[M]={np.atleast_1d(E_M)[i]!r}, p_div/T + (E[L]/T)*rho={np.atleast_1d(rhs)[i]!r} "
            f"(E[L]={np.atleast_1d(E_L)[i]!r}, E[N_post]={np.atleast_1d(E_N_post)[i]!r})"
        )
    return first, rate
