"""kvdiverge.report.formatting: the one number formatter of the report pages and the summary."""

from __future__ import annotations

import numpy as np

from kvdiverge.report.formatting import MISSING, number, with_interval


def test_number():
    assert number(0.123456) == "0.123" and number(np.float64(1234.5)) == "1.23e+03"
    assert number(0.123456, digits=5) == "0.12346"
    assert number(7) == "7" and number(np.int64(7)) == "7" and number("x") == "x"
    assert number(None) == number(float("nan")) == number(np.nan) == MISSING == "–"
    assert number(None, missing="-") == "-"
    assert number(float("inf")) == "inf" and number(-np.inf) == "-inf"


def test_with_interval():
    r = {"E_M": 0.25, "E_M_lo": 0.125, "E_M_hi": None}
    assert with_interval(r, "E_M") == "0.25 [0.125, –]"
    assert with_interval(r, "E_M", digits=1, missing="-") == "0.2 [0.1, -]"


def test_the_table_renderers():
    from kvdiverge.estimation.render import html_table, text_table

    assert text_table(["run", "p"], [["a", "0.5"], ["bb", "12"]]) == ["run    p", "---  ---", "a    0.5", "bb    12"]
    assert html_table(["x<y"], [[1], ["&"]]) == (
        "<table><thead><tr><th>x&lt;y</th></tr></thead><tbody><tr><td>1</td></tr><tr><td>&amp;</td></tr></tbody></table>"
    )
