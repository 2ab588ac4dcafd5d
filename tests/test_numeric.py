"""The guarded quotient: IEEE division where defined, the fill value elsewhere, scalars as floats."""

import math

import numpy as np

from kvdiverge.estimation.numeric import safe_divide


def test_safe_divide_scalars_and_arrays():
    assert safe_divide(1.0, 4.0) == 0.25 and isinstance(safe_divide(1, 4), float)
    assert math.isnan(safe_divide(0.0, 0.0)) and math.isnan(safe_divide(3.0, -2.0))  # den > 0 by default
    assert safe_divide(3.0, -2.0, where=True) == -1.5
    assert safe_divide(1.0, 0.0, fill=0.0) == 0.0
    got = safe_divide(np.array([1.0, 2.0, 3.0]), np.array([2.0, 0.0, -1.0]))
    np.testing.assert_array_equal(got, [0.5, np.nan, np.nan])
    signed = np.array([2.0, 0.0, -4.0])
    np.testing.assert_array_equal(safe_divide(np.ones(3), signed, where=signed != 0), [0.5, np.nan, -0.25])
    # bit for bit the IEEE quotient where defined
    a, b = np.array([0.1, 1 / 3]), np.array([0.3, 7.0])
    assert safe_divide(a, b).tobytes() == (a / b).tobytes()
