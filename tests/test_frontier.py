"""Frontiers: the config section's expansion, the statistics, the figure, the API and the workflow.

- the ``frontier`` section expands into ``<press>@<ratio>``, ``<cache>`` and
  ``<press>@<ratio>+<cache>`` policies on one split, checked with the key named (no model);
- the areas and the ranking, exactly, on hand-made tables (no model): by the area over the
  ratios for presses alone, by the mean over the common range of KV bytes per prompt token
  for eviction and quantized curves together; the byte count by hand and against what
  quanto and HQQ store;
- the expanded policies share documents and common random numbers, and the API draws the
  frontier (a miniature random-weight model, ``miniature``);
- ``config/frontier-smoke.yaml`` runs end to end through Snakemake (``workflow``).
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import yaml
from conftest import run_main

from kvdiverge.config.frontier import FrontierSpec, frontier_grid, frontier_name, frontier_points
from kvdiverge.config.provenance import read_provenance
from kvdiverge.config.workflow import ConfigError, expand_frontier, load_config, runs, validate
from kvdiverge.estimation.bootstrap import Bootstrap
from kvdiverge.estimation.frontier import FrontierPoint, frontier_curves, frontier_tables
from kvdiverge.estimation.frontier_ranking import common_range, range_mean, trapezoid_area
from kvdiverge.estimation.kv_bytes import kv_bytes_per_element

REPO = Path(__file__).resolve().parents[1]
PRESSES = ["snapkv", "knorm", "streamingllm", "tova", "expected-attention", "adakv-snapkv"]
RATIOS = [0.1, 0.25, 0.5, 0.75]


def raw(name: str) -> dict:
    return yaml.safe_load((REPO / "config" / name).read_text())


def error_of(config: dict) -> str:
    with pytest.raises(ConfigError) as info:
        validate(config)
    return str(info.value)


# --------------------------------------------------------------------------- expansion and naming


def test_names_of_frontier_points():
    assert frontier_name("snapkv", ratio=0.5) == "snapkv@0.5"
    assert frontier_name("snapkv", ratio=0.25) == "snapkv@0.25"
    assert frontier_name("snapkv", ratio=0) == "snapkv@0"
    assert frontier_name("snapkv", budget=128) == "snapkv@b128"
    with pytest.raises(ValueError, match="exactly one"):
        frontier_name("snapkv", ratio=0.5, budget=128)
    grid = frontier_grid(["a", "b"], FrontierSpec([0.1, 0.5], [64]))
    assert [p.policy for p in grid] == ["a@0.1", "a@0.5", "a@b64", "b@0.1", "b@0.5", "b@b64"]
    # full-precision points name no cache
    assert grid[2] == FrontierPoint("a@b64", "a", None, 64)
    assert grid[2].as_dict() == {
        "policy": "a@b64",
        "press": "a",
        "compression_ratio": None,
        "budget": 64,
        "cache": None,
        "cache_settings": None,
    }
    with pytest.raises(ValueError, match=r"^ratios: 1\.0 is not a compression ratio; allowed: numbers in \[0, 1\)$"):
        frontier_grid(["a"], FrontierSpec([1.0]))
    with pytest.raises(ValueError, match=r"^budgets: 0 is not a number of tokens; allowed: integers >= 1$"):
        frontier_grid(["a"], FrontierSpec([], [0]))


def test_frontier_config_expands_into_policies_on_its_split():
    before = raw("frontier.yaml")
    config = load_config(REPO / "config" / "frontier.yaml")
    assert raw("frontier.yaml") == before  # the file's dict is not touched
    names = [f"{p}@{r:g}" for p in PRESSES for r in RATIOS]
    assert config["runs"]["exploratory"] == names
    assert [p.policy for p in frontier_points(config)] == names
    assert config["policies"]["snapkv@0.25"] == {
        "press": "SnapKVPress",
        "window_size": 64,
        "kernel_size": 5,
        "compression_ratio": 0.25,
    }
    # a nested press: the top-level ratio goes to the press that takes it (the inner scorer)
    assert config["policies"]["adakv-snapkv@0.75"] == {
        "press": "AdaKVPress",
        "params": {"press": {"press": "SnapKVPress", "window_size": 64, "kernel_size": 5}},
        "compression_ratio": 0.75,
    }
    # ordinary runs: every point on the exploratory split, the noise floor beside them
    expl = [p for m, p, s in runs(config) if s == "exploratory"]
    assert expl == names + ["noise-floor"]
    assert validate(config) == config  # expanding an expanded config changes nothing
    assert expand_frontier(config) == config


def test_frontier_policy_settings_equal_a_hand_written_policy():
    """Provenance and caching see an ordinary policy: the same shard settings as the same entry by hand."""
    from kvdiverge.config.provenance import shard_settings

    config = load_config(REPO / "config" / "frontier.yaml")
    hand = copy.deepcopy(raw("frontier.yaml"))
    hand["policies"]["snapkv-25"] = {
        "press": "SnapKVPress",
        "compression_ratio": 0.25,
        "window_size": 64,
        "kernel_size": 5,
    }
    hand["runs"]["exploratory"] = ["snapkv-25"]
    del hand["frontier"]
    hand = validate(hand)
    assert shard_settings(config, "smollm2-135m", "snapkv@0.25", "exploratory") == shard_settings(
        hand, "smollm2-135m", "snapkv-25", "exploratory"
    )


def test_budgets_expand_too():
    config = raw("frontier-smoke.yaml")
    config["frontier"]["budgets"] = [96]
    out = validate(config)
    assert out["policies"]["snapkv@b96"]["budget"] == 96 and "compression_ratio" not in out["policies"]["snapkv@b96"]
    assert "snapkv@b96" in out["runs"]["exploratory"]


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda f: f.update(ratios=[0.5, 1.0]), "frontier.ratios[1]: 1.0 is out of range; allowed: >= 0 and < 1"),
        (lambda f: f.update(ratios=[-0.1]), "frontier.ratios[0]: -0.1 is out of range; allowed: >= 0 and < 1"),
        (
            lambda f: f["presses"].update(perm={"press": "PermutationPress"}),
            "frontier.presses.perm: PermutationPress takes no compression_ratio",
        ),
        (
            lambda f: f["presses"].update(ada={"press": "AdaKVPress"}),
            "frontier.presses.ada: AdaKVPress takes no compression_ratio",
        ),
        (
            lambda f: f["presses"]["snapkv"].update(compression_ratio=0.5),
            "frontier.presses.snapkv: give the press without compression_ratio or budget",
        ),
        (
            lambda f: f["presses"]["snapkv"].update(window_size=0),
            "frontier.presses.snapkv.window_size: 0 is out of range",
        ),
        (
            lambda f: f["presses"]["snapkv"].update(press="SnapPress"),
            "frontier.presses.snapkv: unknown press 'SnapPress'; available: ",
        ),
        (lambda f: f.update(split="heldout"), "frontier.split: 'heldout' is not allowed"),
    ],
)
def test_bad_frontier_is_refused_with_the_key_named(edit, message):
    config = raw("frontier-smoke.yaml")
    edit(config["frontier"])
    assert message in error_of(config)


def test_frontier_names_are_reserved_and_the_floor_is_required():
    config = raw("frontier-smoke.yaml")
    config["policies"]["snapkv@0.5"] = {"press": "KnormPress", "compression_ratio": 0.5}
    assert "policies.snapkv@0.5: the name belongs to the frontier point frontier.presses.snapkv" in error_of(config)
    config = raw("frontier-smoke.yaml")
    config["policies"]["mine@0.3"] = {"press": "KnormPress", "compression_ratio": 0.3}
    assert "policies.mine@0.3: '@' in a policy name is reserved for the frontier" in error_of(config)
    config = raw("frontier-smoke.yaml")
    del config["runs"]["floor"]
    assert "frontier: needs runs.floor" in error_of(config)


# --------------------------------------------------------------------------- statistics, exactly


def _docs(values: dict[str, tuple[float, float]], n_docs: int = 3, T: int = 4) -> pl.DataFrame:
    """Per-document estimates where every document of a policy has the same (p_div, E_M):
    divergence at step 1 only, so E[L] = (T - 1) p_div and E[N_post] = T E_M - p_div."""
    rows = []
    for policy, (p, em) in values.items():
        for d in range(n_docs):
            f = [p] + [0.0] * (T - 1)
            rows.append(
                {
                    "model": "m",
                    "policy": policy,
                    "split": "exploratory",
                    "doc_id": f"d{d}",
                    "T": T,
                    "prompt_len": 100,
                    "kept_len": 60,
                    "p_div": p,
                    "E_tau_div": p,
                    "E_L": (T - 1) * p,
                    "E_N_post": T * em - p,
                    "E_N": T * em,
                    "E_M": em,
                    "tv_mean": p / 10,
                    "f": f,
                }
            )
    return pl.DataFrame(rows)


def test_trapezoid_area_by_hand():
    x = np.array([0.1, 0.5, 0.75])
    assert trapezoid_area(x, np.array([0.1, 0.3, 0.6])) == pytest.approx(0.4 * 0.2 + 0.25 * 0.45, abs=1e-15)
    y = np.array([[0.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    np.testing.assert_allclose(trapezoid_area(x, y), [0.4 * 0.5 + 0.25, 0.65], atol=1e-15)
    assert np.isnan(trapezoid_area(x[:1], np.array([0.3])))


def test_frontier_tables_areas_and_ranking_exactly():
    grid = frontier_grid(["a", "b"], FrontierSpec([0.1, 0.5, 0.75]))
    E = {"a": [0.1, 0.3, 0.6], "b": [0.05, 0.2, 0.4]}
    P = {"a": [0.4, 0.8, 1.0], "b": [0.2, 0.6, 0.9]}
    values = {f"{k}@{r:g}": (P[k][i], E[k][i]) for k in "ab" for i, r in enumerate([0.1, 0.5, 0.75])}
    values["noise-floor"] = (0.0, 0.0)
    points, areas = frontier_tables(_docs(values), grid, "noise-floor", Bootstrap(50, 0.95, 1))
    area = {"a": 0.4 * (0.1 + 0.3) / 2 + 0.25 * (0.3 + 0.6) / 2, "b": 0.4 * (0.05 + 0.2) / 2 + 0.25 * (0.2 + 0.4) / 2}
    assert areas["press"].to_list() == ["b", "a"] and areas["rank"].to_list() == [1, 2]
    for r in areas.iter_rows(named=True):
        # identical documents: every resample gives the same curve, the interval is the point
        assert r["area_E_M"] == pytest.approx(area[r["press"]], abs=1e-12)
        assert r["area_E_M_lo"] == pytest.approx(area[r["press"]], abs=1e-12)
        assert r["area_E_M_hi"] == pytest.approx(area[r["press"]], abs=1e-12)
        assert r["diff_best_area_E_M"] == pytest.approx(area[r["press"]] - area["b"], abs=1e-12)
        assert r["n_ratios"] == 3 and r["ratio_min"] == 0.1 and r["ratio_max"] == 0.75
        # the floor never diverges: every point lies above it (a degenerate interval above 0)
        assert r["above_floor_everywhere"] and r["first_ratio_above_floor"] == 0.1
    a_p = 0.4 * (0.4 + 0.8) / 2 + 0.25 * (0.8 + 1.0) / 2
    assert areas.filter(pl.col("press") == "a")["area_p_div"][0] == pytest.approx(a_p, abs=1e-12)
    # points: ranked press first, then ratio; retention = 1 - ratio; the decomposition terms
    assert points["policy"].to_list() == ["b@0.1", "b@0.5", "b@0.75", "a@0.1", "a@0.5", "a@0.75"]
    np.testing.assert_allclose(points["retention"], [0.9, 0.5, 0.25] * 2, atol=1e-15)
    np.testing.assert_allclose(points["first_mismatch_term"] + points["exposure_rate_term"], points["E_M"], atol=1e-12)
    np.testing.assert_allclose(points["first_mismatch_term"], points["p_div"] / 4, atol=1e-15)
    assert (points["tau_mean"] == 1.0).all() and (points["tau_median"] == 1.0).all()
    np.testing.assert_allclose(points["rho"], (4 * points["E_M"] - points["p_div"]) / (3 * points["p_div"]), rtol=1e-12)
    assert (points["floor_p_div"] == 0.0).all() and points["floor_tau_mean"].is_nan().all()
    assert (points["kept_fraction"] == 0.6).all()
    # one ratio set for every press: the mean over the common range is the area over the span (0.9 - 0.25
    # in retention), so the ranking is the area's; in bytes (kv_sizes) the same means on 0.25..0.9 x 100 x 4
    for sizes in (None, {"m": {"elements_per_token": 100, "element_bytes": 4}}):
        _, by_bytes = frontier_tables(_docs(values), grid, "noise-floor", Bootstrap(50, 0.95, 1), kv_sizes=sizes)
        assert by_bytes["curve"].to_list() == ["b", "a"] and by_bytes["covers_range"].all()
        for r in by_bytes.iter_rows(named=True):
            assert r["mean_E_M"] == pytest.approx(area[r["press"]] / 0.65, abs=1e-12)
            assert r["diff_best_mean_E_M"] == pytest.approx((area[r["press"]] - area["b"]) / 0.65, abs=1e-12)
        if sizes is None:
            assert by_bytes["range_lo"].is_nan().all() and by_bytes["bytes_min"].is_nan().all()
        else:
            assert by_bytes["range_lo"].to_list() == [100.0] * 2 and by_bytes["range_hi"].to_list() == [360.0] * 2


def test_frontier_is_paired_and_knows_the_floor():
    """Documents that differ: intervals open, and a press well above the floor is flagged above it."""
    grid = frontier_grid(["a"], FrontierSpec([0.25, 0.5]))
    docs = _docs({"a@0.25": (0.5, 0.2), "a@0.5": (0.7, 0.3), "noise-floor": (0.0, 0.0)})
    docs = docs.with_columns(
        pl.when(pl.col("doc_id") == "d0").then(pl.col("p_div") * 0.5).otherwise(pl.col("p_div")).alias("p_div")
    )
    docs = docs.with_columns(
        (pl.col("p_div") * 3).alias("E_L"),
        pl.col("p_div").alias("E_tau_div"),
        (4 * pl.col("E_M") - pl.col("p_div")).alias("E_N_post"),
        pl.concat_list([pl.col("p_div"), pl.lit(0.0), pl.lit(0.0), pl.lit(0.0)]).alias("f"),
    )
    points, areas = frontier_tables(docs, grid, "noise-floor", Bootstrap(400, 0.9, 3))
    assert (points["p_div_lo"] < points["p_div"]).all() and (points["p_div"] < points["p_div_hi"]).all()
    assert points["above_floor"].all()
    assert areas["first_ratio_above_floor"][0] == 0.25 and areas["above_floor_everywhere"][0]
    with pytest.raises(ValueError, match="share their documents"):
        frontier_tables(
            docs.filter(~((pl.col("policy") == "a@0.5") & (pl.col("doc_id") == "d2"))),
            grid,
            "noise-floor",
            Bootstrap(10, 0.9, 3),
        )


def test_frontier_figure_is_written(tmp_path):
    from kvdiverge.report.frontier import plot_frontier
    from kvdiverge.report.pages import frontier_html

    grid = frontier_grid(["a", "b"], FrontierSpec([0.1, 0.5, 0.75], [32]))
    values = {p.policy: (0.3 + 0.5 * (p.compression_ratio or 0.4), 0.1 + (p.press == "b") * 0.1) for p in grid}
    values["noise-floor"] = (1e-4, 1e-5)
    points, areas = frontier_tables(_docs(values), grid, "noise-floor", Bootstrap(20, 0.95, 0))
    plot_frontier(points, tmp_path / "frontier.png", tmp_path / "frontier.pdf")
    assert (tmp_path / "frontier.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "frontier.pdf").read_bytes()[:4] == b"%PDF"
    page = frontier_html(points, areas)
    assert page.count("<table>") == 2 and "a@b32" in page and "(best)" in page
    ninety = frontier_html(points, areas, 0.9)
    assert "[90% CI]" in ninety and "95%" not in ninety and "[95% CI]" in page


# --------------------------------------------------------------------------- quantized caches on the frontier


Q4 = {"backend": "quanto", "nbits": 4, "q_group_size": 64, "residual_length": 32}
SIZES = {"m": {"elements_per_token": 100, "element_bytes": 4}}


def test_kv_bytes_per_element_by_hand():
    # full precision: the dtype's bytes; quantized: nbits/8 + 2 x dtype bytes / group (a scale and a zero point)
    assert kv_bytes_per_element(None, 4) == 4.0 and kv_bytes_per_element(None, 2) == 2.0
    assert kv_bytes_per_element(Q4, 4) == 0.5 + 8 / 64 == 0.625
    assert kv_bytes_per_element({**Q4, "nbits": 2}, 4) == 0.25 + 0.125 == 0.375
    assert kv_bytes_per_element(Q4, 2) == 0.5 + 4 / 64 == 0.5625  # bfloat16 scales
    assert kv_bytes_per_element({"backend": "hqq", "nbits": 3, "q_group_size": 32}, 4) == 0.4 + 8 / 32  # 10 per int32
    assert kv_bytes_per_element({"backend": "hqq", "nbits": 8, "q_group_size": 64}, 4) == 1.125
    # llama.cpp's cache types: ggml's blocks of 32 with an f16 scale, whatever the model's dtype
    llama = {"backend": "llama_cpp", "type_k": "q8_0", "type_v": "q8_0"}
    assert kv_bytes_per_element(llama, 4) == kv_bytes_per_element(llama, 2) == 34 / 32
    assert kv_bytes_per_element({**llama, "type_k": "q4_0", "type_v": "q4_0"}, 4) == 18 / 32
    assert kv_bytes_per_element({**llama, "type_k": "f16", "type_v": "q4_0"}, 4) == (2 + 18 / 32) / 2


def _stored_bytes(q) -> int:
    """Bytes a quantized tensor of optimum-quanto (data, scale, shift) or HQQ ((data, meta)) holds."""
    import torch

    if isinstance(q, tuple):
        data, meta = q
        parts = [data, meta["scale"], meta["zero"]]
    else:
        parts = [getattr(q, n) for n in ("_data", "_scale", "_shift")]
    parts = [getattr(t, "_data", t) for t in parts]
    assert all(isinstance(t, torch.Tensor) for t in parts)
    return sum(t.numel() * t.element_size() for t in parts)


@pytest.mark.parametrize(
    "backend, nbits, dtype",
    [
        ("quanto", 4, "float32"),
        ("quanto", 2, "float32"),
        ("quanto", 4, "bfloat16"),
        ("hqq", 4, "float32"),
        ("hqq", 3, "float32"),
    ],
)
def test_kv_bytes_are_what_the_backend_stores(backend, nbits, dtype):
    """transformers' quantized layers on a (1, 3, 200, 64) key tensor, groups of 64 along the head
    dimension (the axis the engine uses): the bytes held equal the formula's, scales in the tensor's dtype."""
    import torch
    from transformers.cache_utils import HQQQuantizedLayer, QuantoQuantizedLayer

    x = torch.randn(1, 3, 200, 64, generator=torch.Generator().manual_seed(0)).to(getattr(torch, dtype))
    cls, axis = (QuantoQuantizedLayer, 0) if backend == "quanto" else (HQQQuantizedLayer, 1)
    layer = cls(nbits=nbits, axis_key=axis, axis_value=axis, q_group_size=64, residual_length=32)
    layer.keys = x  # HQQ reads the device and compute dtype from the layer's keys
    stored = _stored_bytes(layer._quantize(x.contiguous(), axis))
    per_element = kv_bytes_per_element({"backend": backend, "nbits": nbits, "q_group_size": 64}, x.element_size())
    assert stored == pytest.approx(per_element * x.numel(), rel=1e-12)


def test_common_range_and_range_mean_by_hand():
    # the most curves sharing an interval of positive width; a tie goes to the wider, then the lower one
    assert common_range({"a": (0, 2), "b": (1, 3), "c": (5, 6), "d": (5, 7), "e": (3, 3)}) == (1.0, 2.0, ["a", "b"])
    assert common_range({"a": (0, 4), "b": (1, 3), "c": (2, 6)}) == (2.0, 3.0, ["a", "b", "c"])
    assert common_range({"a": (0, 1), "b": (1, 2), "c": (0.5, 1.5)}) == (0.5, 1.0, ["a", "c"])
    assert common_range({"e": (3, 3)}) is None
    x, y = np.array([0.0, 1.0, 3.0]), np.array([0.0, 2.0, 0.0])
    # y(0.5) = 1, y(1) = 2, y(2) = 1: (0.5 (1 + 2) / 2 + 1 (2 + 1) / 2) / 1.5
    assert range_mean(x, y, 0.5, 2.0) == pytest.approx(2.25 / 1.5, abs=1e-15)
    assert range_mean(x, y, 2.0, 2.0) == pytest.approx(1.0, abs=1e-15)
    np.testing.assert_allclose(range_mean(x, np.stack([y, 2 * y]), 0.0, 3.0), [1.0, 2.0], atol=1e-15)
    with pytest.raises(ValueError, match="outside the curve"):
        range_mean(x, y, 0.5, 3.5)


def test_grid_names_caches_and_curves():
    assert frontier_name("snapkv", ratio=0.5, cache="int4") == "snapkv@0.5+int4"
    assert frontier_name(None, cache="int4") == "int4"
    with pytest.raises(ValueError, match="ratios, not budgets"):
        frontier_name("snapkv", budget=64, cache="int4")
    grid = frontier_grid(
        ["a", "b"], FrontierSpec([0.25, 0.5], [64], caches={"q4": Q4})
    )  # cache ratios: 0 and every ratio
    assert [p.policy for p in grid] == [
        "a@0.25",
        "a@0.5",
        "a@b64",
        "b@0.25",
        "b@0.5",
        "b@b64",
        "q4",
        "a@0.25+q4",
        "a@0.5+q4",
        "b@0.25+q4",
        "b@0.5+q4",
    ]
    assert grid[6].as_dict() == {
        "policy": "q4",
        "press": None,
        "compression_ratio": 0.0,
        "budget": None,
        "cache": "q4",
        "cache_settings": Q4,
    }
    assert {k: c["policies"] for k, c in frontier_curves(grid).items()} == {
        "a": ["a@0.25", "a@0.5"],
        "b": ["b@0.25", "b@0.5"],
        "q4": ["q4"],
        "a+q4": ["q4", "a@0.25+q4", "a@0.5+q4"],
        "b+q4": ["q4", "b@0.25+q4", "b@0.5+q4"],
    }
    no_alone = frontier_grid(["a"], FrontierSpec([0.5], caches={"q4": Q4}, cache_ratios=[0.5]))
    assert [p.policy for p in no_alone] == ["a@0.5", "a@0.5+q4"]
    for kwargs, message in [
        ({"presses": ["a+b"]}, r"^press 'a\+b': '\+' in a press name is reserved"),
        ({"caches": {"a": Q4}}, "^cache 'a': the label is also a press label"),
        ({"caches": {"q@4": Q4}}, r"^cache 'q@4': '@' and '\+' in a cache label are reserved"),
        ({"caches": {"q4": {"nbits": 4}}}, "missing backend, q_group_size"),
        ({"caches": {"q4": Q4}, "cache_ratios": [1.0]}, r"^cache_ratios: 1.0 is not a compression ratio"),
    ]:
        presses = kwargs.pop("presses", ["a"])
        with pytest.raises(ValueError, match=message):
            frontier_grid(presses, FrontierSpec(**{"ratios": [0.5], **kwargs}))


def test_frontier_spec_holds_a_section_as_given():
    section = {"presses": {"a": {}}, "ratios": [0.5, 0.25], "caches": {"q4": Q4}, "cache_ratios": [0], "split": "x"}
    spec = FrontierSpec.of(section)
    assert spec == FrontierSpec((0.5, 0.25), (), {"q4": Q4}, (0,)) and FrontierSpec.of(spec) is spec
    assert FrontierSpec.of(None) == FrontierSpec() == FrontierSpec(None, None, None, None)
    assert FrontierSpec().cache_ratios is None  # the default: 0 and every ratio
    # the values stay as given, for frontier_problems to name
    assert FrontierSpec([True]).ratios == (True,)
    with pytest.raises(ValueError, match="^ratios: True is not a compression ratio"):
        frontier_grid(["a"], FrontierSpec([True]))
    with pytest.raises(ValueError, match=r"^caches must map a label to a quantized cache's settings .* got list$"):
        frontier_grid(["a"], FrontierSpec([0.5], caches=["int4"]))


def test_quantized_frontier_ranks_every_curve_on_the_common_byte_range():
    """Presses a, b at 0.75 and 0.875 (full precision, 4 bytes per element, 100 elements per token: 100
    and 50 bytes), the 4-bit cache q4 (0.625 bytes per element) alone (62.5) and after each press at 0.5
    (31.25). Curves a, b span 50..100, a+q4 and b+q4 31.25..62.5 (from q4 alone), q4 one point: all four
    share 50..62.5. The means there, linear in bytes, by hand:
    a: (0.6 + 0.5) / 2, b: (0.8 + 0.625) / 2, a+q4: (0.46 + 0.3) / 2, b+q4: (0.38 + 0.3) / 2."""
    grid = frontier_grid(["a", "b"], FrontierSpec([0.75, 0.875], caches={"q4": Q4}, cache_ratios=[0, 0.5]))
    E = {"a@0.75": 0.2, "a@0.875": 0.6, "b@0.75": 0.1, "b@0.875": 0.8, "q4": 0.3, "a@0.5+q4": 0.7, "b@0.5+q4": 0.5}
    values = {k: (e + 0.1, e) for k, e in E.items()} | {"noise-floor": (0.0, 0.0)}
    with pytest.raises(ValueError, match=r"quantized-cache points need kv_sizes\['m'\]"):
        frontier_tables(_docs(values), grid, "noise-floor", Bootstrap(20, 0.95, 1))
    points, areas = frontier_tables(_docs(values), grid, "noise-floor", Bootstrap(50, 0.95, 1), kv_sizes=SIZES)
    by = {r["policy"]: r for r in points.iter_rows(named=True)}
    assert {p: by[p]["kv_bytes_per_token"] for p in E} == {
        "a@0.75": 100.0,
        "a@0.875": 50.0,
        "b@0.75": 100.0,
        "b@0.875": 50.0,
        "q4": 62.5,
        "a@0.5+q4": 31.25,
        "b@0.5+q4": 31.25,
    }
    assert by["a@0.75"]["bits_per_element"] == 32.0 and by["q4"]["bits_per_element"] == 5.0
    assert by["q4"]["curves"] == ["q4", "a+q4", "b+q4"] and by["a@0.5+q4"]["curves"] == ["a+q4"]
    mean = {"b+q4": 0.34, "a+q4": 0.38, "a": 0.55, "b": 0.7125}
    assert areas["curve"].to_list() == ["b+q4", "a+q4", "a", "b", "q4"] and areas["rank"].to_list() == [1, 2, 3, 4, 5]
    assert areas["covers_range"].to_list() == [True] * 4 + [False]
    assert (areas["range_lo"] == 50.0).all() and (areas["range_hi"] == 62.5).all()
    for r in areas.head(4).iter_rows(named=True):
        for suffix in ("", "_lo", "_hi"):  # identical documents: the interval is the point
            assert r["mean_E_M" + suffix] == pytest.approx(mean[r["curve"]], abs=1e-12)
            assert r["mean_p_div" + suffix] == pytest.approx(mean[r["curve"]] + 0.1, abs=1e-12)
        assert r["diff_best_mean_E_M"] == pytest.approx(mean[r["curve"]] - 0.34, abs=1e-12)
    q4 = areas.row(4, named=True)  # reported beside the ranking, with its own span
    assert math.isnan(q4["mean_E_M"]) and q4["bytes_min"] == q4["bytes_max"] == 62.5 and q4["n_ratios"] == 1
    # the areas over each curve's own ratios; compared with the best only between curves of the same ratios
    a_q4 = areas.row(1, named=True)
    assert a_q4["area_E_M"] == pytest.approx(0.5 * (0.3 + 0.7) / 2, abs=1e-12)
    assert a_q4["diff_best_area_E_M"] == pytest.approx(0.05, abs=1e-12) and math.isnan(
        areas.row(2, named=True)["diff_best_area_E_M"]
    )
    assert points["policy"].to_list() == ["b@0.5+q4", "a@0.5+q4", "a@0.75", "a@0.875", "b@0.75", "b@0.875", "q4"]


def test_a_curve_off_the_common_range_is_reported_not_dropped():
    """Full precision at 0.5 and 0.75 spans 100..200 bytes, the cache curves 31.25..62.5: no byte
    range is common to all; the two presses share the wider one and rank first, the rest follow in grid order."""
    grid = frontier_grid(["a", "b"], FrontierSpec([0.5, 0.75], caches={"q4": Q4}, cache_ratios=[0, 0.5]))
    values = {p.policy: (0.5, 0.3) for p in grid} | {"a@0.5": (0.3, 0.1), "noise-floor": (0.0, 0.0)}
    points, areas = frontier_tables(_docs(values), grid, "noise-floor", Bootstrap(20, 0.95, 1), kv_sizes=SIZES)
    assert areas["curve"].to_list() == ["a", "b", "q4", "a+q4", "b+q4"]
    assert areas["covers_range"].to_list() == [True, True, False, False, False]
    assert (areas["range_lo"] == 100.0).all() and (areas["range_hi"] == 200.0).all()
    assert areas.filter(pl.col("curve") == "a+q4").select("bytes_min", "bytes_max").row(0) == (31.25, 62.5)
    assert areas.filter(~pl.col("covers_range"))["mean_E_M"].is_nan().all()
    assert areas["mean_E_M"][0] == pytest.approx((0.1 + 0.3) / 2, abs=1e-12)
    assert points.height == 7  # every point is in the table


def test_quantized_frontier_text_page_and_figure(tmp_path):
    from kvdiverge.report.formatting import frontier_text
    from kvdiverge.report.frontier import plot_frontier
    from kvdiverge.report.pages import frontier_html

    grid = frontier_grid(["a", "b"], FrontierSpec([0.75, 0.875], [8], caches={"q4": Q4}, cache_ratios=[0, 0.5]))
    values = {p.policy: (0.5, 0.2 + 0.1 * (p.press == "b")) for p in grid} | {"noise-floor": (1e-4, 1e-5)}
    points, areas = frontier_tables(_docs(values), grid, "noise-floor", Bootstrap(20, 0.95, 0), kv_sizes=SIZES)
    text = frontier_text(points, areas)
    assert "KV bytes per prompt token common to 4 of 5 curves (50-62.5;" in text.splitlines()[0]
    rows = {line.split()[2]: line for line in text.splitlines()[3:]}
    assert set(rows) == {"a", "b", "q4", "a+q4", "b+q4"} and "0:0.2 0.5:0.2" in rows["a+q4"]
    assert rows["q4"].split()[3] == "-"  # not on the common range: no mean
    page = frontier_html(points, areas)
    assert "50–62.5 bytes per token" in page and "a@0.5+q4" in page and "full precision" in page
    plot_frontier(points, tmp_path / "frontier.png", tmp_path / "frontier.pdf")
    assert (tmp_path / "frontier.png").read_bytes()[:4] == b"\x89PNG"


def test_quantized_frontier_config_expands_into_points():
    config = load_config(REPO / "config" / "frontier-quantized.yaml")
    full = [f"{p}@{r:g}" for p in ("snapkv", "streamingllm") for r in (0.5, 0.75, 0.875, 0.9375)]
    cached = ["int4", "snapkv@0.5+int4", "streamingllm@0.5+int4", "int2", "snapkv@0.5+int2", "streamingllm@0.5+int2"]
    assert config["runs"]["exploratory"] == full + cached
    assert [p.policy for p in frontier_points(config)] == full + cached
    q2 = {"cache": "quantized", "backend": "quanto", "nbits": 2, "q_group_size": 64, "residual_length": 32}
    assert config["policies"]["int2"] == q2
    assert config["policies"]["snapkv@0.5+int2"] == {
        "press": "SnapKVPress",
        "window_size": 64,
        "kernel_size": 5,
        "compression_ratio": 0.5,
        **q2,
    }
    assert config["policies"]["streamingllm@0.5+int4"] == {
        "press": "StreamingLLMPress",
        "n_sink": 4,
        "compression_ratio": 0.5,
        **q2,
        "nbits": 4,
    }
    expl = [p for m, p, s in runs(config) if s == "exploratory"]
    assert expl == full + cached + ["noise-floor"]
    assert validate(config) == config and expand_frontier(config) == config
    # the config's arithmetic: 11520 elements per token, float32; every two-point curve covers 3600..4320 bytes
    grid = frontier_points(config)
    per_token = {p.policy: (1 - p.compression_ratio) * 11520 * kv_bytes_per_element(p.cache_settings, 4) for p in grid}
    assert per_token["snapkv@0.9375"] == 2880 and per_token["snapkv@0.875"] == 5760
    assert (per_token["int4"], per_token["snapkv@0.5+int4"], per_token["int2"], per_token["snapkv@0.5+int2"]) == (
        7200,
        3600,
        4320,
        2160,
    )
    spans = {
        k: (min(per_token[p] for p in c["policies"]), max(per_token[p] for p in c["policies"]))
        for k, c in frontier_curves(grid).items()
    }
    assert common_range(spans) == (
        3600.0,
        4320.0,
        ["snapkv", "streamingllm", "snapkv+int4", "streamingllm+int4", "snapkv+int2", "streamingllm+int2"],
    )


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda f: f["caches"]["int4"].update(nbits=3),
            "frontier.caches.int4: quantized cache: nbits must be one of [2, 4] for backend 'quanto', got 3",
        ),
        (
            lambda f: f["caches"]["int4"].update(bits=4),
            "unknown config key frontier.caches.int4.bits; allowed keys at frontier.caches.int4: backend, nbits, "
            "q_group_size, residual_length",
        ),
        (lambda f: f["caches"]["int4"].update(backend="gptq"), "frontier.caches.int4.backend: 'gptq' is not allowed"),
        (lambda f: f["caches"]["int4"].update(q_group_size=0), "frontier.caches.int4.q_group_size: 0 is out of range"),
        (
            lambda f: f.update(cache_ratios=[0, 1.0]),
            "frontier.cache_ratios[1]: 1.0 is out of range; allowed: >= 0 and < 1",
        ),
        (lambda f: f.pop("caches"), "frontier.cache_ratios: given without frontier.caches, which it needs"),
        (lambda f: f["caches"].update({"q+2": {"nbits": 2}}), "frontier.caches: 'q+2' does not match the pattern"),
    ],
)
def test_bad_frontier_cache_is_refused_with_the_key_named(edit, message):
    config = raw("frontier-quantized.yaml")
    edit(config["frontier"])
    assert message in error_of(config)


def test_frontier_cache_names_are_reserved():
    config = raw("frontier-quantized.yaml")
    config["policies"]["int4"] = {"cache": "quantized", "nbits": 2}
    assert "policies.int4: the name belongs to the frontier point frontier.caches.int4; rename the policy" in error_of(
        config
    )
    config = raw("frontier-quantized.yaml")
    config["policies"]["snapkv@0.25+int4"] = {"press": "SnapKVPress", "compression_ratio": 0.25}
    assert "policies.snapkv@0.25+int4: '@' in a policy name is reserved for the frontier" in error_of(config)
    config = raw("frontier-quantized.yaml")  # the same entry as the frontier's: the same policy
    config["policies"]["int2"] = validate(config)["policies"]["int2"]
    assert validate(config)["runs"]["exploratory"].count("int2") == 1


def test_api_and_command_line_expand_caches_as_the_config_does():
    from kvdiverge.config.inputs import frontier_presses
    from kvdiverge.doors.arguments import argument_sources, check_arguments
    from kvdiverge.doors.cli import _parser

    presses = {"snapkv": {"press": "SnapKVPress", "window_size": 64, "kernel_size": 5}}
    out, grid = frontier_presses(
        presses, FrontierSpec([0.5, 0.75], caches={"int4": {"nbits": 4, "residual_length": 32}}, cache_ratios=[0, 0.5])
    )
    config = raw("frontier-quantized.yaml")  # the same points through the config
    config["frontier"].update(
        presses=presses, ratios=[0.5, 0.75], caches={"int4": config["frontier"]["caches"]["int4"]}
    )
    config["analysis"]["gaps"] = []
    expanded = validate(config)
    assert list(out) == ["snapkv@0.5", "snapkv@0.75", "int4", "snapkv@0.5+int4", "noise-floor"]
    assert grid == frontier_points(expanded)
    assert all(out[p.policy] == expanded["policies"][p.policy] for p in grid)
    for caches, message in [
        ({"int4": {"nbits": 3}}, "cache 'int4': quantized cache: nbits must be one of [2, 4]"),
        ({"int4": {"bits": 4}}, "cache 'int4': unknown setting 'bits'"),
        ({"q@4": {"nbits": 4}}, "cache 'q@4': '@' and '+' in a cache label are reserved"),
    ]:
        message = message.replace("+", r"\+")
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            frontier_presses(presses, FrontierSpec([0.5], caches=caches))
    import kvpress

    with pytest.raises(ValueError, match="a quantized cache needs a policy entry"):
        spec = FrontierSpec([0.5], caches={"int4": {}}, cache_ratios=[0.5])
        frontier_presses({"snapkv": kvpress.SnapKVPress()}, spec)
    args = _parser().parse_args(
        [
            "measure",
            "embedded",
            "--sotu",
            "1",
            "--press",
            "SnapKVPress:window_size=64",
            "--cache",
            "quanto:nbits=4",
            "--ratios",
            "0.5",
            "0.75",
            "--cache-ratios",
            "0",
            "0.5",
        ]
    )
    check_arguments(args)
    door, sources, caches = argument_sources(args)
    assert door == {"SnapKVPress:window_size=64": {"press": "SnapKVPress", "params": {"window_size": 64}}}
    assert caches == {"quanto:nbits=4": {"backend": "quanto", "nbits": 4}}
    assert list(sources) == [
        "SnapKVPress:window_size=64@0.5",
        "SnapKVPress:window_size=64@0.75",
        "quanto:nbits=4",
        "SnapKVPress:window_size=64@0.5+quanto:nbits=4",
        "noise-floor",
    ]
    assert sources["SnapKVPress:window_size=64@0.5+quanto:nbits=4"].quantized.nbits == 4


def test_cli_cache_ratios_bad_input_exits_2(capsys, tmp_path):
    from kvdiverge.doors.cli import main

    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    base = ["measure", "embedded", "--prompts", str(prompts), "-T", "2", "-R", "1", "--press", "KnormPress"]
    for extra, message in [
        (["--cache-ratios", "0.5"], "--cache-ratios needs --ratios and at least one --cache"),
        (
            ["--cache", "quanto", "--ratios", "0.5", "--cache-ratios", "1.5"],
            "--cache-ratios: 1.5 is not a compression ratio; allowed: numbers in [0, 1)",
        ),
        (["--cache", "quanto:nbits=3", "--ratios", "0.5"], "nbits must be one of [2, 4]"),
    ]:
        assert main(base + extra) == 2
        assert message in capsys.readouterr().err


# --------------------------------------------------------------------------- the API, CRN (miniature model)


@pytest.mark.miniature
def test_measure_frontier_shares_documents_and_random_numbers(tmp_path):
    """Two presses at ratio 0 leave the cache whole: with common random numbers their coupled
    runs are bit-identical, though their policy names differ."""
    import torch

    import kvdiverge
    from kvdiverge.models.standins import MINIATURE, random_model

    torch.set_num_threads(1)
    model = random_model(MINIATURE["llama-3.1-8b"], initializer_range=0.1, seed=1)
    gen = torch.Generator().manual_seed(3)
    prompts = {f"doc-{i}": torch.randint(1, 500, (n,), generator=gen).tolist() for i, n in enumerate((40, 48))}
    presses = {"snapkv": {"press": "SnapKVPress", "window_size": 8}, "knorm": {"press": "KnormPress"}}
    with pytest.warns(UserWarning, match="left the cache untouched"):  # the two ratio-0 points
        m = kvdiverge.measure(
            model,
            None,
            prompts,
            presses,
            ratios=[0.0, 0.5],
            max_new_tokens=4,
            replicates=2,
            temperature=1.0,
            top_p=1.0,
            seed=5,
            bootstrap=50,
            progress=False,
            model_name="mini",
            split="exploratory",
        )
    assert m.presses == ["snapkv@0", "snapkv@0.5", "knorm@0", "knorm@0.5", "noise-floor"]
    traj = m.trajectories
    docs = {p: sorted(g["doc_id"].to_list()) for (p,), g in traj.group_by(["policy"])}
    assert all(d == ["doc-0", "doc-0", "doc-1", "doc-1"] for d in docs.values())
    a = traj.filter(pl.col("policy") == "snapkv@0").sort("doc_id", "replicate")
    b = traj.filter(pl.col("policy") == "knorm@0").sort("doc_id", "replicate")
    assert a["chain_token"].to_list() == b["chain_token"].to_list()
    assert a["branch_x"].to_list() == b["branch_x"].to_list()
    # the reference side draws the same tokens under every policy up to the first divergence
    c = traj.filter(pl.col("policy") == "knorm@0.5").sort("doc_id", "replicate")
    assert (c["kept_len"] < c["prompt_len"]).all() and (a["kept_len"] == a["prompt_len"]).all()
    points = m.frontier()
    assert set(points["policy"]) == {"snapkv@0", "snapkv@0.5", "knorm@0", "knorm@0.5"}
    zero = points.filter(pl.col("compression_ratio") == 0.0)
    assert (zero["p_div"] == 0.0).all() and (zero["E_M"] == 0.0).all()
    areas = m.frontier_areas()
    assert sorted(areas["press"]) == ["knorm", "snapkv"] and areas["rank"].to_list() == [1, 2]
    assert "area E[M] [CI]" in m.format_frontier()
    assert m.plot_frontier(tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"
    saved = {p.name for p in m.save(tmp_path / "out")}
    assert {"frontier.parquet", "frontier_areas.csv"} <= saved
    with pytest.raises(ValueError, match="not a frontier"):
        kvdiverge.measure(
            model,
            None,
            prompts,
            {"k": {"press": "KnormPress", "compression_ratio": 0.5}},
            max_new_tokens=2,
            replicates=1,
            bootstrap=10,
            progress=False,
        ).frontier()


@pytest.mark.miniature
def test_measure_frontier_with_a_quantized_cache(tmp_path):
    """``measure(..., ratios=, caches=)``: the cache alone and after the press, its KV bytes counted with the
    model's sizes (2 layers x 2 kv heads x head dim 8 x 2 = 64 elements per token, float32): SnapKV at 0.5
    stores 0.5 x 64 x 4 = 128 bytes per prompt token, the 4-bit cache in groups of 8 (0.5 + 8/8 bytes per
    element) 96 alone and 48 after SnapKV at 0.5."""
    import torch

    import kvdiverge
    from kvdiverge.models.standins import MINIATURE, random_model

    torch.set_num_threads(1)
    model = random_model(MINIATURE["llama-3.1-8b"], initializer_range=0.1, seed=1)
    gen = torch.Generator().manual_seed(3)
    prompts = {f"doc-{i}": torch.randint(1, 500, (n,), generator=gen).tolist() for i, n in enumerate((40, 48))}
    m = kvdiverge.measure(
        model,
        None,
        prompts,
        {"snapkv": {"press": "SnapKVPress", "window_size": 8}},
        ratios=[0.5],
        caches={"q4": {"nbits": 4, "q_group_size": 8, "residual_length": 2}},
        max_new_tokens=3,
        replicates=1,
        temperature=1.0,
        top_p=1.0,
        seed=5,
        bootstrap=20,
        progress=False,
        model_name="mini",
        split="exploratory",
    )
    assert m.presses == ["snapkv@0.5", "q4", "snapkv@0.5+q4", "noise-floor"]
    assert m.settings.record()["kv_sizes"] == {"mini": {"elements_per_token": 64, "element_bytes": 4}}
    assert m.settings.quantized_caches == ("q4", "snapkv@0.5+q4")
    points = m.frontier()
    assert dict(zip(points["policy"], points["kv_bytes_per_token"])) == {
        "snapkv@0.5": 128.0,
        "q4": 96.0,
        "snapkv@0.5+q4": 48.0,
    }
    areas = m.frontier_areas()
    assert areas["curve"].to_list() == ["snapkv+q4", "snapkv", "q4"]  # the one curve with two points is ranked
    assert areas["covers_range"].to_list() == [True, False, False]
    assert (areas["range_lo"] == 48.0).all() and (areas["range_hi"] == 96.0).all()
    assert "KV bytes per prompt token common to 1 of 3 curves" in m.format_frontier()
    assert m.plot_frontier(tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_ratios_bad_input_exits_2(capsys, tmp_path):
    from kvdiverge.doors.cli import main

    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    base = ["measure", "embedded", "--prompts", str(prompts), "-T", "2", "-R", "1"]
    for extra, message in [
        (
            ["--press", "KnormPress", "--ratios", "0.5", "1.5"],
            "--ratios: 1.5 is not a compression ratio; allowed: numbers in [0, 1)",
        ),
        (["--press", "PermutationPress", "--ratios", "0.5"], "at least one press besides"),
        (["--press", "AdaKVPress:press=x", "--ratios", "0.5"], "AdaKVPress"),
    ]:
        assert main(base + extra) == 2
        assert message in capsys.readouterr().err


# --------------------------------------------------------------------------- the workflow, end to end


@pytest.mark.workflow
def test_frontier_smoke_runs_through_snakemake(frontier_run):
    """``config/frontier-smoke.yaml``: 2 presses x 2 ratios beside the floor, table, figure, report.

    The run is the session's (fixture ``frontier_run``, tests/conftest.py), beside the smoke run.
    """
    results = frontier_run
    assert results.name == raw("frontier-smoke.yaml")["results_dir"]
    points = pl.read_parquet(results / "analysis" / "frontier.parquet")
    assert sorted(points["policy"]) == ["knorm@0.25", "knorm@0.5", "snapkv@0.25", "snapkv@0.5"]
    assert (points["n_docs"] == points["n_docs"][0]).all() and (points["floor"] == "noise-floor").all()
    assert (points["floor_p_div"] < 1e-3).all()  # float32 rounding only
    areas = pl.read_csv(results / "analysis" / "frontier_areas.csv")
    assert areas["rank"].to_list() == [1, 2]
    assert areas["area_E_M"].is_sorted()
    assert (results / "figures" / "frontier.png").read_bytes()[:4] == b"\x89PNG"
    assert "<table>" in (results / "analysis" / "frontier.html").read_text()
    assert "frontier" in (results / "report.html").read_text(errors="ignore")
    # ordinary policies: the estimates and shards of every point exist under their own names
    for p in points["policy"]:
        assert (results / "estimates" / "smollm2-135m" / p / "exploratory.parquet").is_file()
        shard = read_provenance(results / "trajectories" / "smollm2-135m" / p / "exploratory" / "shard-0.parquet")
        assert shard.shard["policy"] == p and shard.settings["policy"]["compression_ratio"] == float(p.split("@")[1])
    # ... made by one job per split for all its policies (the points and the noise floor), which
    # prefilled each document once for up to 2R = 4 of them
    logs = results / "logs" / "trajectories" / "smollm2-135m"
    log = (logs / "exploratory" / "shard-0.log").read_text()
    assert "5 policies, prefilled in groups of up to 4" in log, log[-2000:]
    assert sorted(p.name for p in logs.iterdir()) == ["confirmatory", "exploratory"]
    # each point's teacher-forced headline joins its row, from one teacher-forced job for all points
    teacher = pl.read_parquet(results / "analysis" / "teacher_forced.parquet")
    joined = points.select("policy", "kld_mean", "ppl_ratio").join(
        teacher.filter(pl.col("split") == "exploratory").select("policy", "kld_mean", "ppl_ratio"), on="policy"
    )
    assert joined.height == 4 and (joined["kld_mean"] == joined["kld_mean_right"]).all()
    assert (points["kld_mean"] > 1e-4).all() and (points["floor_kld_mean"] < 1e-9).all()
    assert "teacher-forced mean KLD" in (results / "analysis" / "frontier.html").read_text()
    # and its length ratio, compressed over full, with its interval (the figure's length panel)
    assert points["length_ratio"].is_between(0.25, 4.0).all()
    assert (points["length_ratio_lo"] <= points["length_ratio"]).all()
    assert (points["length_ratio"] <= points["length_ratio_hi"]).all()
    logs = results / "logs" / "teacher_forced" / "smollm2-135m"  # one job per split: every run of the split
    assert {p.name for p in logs.iterdir()} <= {"exploratory.log", "confirmatory.log"}
    assert "gathered the positions of" in (logs / "exploratory.log").read_text()  # made by the shard jobs
    shard_log = results / "logs" / "trajectories" / "smollm2-135m" / "exploratory" / "shard-0.log"  # shards: 1
    tf_log = shard_log.read_text()
    line = next(x for x in tf_log.splitlines() if "smollm2-135m / exploratory: [" in x)  # the pass's runs
    assert all(p in line for p in points["policy"]) and "noise-floor" in line, tf_log[-2000:]
    assert "prefills held for the coupled run" in tf_log


@pytest.mark.llm
def test_cli_draws_the_frontier_on_the_embedded_model(tmp_path, embedded_cached):
    """``kvdiverge measure ... --press A --press B --ratios r1 r2``: ranked table printed, figure written
    (``kvdiverge.doors.cli.main`` in this process; the embedded model read from the session's kept conversion)."""
    res = run_main(
        [
            "measure",
            "embedded",
            "--sotu",
            "1",
            "-T",
            "4",
            "-R",
            "2",
            "--bootstrap",
            "50",
            "--threads",
            "1",
            "--quiet",
            "--press",
            "SnapKVPress:window_size=8",
            "--press",
            "KnormPress",
            "--ratios",
            "0.25",
            "0.5",
            "--out",
            "out",
        ],
        tmp_path,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "area E[M] [CI]" in res.stdout and "SnapKVPress:window_size=8@0.25" in res.stdout
    table = [line for line in res.stdout.splitlines() if line.startswith(("1 ", "2 "))]
    assert len(table) == 2  # one ranked row per press
    assert (tmp_path / "out" / "frontier.png").read_bytes()[:4] == b"\x89PNG"
    areas = pl.read_parquet(tmp_path / "out" / "frontier_areas.parquet")
    assert sorted(areas["press"]) == ["KnormPress", "SnapKVPress:window_size=8"]
    points = pl.read_parquet(tmp_path / "out" / "frontier.parquet")
    assert sorted(points["compression_ratio"].unique()) == [0.25, 0.5]
    assert (points["kept_fraction"] < 1).all() and (points["floor"] == "noise-floor").all()
