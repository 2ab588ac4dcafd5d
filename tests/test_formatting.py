"""kvdiverge.report.formatting: the one number formatter of the report pages and the summary."""

from __future__ import annotations

import numpy as np
import pytest

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
    from kvdiverge.io.render import html_table, markdown_table, text_table

    assert text_table(["run", "p"], [["a", "0.5"], ["bb", "12"]]) == ["run    p", "---  ---", "a    0.5", "bb    12"]
    assert markdown_table(["run", "p"], [["a", "0.5"]]) == ["| run | p |", "| --- | --- |", "| a | 0.5 |"]
    with pytest.raises(ValueError, match="a row has 1 cells, the header 2"):
        markdown_table(["run", "p"], [["a"]])
    assert html_table(["x<y"], [[1], ["&"]]) == (
        "<table><thead><tr><th>x&lt;y</th></tr></thead><tbody><tr><td>1</td></tr><tr><td>&amp;</td></tr></tbody></table>"
    )


def test_task_text_prints_accuracy_correlations_and_auc_with_whole_press_names():
    import polars as pl

    from kvdiverge.report.formatting import task_text

    long = ["SnapKVPress:compression_ratio=0.25,window_size=16", "SnapKVPress:compression_ratio=0.5,window_size=16"]
    accuracy = pl.DataFrame({"policy": long, "n_docs": [24, 24], "full_accuracy": [0.875, 0.875],
                             "accuracy": [0.5, 0.25], "drop": [0.375, 0.625], "drop_lo": [0.2, 0.4],
                             "drop_hi": [0.55, None], "extra": [1, 2]})  # fmt: skip
    correlations = pl.DataFrame({"measure": ["E_M"], "n_points": [6], "spearman": [0.9], "spearman_lo": [0.6],
                                 "spearman_hi": [1.0], "kendall": [0.8]})  # fmt: skip
    auc = pl.DataFrame({"measure": ["p_div"], "n_pairs": [40], "n_broken": [9], "auc": [0.93], "auc_lo": [0.81],
                        "auc_hi": [0.99]})  # fmt: skip
    lines = task_text({"accuracy": accuracy, "correlations": correlations, "auc": auc}).splitlines()
    width = len(long[0])
    assert lines[:4] == [
        "press".ljust(width) + "  prompts  full-cache accuracy  accuracy          drop [CI]",
        "-" * width + "  -------  -------------------  --------  -----------------",
        long[0] + "       24                0.875       0.5  0.375 [0.2, 0.55]",
        long[1] + "        24                0.875      0.25     0.625 [0.4, -]",
    ]
    assert lines[5:8] == [
        "measure  points  Spearman [CI]  Kendall",
        "-------  ------  -------------  -------",
        "E_M           6   0.9 [0.6, 1]      0.8",
    ]
    assert lines[9:] == [
        "measure  pairs  broken           AUC [CI]",
        "-------  -----  ------  -----------------",
        "p_div       40       9  0.93 [0.81, 0.99]",
    ]
