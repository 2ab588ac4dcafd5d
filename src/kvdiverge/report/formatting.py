"""Numbers as text for the report pages and the measurement summary.

- :func:`number` — 3 significant digits (``%g``), a dash for a missing value or NaN.
- :func:`with_interval` — ``value [lo, hi]`` from a row's ``c``, ``c_lo`` and ``c_hi``.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

__all__ = ["MISSING", "number", "with_interval"]

#: What a missing value or NaN reads as (an en dash).
MISSING = "–"


def number(v: Any, digits: int = 3, missing: str = MISSING) -> str:
    """``v`` with ``digits`` significant digits (``%g``); ``missing`` for None or NaN.

    Parameters
    ----------
    v : float, int, str or None
        Floats (numpy floats included) are formatted, infinities read ``inf`` / ``-inf``;
        anything else is ``str(v)``.
    digits : int
        Significant digits.
    missing : str
        Text for None and NaN (the plain-text summary uses ``-``).
    """
    if v is None:
        return missing
    if isinstance(v, float):
        if math.isnan(v):
            return missing
        return str(v) if math.isinf(v) else f"{v:.{digits}g}"
    return str(v)


def with_interval(r: Mapping[str, Any], c: str, digits: int = 3, missing: str = MISSING) -> str:
    """``r[c] [r[c_lo], r[c_hi]]``, each formatted by :func:`number`."""
    return (f"{number(r[c], digits, missing)} "
            f"[{number(r[c + '_lo'], digits, missing)}, {number(r[c + '_hi'], digits, missing)}]")
