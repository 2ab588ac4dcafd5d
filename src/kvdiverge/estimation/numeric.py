"""Division where the denominator may vanish: the one guarded quotient of the estimators and tables."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["safe_divide"]


def safe_divide(num: Any, den: Any, fill: float = float("nan"), where: Any = None) -> Any:
    """``num / den`` where ``den > 0`` (or where ``where`` holds), ``fill`` elsewhere, without warnings.

    Parameters
    ----------
    num, den : float or array_like
        Numerator and denominator, broadcastable (float64).
    fill : float
        The value where the quotient is undefined; default NaN.
    where : bool array_like, optional
        Where the quotient is defined; default ``den > 0`` (a ratio of masses or counts).
        Pass ``den != 0`` for a signed denominator.

    Returns
    -------
    float or numpy.ndarray
        A Python float for scalar inputs, else a float64 array of the broadcast shape.
        Where defined, the result is the IEEE quotient bit for bit.
    """
    if np.ndim(num) == 0 and np.ndim(den) == 0 and (where is None or np.ndim(where) == 0):
        ok = float(den) > 0 if where is None else bool(where)
        return float(num) / float(den) if ok else float(fill)
    num, den = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    ok = den > 0 if where is None else np.asarray(where, dtype=bool)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(ok, num / np.where(ok, den, 1.0), fill)
