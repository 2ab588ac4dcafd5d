"""The predictive analysis: fidelity on some documents against a task's drop on others, beyond the ratio."""

from __future__ import annotations

import itertools
import math

import numpy as np
import polars as pl
import pytest
from scipy import stats

from kvdiverge.estimation.beyond_ratio import (
    STATISTICS,
    TESTED,
    held_out_predictions,
    prediction_statistics,
    within_ratio_permutation,
)
from kvdiverge.estimation.bootstrap import Bootstrap
from kvdiverge.estimation.confirmatory import holm
from kvdiverge.estimation.prediction import PredictionSettings, prediction_study, prediction_tables, press_errors
from kvdiverge.estimation.prediction_inputs import PredictionInputError, prediction_problems
from kvdiverge.estimation.prediction_review import chance_accuracy, cpu_per_point, prediction_without
from kvdiverge.estimation.task import direction

RATIOS = (0.25, 0.5, 0.75, 0.9)
PRESSES = ("a", "b", "c", "d", "e", "f")


def stat(values, name):
    return values[STATISTICS.index(name)]


def quick(n_boot=50, n_perm=49, seed=1, **kw):
    return PredictionSettings(boot=Bootstrap(n_boot, 0.9, seed), n_perm=n_perm, **kw)


# --------------------------------------------------------------------------- an independent reimplementation


def naive_ranks(v):
    return [sum(w < a for w in v) + (sum(w == a for w in v) + 1) / 2 for a in v]


def naive_pearson(a, b):
    n = len(a)
    ma, mb = sum(a) / n, sum(b) / n
    sab = sum((p - ma) * (q - mb) for p, q in zip(a, b))
    return sab / math.sqrt(sum((p - ma) ** 2 for p in a) * sum((q - mb) ** 2 for q in b))


def sign(v):
    return (v > 0) - (v < 0)


def naive_kendall_b(x, y):
    pairs = list(itertools.combinations(range(len(x)), 2))
    s = sum(sign(x[i] - x[j]) * sign(y[i] - y[j]) for i, j in pairs)
    untied_x = sum(x[i] != x[j] for i, j in pairs)
    untied_y = sum(y[i] != y[j] for i, j in pairs)
    return s / math.sqrt(untied_x * untied_y)


def naive_isotonic(xs, ys):
    """Pool ties, then pool adjacent violators; the fit as a function, flat beyond the ends."""
    blocks = []
    for x, y in sorted(zip(xs, ys)):
        if blocks and blocks[-1][0] == x:
            blocks[-1][1] += y
            blocks[-1][2] += 1
        else:
            blocks.append([x, y, 1])
    stack = []
    for _, total, w in blocks:
        stack.append([total / w, w, 1])
        while len(stack) > 1 and stack[-2][0] > stack[-1][0]:
            v2, w2, c2 = stack.pop()
            v1, w1, c1 = stack.pop()
            stack.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, c1 + c2])
    knots = [b[0] for b in blocks]
    fitted = [v for v, _, c in stack for _ in range(c)]

    def predict(x):
        if x <= knots[0]:
            return fitted[0]
        if x >= knots[-1]:
            return fitted[-1]
        k = max(i for i in range(len(knots)) if knots[i] <= x)
        return fitted[k] + (x - knots[k]) * (fitted[k + 1] - fitted[k]) / (knots[k + 1] - knots[k])

    return predict


def naive_held_out_mae(x, y, presses):
    if len(set(presses)) < 2:
        return float("nan")
    errors = []
    for i in range(len(x)):
        others = [k for k in range(len(x)) if presses[k] != presses[i]]
        fit = naive_isotonic([x[k] for k in others], [y[k] for k in others])
        errors.append(abs(fit(x[i]) - y[i]))
    return sum(errors) / len(errors)


def naive_within(x, y, r):
    same = [(i, j) for i, j in itertools.combinations(range(len(x)), 2) if abs(r[i] - r[j]) <= 1e-9]
    if not same:
        return float("nan")
    return sum(sign(x[i] - x[j]) * sign(y[i] - y[j]) for i, j in same) / len(same)


def naive_statistics(x, y, r, presses, band):
    keep = [i for i in range(len(x)) if math.isfinite(x[i]) and math.isfinite(y[i])]
    x, y, r, presses = ([v[i] for i in keep] for v in (x, y, r, presses))
    near = [i for i in range(len(x)) if abs(y[i]) <= band]
    xn, yn, rn, pn = ([v[i] for i in near] for v in (x, y, r, presses))
    held, ratio_only = naive_held_out_mae(x, y, presses), naive_held_out_mae(r, y, presses)
    gain_near = naive_held_out_mae(rn, yn, pn) - naive_held_out_mae(xn, yn, pn)
    rx, ry, rr = naive_ranks(x), naive_ranks(y), naive_ranks(r)
    rho, xr, yr = naive_pearson(rx, ry), naive_pearson(rx, rr), naive_pearson(ry, rr)
    partial = (rho - xr * yr) / math.sqrt((1 - xr**2) * (1 - yr**2))
    return [naive_within(x, y, r), held, ratio_only, ratio_only - held, naive_within(xn, yn, rn), gain_near,
            rho, naive_kendall_b(x, y), partial]  # fmt: skip


def synthetic_points(seed):
    """A frontier's points: 6 presses at 4 ratios and a quantized cache alone at its ratio, drops in
    steps of 1/28 (ties), two tied measures and one point without the measure."""
    rng = np.random.default_rng(seed)
    presses = [p for _ in RATIOS for p in PRESSES] + ["int4"]
    ratio = np.array([r for r in RATIOS for _ in PRESSES] + [0.84])
    x = rng.normal(size=len(ratio)) + ratio
    x[3] = x[7]
    x[11] = np.nan
    y = np.round(np.clip(ratio * rng.random(len(ratio)) + rng.normal(0, 0.05, len(ratio)), -0.1, 1) * 28) / 28
    return x, y, ratio, np.array(presses)


@pytest.mark.parametrize("seed", range(4))
def test_the_statistics_equal_an_independent_reimplementation(seed):
    x, y, ratio, presses = synthetic_points(seed)
    expected = naive_statistics(x.tolist(), y.tolist(), ratio.tolist(), presses.tolist(), 0.10)
    np.testing.assert_allclose(prediction_statistics(x, y, ratio, presses, band=0.10), expected, rtol=0, atol=1e-15)
    ok = np.isfinite(x)  # and against scipy's own rank correlations
    assert stat(prediction_statistics(x, y, ratio, presses), "kendall") == pytest.approx(
        stats.kendalltau(x[ok], y[ok]).statistic, abs=1e-15
    )
    assert stat(prediction_statistics(x, y, ratio, presses), "spearman") == pytest.approx(
        stats.spearmanr(x[ok], y[ok]).statistic, abs=1e-15
    )


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
    s = prediction_statistics(x, y, ratio, presses, band=0.15)
    assert stat(s, "spearman") == pytest.approx(0.8)  # ranks of y: 1, 3, 2, 4
    assert stat(s, "kendall") == pytest.approx(4 / 6)  # 5 concordant, 1 discordant
    assert stat(s, "kendall_within_ratio") == 1.0
    assert stat(s, "spearman_given_ratio") == pytest.approx(1.0)
    # press a out: fit on b (x 2, 4; y 0.2, 0.3): predict a at 1 -> 0.2 (clipped), at 3 -> 0.25
    # press b out: fit on a (x 1, 3; y 0.1, 0.15): predict b at 2 -> 0.125, at 4 -> 0.15
    mae = np.mean(np.abs(np.array([0.2, 0.125, 0.25, 0.15]) - y))
    assert stat(s, "mae_held_out") == pytest.approx(mae)
    # ratio only: a out, fit on b (r .5 .9; y .2 .3) -> a: .2, .3; b out, fit on a -> b: .1, .15
    ratio_mae = np.mean(np.abs(np.array([0.2, 0.1, 0.3, 0.15]) - y))
    assert stat(s, "mae_ratio_only") == pytest.approx(ratio_mae)
    assert stat(s, "mae_gain") == pytest.approx(ratio_mae - mae)
    # near the baseline (|y| <= 0.15): points 0 (a, 0.5) and 2 (a, 0.9): one press, no pair at one ratio
    assert np.isnan(stat(s, "kendall_within_ratio_band")) and np.isnan(stat(s, "mae_gain_band"))


def test_a_point_alone_at_its_ratio_moves_the_partial_correlation_and_not_the_within_ratio_kendall():
    # 6 presses at 4 ratios, the drop following the ratio and not the measure; then one 4-bit-like
    # point alone at its ratio: a high ratio, a low drop and the lowest measure
    rng = np.random.default_rng(0)
    ratio, presses = np.repeat(RATIOS, 6), np.array(list(PRESSES) * 4)
    x, y = ratio + rng.normal(0, 0.3, 24), ratio**2 + rng.normal(0, 0.1, 24)
    before = prediction_statistics(x, y, ratio, presses)
    after = prediction_statistics(
        *(np.append(v, a) for v, a in ((x, x.min()), (y, 0.07), (ratio, 0.84), (presses, "int4")))
    )
    assert stat(after, "kendall_within_ratio") == stat(before, "kendall_within_ratio") == pytest.approx(-0.2)
    assert stat(before, "spearman_given_ratio") < -0.2 and stat(after, "spearman_given_ratio") > 0.3


# --------------------------------------------------------------------------- the permutation test


def test_the_permutation_p_value_approaches_the_exact_one_by_enumeration():
    # two ratios of three points: 3! x 3! = 36 within-ratio arrangements, enumerated
    x = np.array([0.1, 0.5, 0.3, 1.2, 0.9, 1.0])
    y = np.array([0.0, 0.2, 0.1, 0.5, 0.6, 0.4])
    ratio = np.array([0.5, 0.5, 0.5, 0.9, 0.9, 0.9])
    presses = np.array(["a", "b", "c", "a", "b", "c"])
    observed = stat(prediction_statistics(x, y, ratio, presses), "kendall_within_ratio")
    arrangements = [np.r_[x[:3][list(p)], x[3:][list(q)]] for p in itertools.permutations(range(3))
                    for q in itertools.permutations(range(3))]  # fmt: skip
    exact = np.mean([stat(prediction_statistics(a, y, ratio, presses), "kendall_within_ratio") >= observed - 1e-12
                     for a in arrangements])  # fmt: skip
    test = within_ratio_permutation(x, y, ratio, presses, band=0.0, n_perm=1000, rng=5)
    k = TESTED.index("kendall_within_ratio")
    assert test.statistic[k] == observed == pytest.approx(1 / 3)
    assert exact == pytest.approx(13 / 36)  # stratum sums (3, 3), (3, 1), (1, 3), (3, -1), (-1, 3), (1, 1)
    assert test.pvalue[k] == pytest.approx(exact, abs=3 * np.sqrt(exact * (1 - exact) / 1000))
    assert test.pvalue[k] == (1 + np.sum(test.null_distribution[:, k] >= observed - 1e-12)) / 1001
    # every permuted measure keeps each ratio's values: the null holds only the enumerated values
    assert set(np.round(test.null_distribution[:, k], 12)) <= {
        round(stat(prediction_statistics(a, y, ratio, presses), "kendall_within_ratio"), 12) for a in arrangements
    }
    again = within_ratio_permutation(x, y, ratio, presses, band=0.0, n_perm=1000, rng=5)
    np.testing.assert_array_equal(again.null_distribution, test.null_distribution)


def null_frontier(rng, presses=4, ratios=(0.25, 0.5, 0.9)):
    """A frontier where the drop follows press and ratio and the measure is noise within each ratio."""
    fragility = rng.random(presses)
    press = np.tile(np.arange(presses), len(ratios)).astype(str)
    ratio = np.repeat(ratios, presses)
    y = ratio * np.tile(fragility, len(ratios)) + rng.normal(0, 0.05, len(ratio))
    return ratio + rng.normal(size=len(ratio)), y, ratio, press


def test_the_permutation_p_values_are_calibrated_under_the_null():
    rng = np.random.default_rng(11)
    p = np.array(
        [within_ratio_permutation(*null_frontier(rng), band=0.0, n_perm=39, rng=s).pvalue[:2] for s in range(200)]
    )
    lo, hi = stats.binom(200, 0.05).ppf([0.001, 0.999])
    rejected = (p <= 0.05).sum(axis=0)  # within-ratio Kendall, held-out gain
    assert lo <= rejected[0] <= hi and lo <= rejected[1] <= hi, rejected
    lo, hi = stats.binom(200, 0.25).ppf([0.001, 0.999])
    assert np.all((lo <= (p <= 0.25).sum(axis=0)) & ((p <= 0.25).sum(axis=0) <= hi))


def test_the_permutation_finds_a_measure_that_orders_each_ratio():
    rng = np.random.default_rng(3)
    x, y, ratio, press = null_frontier(rng, presses=6, ratios=RATIOS)
    test = within_ratio_permutation(y + rng.normal(0, 0.01, len(y)), y, ratio, press, n_perm=199, rng=0)
    assert test.pvalue[TESTED.index("kendall_within_ratio")] == 1 / 200
    assert test.pvalue[TESTED.index("mae_gain")] < 0.05


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n_perm": 0}, "n_perm must be an integer >= 1, got 0"),
        ({"n_perm": 9.5}, "n_perm must be an integer >= 1, got 9.5"),
        ({"band": -0.1}, "band must be a finite number >= 0, got -0.1"),
        ({"band": float("nan")}, "band must be a finite number >= 0, got nan"),
    ],
)
def test_the_permutation_test_refuses_bad_options(kwargs, message):
    x, y, ratio, press = null_frontier(np.random.default_rng(0))
    with pytest.raises(ValueError, match=message):
        within_ratio_permutation(x, y, ratio, press, **kwargs)
    with pytest.raises(ValueError, match=r"1-D of one length, got shapes \{'x': \(12,\), 'y': \(11,\)"):
        within_ratio_permutation(x, y[:-1], ratio, press)


def test_holm_by_hand():
    # sorted 0.01, 0.03, 0.04, 0.2: times 4, 3, 2, 1 = 0.04, 0.09, 0.08, 0.2; then running maxima
    np.testing.assert_allclose(holm([0.01, 0.04, 0.03, 0.2]), [0.04, 0.09, 0.09, 0.2])
    np.testing.assert_allclose(holm([0.3, 0.01, np.nan]), [0.3, 0.02, np.nan])


# --------------------------------------------------------------------------- the tables


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


def test_a_drop_that_follows_the_ratio_alone_gives_no_within_ratio_order_and_no_gain():
    fid, task, pts = frontier(drop_of=lambda f, r: r**2, measure_of=lambda f, r: f * r, n_task=200)
    out = prediction_tables(fid, task, pts, ["kld"], settings=quick(200, 99))
    row = out.table.row(0, named=True)
    assert row["n_points"] == 24 and row["n_presses"] == 6 and row["n_fidelity_docs"] == 24
    assert row["spearman"] > 0.5  # more compression: larger measure and larger drop
    assert abs(row["kendall_within_ratio"]) < 0.35
    assert row["kendall_within_ratio_lo"] < 0 < row["kendall_within_ratio_hi"]
    assert row["mae_gain"] < 0.02 and row["mae_gain_lo"] < 0.01  # no better than the ratio
    assert row["p_kendall_within_ratio"] > 0.05 and row["p_mae_gain"] > 0.05
    assert out.predictions.height == 24 and set(out.predictions["press"]) == set(PRESSES)


def test_a_drop_that_follows_the_measure_gives_a_clear_within_ratio_order_and_gain():
    fid, task, pts = frontier(drop_of=lambda f, r: f * r, measure_of=lambda f, r: f * r, n_task=200)
    row = prediction_tables(fid, task, pts, ["kld"], settings=quick(200, 99)).table.row(0, named=True)
    assert row["spearman"] > 0.9 and row["spearman_given_ratio"] > 0.7
    assert row["kendall_within_ratio"] > 0.6 and row["kendall_within_ratio_lo"] > 0.3
    assert row["mae_held_out"] < row["mae_ratio_only"]
    assert row["mae_gain"] > 0.05 and row["mae_gain_lo"] > 0
    assert row["p_kendall_within_ratio"] == row["p_mae_gain"] == 0.01  # 1 / (1 + 99)
    assert row["p_kendall_within_ratio_holm"] == 0.01  # one measure: nothing to adjust


def test_holm_adjusts_each_statistics_p_values_across_the_measures_of_a_side():
    fid, task, pts = frontier(drop_of=lambda f, r: f * r, measure_of=lambda f, r: f * r)
    rng = np.random.default_rng(0)
    fid = fid.with_columns(noise=pl.Series(rng.normal(size=fid.height)), weak=pl.col("kld") + 0.05 * rng.normal())
    table = prediction_tables(fid, task, pts, ["kld", "noise", "weak"], settings=quick(10, 99)).table
    for name in TESTED:
        p = table[f"p_{name}"].to_numpy()
        order = np.argsort(p, kind="stable")  # Holm by hand: (m - i) p_(i), running maximum, capped at 1
        expected = np.empty(3)
        expected[order] = np.minimum(1, np.maximum.accumulate((3 - np.arange(3)) * p[order]))
        np.testing.assert_allclose(table[f"p_{name}_holm"].to_numpy(), expected, rtol=0, atol=1e-15)


def test_every_measure_shares_the_resamples_so_pairs_compare_draw_by_draw():
    fid, task, pts = frontier(drop_of=lambda f, r: f * r, measure_of=lambda f, r: f * r)
    rng = np.random.default_rng(1)
    fid = fid.with_columns(double=2 * pl.col("kld"), noise=pl.Series(rng.normal(size=fid.height)))
    out = prediction_tables(fid, task, pts, ["kld", "double", "noise"], settings=quick(100, 9))
    pairs = out.pairwise
    assert pairs.select("measure_a", "measure_b").rows() == [("kld", "double"), ("kld", "noise"), ("double", "noise")]
    # the same resamples for both: a monotone transform of a measure differs from it in no draw
    same = pairs.row(0, named=True)
    assert same["mae_gain_difference"] == same["mae_gain_difference_lo"] == same["mae_gain_difference_hi"] == 0
    assert same["kendall_within_ratio_difference_lo"] == same["kendall_within_ratio_difference_hi"] == 0
    gains = dict(zip(out.table["measure"], out.table["mae_gain"]))
    row = pairs.row(1, named=True)
    assert row["mae_gain_difference"] == pytest.approx(gains["kld"] - gains["noise"], abs=1e-15)
    assert 0 < row["mae_gain_difference_lo"] <= row["mae_gain_difference"] <= row["mae_gain_difference_hi"]


def test_the_near_baseline_band_restricts_both_primary_statistics_to_small_drops():
    fid, task, pts = frontier(drop_of=lambda f, r: f * r, measure_of=lambda f, r: f * r)
    settings = quick(20, 9, band=0.2)
    out = prediction_tables(fid, task, pts, ["kld"], settings=settings)
    row, marks = out.table.row(0, named=True), out.predictions
    near = marks.filter(pl.col("drop").abs() <= 0.2)
    assert marks["near_baseline"].sum() == near.height == row["n_points_band"] and 4 < near.height < 24
    direct = prediction_statistics(*(near[c].to_numpy() for c in ("x", "drop", "ratio", "press")), band=np.inf)
    assert row["kendall_within_ratio_band"] == stat(direct, "kendall_within_ratio")
    assert row["mae_gain_band"] == pytest.approx(stat(direct, "mae_gain"), abs=1e-15)
    assert row["band"] == 0.2


def test_a_point_without_the_measure_is_left_out_and_the_others_keep_their_marks():
    fid, task, pts = frontier(drop_of=lambda f, r: f * r, measure_of=lambda f, r: f * r, n_fid=4, n_task=8)
    fid = fid.with_columns(kld=pl.when(pl.col("point") == "c@0.5").then(None).otherwise(pl.col("kld")))
    out = prediction_tables(fid, task, pts, ["kld"], settings=quick(10, 9))
    marks = out.predictions
    missing = marks.filter(pl.col("point") == "c@0.5")
    assert (
        np.isnan(missing["x"][0]) and np.isnan(missing["predicted"][0]) and np.isnan(missing["predicted_ratio_only"][0])
    )
    assert marks.filter(pl.col("point") != "c@0.5").select("predicted", "predicted_ratio_only").to_numpy().all()
    assert np.isfinite(marks.filter(pl.col("point") != "c@0.5")["predicted"].to_numpy()).all()
    assert out.table["n_points"][0] == 23
    rest = marks.filter(pl.col("point") != "c@0.5")
    expected = held_out_predictions(rest["x"].to_numpy(), rest["drop"].to_numpy(), rest["press"].to_numpy())
    np.testing.assert_array_equal(rest["predicted"].to_numpy(), expected)


@pytest.mark.parametrize("measure", ["same_top_p", "S_8", "tau_first"])
def test_a_measure_where_smaller_is_worse_is_oriented(measure):
    fid, task, pts = frontier(drop_of=lambda f, r: f * r, measure_of=lambda f, r: 1 - f * r)
    fid = fid.rename({"kld": measure})
    out = prediction_tables(fid, task, pts, [measure], settings=quick(20, 9))
    assert out.table["direction"][0] == -1 and out.table["spearman"][0] > 0.8
    assert (out.predictions["x"] <= 0).all()


def test_direction_of_each_fidelity_measure():
    signs = {
        m: direction(m)
        for m in ("E_M", "p_div", "S_8", "S_16", "tau_first", "kld_mean", "kld_p99", "same_top_p", "ppl_ratio")
        + ("kld_key_mean", "same_top_p_key")
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
        "kld_key_mean": 1,
        "same_top_p_key": -1,
    }


def test_intervals_resample_both_sides_and_repeat_with_the_seed():
    fid, task, pts = frontier(drop_of=lambda f, r: f * r, measure_of=lambda f, r: f * r)
    a = prediction_tables(fid, task, pts, ["kld"], settings=quick(30, 19, seed=4)).table
    b = prediction_tables(fid, task, pts, ["kld"], settings=quick(30, 19, seed=4)).table
    assert a.equals(b)
    assert all(a[f"{name}_lo"][0] <= a[f"{name}_hi"][0] for name in STATISTICS)
    c = prediction_tables(fid, task, pts, ["kld"], settings=quick(30, 19, seed=5)).table
    assert c["mae_gain_lo"][0] != a["mae_gain_lo"][0] and c["mae_gain"][0] == a["mae_gain"][0]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n_perm": -1}, "PredictionSettings.n_perm must be an integer >= 0, got -1"),
        ({"band": -0.5}, "PredictionSettings.band must be a finite number >= 0, got -0.5"),
        ({"min_full_accuracy": 1.5}, r"PredictionSettings.min_full_accuracy must be a number in \[0, 1\], got 1.5"),
        ({"boot": 200}, "PredictionSettings.boot must be a Bootstrap, got 200"),
    ],
)
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PredictionSettings(**kwargs)


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
        prediction_tables(overlap, task, pts, ["kld"], settings=quick(10))


def test_the_figure_has_a_panel_per_measure_and_task_with_the_held_out_marks(tmp_path):
    from kvdiverge.report.prediction import plot_prediction, prediction_figure

    fid, task, pts = frontier(drop_of=lambda f, r: f * r, measure_of=lambda f, r: f * r, n_fid=4, n_task=8)
    fid = fid.with_columns(same_top_p=1 - pl.col("kld"))
    after = task.with_columns(placement=pl.lit("after"))
    out = prediction_tables(fid, pl.concat([task, after]), pts, ["kld", "same_top_p"], settings=quick(20, 19))
    fig = prediction_figure(out.table, out.predictions)
    assert len(fig.axes) == 4
    titles = [ax.get_title() for ax in fig.axes]
    assert titles[0].startswith("niah (after): tau within ratio") and "gain" in titles[0] and "Holm" in titles[0]
    assert fig.axes[2].get_xlabel() == "minus same top p (fidelity documents)"
    assert len(fig.axes[0].collections) == 2  # the points and the held-out crosses
    plot_prediction(out.table, out.predictions, tmp_path / "p.png", tmp_path / "p.pdf")
    assert (tmp_path / "p.png").stat().st_size > 0 and (tmp_path / "p.pdf").stat().st_size > 0


# --------------------------------------------------------------------------- what a reviewer asks next


def test_each_press_held_out_error_from_the_marks_by_hand():
    marks = pl.DataFrame(
        {
            "measure": ["m"] * 4, "task": ["niah"] * 4, "placement": ["inside"] * 4, "press": ["a", "a", "b", "b"],
            "drop": [0.1, 0.3, 0.5, 0.0], "predicted": [0.2, 0.2, 0.1, np.nan],
            "predicted_ratio_only": [0.1, 0.1, 0.5, 0.5],
        }
    )  # fmt: skip
    out = press_errors(marks)
    assert out["press"].to_list() == ["a", "b"] and out["n_points"].to_list() == [2, 1]
    np.testing.assert_allclose(out["mae_held_out"].to_numpy(), [0.1, 0.4])
    np.testing.assert_allclose(out["mae_ratio_only"].to_numpy(), [0.1, 0.25])
    np.testing.assert_allclose(out["mae_gain"].to_numpy(), [0.0, -0.15])


def test_the_table_without_named_presses_is_recomputed_on_the_others():
    fid, task, pts = frontier(drop_of=lambda f, r: f * r, measure_of=lambda f, r: f * r, n_fid=6, n_task=12)
    out = prediction_without(fid, task, pts, ["kld"], leave_out=["a", "b@0.5"], settings=quick(10, 9))
    assert out["without"].to_list() == ["a, b@0.5"] and out["n_points"].to_list() == [19]
    kept = pts.filter(~pl.col("point").str.starts_with("a@") & (pl.col("point") != "b@0.5"))
    direct = prediction_study(fid, task, kept, ["kld"], settings=quick(10, 9))
    assert out.drop("without").equals(direct.prediction)
    with pytest.raises(PredictionInputError, match="leave_out: 'zz' is neither a press nor a point; the presses: a, b"):
        prediction_without(fid, task, pts, ["kld"], leave_out=["zz"], settings=quick(10, 9))


def test_the_accuracy_table_gives_the_drop_among_the_right_answers_and_the_chance_level():
    fid, task, pts = frontier(drop_of=lambda f, r: f * r, measure_of=lambda f, r: f * r, n_fid=4, n_task=10)
    # t0 wrong under the full cache everywhere; at a@0.25 it is right under the press (a fixed answer)
    task = task.with_columns(
        correct_full=pl.col("doc_id") != "t0",
        correct=pl.when(pl.col("doc_id") == "t0").then(pl.col("point") == "a@0.25").otherwise(pl.col("correct")),
    )
    task = task.with_columns(correct=pl.when(pl.col("point") == "a@0.25").then(pl.col("doc_id").is_in(["t0", "t1"]))
                             .otherwise(pl.col("correct")))  # fmt: skip
    study = prediction_study(fid, task, pts, ["kld"], settings=quick(10, 9), chance={"niah": 1 / 9e6})
    row = study.accuracy.filter(pl.col("point") == "a@0.25").row(0, named=True)
    # full cache 9/10; the press answers t0 and t1: accuracy 2/10, drop 0.7; of the 9 right, 8 now wrong
    assert row["n_docs"] == 10 and row["n_full_right"] == 9 and row["full_accuracy"] == pytest.approx(0.9)
    assert row["accuracy"] == pytest.approx(0.2) and row["drop"] == pytest.approx(0.7)
    assert row["drop_full_right"] == pytest.approx(8 / 9)
    assert row["chance_accuracy"] == pytest.approx(1 / 9e6) and row["min_full_accuracy"] == 0.7
    assert row["lowest_accuracy"] == study.accuracy["accuracy"].min()


def test_the_chance_level_of_each_task():
    assert chance_accuracy("niah", {"digits": 7}) == pytest.approx(1 / 9_000_000)
    assert chance_accuracy("niah", {"digits": 1}) == pytest.approx(1 / 9)
    assert chance_accuracy("multikey", {"digits": 7, "distractors": 3}) == 0.25
    assert np.isnan(chance_accuracy("recall", {}))
    with pytest.raises(ValueError, match="task 'vqa': no chance level known; the tasks: niah, multikey, recall"):
        chance_accuracy("vqa", {})
    with pytest.raises(ValueError, match="task 'multikey': its chance level needs the setting 'distractors'"):
        chance_accuracy("multikey", {"digits": 7})


def test_a_jobs_cpu_per_point_is_shared_by_the_documents_it_served():
    # 3 points on 8 documents each, a control on 4 and a confirmatory run on 30: 58 pairs
    served = pl.concat(
        [
            pl.DataFrame({"policy": p, "split": "exploratory", "doc_id": [f"e{i}" for i in range(8)]})
            for p in ("a@0.5", "b@0.5", "int4")
        ]
        + [pl.DataFrame({"policy": "none", "split": "exploratory", "doc_id": [f"e{i}" for i in range(4)]}),
           pl.DataFrame({"policy": "snapkv-50", "split": "confirmatory", "doc_id": [f"c{i}" for i in range(30)]})]
    )  # fmt: skip
    assert cpu_per_point(116.0, served, ["a@0.5", "b@0.5", "int4"]) == pytest.approx(116 * 24 / 58 / 3)
    assert cpu_per_point(116.0, served.filter(pl.col("policy") != "snapkv-50"), ["a@0.5"]) == pytest.approx(
        116 / 28 * 8
    )
    assert np.isnan(cpu_per_point(1.0, served.clear(), ["a@0.5"]))
    with pytest.raises(ValueError, match="points must name at least one point"):
        cpu_per_point(1.0, served, [])


# --------------------------------------------------------------------------- the workflow's inputs


def test_fidelity_documents_from_the_estimates_and_the_teacher_forced_tables():
    from kvdiverge.estimation.prediction_inputs import fidelity_documents

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
        {"policy": ["a@0.5"], "doc_id": ["d0"], "kld_mean": [0.01], "same_top_p": [0.9], "ppl_ratio": [1.02],
         "kld_key_mean": [0.5], "n_positions": [128], "continuation": ["corpus"]}
    )  # fmt: skip
    # 101 positions of d0 with KL 0, 1, ..., 100: the 99th percentile is 99 (linear interpolation)
    positions = pl.DataFrame({"policy": ["a@0.5"] * 101, "doc_id": ["d0"] * 101, "kld": np.arange(101.0)})
    out = fidelity_documents(estimates, teacher, positions)
    assert out["doc_id"].to_list() == ["d0", "d1"] and out["point"].to_list() == ["a@0.5"] * 2
    # tau_first = E_tau_div + (1 - p_div)(T + 1): 0 + 4 for d0, 1 + 0.5 x 4 for d1
    assert out["tau_first"].to_list() == [4.0, 3.0]
    assert out["S_2"].to_list() == [1.0, 0.75] and out["S_3"].to_list() == [1.0, 0.5]
    assert out["kld_p99"].to_list() == [99.0, None]
    assert out["kld_mean"].to_list() == [0.01, None] and out["same_top_p"].to_list() == [0.9, None]
    # every float column of the teacher-forced table is a measure, by name; counts and labels are not
    assert out["kld_key_mean"].to_list() == [0.5, None] and "n_positions" not in out.columns


def test_the_reconstruction_passs_measures_join_each_document_under_their_prefix():
    from kvdiverge.estimation.prediction_inputs import fidelity_documents
    from kvdiverge.estimation.teacher_forced import POSITION_SCHEMA

    estimates = pl.DataFrame(
        {"policy": ["a@0.5", "a@0.5"], "doc_id": ["d0", "d1"], "T": [2, 2], "E_M": [0.0, 0.5],
         "p_div": [0.0, 1.0], "E_tau_div": [0.0, 1.0], "S": [[1.0, 1.0], [0.5, 0.0]]}
    )  # fmt: skip
    # d0's four repeated tokens: KL 0.1, 0.3, 0.2, 1.4; the 2nd and 4th are key tokens; top-1 differs at the 4th
    rows = {
        "model": ["m"] * 4, "policy": ["a@0.5"] * 4, "split": ["exploratory"] * 4, "doc_id": ["d0"] * 4,
        "position": [0, 1, 2, 3], "token": [5, 6, 7, 8], "continuation": ["prompt"] * 4,
        "target": ["reconstruction"] * 4, "one_forward": [True] * 4, "kld": [0.1, 0.3, 0.2, 1.4],
        "delta_p": [0.0] * 4, "ll_ref": [-1.0] * 4, "ll_ev": [-1.0] * 4, "top_ref": [1, 1, 1, 1],
        "top_ev": [1, 1, 1, 2], "same_top": [True, True, True, False], "ll_short": [-2.0] * 4,
        "key": [False, True, False, True],
    }  # fmt: skip
    reconstruction = pl.DataFrame(rows, schema=POSITION_SCHEMA)
    out = fidelity_documents(estimates, reconstruction=reconstruction)
    assert out["doc_id"].to_list() == ["d0", "d1"]
    np.testing.assert_allclose(out["reconstruction_kld_mean"][0], 0.5)  # (0.1 + 0.3 + 0.2 + 1.4) / 4
    np.testing.assert_allclose(out["reconstruction_kld_key_mean"][0], 0.85)  # (0.3 + 1.4) / 2
    assert out["reconstruction_same_top_p"][0] == 0.75 and out["reconstruction_same_top_p_key"][0] == 0.5
    assert out["reconstruction_kld_max"][0] == 1.4
    # the 99th percentile of 0.1, 0.2, 0.3, 1.4: 0.3 + 0.97 x (1.4 - 0.3), linear between order statistics
    np.testing.assert_allclose(out["reconstruction_kld_p99"][0], 0.3 + 0.97 * 1.1)
    # d1 has no reconstruction positions: missing, not 0; the continuation pass's names are not taken
    assert out["reconstruction_kld_mean"][1] is None and "kld_mean" not in out.columns


def test_the_reconstruction_pass_is_the_teacher_forced_pass_with_its_target_and_length():
    from kvdiverge.jobs.prediction import reconstruction_config

    config = {
        "teacher_forced": {"length": 128, "target": "continuation", "repeat_instruction": "Repeat."},
        "prediction": {"measures": ["E_M", "kld_mean"], "reconstruction": {"length": 1024}},
    }
    assert reconstruction_config(config) is None  # no measure reads it: no job
    config["prediction"]["measures"].append("reconstruction_kld_key_mean")
    section = reconstruction_config(config)["teacher_forced"]
    assert section == {"length": 1024, "target": "reconstruction", "repeat_instruction": "Repeat."}
    assert config["teacher_forced"]["target"] == "continuation"  # the config itself is not changed


def test_the_ratio_of_a_point_is_the_fraction_of_the_full_caches_kv_bytes_it_removes():
    from kvdiverge.estimation.prediction_inputs import frontier_points_table

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
    fid, task, pts = frontier(drop_of=lambda f, r: r, measure_of=lambda f, r: f * r, n_fid=4, n_task=24)
    weak = task.with_columns(correct_full=pl.col("doc_id").is_in([f"t{i}" for i in range(20)]))  # 20/24 = 83%
    prediction_tables(fid, weak, pts, ["kld"], settings=quick(5, 9))
    with pytest.raises(PredictionInputError, match="answers 83% of the documents, below 90%"):
        prediction_tables(fid, weak, pts, ["kld"], settings=quick(5, 9, min_full_accuracy=0.9))


def test_each_task_side_is_compared_on_the_points_it_ran():
    fid, task, pts = frontier(drop_of=lambda f, r: f * r, measure_of=lambda f, r: f * r, n_fid=6)
    after = task.filter(pl.col("point") != "a@0.9").with_columns(placement=pl.lit("after"))
    controls = fid.filter(pl.col("point") == "a@0.25").with_columns(point=pl.lit("noise-floor"))
    study = prediction_study(pl.concat([fid, controls]), pl.concat([task, after]), pts, ["kld"], settings=quick(20, 9))
    table = study.prediction.sort("placement")
    assert table["placement"].to_list() == ["after", "inside"] and table["n_points"].to_list() == [23, 24]
    acc = study.accuracy.filter(pl.col("point") == "f@0.9")
    assert acc["n_docs"].to_list() == [24, 24] and acc["full_accuracy"].to_list() == [1.0, 1.0]
    np.testing.assert_allclose(acc["drop"].to_numpy(), 1 - acc["accuracy"].to_numpy())
    np.testing.assert_allclose(acc["drop_full_right"].to_numpy(), acc["drop"].to_numpy())  # the full cache is right
    assert study.predictions.height == 47 and study.presses.height == 12
    assert study.accuracy["refused"].null_count() == study.accuracy.height
    assert study.accuracy["chance_accuracy"].null_count() == study.accuracy.height  # none given


def test_a_side_whose_full_cache_is_too_weak_is_refused_and_the_others_still_report():
    fid, task, pts = frontier(drop_of=lambda f, r: f * r, measure_of=lambda f, r: f * r, n_fid=6)
    weak = task.with_columns(task=pl.lit("recall"), correct_full=pl.col("doc_id").is_in(["t0", "t1", "t2"]))
    study = prediction_study(fid, pl.concat([task, weak]), pts, ["kld"], settings=quick(20, 9))
    assert study.prediction["task"].to_list() == ["niah"]
    refused = study.accuracy.filter(pl.col("task") == "recall")["refused"].unique().to_list()
    assert refused == ["task recall (inside): the full cache answers 12% of the documents, below 70%: "
                       "too few right answers to measure a press's drop"]  # fmt: skip
    with pytest.raises(PredictionInputError, match="task recall .inside.: the full cache answers 12%"):
        prediction_study(fid, weak, pts, ["kld"], settings=quick(20, 9))


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
        model=pl.lit("m"), policy="point", split=pl.lit("exploratory"), doc_id="doc_id", T=pl.lit(16), E_M="kld", p_div="kld",
        E_tau_div=pl.lit(1.0), S=pl.concat_list([1 - pl.col("kld")] * 16),
    )  # fmt: skip
    control = docs.filter(pl.col("policy") == "a@0.25").with_columns(policy=pl.lit("none"), doc_id=pl.lit("t0"))
    # a confirmatory run's documents: not served by the frontier split's shard jobs
    other = docs.head(3).with_columns(policy=pl.lit("snapkv-90"), split=pl.lit("confirmatory"))
    teacher = fid.select(
        model=pl.lit("m"), policy="point", split=pl.lit("exploratory"), doc_id="doc_id", kld_mean="kld",
        same_top_p=1 - pl.col("kld"),
    )  # fmt: skip
    # a confirmatory run's teacher-forced documents: another job's, the confirmatory split's
    confirmatory = pl.DataFrame({"model": "m", "policy": "snapkv-50", "split": "confirmatory",
                                 "doc_id": [f"c{i}" for i in range(24)], "kld_mean": 0.1,
                                 "same_top_p": 0.9})  # fmt: skip
    positions = teacher.select("model", "policy", "doc_id", kld="kld_mean")
    # the reconstruction pass: one scored position per document, twice the measure's KL
    reconstruction = fid.select(
        model=pl.lit("m"), policy="point", split=pl.lit("exploratory"), doc_id="doc_id", position=pl.lit(0),
        token=pl.lit(5), continuation=pl.lit("prompt"), target=pl.lit("reconstruction"), one_forward=pl.lit(True),
        kld=2 * pl.col("kld"), delta_p=pl.lit(0.0), ll_ref=pl.lit(-1.0), ll_ev=pl.lit(-1.0), top_ref=pl.lit(1),
        top_ev=pl.lit(1), same_top=pl.lit(True), ll_short=pl.lit(-2.0), key=pl.lit(True),
    )  # fmt: skip
    answers = task.select(model=pl.lit("m"), policy="point", doc_id="doc_id", correct_full="correct_full",
                          correct="correct", task="task", placement="placement")  # fmt: skip
    inputs = {
        "frontier": pts,
        "documents": pl.concat([docs, control, other]),
        "teacher": pl.concat([teacher, confirmatory]),
    }
    for name, frame in {**inputs, "positions": positions, "answers": answers, "reconstruction": reconstruction}.items():
        frame.write_parquet(tmp_path / f"{name}.parquet")
    (tmp_path / "coupled.tsv").write_text("s\tcpu_time\n1\t48.0\n")
    (tmp_path / "teacher.tsv").write_text("s\tcpu_time\n1\t14.0\n")
    (tmp_path / "reconstruction.tsv").write_text("s\tcpu_time\n1\t24.0\n")
    names = ("prediction", "predictions", "pairwise", "presses", "accuracy", "without", "fidelity", "task", "points")
    out = _Named({f"{n}_{k}": str(tmp_path / "out" / f"{n}.{k}") for n in names for k in ("parquet", "csv")},
                 png=str(tmp_path / "out" / "p.png"), pdf=None)  # fmt: skip
    sm = NS(
        input=_Named({n: str(tmp_path / f"{n}.parquet") for n in inputs},
                     positions=[str(tmp_path / "positions.parquet")], answers=[str(tmp_path / "answers.parquet")],
                     reconstruction=[str(tmp_path / "reconstruction.parquet")]),
        params=NS(measures=["E_M", "kld_mean", "same_top_p", "reconstruction_kld_mean"], min_full_accuracy=0.7,
                  points=pts["point"].to_list(), split="exploratory",
                  costs={"coupled": [str(tmp_path / "coupled.tsv")], "teacher": [str(tmp_path / "teacher.tsv")],
                         "reconstruction": [str(tmp_path / "reconstruction.tsv")]},
                  tasks={"niah-inside": {"name": "niah", "question": "inside", "digits": 7}},
                  boot={"n_boot": 20, "confidence": 0.9, "seed": 3}, n_perm=19),
        output=out, log=[str(tmp_path / "prediction.log")], wildcards=NS(model="m"),
    )  # fmt: skip
    runpy.run_path(str(Path(__file__).parents[1] / "workflow/scripts/prediction.py"), init_globals={"snakemake": sm})
    table = pl.read_parquet(out["prediction_parquet"])
    assert table["measure"].to_list() == ["E_M", "kld_mean", "same_top_p", "reconstruction_kld_mean"]
    assert set(table["n_points"]) == {24}
    assert table["n_fidelity_docs"].to_list() == [6, 6, 6, 6]  # the none control's document is left out
    # the split's shard jobs' 48 s shared by the 145 pairs of the split (the control's document too), 144 of
    # them the points'; the split's teacher-forced job's 14 s by its 144 pairs, all of them the points'
    # (the confirmatory run's 24 are the other split's job's); the reconstruction pass's 24 s over its 24 points
    coupled_s, teacher_s = 48 * 144 / 145 / 24, 14 / 24
    assert table["cpu_s_per_point"].to_list() == pytest.approx([coupled_s, teacher_s, teacher_s, 1.0])
    assert (table["spearman"] > 0.5).all()  # same_top_p is oriented: smaller predicts a larger drop
    # twice the KL of kld_mean, document by document: the same ranks, the same statistics
    assert table.row(3, named=True)["kendall_within_ratio"] == table.row(1, named=True)["kendall_within_ratio"]
    fidelity = pl.read_parquet(out["fidelity_parquet"])
    assert (fidelity["reconstruction_kld_mean"] == 2 * fidelity["kld_mean"]).all()
    assert pl.read_parquet(out["points_parquet"]).height == 24 and pl.read_parquet(out["task_parquet"]).height == 576
    assert pl.read_parquet(out["pairwise_parquet"]).height == 6 and pl.read_parquet(out["presses_parquet"]).height == 24
    accuracy = pl.read_parquet(out["accuracy_parquet"])
    assert accuracy.height == 24 and accuracy["chance_accuracy"].to_list() == pytest.approx([1 / 9e6] * 24)
    without = pl.read_parquet(out["without_parquet"])
    assert without["without"].unique(maintain_order=True).to_list() == list(PRESSES) and without.height == 24
    assert without["spearman_lo"].is_nan().all()  # point estimates and p-values: no bootstrap
    assert Path(out["png"]).exists()
