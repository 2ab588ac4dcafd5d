"""Exploratory gap decomposition (§7) and the confirmatory test (§8)."""

import copy

import numpy as np
import polars as pl
import pytest
from scipy import stats

from kvdiverge.estimation.bootstrap import Bootstrap
from kvdiverge.estimation.confirmatory import (
    PLAN_FIELDS,
    PlanError,
    confirmatory_analysis,
    holm,
    plan_hash,
    validate_plan,
)
from kvdiverge.estimation.floor import floor_comparison
from kvdiverge.estimation.gap import gap_decomposition, gap_terms
from kvdiverge.estimation.pooling import pooled_estimates, survival_curve
from kvdiverge.estimation.timing import timing_table
from kvdiverge.io.files import save_table
from kvdiverge.report.pages import confirmatory_html, summary_html

PLAN = {
    "policy": "snapkv-90",
    "early": [1, 2],
    "late": [3, 4],
    "test": "wilcoxon-signed-rank",
    "alternative": "greater",
    "correction": "holm",
    "alpha": 0.05,
}


# --------------------------------------------------------------------------- gaps


def means(p, L, Np, N):
    """A policy's pooled means, as :func:`gap_terms` reads them."""
    return {"p_div": p, "E_L": L, "E_N_post": Np, "E_N": N}


def test_gap_terms_sum_exactly_to_the_gap():
    rng = np.random.default_rng(0)
    for _ in range(200):
        pA, pB = rng.uniform(0, 1, 2)
        LA, LB = rng.uniform(0, 20, 2)
        NpA, NpB = LA * rng.uniform(0, 1), LB * rng.uniform(0, 1)
        t = gap_terms(means(pA, LA, NpA, pA + NpA), means(pB, LB, NpB, pB + NpB))
        assert t["first_mismatch"] + t["exposure"] + t["rate"] == pytest.approx(t["delta"], abs=1e-12)
    # by hand: A = (p .5, L 4, N_post 2), B = (p .25, L 2, N_post .5): rho_A = .5, rho_B = .25
    t = gap_terms(means(0.5, 4.0, 2.0, 2.5), means(0.25, 2.0, 0.5, 0.75))
    assert t["delta"] == pytest.approx(1.75)
    assert t["first_mismatch"] == pytest.approx(0.25)
    assert t["exposure"] == pytest.approx(2 * 0.375)
    assert t["rate"] == pytest.approx(3 * 0.25)
    # no exposure at all (the none control): rho := 0, still exact
    t = gap_terms(means(0.0, 0.0, 0.0, 0.0), means(0.5, 2.0, 1.0, 1.5))
    assert t["first_mismatch"] + t["exposure"] + t["rate"] == pytest.approx(-1.5)
    # resamples: arrays elementwise, the same as the scalars one by one
    arr = gap_terms(
        means(np.array([0.5, 0.0]), np.array([4.0, 0.0]), np.array([2.0, 0.0]), np.array([2.5, 0.0])),
        means(np.array([0.25, 0.5]), np.array([2.0, 2.0]), np.array([0.5, 1.0]), np.array([0.75, 1.5])),
    )
    assert arr["delta"].tolist() == pytest.approx([1.75, -1.5]) and arr["rate"][0] == pytest.approx(0.75)


def doc_frame(policy, p, L, Np, split="exploratory", model="m", docs=None, T=10):
    n = len(p)
    docs = docs or [f"d{i}" for i in range(n)]
    return pl.DataFrame(
        {
            "model": model,
            "policy": policy,
            "split": split,
            "doc_id": docs,
            "T": T,
            "p_div": np.asarray(p, float),
            "E_L": np.asarray(L, float),
            "E_N_post": np.asarray(Np, float),
            "E_N": np.asarray(p, float) + np.asarray(Np, float),
        }
    )


def test_gap_decomposition_is_paired_by_document():
    rng = np.random.default_rng(1)
    n = 12
    # large document effects, identical shift of A over B in every document
    pB = rng.uniform(0.1, 0.6, n)
    LB = rng.uniform(1, 8, n)
    NpB = LB * rng.uniform(0.1, 0.9, n)
    A = doc_frame("A", pB + 0.1, LB + 1.0, NpB + 0.5)
    B = doc_frame("B", pB, LB, NpB)
    # shuffle B's rows: pairing must go by doc_id, not row order
    docs = pl.concat([A, B.sample(fraction=1.0, shuffle=True, seed=3)])
    g = gap_decomposition(docs, "m", "A", "B", "exploratory", Bootstrap(2000, 0.95, 7))
    t = {r["term"]: r for r in g.iter_rows(named=True)}
    assert t["delta"]["value"] == pytest.approx(0.6)
    assert t["delta"]["n_docs"] == n
    total = sum(t[k]["value"] for k in ("first_mismatch", "exposure", "rate"))
    assert total == pytest.approx(t["delta"]["value"], abs=1e-12)
    assert sum(t[k]["share"] for k in ("first_mismatch", "exposure", "rate")) == pytest.approx(1.0)
    assert t["first_mismatch"]["value"] == pytest.approx(0.1)
    # paired resampling: the gap is 0.6 in every resample, so its interval is a point
    assert t["delta"]["value_lo"] == pytest.approx(0.6) and t["delta"]["value_hi"] == pytest.approx(0.6)
    assert t["first_mismatch"]["value_hi"] - t["first_mismatch"]["value_lo"] < 1e-12
    # unpaired (independent) resampling would give a wide interval for the same data
    idx_a = np.random.default_rng(0).integers(0, n, (2000, n))
    idx_b = np.random.default_rng(1).integers(0, n, (2000, n))
    EA = (A["E_N"].to_numpy())[idx_a].mean(1) - (B.sort("doc_id")["E_N"].to_numpy())[idx_b].mean(1)
    assert np.percentile(EA, 97.5) - np.percentile(EA, 2.5) > 0.3
    # intervals of the other terms contain the point values
    for k in ("exposure", "rate"):
        assert t[k]["value_lo"] - 1e-12 <= t[k]["value"] <= t[k]["value_hi"] + 1e-12


def test_gap_decomposition_uses_shared_documents_only():
    A = doc_frame("A", [0.5, 0.4, 0.3], [2, 2, 2], [1, 1, 1], docs=["a", "b", "c"])
    B = doc_frame("B", [0.2, 0.2], [1, 1], [0.5, 0.5], docs=["b", "c"])
    g = gap_decomposition(pl.concat([A, B]), "m", "A", "B", "exploratory", Bootstrap(100, 0.9, 1))
    assert set(g["n_docs"].to_list()) == {2}
    assert g.filter(pl.col("term") == "first_mismatch")["value"][0] == pytest.approx(0.35 - 0.2)
    with pytest.raises(ValueError, match="no per-document"):
        gap_decomposition(pl.concat([A, B]), "m", "A", "C", "exploratory", Bootstrap(100, 0.9, 1))


# --------------------------------------------------------------------------- confirmatory


def test_holm_by_hand():
    np.testing.assert_allclose(holm([0.01, 0.04, 0.03]), [0.03, 0.06, 0.06])
    np.testing.assert_allclose(holm([0.01, 0.04, 0.03], "bonferroni"), [0.03, 0.12, 0.09])
    np.testing.assert_allclose(holm([0.5, 0.9]), [1.0, 1.0])  # 2 * 0.5, capped; monotone
    np.testing.assert_allclose(holm([0.2, 0.01]), [0.2, 0.02])
    out = holm([0.02, np.nan])
    assert out[0] == pytest.approx(0.02) and np.isnan(out[1])


def test_plan_validation_names_missing_fields():
    assert validate_plan(PLAN) == PLAN
    for field in PLAN_FIELDS:
        bad = {k: v for k, v in PLAN.items() if k != field}
        with pytest.raises(PlanError, match=field):
            validate_plan(bad)
    with pytest.raises(PlanError, match="late"):
        validate_plan({**PLAN, "late": [4, 3]})
    with pytest.raises(PlanError, match="test"):
        validate_plan({**PLAN, "test": "t-test"})
    with pytest.raises(PlanError, match="alpha"):
        validate_plan({**PLAN, "alpha": 1.5})
    with pytest.raises(PlanError):
        validate_plan(None)


def test_plan_hash_is_stable_and_sensitive():
    h = plan_hash(PLAN)
    assert len(h) == 64
    assert plan_hash(dict(reversed(list(PLAN.items())))) == h  # key order does not matter
    assert plan_hash({**PLAN, "alpha": 0.01}) != h
    assert plan_hash({**PLAN, "late": [3, 5]}) != h


def btv_docs(diffs_early_late, model="m", policy="snapkv-90", split="confirmatory", T=6):
    """Per-document rows with per-lag btv sums giving btv[early] = e and btv[late] = l."""
    rows = []
    for i, (e, l_) in enumerate(diffs_early_late):
        num, den = np.zeros(T), np.zeros(T)
        if e is not None:
            num[0:2], den[0:2] = e, 1.0  # lags 1, 2
        if l_ is not None:
            num[2:4], den[2:4] = 0.5 * l_, 0.5  # lags 3, 4 with weight 0.5
        rows.append(
            {
                "model": model,
                "policy": policy,
                "split": split,
                "doc_id": f"d{i}",
                "btv_num": num.tolist(),
                "btv_den": den.tolist(),
            }
        )
    return pl.DataFrame(rows)


def test_confirmatory_statistics_match_scipy_and_count_exclusions():
    pairs = [(0.1, 0.3), (0.2, 0.25), (0.3, 0.2), (0.1, 0.5), (0.2, 0.6), (0.15, 0.35), (0.1, None), (None, None)]
    other = [(0.3, 0.1), (0.2, 0.2), (0.4, 0.1), (0.3, 0.2), (0.2, 0.1)]
    docs = pl.concat([btv_docs(pairs, model="m1"), btv_docs(other, model="m2")])
    res, per = confirmatory_analysis(docs, PLAN, "confirmatory", Bootstrap(1000, 0.95, 1))
    r1 = res.filter(pl.col("model") == "m1").row(0, named=True)
    r2 = res.filter(pl.col("model") == "m2").row(0, named=True)
    d1 = np.array([0.2, 0.05, -0.1, 0.4, 0.4, 0.2])
    ref = stats.wilcoxon(d1, alternative="greater")
    assert r1["n_docs"] == 8 and r1["n_used"] == 6 and r1["n_excluded"] == 2
    assert r1["n_no_late"] == 2 and r1["n_no_early"] == 1
    assert r1["statistic"] == pytest.approx(ref.statistic)
    assert r1["p_raw"] == pytest.approx(ref.pvalue)
    assert r1["mean_diff"] == pytest.approx(d1.mean())
    assert r1["median_diff"] == pytest.approx(np.median(d1))
    assert r1["mean_diff_lo"] <= r1["mean_diff"] <= r1["mean_diff_hi"]
    assert r1["median_diff_lo"] <= r1["median_diff"] <= r1["median_diff_hi"]
    assert r2["n_zero"] == 1 and r2["n_used"] == 5
    adj = holm([r1["p_raw"], r2["p_raw"]])
    assert [r1["p_adjusted"], r2["p_adjusted"]] == pytest.approx(list(adj))
    assert r1["decision"] == ("reject" if adj[0] < 0.05 else "not rejected")
    assert r2["decision"] == "not rejected"
    assert r1["plan_hash"] == plan_hash(PLAN)
    assert per.filter(pl.col("model") == "m1")["d"].null_count() == 2
    html = confirmatory_html(PLAN, res)
    assert plan_hash(PLAN) in html and "wilcoxon-signed-rank" in html


def test_confirmatory_refuses_exploratory_split_and_incomplete_plans():
    docs = btv_docs([(0.1, 0.3), (0.2, 0.4)])
    with pytest.raises(ValueError, match="refusing 'exploratory'"):
        confirmatory_analysis(docs, PLAN, "exploratory", Bootstrap(100, 0.95, 1))
    with pytest.raises(ValueError, match="exploratory"):
        confirmatory_analysis(
            btv_docs([(0.1, 0.3)], split="exploratory"), PLAN, "confirmatory", Bootstrap(100, 0.95, 1)
        )
    incomplete = {k: v for k, v in PLAN.items() if k not in ("late", "alpha")}
    with pytest.raises(PlanError, match=r"\['late', 'alpha'\]"):
        confirmatory_analysis(docs, incomplete, "confirmatory", Bootstrap(100, 0.95, 1))
    with pytest.raises(ValueError, match="policy"):
        confirmatory_analysis(docs, {**PLAN, "policy": "other"}, "confirmatory", Bootstrap(100, 0.95, 1))


def test_confirmatory_with_no_document_reaching_a_window():
    res, per = confirmatory_analysis(
        btv_docs([(None, None), (0.1, None)]), PLAN, "confirmatory", Bootstrap(100, 0.95, 1)
    )
    r = res.row(0, named=True)
    assert r["n_used"] == 0 and r["n_excluded"] == 2 and r["decision"] == "not tested"
    assert np.isnan(r["p_raw"])


# --------------------------------------------------------------------------- tables and pages


def test_timing_summary_and_tables(tmp_path, kernel):
    from kvdiverge.engine.core.coupled import simulate
    from kvdiverge.engine.core.pairs import TableKernelPair
    from kvdiverge.estimation.estimators import document_estimates, replicate_estimates

    frames = [simulate(TableKernelPair(kernel, 3), 5, 3, seed=4, doc_id=f"doc{i}") for i in range(4)]
    docs = document_estimates(replicate_estimates(pl.concat(frames), 2))
    pooled = pooled_estimates(docs, Bootstrap(100, 0.95, 1))
    surv = survival_curve(docs, Bootstrap(100, 0.95, 1))
    t = timing_table(pooled, surv)
    f = surv["f"].to_numpy()
    c = np.cumsum(f) / f.sum()
    assert t["tau_median"][0] == int(np.argmax(c >= 0.5 - 1e-12))
    assert t["p_div"][0] == pytest.approx(docs["p_div"].mean())
    gaps = gap_decomposition(
        docs.with_columns(pl.lit("A").alias("policy")).vstack(docs.with_columns(pl.lit("B").alias("policy"))),
        "synthetic",
        "A",
        "B",
        "synthetic",
        Bootstrap(50, 0.9, 1),
    )
    assert gaps.filter(pl.col("term") == "delta")["value"][0] == 0.0
    conf, _ = confirmatory_analysis(btv_docs([(0.1, 0.3), (0.2, 0.4)]), PLAN, "confirmatory", Bootstrap(50, 0.95, 1))
    page = summary_html(pooled, gaps, conf, PLAN)
    assert plan_hash(PLAN) in page and "synthetic" in page and "not rejected" in page
    assert "[95% CI]" in page and "90%" not in page
    ninety = summary_html(pooled, gaps, conf, PLAN, confidence=0.9)  # analysis.confidence: 0.9
    assert ninety.count("[90% CI]") == page.count("[95% CI]") > 5 and "95%" not in ninety
    assert confidence_labels(confirmatory_html(PLAN, conf, confidence=0.9)) == {"90% CI"}
    save_table(docs, tmp_path / "d.parquet", tmp_path / "d.csv")
    back = pl.read_csv(tmp_path / "d.csv")
    assert "S" not in back.columns and back.height == 4
    assert pl.read_parquet(tmp_path / "d.parquet")["S"].dtype == pl.List(pl.Float64)


# --------------------------------------------------------------------------- noise floor


def floor_frame(policy, p, N, tv, split="exploratory", model="m", docs=None):
    docs = docs or [f"d{i}" for i in range(len(p))]
    return pl.DataFrame(
        {
            "model": model,
            "policy": policy,
            "split": split,
            "doc_id": docs,
            "p_div": np.asarray(p, float),
            "E_N": np.asarray(N, float),
            "tv_mean": np.asarray(tv, float),
        }
    )


def test_floor_comparison_is_paired_on_the_floor_documents():
    rng = np.random.default_rng(5)
    n = 8
    fp, fN, ftv = rng.uniform(0, 0.3, n), rng.uniform(0, 2, n), rng.uniform(0, 0.01, n)
    floor = floor_frame("noise-floor", fp[:5], fN[:5], ftv[:5], docs=[f"d{i}" for i in range(5)])
    above = floor_frame("A", fp + 0.2, fN + 1.0, ftv + 0.05)  # shifted in every document
    equal = floor_frame("B", fp, fN, ftv)  # the floor itself
    other = floor_frame("C", fp + 0.5, fN, ftv, split="confirmatory")  # no floor on that split
    docs = pl.concat([above.sample(fraction=1.0, shuffle=True, seed=2), floor, equal, other])
    t = floor_comparison(docs, "noise-floor", Bootstrap(500, 0.95, 3))
    assert sorted(t["policy"].to_list()) == ["A", "B"] and set(t["split"]) == {"exploratory"}
    a = t.filter(pl.col("policy") == "A").row(0, named=True)
    b = t.filter(pl.col("policy") == "B").row(0, named=True)
    assert a["n_docs"] == 5 and a["floor"] == "noise-floor"  # the floor's subset of documents
    assert a["p_div"] == pytest.approx(fp[:5].mean() + 0.2)
    assert a["floor_p_div"] == pytest.approx(fp[:5].mean())
    assert a["floor_tv_mean"] == pytest.approx(ftv[:5].mean())
    # paired: the difference is the same in every document, so its interval is a point
    assert a["diff_p_div_lo"] == pytest.approx(0.2) and a["diff_p_div_hi"] == pytest.approx(0.2)
    assert a["diff_E_N"] == pytest.approx(1.0) and a["diff_tv_mean"] == pytest.approx(0.05)
    assert a["above_floor_p_div"] and a["above_floor_E_N"]
    assert a["p_div_lo"] <= a["p_div"] <= a["p_div_hi"]
    assert b["diff_p_div"] == 0.0 and not b["above_floor_p_div"] and not b["above_floor_E_N"]
    # no floor at all: an empty table with the same columns
    empty = floor_comparison(equal, "noise-floor", Bootstrap(100, 0.95, 3))
    assert empty.height == 0 and "above_floor_E_N" in empty.columns


def test_confirmatory_reports_the_floor_outside_the_family():
    pairs = [(0.1, 0.3), (0.2, 0.25), (0.3, 0.2), (0.1, 0.5), (0.2, 0.6)]
    floor_pairs = [(0.01, 0.02), (0.02, 0.01), (0.0, 0.03), (0.01, 0.01), (None, 0.02)]
    plain, _ = confirmatory_analysis(btv_docs(pairs), PLAN, "confirmatory", Bootstrap(500, 0.95, 1))
    docs = pl.concat([btv_docs(pairs), btv_docs(floor_pairs, policy="noise-floor")])
    res, per = confirmatory_analysis(docs, PLAN, "confirmatory", Bootstrap(500, 0.95, 1), floor="noise-floor")
    plan_row = res.filter(pl.col("role") == "plan").row(0, named=True)
    fl = res.filter(pl.col("role") == "floor").row(0, named=True)
    assert plan_row["p_adjusted"] == pytest.approx(plain["p_adjusted"][0])  # family unchanged
    assert plan_row["decision"] == plain["decision"][0]
    assert fl["policy"] == "noise-floor" and fl["n_used"] == 4 and fl["n_excluded"] == 1
    assert fl["mean_diff"] == pytest.approx(np.mean([0.01, -0.01, 0.03, 0.0]))
    assert np.isnan(fl["p_adjusted"]) and fl["decision"] == "floor (reference)"
    assert per.filter(pl.col("policy") == "noise-floor").height == 5
    html = confirmatory_html(PLAN, res)
    assert "noise-floor (noise floor)" in html


def test_summary_page_says_which_policies_lie_above_the_floor():
    from kvdiverge.report.pages import floor_html

    n = 6
    fp = np.linspace(0.0, 0.1, n)
    docs = pl.concat(
        [
            floor_frame("noise-floor", fp, fp, fp / 10),
            floor_frame("A", fp + 0.3, fp + 2, fp),
            floor_frame("B", fp, fp, fp / 10),
        ]
    )
    t = floor_comparison(docs, "noise-floor", Bootstrap(200, 0.95, 1))
    page = floor_html(t)
    assert "above floor (p_div / E[N])" in page and "yes / yes" in page and "no / no" in page
    assert confidence_labels(page) == {"95% CI"} and confidence_labels(floor_html(t, confidence=0.9)) == {"90% CI"}


def confidence_labels(page: str) -> set[str]:
    """The interval labels a page's headers carry (``[95% CI]`` gives ``95% CI``)."""
    import re

    return set(re.findall(r"\[([0-9.]+% CI)\]", page))


def test_every_caption_says_the_configured_confidence():
    """The report's captions spell the interval coverage from ``analysis.confidence``, not a fixed 95%."""
    from pathlib import Path
    from types import SimpleNamespace

    import jinja2

    from kvdiverge.config.reading import read_yaml
    from kvdiverge.config.workflow import validate

    root = Path(__file__).resolve().parents[1]
    config = read_yaml(root / "config" / "smoke.yaml")  # as written: the report reads Snakemake's own config
    config["analysis"]["confidence"] = 0.9
    assert "drift" not in config
    validate(copy.deepcopy(config))  # a config the workflow takes
    figures = ["survival", "gap_decomposition", "branch_tv", "confirmatory_differences", "speculative", "frontier"]
    said = 0
    for caption in sorted((root / "workflow" / "report").glob("*.rst")):
        for figure in figures if caption.name == "figure.rst" else [None]:
            snakemake = SimpleNamespace(config=config, wildcards=SimpleNamespace(figure=figure), params={})
            text = jinja2.Template(caption.read_text()).render(snakemake=snakemake)
            assert "95%" not in text, (caption.name, figure)
            said += text.count("90%")
    assert said >= 12  # every caption that names a coverage
