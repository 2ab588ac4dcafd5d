"""Half precision end to end: the smoke config in bfloat16 through Snakemake (up to its tables, one
shard per run, from the session smoke run's corpus), float16 on one document."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest
import yaml
from conftest import REPO

from kvdiverge.engine.core.sampling import Decoding, Sampling
from kvdiverge.estimation.finite import check_finite, document_undefined

pytestmark = [pytest.mark.workflow, pytest.mark.llm, pytest.mark.long]  # a whole workflow run in bfloat16


@pytest.fixture(scope="module")
def bf16(bf16_run, smoke_run) -> Path:
    """The session's bfloat16 run (fixture ``bf16_run``, tests/conftest.py): the smoke config
    with ``dtype: bfloat16`` and one shard per run, up to its tables (``BF16_TARGETS``), in a
    copy of the smoke run whose corpus it kept.

    Returns
    -------
    pathlib.Path
        The run's results directory (the smoke config's ``results_dir``, logs under it).
    """
    results = bf16_run
    assert not (results / "figures").exists()  # only the targets were built
    corpus = "corpus/documents.parquet"  # kept: the copy's, with the smoke run's mtime
    assert (results / corpus).stat().st_mtime_ns == (Path(smoke_run) / corpus).stat().st_mtime_ns
    assert len(list((results / "trajectories").rglob("shard-*.parquet"))) == 7  # 7 runs x 1 shard
    return results


# Where a NaN (or +inf) is the documented value of an undefined quantity in the analysis
# tables (docs/internals.md): a ratio with a zero denominator, a lag no branch reached,
# a test with no usable document. Everything else must be finite.
E_L0, P0, M0, VC0 = (pl.col("E_L") <= 0), (pl.col("p_div") <= 0), (pl.col("E_M") <= 0), (pl.col("var_N_cmc") <= 0)
NO_DOCS = pl.col("n_used") == 0
ANALYSIS_UNDEFINED = {
    "pooled": {
        **{c: E_L0 for c in ("rho", "rho_lo", "rho_hi", "interval_rho_lo", "interval_rho_hi")},
        **{c: P0 for c in ("tau_mean", "tau_mean_lo", "tau_mean_hi")},
        "exposure_share": M0,
        "var_ratio": VC0,
        "var_ratio_tv": VC0,
        "var_ratio_median": VC0,
    },
    "timing": {**{c: P0 for c in ("tau_mean", "tau_mean_lo", "tau_mean_hi")}, "exposure_share": M0},
    "variance": {"var_ratio": VC0, "var_ratio_tv": VC0, "var_ratio_median": VC0},
    "branch_tv": {c: pl.col("n_docs") == 0 for c in ("btv", "btv_lo", "btv_hi")},
    "confirmatory_documents": {"btv_early": ~pl.col("reached_early"), "btv_late": ~pl.col("reached_late")},
    "confirmatory": {
        **{c: NO_DOCS | (pl.col("n_zero") == pl.col("n_used")) for c in ("statistic", "p_raw")},
        # the noise floor's row is reported outside the tested family
        "p_adjusted": NO_DOCS | (pl.col("n_zero") == pl.col("n_used")) | (pl.col("role") == "floor"),
        **{
            c: NO_DOCS
            for c in ("mean_diff", "mean_diff_lo", "mean_diff_hi", "median_diff", "median_diff_lo", "median_diff_hi")
        },
    },
}


def test_bfloat16_smoke_run_gives_finite_tables(bf16):
    """Every estimate and analysis table of the bfloat16 run is finite where a number belongs."""
    results = bf16
    converted = results / "models/smollm2-135m/config.json"
    assert '"dtype": "bfloat16"' in converted.read_text()  # the GGUF conversion kept the dtype
    tables = sorted([*(results / "estimates").rglob("*.parquet"), *(results / "analysis").rglob("*.parquet")])
    # 7 runs (the noise floor on both splits, the decode-time window-50) x (documents,
    # replicates, drift); 9 analysis tables, provenance and floor
    assert len(tables) == 21 + 11
    for path in tables:
        frame = pl.read_parquet(path)
        assert frame.height > 0, path
        name = path.name.removesuffix(".parquet")
        if name.endswith(".replicates"):
            undefined = {}
        elif path.parent.name != "analysis" or name == "documents":
            undefined = document_undefined(frame.columns)
        else:
            undefined = ANALYSIS_UNDEFINED.get(name, {})
        check_finite(frame, path, undefined=undefined, inf_ok=("var_ratio", "var_ratio_tv"))
    # the half-precision evicted runs really diverge, and the control stays exact
    pooled = pl.read_parquet(results / "analysis/pooled.parquet")
    p_div = dict(zip(pooled["policy"], pooled["p_div"]))
    assert p_div["none"] == 0.0
    assert all(0 < p_div[p] <= 1 for p in ("snapkv-50", "snapkv-90", "snapkv-b128"))
    # and bfloat16 rounding alone (the permutation control) makes generations part too
    floor = pooled.filter(pl.col("policy") == "noise-floor")
    assert floor.height == 2 and (floor["p_div"] > 0).all() and (floor["tv_mean"] > 1e-4).all()


def test_float16_runs_on_cpu(bf16):
    """float16 on CPU: one short document, T = 4, through the engine; the records are finite."""
    import torch

    from kvdiverge.engine.core.coupled import to_frame
    from kvdiverge.engine.presses.policies import Policy
    from kvdiverge.engine.runner import Document, run_documents
    from kvdiverge.estimation.finite import check_shard
    from kvdiverge.models.loading import load_model, local_entry

    config = yaml.safe_load((REPO / "config" / "smoke.yaml").read_text())
    spec = local_entry({**config["models"]["smollm2-135m"], "dtype": "float16"}, bf16 / "models/smollm2-135m")
    model, _ = load_model(spec, "smollm2-135m")
    assert next(model.parameters()).dtype == torch.float16
    prompts = pl.read_parquet(bf16 / "prompts/smollm2-135m.parquet")
    # a 48-token prompt: float16 matrix products have no fast CPU kernels (slow)
    ids = prompts.filter(pl.col("split") == "exploratory")["input_ids"][0].to_list()[:48]
    policy = Policy.from_config("snapkv-50", config["policies"]["snapkv-50"])
    records = run_documents(
        model,
        [Document("d0", ids)],
        policy,
        Sampling(T=4, replicates=2, decoding=Decoding(temperature=0.7, top_p=0.95), seed=1, model_name="smollm2-135m"),
    )
    frame = to_frame([{"model": "smollm2-135m", "policy": "snapkv-50", "split": "exploratory", **r} for r in records])
    check_shard(frame, "float16 records")
    assert frame["kept_len"][0] < len(ids)
    assert frame["survival"].list.last().max() < 1  # the evicted side diverges somewhere
