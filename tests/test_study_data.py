"""The prediction study's numbers in docs/task.md, rebuilt from the tables committed under docs/data/.

Each model's directory holds what the ``prediction`` rule read and wrote (``fidelity.csv``: the fidelity
measures per point and document; ``task.csv``: the task answers; ``points.csv``: the points and their
ratio; ``prediction.csv`` and ``accuracy.csv``: its results). The point estimates and the within-ratio
permutation p-values are rebuilt here from the inputs with the project's own analysis (no bootstrap:
the intervals are read from ``prediction.csv``), and docs/task.md's tables are the committed tables
rendered (:func:`kvdiverge.report.formatting.prediction_markdown`). A model may also hold exploratory
tables (``prediction-<side>.csv``): one task side analysed under a lower full-cache bar than its config's.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from kvdiverge.config.workflow import load_config
from kvdiverge.estimation.beyond_ratio import STATISTICS, TESTED
from kvdiverge.estimation.bootstrap import Bootstrap
from kvdiverge.estimation.prediction import PredictionSettings, prediction_study
from kvdiverge.report.formatting import accuracy_markdown, pairwise_markdown, prediction_markdown

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data" / "prediction"
#: Each model's study config (its seed seeds the permutations; its bar refuses a weak task side).
CONFIGS = {
    "smollm2-135m": ROOT / "config" / "fidelity-predicts-task.yaml",
    "gemma3-270m": ROOT / "config" / "fidelity-predicts-task-gemma.yaml",
}
MODELS = sorted(p.name for p in DATA.iterdir() if p.is_dir())
KEYS = ["task", "placement", "measure"]


#: The pairs of measures docs/task.md compares draw by draw (``pairwise.csv``).
PAIRS = [
    ("kld_mean", "p_div"),
    ("kld_key_mean", "kld_mean"),
    ("reconstruction_kld_mean", "kld_mean"),
    ("reconstruction_kld_key_mean", "kld_mean"),
]


def test_every_studied_model_has_its_tables_and_its_config():
    assert MODELS and set(MODELS) <= set(CONFIGS)
    for model in MODELS:
        assert {p.name for p in (DATA / model).iterdir()} >= {
            "fidelity.csv", "task.csv", "points.csv", "prediction.csv", "accuracy.csv"
        }  # fmt: skip
        assert list(load_config(CONFIGS[model])["models"]) == [model]


def _read(model: str, name: str) -> pl.DataFrame:
    return pl.read_csv(DATA / model / f"{name}.csv", infer_schema_length=None)


#: Exploratory tables beside a model's study: the table's suffix, the task side it keeps and the bar it
#: was computed with (below the config's, so a side the study refuses is analysed, and said to be).
EXPLORATORY = {"smollm2-135m": [("-recall", "recall", 0.5)]}
TABLES = [(model, "", None, None) for model in MODELS] + [
    (model, *entry) for model in MODELS for entry in EXPLORATORY.get(model, [])
]


@pytest.mark.long  # every measure's permutation p-values at the study's size, about 25 s for the four tables
@pytest.mark.parametrize(("model", "suffix", "side", "bar"), TABLES)
def test_the_point_estimates_and_p_values_rebuild_from_the_committed_inputs(model, suffix, side, bar):
    config = load_config(CONFIGS[model])
    table = _read(model, f"prediction{suffix}")
    measures = table["measure"].unique(maintain_order=True).to_list()
    assert measures == config["prediction"]["measures"]
    settings = PredictionSettings(
        boot=Bootstrap(0, config["analysis"]["confidence"], config["seed"]),
        n_perm=999,
        min_full_accuracy=config["prediction"]["min_full_accuracy"] if bar is None else bar,
    )
    task = _read(model, "task")
    if side is not None:
        assert bar < config["prediction"]["min_full_accuracy"]
        task = task.filter(pl.col("task") == side)
    study = prediction_study(_read(model, "fidelity"), task, _read(model, "points"), measures, settings=settings)
    rebuilt = study.prediction.join(table, on=KEYS, how="full", suffix="_committed", coalesce=True)
    assert rebuilt.height == table.height == study.prediction.height
    # SmolLM2's input CSVs keep 6 decimals (the prediction rule's): a statistic moves by less than 1e-5, and a
    # permuted statistic tied with the observed one at that rounding can fall on either side of it, moving a
    # p-value by one permutation in 1 + 999 (a Holm-adjusted one by that times the side's measures). Gemma's
    # are written at full precision from the rule's parquet files: its AdaKV and SnapKV points nearly tie, and
    # 6 decimals reorder them (Spearman moves by 5e-4).
    one = 1 / (1 + settings.n_perm)
    tolerance = {column: 1e-5 for column in STATISTICS}
    tolerance |= {f"p_{s}": one + 1e-9 for s in TESTED}
    tolerance |= {f"p_{s}_holm": len(measures) * one + 1e-9 for s in TESTED}
    for column, atol in tolerance.items():
        np.testing.assert_allclose(
            rebuilt[column].to_numpy().astype(float),
            rebuilt[f"{column}_committed"].to_numpy().astype(float),
            rtol=0,
            atol=atol,
            equal_nan=True,
            err_msg=column,
        )
    if side is not None:
        return
    columns = ["task", "placement", "point", "accuracy", "full_accuracy"]
    accuracy, again = (t.select(columns).sort(columns[:3]) for t in (_read(model, "accuracy"), study.accuracy))
    assert accuracy.select(columns[:3]).equals(again.select(columns[:3]))
    np.testing.assert_allclose(again.select(columns[3:]).to_numpy(), accuracy.select(columns[3:]).to_numpy(), atol=1e-6)


def _quoted(name: str, model: str) -> str:
    text = (ROOT / "docs" / "task.md").read_text()
    found = re.search(rf"<!-- {name} {re.escape(model)} -->\n(.*?)\n<!-- end -->", text, re.S)
    assert found, f"docs/task.md has no {name} of {model}"
    return found.group(1)


@pytest.mark.parametrize("model", MODELS)
def test_docs_task_quotes_the_committed_tables(model):
    measures = load_config(CONFIGS[model])["prediction"]["measures"]
    assert _quoted("prediction table", model) == prediction_markdown(_read(model, "prediction"), measures)
    assert _quoted("pairwise table", model) == pairwise_markdown(_read(model, "pairwise"), PAIRS)
    assert _quoted("accuracy table", model) == accuracy_markdown(_read(model, "accuracy"))
    for suffix, side, _ in EXPLORATORY.get(model, []):
        assert _quoted(f"{side} table", model) == prediction_markdown(_read(model, f"prediction{suffix}"), measures)
        assert _quoted(f"{side} pairwise table", model) == pairwise_markdown(_read(model, f"pairwise{suffix}"), PAIRS)


def test_docs_results_quote_the_llama_cpp_caches_table():
    """docs/results.md's llama.cpp table is ``docs/data/llamacpp/caches.csv`` rendered by the script that wrote it
    (``benchmarks/llamacpp_caches.py``), and each model's f16 control is exactly 0 on every measure."""
    import importlib.util

    path = ROOT / "benchmarks" / "llamacpp_caches.py"
    spec = importlib.util.spec_from_file_location("benchmark_llamacpp_caches", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    table = pl.read_csv(ROOT / "docs" / "data" / "llamacpp" / "caches.csv")
    assert sorted(table["model"].unique()) == ["gemma3-270m", "smollm2-135m"]
    control = table.filter(pl.col("policy") == "f16")
    assert control.height == 2
    assert control.select("p_div", "p_div_hi", "E_M", "E_M_hi", "kld_mean", "kld_mean_hi").to_numpy().max() == 0
    # bits per element by hand: ggml's q8_0 is 34 bytes per 32 elements, q5_1 24, q5_0 22, q4_1 20, q4_0 and
    # iq4_nl 18, and quanto's int4 is 4 bits plus a float32 scale and zero point per group of 64
    bits = {(r["backend"], r["policy"]): r["bits"] for r in table.iter_rows(named=True)}
    assert bits == {
        ("llama_cpp", "f16"): 16.0,
        ("llama_cpp", "q8_0"): 8.5,
        ("llama_cpp", "q8_0:norot"): 8.5,
        ("llama_cpp", "q4_0"): 4.5,
        ("llama_cpp", "q4_0:norot"): 4.5,
        ("llama_cpp", "q5_1"): 6.0,
        ("llama_cpp", "q5_0"): 5.5,
        ("llama_cpp", "q4_1"): 5.0,
        ("llama_cpp", "iq4_nl"): 4.5,
        ("transformers", "quanto:nbits=4"): 5.0,
    }
    assert table.filter(pl.col("backend") == "transformers")["kld_mean"].null_count() == 1  # no KLD on its weights
    page = (ROOT / "docs" / "results.md").read_text()
    assert script.caches_markdown(table) in page
    kld = {r["policy"]: r["kld_mean"] for r in table.filter(pl.col("model") == "smollm2-135m").iter_rows(named=True)}
    assert f"it is {kld['q4_0:norot'] / kld['q4_0']:.1f} times" in page  # the rotation's ratio the prose quotes
    assert (ROOT / "docs" / "images" / "llamacpp_caches.png").is_file() and "images/llamacpp_caches.png" in page


#: Numbers docs/task.md's prose quotes beside its tables: (model, point, measure, quoted value). A measure is
#: the point's mean over the fidelity documents (``fidelity.csv``); ``drop:<task>`` is the point's accuracy
#: drop with the question inside (``accuracy.csv``).
PROSE = [
    ("smollm2-135m", "expected-attention@0.25", "kld_mean", 0.006),
    ("smollm2-135m", "expected-attention@0.25", "reconstruction_kld_mean", 0.28),
    ("smollm2-135m", "tova@0.25", "reconstruction_kld_mean", 0.58),
    ("smollm2-135m", "streamingllm@0.25", "reconstruction_kld_mean", 0.71),
    ("smollm2-135m", "adakv-snapkv@0.25", "reconstruction_kld_mean", 1.1),
    ("smollm2-135m", "knorm@0.25", "kld_mean", 0.14),
    ("smollm2-135m", "int4", "reconstruction_kld_mean", 0.07),
    ("smollm2-135m", "tova@0.25", "drop:niah", 0.0),
    ("smollm2-135m", "streamingllm@0.25", "drop:niah", 0.21),
    ("gemma3-270m", "tova@0.25", "kld_mean", 0.002),
    ("gemma3-270m", "tova@0.25", "reconstruction_kld_mean", 0.48),
    ("gemma3-270m", "streamingllm@0.25", "reconstruction_kld_mean", 0.69),
    ("gemma3-270m", "snapkv@0.25", "reconstruction_kld_mean", 0.69),
    ("gemma3-270m", "tova@0.25", "drop:multikey", 0.57),
    ("gemma3-270m", "streamingllm@0.25", "drop:multikey", 0.04),
    ("gemma3-270m", "streamingllm@0.25", "drop:niah", 0.18),
    ("gemma3-270m", "knorm@0.25", "drop:niah", 0.04),
    ("gemma3-270m", "snapkv@0.25", "drop:niah", 0.61),
    ("gemma3-270m", "snapkv@0.25", "drop:multikey", 0.21),
]


@pytest.mark.parametrize(("model", "point", "measure", "quoted"), PROSE)
def test_the_numbers_docs_task_quotes_in_its_prose_rebuild_from_the_committed_tables(model, point, measure, quoted):
    if measure.startswith("drop:"):
        rows = _read(model, "accuracy").filter(
            (pl.col("point") == point) & (pl.col("task") == measure[5:]) & (pl.col("placement") == "inside")
        )
        value = rows["drop"].item()
    else:
        value = _read(model, "fidelity").filter(pl.col("point") == point)[measure].mean()
    assert round(value, len(repr(quoted).split(".")[1])) == quoted  # to the digits quoted


def test_the_cost_per_point_docs_task_quotes_rebuilds_from_the_committed_table():
    """The "Cost against power" paragraph: each family's CPU-seconds per point (``cpu_s_per_point``)."""
    table = _read("smollm2-135m", "prediction")
    cost = {m: round(table.filter(pl.col("measure") == m)["cpu_s_per_point"].unique().item()) for m in
            ("kld_mean", "reconstruction_kld_mean", "E_M")}  # fmt: skip
    sentence = (
        f"Per point, the continuation pass costs {cost['kld_mean']} CPU-seconds, the reconstruction\n"
        f"pass {cost['reconstruction_kld_mean']} and the coupled measures {cost['E_M']}"
    )
    assert sentence in (ROOT / "docs" / "task.md").read_text()
