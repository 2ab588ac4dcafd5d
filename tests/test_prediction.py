"""The predictive analysis: fidelity on some documents against a task's drop on others, beyond the ratio."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from kvdiverge.estimation.bootstrap import Bootstrap
from kvdiverge.estimation.prediction import (
    STATISTICS,
    PredictionInputError,
    held_out_predictions,
    prediction_problems,
    prediction_statistics,
    prediction_tables,
)
from kvdiverge.estimation.task import direction

RATIOS = (0.25, 0.5, 0.75, 0.9)
PRESSES = ("a", "b", "c", "d", "e", "f")


def stat(values, name):
    return values[STATISTICS.index(name)]


def test_held_out_press_is_predicted_from_the_others_by_interpolation():
    x = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    y = np.array([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    presses = np.array(["a", "a", "b", "b", "c", "c"])
    # b out: fit on x = 1, 2, 5, 6 (already increasing), interpolate at 3 and 4; a out: clipped at x = 3
    np.testing.assert_allclose(held_out_predictions(x, y, presses), [0.3, 0.3, 0.3, 0.4, 0.4, 0.4])


def test_isotonic_fit_pools_violators_and_ties():
    # fitted on press a: x = 1, 2, 2, 3 with y = 0.3, 0.0, 0.2, 0.2: the tie at 2 pools to 0.1,
    # then 0.3 (weight 1) and 0.1 (weight 2) pool to 1/6 over x = 1, 2, and 0.2 stays at 3
    x = np.array([1.0, 2.0, 2.0, 3.0, 1.5, 2.5])
    y = np.array([0.3, 0.0, 0.2, 0.2, 0.0, 0.0])
    presses = np.array(["a", "a", "a", "a", "b", "b"])
    predicted = held_out_predictions(x, y, presses)
    np.testing.assert_allclose(predicted[4:], [1 / 6, (1 / 6 + 0.2) / 2])


def test_statistics_enumerated_by_hand():
    # two ratios, two presses: at each ratio the measure orders the presses as their drops do
    x = np.array([1.0, 2.0, 3.0, 4.0])
    y = np.array([0.1, 0.2, 0.15, 0.3])
    ratio = np.array([0.5, 0.5, 0.9, 0.9])
    presses = np.array(["a", "b", "a", "b"])
    s = prediction_statistics(x, y, ratio, presses)
    assert stat(s, "spearman") == pytest.approx(0.8)  # ranks of y: 1, 3, 2, 4
    assert stat(s, "kendall") == pytest.approx(4 / 6)  # 5 concordant, 1 discordant
    assert stat(s, "kendall_within_ratio") == 1.0
    # ranks: x (1 2 3 4), y (1 3 2 4), r (1.5 1.5 3.5 3.5): r_xy 0.8, r_xr = r_yr = 0.8/sqrt(0.8)... by hand
    rx, ry, rr = np.array([1, 2, 3, 4.0]), np.array([1, 3, 2, 4.0]), np.array([1.5, 1.5, 3.5, 3.5])
    c = np.corrcoef([rx, ry, rr])
    expected = (c[0, 1] - c[0, 2] * c[1, 2]) / np.sqrt((1 - c[0, 2] ** 2) * (1 - c[1, 2] ** 2))
    assert stat(s, "spearman_given_ratio") == pytest.approx(expected)
    assert stat(s, "spearman_given_ratio") == pytest.approx(1.0)
    # press a out: fit on b (x 2, 4; y 0.2, 0.3): predict a at 1 -> 0.2 (clipped), at 3 -> 0.25
    # press b out: fit on a (x 1, 3; y 0.1, 0.15): predict b at 2 -> 0.125, at 4 -> 0.15
    mae = np.mean(np.abs(np.array([0.2, 0.125, 0.25, 0.15]) - y))
    assert stat(s, "mae_held_out") == pytest.approx(mae)
    # ratio only: a out, fit on b (r .5 .9; y .2 .3) -> a: .2, .3; b out, fit on a -> b: .1, .15
    ratio_mae = np.mean(np.abs(np.array([0.2, 0.1, 0.3, 0.15]) - y))
    assert stat(s, "mae_ratio_only") == pytest.approx(ratio_mae)
    assert stat(s, "mae_gain") == pytest.approx(ratio_mae - mae)


def frontier(drop_of, measure_of, n_fid=24, n_task=24, seed=0):
    """Document tables of a 6-press x 4-ratio frontier: per point, a fidelity measure around
    ``measure_of(press, ratio)`` and answers broken with probability ``drop_of(press, ratio)``."""
    rng = np.random.default_rng(seed)
    fragility = dict(zip(PRESSES, np.linspace(0.2, 1.0, len(PRESSES))))
    fid, task, pts = [], [], []
    for press in PRESSES:
        for r in RATIOS:
            point = f"{press}@{r}"
            pts.append({"point": point, "press": press, "ratio": r})
            m = measure_of(fragility[press], r)
            fid += [{"point": point, "doc_id": f"f{i}", "kld": m + 0.01 * rng.normal()} for i in range(n_fid)]
            broken = rng.random(n_task) < drop_of(fragility[press], r)
            task += [
                {"task": "niah", "placement": "inside", "point": point, "doc_id": f"t{i}",
                 "correct_full": True, "correct": not broken[i]}
                for i in range(n_task)
            ]  # fmt: skip
    return pl.DataFrame(fid), pl.DataFrame(task), pl.DataFrame(pts)


def test_a_drop_that_follows_the_ratio_alone_gives_no_partial_correlation_and_no_gain():
    fid, task, pts = frontier(drop_of=lambda f, r: r**2, measure_of=lambda f, r: f * r, n_task=200)
    table, marks = prediction_tables(fid, task, pts, ["kld"], boot=Bootstrap(200, 0.9, 1))
    row = table.row(0, named=True)
    assert row["n_points"] == 24 and row["n_presses"] == 6 and row["n_fidelity_docs"] == 24
    assert row["spearman"] > 0.5  # more compression: larger measure and larger drop
    assert abs(row["spearman_given_ratio"]) < 0.35
    assert row["spearman_given_ratio_lo"] < 0 < row["spearman_given_ratio_hi"]
    assert abs(row["kendall_within_ratio"]) < 0.35
    assert row["mae_gain"] < 0.02  # the measure predicts no better than the ratio
    assert row["mae_gain_lo"] < 0.01
    assert marks.height == 24 and set(marks["press"]) == set(PRESSES)


def test_a_drop_that_follows_the_measure_gives_a_clear_partial_correlation_and_gain():
    fid, task, pts = frontier(drop_of=lambda f, r: f * r, measure_of=lambda f, r: f * r, n_task=200)
    table, _ = prediction_tables(fid, task, pts, ["kld"], boot=Bootstrap(200, 0.9, 1))
    row = table.row(0, named=True)
    assert row["spearman"] > 0.9
    assert row["spearman_given_ratio"] > 0.7 and row["spearman_given_ratio_lo"] > 0.4
    assert row["kendall_within_ratio"] > 0.6 and row["kendall_within_ratio_lo"] > 0.3
    assert row["mae_held_out"] < row["mae_ratio_only"]
    assert row["mae_gain"] > 0.05 and row["mae_gain_lo"] > 0


@pytest.mark.parametrize("measure", ["same_top_p", "S_8", "tau_first"])
def test_a_measure_where_smaller_is_worse_is_oriented(measure):
    fid, task, pts = frontier(drop_of=lambda f, r: f * r, measure_of=lambda f, r: 1 - f * r)
    fid = fid.rename({"kld": measure})
    table, marks = prediction_tables(fid, task, pts, [measure], boot=Bootstrap(50, 0.9, 1))
    assert table["direction"][0] == -1 and table["spearman"][0] > 0.8
    assert (marks["x"] <= 0).all()


def test_direction_of_each_fidelity_measure():
    signs = {
        m: direction(m)
        for m in ("E_M", "p_div", "S_8", "S_16", "tau_first", "kld_mean", "kld_p99", "same_top_p", "ppl_ratio")
    }
    assert signs == {
        "E_M": 1,
        "p_div": 1,
        "S_8": -1,
        "S_16": -1,
        "tau_first": -1,
        "kld_mean": 1,
        "kld_p99": 1,
        "same_top_p": -1,
        "ppl_ratio": 1,
    }


def test_intervals_resample_both_sides_and_repeat_with_the_seed():
    fid, task, pts = frontier(drop_of=lambda f, r: f * r, measure_of=lambda f, r: f * r)
    a, _ = prediction_tables(fid, task, pts, ["kld"], boot=Bootstrap(30, 0.9, 4))
    b, _ = prediction_tables(fid, task, pts, ["kld"], boot=Bootstrap(30, 0.9, 4))
    assert a.equals(b)
    for name in STATISTICS:
        assert a[f"{name}_lo"][0] <= a[name][0] + 1e-12 or np.isnan(a[name][0])


def test_bad_input_is_named_in_one_sentence_each():
    fid, task, pts = frontier(drop_of=lambda f, r: f * r, measure_of=lambda f, r: f * r, n_fid=4, n_task=4)
    overlap = fid.with_columns(doc_id=pl.col("doc_id").str.replace("f", "t"))
    assert "overlap in 4 documents (e.g. 't0')" in prediction_problems(overlap, task, pts)[0]
    two = pts.filter(pl.col("press").is_in(["a", "b"]))
    (problem,) = prediction_problems(fid.filter(pl.col("point").is_in(two["point"])), task, two)[:1]
    assert problem == "the frontier has 2 presses (a, b); leaving one press out needs at least 3"
    weak = task.with_columns(correct_full=pl.col("doc_id").is_in(["t0", "t1"]))
    assert prediction_problems(fid, weak, pts) == [
        "task niah (inside): the full cache answers 50% of the documents, below 70%: too few right answers "
        "to measure a press's drop"
    ]
    with pytest.raises(PredictionInputError, match="overlap"):
        prediction_tables(overlap, task, pts, ["kld"], boot=Bootstrap(10))


def test_the_figure_has_a_panel_per_measure_and_task_with_the_held_out_marks(tmp_path):
    from kvdiverge.report.prediction import plot_prediction, prediction_figure

    fid, task, pts = frontier(drop_of=lambda f, r: f * r, measure_of=lambda f, r: f * r, n_fid=4, n_task=8)
    fid = fid.with_columns(same_top_p=1 - pl.col("kld"))
    after = task.with_columns(placement=pl.lit("after"))
    table, marks = prediction_tables(fid, pl.concat([task, after]), pts, ["kld", "same_top_p"], boot=Bootstrap(20))
    fig = prediction_figure(table, marks)
    assert len(fig.axes) == 4
    titles = [ax.get_title() for ax in fig.axes]
    assert titles[0].startswith("niah (after): rho|ratio") and "held-out MAE" in titles[0]
    assert fig.axes[2].get_xlabel() == "minus same top p (fidelity documents)"
    assert len(fig.axes[0].collections) == 2  # the points and the held-out crosses
    plot_prediction(table, marks, tmp_path / "p.png", tmp_path / "p.pdf")
    assert (tmp_path / "p.png").stat().st_size > 0 and (tmp_path / "p.pdf").stat().st_size > 0


# --------------------------------------------------------------------------- the workflow's inputs


def test_fidelity_documents_from_the_estimates_and_the_teacher_forced_tables():
    from kvdiverge.estimation.prediction import fidelity_documents

    estimates = pl.DataFrame(
        {
            "policy": ["a@0.5", "a@0.5"],
            "doc_id": ["d1", "d0"],
            "T": [3, 3],
            "E_M": [0.2, 0.0],
            "p_div": [0.5, 0.0],
            "E_tau_div": [1.0, 0.0],  # E[tau 1{tau <= T}]
            "S": [[1.0, 0.75, 0.5], [1.0, 1.0, 1.0]],
        }
    )
    teacher = pl.DataFrame(
        {"policy": ["a@0.5"], "doc_id": ["d0"], "kld_mean": [0.01], "same_top_p": [0.9], "ppl_ratio": [1.02]}
    )
    # 101 positions of d0 with KL 0, 1, ..., 100: the 99th percentile is 99 (linear interpolation)
    positions = pl.DataFrame({"policy": ["a@0.5"] * 101, "doc_id": ["d0"] * 101, "kld": np.arange(101.0)})
    out = fidelity_documents(estimates, teacher, positions)
    assert out["doc_id"].to_list() == ["d0", "d1"] and out["point"].to_list() == ["a@0.5"] * 2
    # tau_first = E_tau_div + (1 - p_div)(T + 1): 0 + 4 for d0, 1 + 0.5 x 4 for d1
    assert out["tau_first"].to_list() == [4.0, 3.0]
    assert out["S_2"].to_list() == [1.0, 0.75] and out["S_3"].to_list() == [1.0, 0.5]
    assert out["kld_p99"].to_list() == [99.0, None]
    assert out["kld_mean"].to_list() == [0.01, None] and out["same_top_p"].to_list() == [0.9, None]


def test_the_ratio_of_a_point_is_the_fraction_of_the_full_caches_kv_bytes_it_removes():
    from kvdiverge.estimation.prediction import frontier_points_table

    frontier = pl.DataFrame(
        {
            "policy": ["snapkv@0.25", "snapkv@0.5", "int4", "knorm@0.5"],
            "press": ["snapkv", "snapkv", None, "knorm"],
            "cache": [None, None, "int4", None],
            "retention": [0.75, 0.5, 1.0, 0.5],
            "kv_bytes_per_token": [750.0, 500.0, 140.625, 500.0],  # 1000 in full; 4.5 of 32 bits
        }
    )
    out = frontier_points_table(frontier)
    assert out["press"].to_list() == ["snapkv", "snapkv", "int4", "knorm"]
    np.testing.assert_allclose(out["ratio"].to_numpy(), [0.25, 0.5, 0.859375, 0.5])
    with pytest.raises(PredictionInputError, match="KV bytes per token"):
        frontier_points_table(frontier.with_columns(kv_bytes_per_token=pl.lit(None, dtype=pl.Float64)))


def test_the_full_accuracy_threshold_is_a_setting():
    fid, task, pts = frontier(drop_of=lambda f, r: r, measure_of=lambda f, r: f * r)
    weak = task.with_columns(correct_full=pl.col("doc_id").is_in([f"t{i}" for i in range(20)]))  # 20/24 = 83%
    prediction_tables(fid, weak, pts, ["kld"], boot=Bootstrap(20, 0.9, 1))
    with pytest.raises(PredictionInputError, match="answers 83% of the documents, below 90%"):
        prediction_tables(fid, weak, pts, ["kld"], boot=Bootstrap(20, 0.9, 1), min_full_accuracy=0.9)


def test_each_task_side_is_compared_on_the_points_it_ran():
    from kvdiverge.estimation.prediction import prediction_study

    fid, task, pts = frontier(drop_of=lambda f, r: f * r, measure_of=lambda f, r: f * r)
    after = task.filter(pl.col("point") != "a@0.9").with_columns(placement=pl.lit("after"))
    controls = fid.filter(pl.col("point") == "a@0.25").with_columns(point=pl.lit("noise-floor"))
    study = prediction_study(
        pl.concat([fid, controls]), pl.concat([task, after]), pts, ["kld"], boot=Bootstrap(20, 0.9, 1)
    )
    table = study["prediction"].sort("placement")
    assert table["placement"].to_list() == ["after", "inside"] and table["n_points"].to_list() == [23, 24]
    acc = study["accuracy"].filter(pl.col("point") == "f@0.9")
    assert acc["n_docs"].to_list() == [24, 24] and acc["full_accuracy"].to_list() == [1.0, 1.0]
    np.testing.assert_allclose(acc["drop"].to_numpy(), 1 - acc["accuracy"].to_numpy())
    assert study["predictions"].height == 47
    assert study["accuracy"]["refused"].null_count() == study["accuracy"].height


def test_a_side_whose_full_cache_is_too_weak_is_refused_and_the_others_still_report():
    from kvdiverge.estimation.prediction import prediction_study

    fid, task, pts = frontier(drop_of=lambda f, r: f * r, measure_of=lambda f, r: f * r)
    weak = task.with_columns(task=pl.lit("recall"), correct_full=pl.col("doc_id").is_in(["t0", "t1", "t2"]))
    study = prediction_study(fid, pl.concat([task, weak]), pts, ["kld"], boot=Bootstrap(20, 0.9, 1))
    assert study["prediction"]["task"].to_list() == ["niah"]
    refused = study["accuracy"].filter(pl.col("task") == "recall")["refused"].unique().to_list()
    assert refused == ["task recall (inside): the full cache answers 12% of the documents, below 70%: "
                       "too few right answers to measure a press's drop"]  # fmt: skip
    with pytest.raises(PredictionInputError, match="task recall .inside.: the full cache answers 12%"):
        prediction_study(fid, weak, pts, ["kld"], boot=Bootstrap(20, 0.9, 1))


class _Named(dict):
    """A stand-in for Snakemake's named lists: items and attributes."""

    __getattr__ = dict.__getitem__


def test_the_prediction_script_joins_both_sides_and_writes_every_table(tmp_path):
    import runpy
    from pathlib import Path
    from types import SimpleNamespace as NS

    fid, task, pts = frontier(drop_of=lambda f, r: f * r, measure_of=lambda f, r: f * r, n_fid=6, n_task=24)
    pts = pts.with_columns(policy=pl.col("point"), model=pl.lit("m"), cache=pl.lit(None, dtype=pl.String),
                           retention=1 - pl.col("ratio"), kv_bytes_per_token=1000 * (1 - pl.col("ratio")))  # fmt: skip
    docs = fid.select(
        model=pl.lit("m"), policy="point", doc_id="doc_id", T=pl.lit(16), E_M="kld", p_div="kld",
        E_tau_div=pl.lit(1.0), S=pl.concat_list([1 - pl.col("kld")] * 16),
    )  # fmt: skip
    control = docs.filter(pl.col("policy") == "a@0.25").with_columns(policy=pl.lit("none"), doc_id=pl.lit("t0"))
    teacher = fid.select(
        model=pl.lit("m"), policy="point", doc_id="doc_id", kld_mean="kld", same_top_p=1 - pl.col("kld")
    )
    positions = teacher.select("model", "policy", "doc_id", kld="kld_mean")
    answers = task.select(model=pl.lit("m"), policy="point", doc_id="doc_id", correct_full="correct_full",
                          correct="correct", task="task", placement="placement")  # fmt: skip
    inputs = {"frontier": pts, "documents": pl.concat([docs, control]), "teacher": teacher}
    for name, frame in {**inputs, "positions": positions, "answers": answers}.items():
        frame.write_parquet(tmp_path / f"{name}.parquet")
    (tmp_path / "coupled.tsv").write_text("s\tcpu_time\n1\t48.0\n")
    (tmp_path / "teacher.tsv").write_text("s\tcpu_time\n1\t13.0\n")
    out = _Named({f"{n}_{k}": str(tmp_path / "out" / f"{n}.{k}") for n in ("prediction", "predictions", "accuracy")
                  for k in ("parquet", "csv")}, png=str(tmp_path / "out" / "p.png"), pdf=None)  # fmt: skip
    sm = NS(
        input=_Named({n: str(tmp_path / f"{n}.parquet") for n in inputs},
                     positions=[str(tmp_path / "positions.parquet")], answers=[str(tmp_path / "answers.parquet")]),
        params=NS(measures=["E_M", "kld_mean", "same_top_p"], min_full_accuracy=0.7, points=pts["point"].to_list(),
                  costs={"coupled": [str(tmp_path / "coupled.tsv")], "teacher": [str(tmp_path / "teacher.tsv")]},
                  cost_runs={"coupled": 24, "teacher": 26},
                  bootstrap=20, confidence=0.9, seed=3),
        output=out, log=[str(tmp_path / "prediction.log")], wildcards=NS(model="m"),
    )  # fmt: skip
    runpy.run_path(str(Path(__file__).parents[1] / "workflow/scripts/prediction.py"), init_globals={"snakemake": sm})
    table = pl.read_parquet(out["prediction_parquet"])
    assert table["measure"].to_list() == ["E_M", "kld_mean", "same_top_p"] and set(table["n_points"]) == {24}
    assert table["n_fidelity_docs"].to_list() == [6, 6, 6]  # the none control's document is left out
    # 48 s over the 24 points; the teacher-forced job's 13 s over the 26 runs it served
    assert table["cpu_s_per_point"].to_list() == [2.0, 0.5, 0.5]
    assert (table["spearman"] > 0.5).all()  # same_top_p is oriented: smaller predicts a larger drop
    assert pl.read_parquet(out["accuracy_parquet"]).height == 24 and Path(out["png"]).exists()
