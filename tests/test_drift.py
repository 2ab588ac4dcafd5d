"""Length and loop drift (kvdiverge.estimation.drift): the loop detector on hand-written sequences, the
marginal laws of the coupled draw against a hand-enumerated kernel pair, the none control's exact 0."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from kvdiverge.estimation.bootstrap import Bootstrap
from kvdiverge.estimation.drift import (
    distinct_n,
    drift_problems,
    drift_replicates,
    drift_table,
    length_survival,
    loop_onset,
    repeated_ngram_rate,
)

# --------------------------------------------------------------------------- the loop detector


def test_a_period_4_loop_is_found_where_it_starts():
    head = [90, 91, 92, 93, 94]
    assert loop_onset(head + [1, 2, 3, 4] * 3) == (6, 4)
    assert loop_onset(head + [1, 2, 3, 4] * 3 + [1, 2]) == (6, 4)  # a partial last period still loops


def test_a_period_31_loop_is_found_and_a_period_beyond_the_limit_is_not():
    period = list(range(100, 131))
    assert loop_onset([7, 8] + period * 3) == (3, 31)
    long = list(range(200, 233))  # 33 tokens: longer than the 32-token limit
    assert loop_onset(long * 3) is None
    assert loop_onset(long * 3, max_period=33) == (1, 33)


def test_a_near_loop_with_one_token_changed_and_no_loop_are_not_loops():
    near = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 9, 4, 1, 2, 3, 4]  # the third repeat has one token changed
    assert loop_onset(near) is None
    assert loop_onset(list(range(40))) is None
    assert loop_onset([5, 5]) is None and loop_onset([5, 5, 5]) == (1, 1)  # a period of 1 needs 3 repeats


def test_repetition_rates_enumerated_by_hand():
    assert repeated_ngram_rate([1, 2, 3, 4, 1, 2, 3, 4], 4) == pytest.approx(1 - 4 / 5)  # 5 4-grams, 4 distinct
    assert repeated_ngram_rate([1, 2, 3]) == 0.0
    assert distinct_n([1, 2, 1, 2, 1], 2) == pytest.approx(2 / 4)
    assert distinct_n([7]) == 1.0


def test_settings_that_cannot_see_a_loop_are_named():
    assert drift_problems(32) == [] and drift_problems(96, 32, 3) == []
    assert drift_problems(16, 32) == [
        "drift.max_period: a loop period of 32 tokens is longer than the horizon decoding.max_new_tokens = 16; "
        "lower it to at most 16 (or raise the horizon)"
    ]
    assert drift_problems(32, 8, 1) == ["drift.min_repeats: a loop repeats its period at least twice, got 1"]
    # T = 8: a 1-token period repeated 8 times fills the horizon, 9 times cannot fit (the detector agrees)
    assert drift_problems(8, None, 8) == [] and loop_onset([5] * 8, 1, 8) == (1, 1)
    assert drift_problems(8, None, 9) == [
        "drift.min_repeats: 9 repeats of even a 1-token period are longer than the horizon "
        "decoding.max_new_tokens = 8, so no loop could be found; lower it to at most 8 (or raise the horizon)"
    ]
    assert loop_onset([5] * 8, 1, 9) is None
    assert drift_problems(2) == []  # a default is not checked: 3 repeats at T = 2 find no loop, yet are no error


def test_a_horizon_that_sees_no_stop_is_named():
    from kvdiverge.estimation.drift import no_stop_note

    row = {"model": "m", "policy": "p", "split": "s", "T": 8, "measure": "stop_rate", "full": 0.0, "compressed": 0.0}
    assert no_stop_note(pl.DataFrame([row])) == [
        "m/p/s: no draw stopped within the horizon T = 8 on either side, so a change of length cannot be seen; "
        "raise decoding.max_new_tokens above the full cache's lengths (config/length.yaml)"
    ]
    assert no_stop_note(pl.DataFrame([{**row, "compressed": 0.25}])) == []


# --------------------------------------------------------------------------- the coupled draw's marginals

V, EOS, T = 3, 2, 4


def _p(h):
    """The full-cache kernel: EOS becomes likelier with length."""
    e = 0.1 + 0.15 * len(h)
    return np.array([0.6 * (1 - e), 0.4 * (1 - e), e])


def _q(h):
    """The compressed kernel: prefers token 1, and stops later, then loops on 1."""
    e = 0.05 + 0.05 * len(h)
    one = 0.9 if h and h[-1] == 1 else 0.5
    return np.array([(1 - one) * (1 - e), one * (1 - e), e])


def kernel(hx, hy):
    return _p(hx), _q(hy)


def exact_length_law(k) -> np.ndarray:
    """P(EOS at step t), t = 1..T, and P(no EOS) last: enumerated over every history of one kernel."""
    law = np.zeros(T + 1)

    def walk(h, prob):
        if len(h) == T:
            law[T] += prob
            return
        dist = k(h)
        for v in range(V):
            if v == EOS:
                law[len(h)] += prob * dist[v]
            else:
                walk(h + (v,), prob * dist[v])

    walk((), 1.0)
    return law


@pytest.fixture(scope="module")
def coupled():
    from kvdiverge.engine.core.coupled import simulate
    from kvdiverge.engine.core.pairs import TableKernelPair

    rows = simulate(TableKernelPair(kernel, V, eos_ids=(EOS,)), T, 3000, seed=3, doc_id="d")
    return drift_replicates(rows, [EOS], max_period=1, min_repeats=2)


def test_each_side_of_the_coupled_draw_has_its_kernels_length_law(coupled):
    survival = length_survival(coupled)
    for side, k in (("full", _p), ("compressed", _q)):
        law = exact_length_law(k)
        got = survival.filter(pl.col("side") == side)["survival"].to_numpy()
        exact = 1.0 - np.concatenate([[0.0], np.cumsum(law[:T])])
        se = np.sqrt(exact * (1 - exact) / coupled.height)
        assert np.all(np.abs(got - exact) <= 4 * se + 1e-12), (side, got, exact)
        mean = coupled[f"length_{side}"].mean()
        exact_mean = sum((t + 1) * law[t] for t in range(T)) + T * law[T]
        assert mean == pytest.approx(exact_mean, abs=4 * coupled[f"length_{side}"].std() / np.sqrt(coupled.height))
    assert exact_length_law(_q)[T] > exact_length_law(_p)[T] + 0.1  # Q stops later: a drift to see


def test_the_rao_blackwellised_draw_is_the_chain_and_branch_weighted(coupled):
    r = coupled.filter(pl.col("weight_branch").is_between(0.01, 0.99)).row(0, named=True)
    w = r["weight_branch"]
    assert r["length_full"] == pytest.approx((1 - w) * r["length_chain"] + w * r["length_x"])
    assert r["length_diff"] == pytest.approx(w * (r["length_y"] - r["length_x"]))
    assert r["stopped_compressed"] == pytest.approx((1 - w) * r["stopped_chain"] + w * r["stopped_y"])


def test_the_none_control_differs_by_exactly_0():
    from kvdiverge.engine.core.coupled import simulate
    from kvdiverge.engine.core.pairs import TableKernelPair

    same = TableKernelPair(lambda hx, hy: (_p(hx), _p(hy)), V, eos_ids=(EOS,))
    frames = [simulate(same, T, 4, seed=1, doc_id=f"d{i}") for i in range(5)]
    reps = drift_replicates(pl.concat(frames), [EOS])
    assert (reps["weight_branch"] == 0).all() and (reps.select(pl.col("^.*_diff$")) == 0).to_numpy().all()
    table = drift_table(reps, Bootstrap(200, 0.95, 0))
    assert table["measure"].to_list() == ["length_mean", "length_median", "stop_rate", "loop_rate", "rep4", "distinct2"]
    assert (table["diff"] == 0).all() and (table["diff_lo"] == 0).all() and (table["diff_hi"] == 0).all()


def test_the_table_sees_the_drift_of_a_kernel_that_stops_later():
    from kvdiverge.engine.core.coupled import simulate
    from kvdiverge.engine.core.pairs import TableKernelPair

    frames = [simulate(TableKernelPair(kernel, V, eos_ids=(EOS,)), T, 50, seed=2, doc_id=f"d{i}") for i in range(8)]
    table = drift_table(drift_replicates(pl.concat(frames), [EOS]), Bootstrap(400, 0.95, 0))
    stop = table.filter(pl.col("measure") == "stop_rate").row(0, named=True)
    exact = exact_length_law(_q)[:T].sum() - exact_length_law(_p)[:T].sum()
    assert stop["diff"] == pytest.approx(exact, abs=0.06) and stop["diff_hi"] < 0  # Q stops less often (SE ~0.025)
    assert stop["diff_lo"] <= stop["diff"] <= stop["diff_hi"]
    length = table.filter(pl.col("measure") == "length_mean").row(0, named=True)
    assert length["diff_lo"] > 0 and length["n_docs"] == 8


def test_the_length_ratio_joins_the_frontier_points():
    from kvdiverge.engine.core.coupled import simulate
    from kvdiverge.engine.core.pairs import TableKernelPair
    from kvdiverge.estimation.drift import length_ratios, with_drift_columns

    frames = [simulate(TableKernelPair(kernel, V, eos_ids=(EOS,)), T, 20, seed=2, doc_id=f"d{i}") for i in range(4)]
    reps = drift_replicates(pl.concat(frames), [EOS])
    ratios = length_ratios(reps, Bootstrap(300, 0.95, 0))
    r = ratios.row(0, named=True)
    means = reps.group_by("doc_id").agg(pl.col("length_full").mean(), pl.col("length_compressed").mean())
    assert r["length_ratio"] == pytest.approx(means["length_compressed"].mean() / means["length_full"].mean())
    assert 1 < r["length_ratio_lo"] <= r["length_ratio"] <= r["length_ratio_hi"]  # Q stops later: longer
    points = pl.DataFrame({"model": ["synthetic"], "policy": ["synthetic"], "split": ["synthetic"], "E_M": [0.1]})
    joined = with_drift_columns(points, ratios)
    assert joined["length_ratio"].to_list() == [r["length_ratio"]] and with_drift_columns(points, None).equals(points)


@pytest.mark.miniature
def test_measure_reports_the_drift_and_the_none_control_is_exactly_0(tmp_path):
    import kvpress
    import torch

    import kvdiverge
    from kvdiverge.models.standins import MINIATURE, random_model

    model = random_model(MINIATURE["llama-3.1-8b"], num_hidden_layers=2)
    gen = torch.Generator().manual_seed(0)
    prompts = {f"p{i}": torch.randint(1, 500, (40,), generator=gen).tolist() for i in range(3)}
    presses = {
        "none": {"press": "SnapKVPress", "compression_ratio": 0.0},
        "snap": kvpress.SnapKVPress(0.75, window_size=8),
    }
    m = kvdiverge.measure(model, None, prompts, presses, max_new_tokens=6, replicates=2, bootstrap=50,
                          progress=False, eos_ids=[3, 7, 11])  # fmt: skip
    none = m.drift.filter(pl.col("policy") == "none")
    assert none.height == 6 and (none["diff"] == 0).all() and (none["diff_hi"] == 0).all()
    assert set(m.drift["policy"]) == {"none", "snap"} and m.eos_ids == (3, 7, 11)
    assert "length drift (compressed - full, paired)" in m.format_summary()
    files = {p.name for p in m.save(tmp_path)}
    assert {"drift.parquet", "length_survival.parquet"} <= files


def test_the_eos_survival_is_kaplan_meier_censored_at_the_horizon():
    """With whole-chain or whole-branch draws (S_T 0 or 1), the survival is scipy's Kaplan–Meier estimate of the
    EOS time, right-censored at T for the draws that did not stop."""
    from scipy.stats import CensoredData, ecdf

    rng = np.random.default_rng(0)
    n, T8 = 40, 8
    eos_step = rng.integers(1, 12, size=n)  # steps beyond T8 never stop within the horizon
    rows = []
    for i, step in enumerate(eos_step):
        tokens = [5] * (int(step) - 1) + [EOS] if step <= T8 else [5, 6] * T8
        rows.append(
            {
                "model": "m", "policy": "p", "split": "s", "doc_id": f"d{i}", "replicate": 0, "T": T8,
                "chain_token": (tokens + [EOS] * T8)[:T8], "survival": [1.0] * T8, "t_star": None,
                "x_star": None, "y_star": None, "branch_x": [], "branch_y": [],
            }
        )  # fmt: skip
    reps = drift_replicates(pl.DataFrame(rows), [EOS])
    got = length_survival(reps).filter(pl.col("side") == "full").sort("t")["survival"].to_numpy()
    stopped = eos_step[eos_step <= T8].astype(float)
    km = ecdf(CensoredData(uncensored=stopped, right=np.full((eos_step > T8).sum(), float(T8))))
    np.testing.assert_allclose(got[:T8], km.sf.evaluate(np.arange(T8)), atol=1e-12)
