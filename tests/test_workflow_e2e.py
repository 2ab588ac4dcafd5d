"""End to end: the whole workflow on config/smoke.yaml produces every table and figure.

The run itself is the session fixture ``smoke_run`` (tests/conftest.py).
"""

from pathlib import Path

import numpy as np
import polars as pl
import pytest

from kvdiverge.config.workflow import load_config, runs
from kvdiverge.estimation.confirmatory import plan_hash

pytestmark = pytest.mark.workflow

REPO = Path(__file__).resolve().parents[1]
FIGURES = ["survival", "gap_decomposition", "branch_tv", "confirmatory_differences", "variance", "length"]
TABLES = [
    "documents",
    "pooled",
    "timing",
    "survival",
    "branch_tv",
    "variance",
    "gaps",
    "confirmatory",
    "confirmatory_documents",
    "floor",
    "drift",
    "length_survival",
]


@pytest.fixture(scope="module")
def config():
    return load_config(REPO / "config" / "smoke.yaml")


def test_every_output_exists(smoke_run, config):
    res = smoke_run
    for model, policy, split in runs(config):
        for suffix in (".parquet", ".replicates.parquet"):
            assert (res / "estimates" / model / policy / f"{split}{suffix}").stat().st_size > 0
    for t in TABLES:
        assert (res / "analysis" / f"{t}.parquet").stat().st_size > 0
        assert (res / "analysis" / f"{t}.csv").stat().st_size > 0
    for f in FIGURES:
        assert (res / "figures" / f"{f}.png").read_bytes()[:4] == b"\x89PNG"
        assert (res / "figures" / f"{f}.pdf").read_bytes()[:4] == b"%PDF"
    for page in ("summary.html", "confirmatory.html"):
        assert "<table>" in (res / "analysis" / page).read_text()
    report = res / "report.html"
    assert report.stat().st_size > 100_000


def test_the_length_drift_of_the_controls(smoke_run, config):
    """The none control's paired differences are exactly 0; the noise floor's lie within their intervals of 0."""
    drift = pl.read_parquet(smoke_run / "analysis" / "drift.parquet")
    assert sorted(set(drift.select("model", "policy", "split").rows())) == sorted(runs(config))
    none = drift.filter(pl.col("policy") == "none")
    assert none.height == 6 and (none["diff"] == 0).all() and (none["diff_lo"] == 0).all()
    floor = drift.filter(pl.col("policy") == "noise-floor")
    assert ((floor["diff_lo"] <= 0) & (floor["diff_hi"] >= 0)).all()
    for model, policy, split in runs(config):
        reps = pl.read_parquet(smoke_run / "estimates" / model / policy / f"{split}.drift.parquet")
        assert (
            reps.height
            == pl.read_parquet(smoke_run / "estimates" / model / policy / f"{split}.replicates.parquet").height
        )
        T = config["decoding"]["max_new_tokens"]
        assert reps["length_full"].is_between(1, T).all() and reps["length_compressed"].is_between(1, T).all()


def test_per_document_estimates_are_sane(smoke_run, config):
    T, W, R = config["decoding"]["max_new_tokens"], config["window"], config["replicates"]
    for model, policy, split in runs(config):
        d = pl.read_parquet(smoke_run / "estimates" / model / policy / f"{split}.parquet")
        assert d.height >= 1
        assert (d["T"] == T).all() and (d["W"] == W).all() and (d["R"] == R).all()
        assert d["doc_id"].n_unique() == d.height
        p = d["p_div"].to_numpy()
        assert np.all((p >= 0) & (p <= 1))
        for c in ("E_L", "E_N", "E_N_post", "E_N_win", "E_L_tail", "E_N_naive"):
            assert np.all(d[c].to_numpy() >= -1e-12), c
        assert np.all(d["E_M"].to_numpy() <= 1 + 1e-9)
        np.testing.assert_allclose(d["first_mismatch_term"] + d["exposure_rate_term"], d["E_M"], atol=1e-9)
        assert np.all(d["E_N_lo"].to_numpy() <= d["E_N_hi"].to_numpy() + 1e-12)
        assert np.all(d["E_L"].to_numpy() <= T)
        reps = pl.read_parquet(smoke_run / "estimates" / model / policy / f"{split}.replicates.parquet")
        assert reps.height == d.height * R
        if policy == "none":  # identical caches: TV exactly 0, never diverges
            assert p.max() == 0.0 and d["E_N"].max() == 0.0
        if policy == "noise-floor":  # every position kept, only reordered: float32 rounding only
            assert (d["kept_len"] == d["prompt_len"]).all()
            assert 0 < d["tv_max"].max() < 1e-3


def test_pooled_tables(smoke_run, config):
    a = smoke_run / "analysis"
    pooled = pl.read_parquet(a / "pooled.parquet")
    assert sorted(pooled.select("model", "policy", "split").rows()) == sorted(runs(config))
    np.testing.assert_allclose(pooled["first_mismatch_term"] + pooled["exposure_rate_term"], pooled["E_M"], atol=1e-9)
    for c in ("p_div", "E_N", "E_M"):
        assert (pooled[c + "_lo"] <= pooled[c] + 1e-12).all() and (pooled[c] <= pooled[c + "_hi"] + 1e-12).all()
    surv = pl.read_parquet(a / "survival.parquet")
    for _, g in surv.group_by(["model", "policy", "split"]):
        S = g.sort("t")["S"].to_numpy()
        assert S[0] == 1.0 and np.all(np.diff(S) <= 1e-12) and S[-1] >= 0
    gaps = pl.read_parquet(a / "gaps.parquet")
    n_gaps = len(config["analysis"]["gaps"]) * len(config["models"])
    assert gaps.height == 4 * n_gaps
    for _, g in gaps.group_by(["model", "policy_a", "policy_b"]):
        t = dict(zip(g["term"], g["value"]))
        assert t["first_mismatch"] + t["exposure"] + t["rate"] == pytest.approx(t["delta"], abs=1e-9)
    btv = pl.read_parquet(a / "branch_tv.parquet").drop_nans("btv")
    assert ((btv["btv"] >= 0) & (btv["btv"] <= 1)).all()


def test_floor_beside_every_policy(smoke_run, config):
    a = smoke_run / "analysis"
    floor = pl.read_parquet(a / "floor.parquet")
    want = sorted((m, s, p) for m, p, s in runs(config) if p != "noise-floor")
    assert sorted(floor.select("model", "split", "policy").rows()) == want
    prompts = pl.read_parquet(smoke_run / "prompts" / "smollm2-135m.parquet").filter(
        pl.col("exclusion_reason").is_null()
    )
    for r in floor.iter_rows(named=True):
        # paired on the floor's documents: all of the split's (the none control: its own few)
        n_split = prompts.filter(pl.col("split") == r["split"]).height
        n_control = config["runs"]["control"]["documents"]
        assert r["n_docs"] == (n_control if r["policy"] == "none" else n_split)
        assert 0 < r["floor_tv_mean"] < 1e-4 and r["floor_tv_mean_lo"] <= r["floor_tv_mean"]
        assert r["diff_p_div"] == pytest.approx(r["p_div"] - r["floor_p_div"], abs=1e-12)
        assert r["above_floor_p_div"] == (r["diff_p_div_lo"] > 0)
    none = floor.filter(pl.col("policy") == "none").row(0, named=True)
    assert not none["above_floor_p_div"] and not none["above_floor_E_N"]
    summary = (a / "summary.html").read_text()
    assert "above noise floor" in summary and "floor p_div" in summary
    surv = pl.read_parquet(a / "survival.parquet")
    assert surv.filter(pl.col("policy") == "noise-floor")["split"].n_unique() == 2


def test_confirmatory_table(smoke_run, config):
    c = pl.read_parquet(smoke_run / "analysis" / "confirmatory.parquet")
    fl = c.filter(pl.col("role") == "floor")
    assert fl["policy"].to_list() == ["noise-floor"] * len(config["models"])
    assert (fl["decision"] == "floor (reference)").all() and fl["p_adjusted"].is_nan().all()
    c = c.filter(pl.col("role") == "plan")
    assert c["model"].to_list() == list(config["models"])
    assert (c["plan_hash"] == plan_hash(config["confirmatory"])).all()
    assert (c["n_used"] + c["n_excluded"] == c["n_docs"]).all()
    assert set(c["decision"]) <= {"reject", "not rejected", "not tested"}
    assert (c["split"] == "confirmatory").all() and (c["policy"] == config["confirmatory"]["policy"]).all()
    assert plan_hash(config["confirmatory"]) in (smoke_run / "analysis" / "confirmatory.html").read_text()


def test_shards_and_report_carry_the_provenance(smoke_run, config):
    from kvdiverge.config.provenance import read_provenance, settings_hash, shard_settings, study_hash

    prov = pl.read_parquet(smoke_run / "analysis" / "provenance.parquet")
    assert sorted(prov.select("model", "policy", "split").rows()) == sorted(runs(config))
    summary = (smoke_run / "analysis" / "summary.html").read_text()
    assert study_hash(prov) in summary
    for row in prov.iter_rows(named=True):
        want = settings_hash(shard_settings(config, row["model"], row["policy"], row["split"]))
        assert row["settings_hash"] == want and want in summary
        assert row["shards"] == config["shards"] and row["kvpress"] == "0.5.5"
        shard = read_provenance(
            smoke_run / "trajectories" / row["model"] / row["policy"] / row["split"] / "shard-1.parquet"
        )
        assert shard.settings_hash == want and shard.versions["torch"] == row["torch"]
