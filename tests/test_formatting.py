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
    from kvdiverge.io.render import html_table, text_table

    assert text_table(["run", "p"], [["a", "0.5"], ["bb", "12"]]) == ["run    p", "---  ---", "a    0.5", "bb    12"]
    assert html_table(["x<y"], [[1], ["&"]]) == (
        "<table><thead><tr><th>x&lt;y</th></tr></thead><tbody><tr><td>1</td></tr><tr><td>&amp;</td></tr></tbody></table>"
    )


def test_task_text_prints_accuracy_correlations_and_auc():
    import polars as pl

    from kvdiverge.report.formatting import task_text

    accuracy = pl.DataFrame({"policy": ["snap"], "n_docs": [24], "full_accuracy": [0.875], "accuracy": [0.5],
                             "drop": [0.375], "drop_lo": [0.2], "drop_hi": [0.55], "extra": [1]})  # fmt: skip
    correlations = pl.DataFrame({"measure": ["E_M"], "n_points": [6], "spearman": [0.9], "spearman_lo": [0.6],
                                 "spearman_hi": [1.0], "kendall": [0.8]})  # fmt: skip
    auc = pl.DataFrame({"measure": ["p_div"], "n_pairs": [40], "n_broken": [9], "auc": [0.93], "auc_lo": [0.81],
                        "auc_hi": [0.99]})  # fmt: skip
    text = task_text({"accuracy": accuracy, "correlations": correlations, "auc": auc})
    assert text.count("shape:") == 3 and "extra" not in text
    for shown in ("snap", "0.875", "0.375", "E_M", "0.9", "p_div", "0.93", "n_broken"):
        assert shown in text, shown
