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


def test_the_prediction_studys_markdown_tables_quote_their_rows():
    import polars as pl

    from kvdiverge.report.formatting import accuracy_markdown, pairwise_markdown, prediction_markdown

    row = {"task": "niah", "placement": "inside", "measure": "kld_mean", "kendall_within_ratio": -0.2,
           "kendall_within_ratio_lo": -0.351, "kendall_within_ratio_hi": 0.0812, "p_kendall_within_ratio_holm": 0.93,
           "mae_gain": -0.031, "mae_gain_lo": -0.05, "mae_gain_hi": 0.004, "p_mae_gain_holm": 1.0,
           "n_points_band": 9, "kendall_within_ratio_band": 0.11, "mae_gain_band": 0.0123,
           "p_kendall_within_ratio_band_holm": 0.4, "p_mae_gain_band_holm": 0.25, "spearman_given_ratio": 0.17,
           "cpu_s_per_point": 22.4}  # fmt: skip
    other = {**row, "measure": "E_M"}
    lines = prediction_markdown(pl.DataFrame([row, other]), ["E_M", "kld_mean"]).splitlines()
    assert lines[0].startswith("| task | measure | τ within ratio [95% CI] | p Holm | gain [95% CI] | p Holm |")
    assert lines[1] == "| " + " | ".join(["---"] * 10) + " |"
    assert lines[2].startswith("| niah (inside) | `E_M` |") and len(lines) == 4  # in the measures' order
    assert lines[3] == ("| niah (inside) | `kld_mean` | -0.2 [-0.35, 0.081] | 0.93 | -0.031 [-0.05, 0.004] | 1 | "
                        "9, 0.11, 0.012 | 0.4, 0.25 | 0.17 | 22 |")  # fmt: skip
    pairs = pl.DataFrame([{"task": "niah", "placement": "inside", "measure_a": "E_M", "measure_b": "kld_mean",
                           "mae_gain_difference": 0.02, "mae_gain_difference_lo": -0.01, "mae_gain_difference_hi": 0.05,
                           "kendall_within_ratio_difference": 0.1, "kendall_within_ratio_difference_lo": 0.0,
                           "kendall_within_ratio_difference_hi": 0.3}])  # fmt: skip
    # a pair asked the other way round: the differences and their intervals negated
    assert pairwise_markdown(pairs, [("kld_mean", "E_M")]).splitlines()[2] == (
        "| niah (inside) | `kld_mean` − `E_M` | -0.02 [-0.05, 0.01] | -0.1 [-0.3, 0] |"
    )
    with pytest.raises(ValueError, match=r"no pair \(kld_mean, p_div\) for task side \('niah', 'inside'\)"):
        pairwise_markdown(pairs, [("kld_mean", "p_div")])
    accuracy = pl.DataFrame([{"task": "niah", "placement": "inside", "point": p, "n_docs": 28, "n_full_right": 27,
                              "full_accuracy": 27 / 28, "lowest_accuracy": 0.21, "chance_accuracy": None,
                              "min_full_accuracy": 0.7, "refused": None} for p in ("a", "b")])  # fmt: skip
    assert accuracy_markdown(accuracy).splitlines()[2] == "| niah (inside) | 2 | 27 / 28 (96%) | 0.21 | – | no |"


def test_summary_text_names_llama_cpps_f16_control_as_the_noise_floor():
    """Without a noise-floor press, the note asks for one; on llama.cpp, where a kvpress press does not run,
    it names the f16 control instead (the presses' records say ``backend: llama_cpp``)."""
    import polars as pl

    from kvdiverge.report.formatting import summary_text

    zero = {f"{c}{s}": 0.0 for c in ("p_div", "tau_mean", "E_M") for s in ("", "_lo", "_hi")}
    row = {"n_docs": 2, "kept_fraction": 1.0, "first_mismatch_term": 0.0, "exposure_rate_term": 0.0,
           "E_L": 0.0, "rho": None, "no_divergence": False, **zero}  # fmt: skip
    summary = pl.DataFrame([{"policy": "f16", "untouched": True, **row}, {"policy": "q4_0", "untouched": False, **row}])
    settings = {"model": "m", "T": 4, "R": 1, "temperature": 0.7, "top_p": 0.95, "seed": 0, "confidence": 0.95}
    llama = {"backend": "llama_cpp", "type_v": "f16", "rotation": True}
    notes = {
        "transformers": summary_text(summary, {**settings, "presses": {"knorm": {"press": "KnormPress"}}}, None, "P"),
        "llama.cpp": summary_text(
            summary, {**settings, "presses": {"f16": {**llama, "type_k": "f16"}, "q4_0": {**llama, "type_k": "q4_0"}}},
            None, "P",
        ),
    }  # fmt: skip
    assert notes["transformers"].splitlines()[-1] == "noise floor: not measured (add a P to compare each press with it)"
    assert notes["llama.cpp"].splitlines()[-1] == (
        "noise floor: the f16 control (llama.cpp's full cache against itself; a P is a kvpress press and does not run "
        "on llama.cpp)"
    )
