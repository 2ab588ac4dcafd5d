"""The press catalogue against kvpress and the engine: every press kvpress exports is catalogued or refused,
each record is what the engine's registry reads from the real class, and every question the config asks of a
policy entry gets the engine's answer and sentence."""

from types import SimpleNamespace

import kvpress
import pytest
from kvpress.presses.duo_attention_press import PATTERNS_DICT

from kvdiverge.engine.core.errors import PressError
from kvdiverge.engine.presses import catalogue, registry, status
from kvdiverge.engine.presses.bases import abstract_reason
from kvdiverge.engine.presses.policies import Policy
from kvdiverge.engine.presses.policies import min_prompt_tokens as engine_min_prompt_tokens
from kvdiverge.engine.presses.project import PROJECT_PRESSES

CATALOGUE = catalogue.CATALOGUE


def test_every_press_kvpress_exports_is_catalogued_or_refused():
    exported = {n for n in kvpress.__all__ if isinstance(getattr(kvpress, n), type)}
    presses = {n for n in exported if issubclass(getattr(kvpress, n), kvpress.BasePress)}
    assert presses == (set(CATALOGUE) - set(PROJECT_PRESSES)) | set(catalogue.ABSTRACT)
    assert set(CATALOGUE) == set(registry.PRESS_CLASSES)
    assert set(catalogue.ABSTRACT) == {"BasePress", "ScorerPress"}
    for name, sentence in catalogue.ABSTRACT.items():
        assert sentence == abstract_reason(getattr(kvpress, name))
        with pytest.raises(ValueError) as info:
            registry.press_class(name)
        assert str(info.value) == sentence
        with pytest.raises(ValueError, match=r"^" + name + " is an abstract press"):
            catalogue.record(name)


@pytest.mark.parametrize("name", sorted(registry.PRESS_CLASSES))
def test_each_record_is_what_the_registry_reads_from_the_class(name):
    expected = registry.catalogue_record(name)
    assert CATALOGUE[name] == expected, f"catalogue.py's record of {name} should read:\n{expected!r}"


def test_the_duo_attention_sentence_names_every_model_kvpress_has_patterns_for():
    sentence = CATALOGUE["DuoAttentionPress"].refused
    for key in PATTERNS_DICT:
        assert key.replace("//", "/") in sentence, key
    assert sentence.count("//") == 0


def test_an_unknown_press_lists_the_same_presses_as_the_registry():
    with pytest.raises(ValueError) as engine:
        registry.press_class("SnapKV")
    with pytest.raises(ValueError) as mine:
        catalogue.record("SnapKV")
    assert str(mine.value) == str(engine.value) and str(mine.value).startswith("unknown press 'SnapKV'; available: ")
    with pytest.raises(LookupError, match="'mypresses:KeepAllPress' is a class of another module"):
        catalogue.record("mypresses:KeepAllPress")


def _engine_problem(entry) -> str | None:
    try:
        Policy.from_config("p", entry)
    except PressError as exc:
        return exc.problem
    return None


_SNAP = {"press": "SnapKVPress", "compression_ratio": 0.5, "window_size": 16}
_ADA = {"press": "AdaKVPress", "compression_ratio": 0.5, "params": {"press": {"press": "SnapKVPress"}}}
#: Entries beside the test instances: each of the engine's refusals before kvpress builds the press.
ENTRIES = [
    _SNAP,
    {"press": "SnapKVPress", "budget": 40, "kernel_size": 3},
    {"press": "SnapKVPress", "compression_ratio": 0.0},
    {"press": "SnapKVPress", "compression_ratio": 0.5, "budget": 8},
    {"press": "SnapKVPress"},
    {"press": "SnapKVPress", "compression_ratio": 0.5, "params": {"windowsize": 3}},
    {"press": "SnapKV", "compression_ratio": 0.5},
    {"press": "", "compression_ratio": 0.5},
    {"press": "BasePress", "compression_ratio": 0.5},
    _ADA,
    {**_ADA, "compression_ratio": None, "budget": 40},
    {**_ADA, "params": {"press": {"press": "SnapKVPress", "compression_ratio": 0.3}}},
    {**_ADA, "params": {"press": {"press": "SnapKV"}}},
    {**_ADA, "params": {"press": {"press": "SnapKVPress", "windowsize": 3}}},
    {"press": "AdaKVPress", "compression_ratio": 0.5},
    {**_ADA, "params": {**_ADA["params"], "alpha_safeguard": 2.0}},  # kvpress's own assert: at build only
    {"press": "ThinKPress", "compression_ratio": 0.5},
    {"press": "PermutationPress", "seed": 2},
    {"press": "PermutationPress", "compression_ratio": 0.5},
    {"press": "PerLayerCompressionPress", "compression_ratio": 0.5, "params": {"press": {"press": "KnormPress"}}},
    {
        "press": "ComposedPress",
        "budget": 8,
        "params": {"presses": [{"press": "KeyRerotationPress", "params": {"press": {"press": "StreamingLLMPress"}}}]},
    },
    {"press": "ComposedPress", "compression_ratio": 0.5, "params": {"presses": [{"press": "PermutationPress"}]}},
    {
        "press": "PrefillDecodingPress",
        "compression_ratio": 0.5,
        "params": {"prefilling_press": {"press": "KnormPress"}},
    },
    {"press": "FinchPress", "compression_ratio": 0.5},
    {"press": "FinchPress", "compression_ratio": 0.5, "delimiter_token_id": 7, "rerotate_keys": False},
    {"press": "DMSPress", "params": {"press": {"press": "KnormPress"}, "threshold": -0.5, "decoding": True}},
    {"press": "DMSPress", "params": {"press": {"press": "KnormPress"}}},
    {"press": "QFilterPress", "compression_ratio": 0.5},
    {"press": "SlidingWindowPress", "compression_ratio": 0.25},
    {"cache": "quantized", "nbits": 2},
    {"cache": "quantized", "nbits": 3},
    {"cache": "quantised"},
    {"cache": "quantized", "backend": "hqq", "nbits": 3},
    {**_SNAP, "cache": "quantized", "nbits": 4},
    {"press": "SlidingWindowPress", "compression_ratio": 0.25, "cache": "quantized"},
]
#: Every test instance of the press matrix, and the entries above.
CASES = [status.test_spec(name) for name in sorted(registry.ROWS) if name != "QuantizedCachePress"] + ENTRIES


def _id(entry) -> str:
    return str(entry.get("press") or entry.get("cache")) + ("+cache" if "cache" in entry and "press" in entry else "")


@pytest.mark.parametrize("entry", CASES, ids=[f"{i}-{_id(e)}" for i, e in enumerate(CASES)])
def test_the_catalogue_refuses_what_the_engine_refuses_with_its_sentence(entry):
    engine = _engine_problem(entry)
    if engine is not None and " failed: " in engine:  # kvpress's own check, which only building the press runs
        assert catalogue.entry_problem(entry) is None, engine
        return
    assert catalogue.entry_problem(entry) == engine


#: A Gemma-3-like model's layers: 2 full-attention, 4 sliding-window of 64 tokens.
GEMMA = SimpleNamespace(layer_types=["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2
                        + ["full_attention"], sliding_window=64, num_hidden_layers=6)  # fmt: skip


@pytest.mark.parametrize("entry", CASES, ids=[f"{i}-{_id(e)}" for i, e in enumerate(CASES)])
def test_every_fact_of_a_buildable_entry_is_the_engines(entry):
    if catalogue.build_problem(entry) is not None:
        return
    try:
        policy = Policy.from_config("p", entry, check=False)
        press = policy.probe_press
    except PressError:  # kvpress's own check: nothing the config asks of it
        return
    if _engine_problem(entry) in {r.refused for r in CATALOGUE.values()}:
        return  # a refused press: nothing else is asked of it (LUKVPress's default scorer is not in the entry)
    assert catalogue.is_decode_time(entry) == registry.is_decode_time(entry)
    assert catalogue.question_after_problem(entry) == registry.question_after_problem(press)
    assert catalogue.sliding_refusal(entry, GEMMA) == registry.sliding_refusal(press, GEMMA)
    if entry.get("press"):
        assert catalogue.shares_prefill(entry) == registry.shares_prefill(entry)
        assert catalogue.takes_ratio(entry["press"], catalogue.spec_parameters(entry)) == policy.takes_ratio
    if catalogue.entry_problem(entry) is None:
        assert catalogue.min_prompt_tokens(entry) == engine_min_prompt_tokens(entry)


def test_minimum_prompt_lengths_by_hand():
    assert catalogue.min_prompt_tokens(_SNAP) == 17  # window 16 + 1
    assert catalogue.min_prompt_tokens({"press": "SnapKVPress", "compression_ratio": 0.5}) == 65  # default 64
    assert catalogue.min_prompt_tokens({"press": "SnapKVPress", "budget": 40}) == 40 + 64 + 1
    assert catalogue.min_prompt_tokens({"press": "StreamingLLMPress", "budget": 40}) == 41  # 4 sinks, no window
    assert catalogue.min_prompt_tokens({**_ADA, "compression_ratio": None, "budget": 40}) == 105
    assert catalogue.min_prompt_tokens({"press": "SnapKVPress", "compression_ratio": 0.0}) == 1  # the control
    assert catalogue.min_prompt_tokens({"cache": "quantized"}) == 1
    assert catalogue.min_prompt_tokens({"press": "PermutationPress"}) == 1


def test_decode_time_and_prefill_by_hand():
    assert catalogue.is_decode_time({"press": "SlidingWindowPress", "compression_ratio": 0.5})
    assert not catalogue.is_decode_time(_SNAP) and not catalogue.is_decode_time({"cache": "quantized"})
    dms = {"press": "DMSPress", "params": {"press": {"press": "KnormPress"}, "threshold": -0.5}}
    assert not catalogue.is_decode_time(dms)
    assert catalogue.is_decode_time({**dms, "params": {**dms["params"], "decoding": True}})
    assert catalogue.shares_prefill(_SNAP) and not catalogue.shares_prefill({"press": "FinchPress"})
    finch = {"press": "FinchPress", "compression_ratio": 0.5, "delimiter_token_id": 7}
    assert "re-rotates kept keys (FinchPress)" in catalogue.sliding_refusal(finch, GEMMA)
    assert catalogue.sliding_refusal({**finch, "rerotate_keys": False}, GEMMA) is None
    assert catalogue.sliding_refusal(_SNAP, SimpleNamespace(num_hidden_layers=4)) is None  # no sliding layers


def test_a_press_of_a_users_module_gets_its_record_from_the_engine(tmp_path, monkeypatch):
    (tmp_path / "ownpresses.py").write_text(
        "from dataclasses import dataclass\nfrom kvpress import SnapKVPress\n\n\n"
        "@dataclass\nclass WidePress(SnapKVPress):\n    window_size: int = 200\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    name = "ownpresses:WidePress"
    rec = registry.catalogue_record(name)
    assert rec.name == "WidePress" and rec.parameters == ("compression_ratio", "window_size", "kernel_size")
    assert rec.defaults == {"window_size": 200}
    monkeypatch.setattr(catalogue, "_OWN", {})
    catalogue.register(name, rec)
    assert catalogue.min_prompt_tokens({"press": name, "compression_ratio": 0.5}) == 201
    assert catalogue.entry_problem({"press": name, "compression_ratio": 0.5, "width": 3}) == (
        "WidePress has no parameter(s) ['width']; accepted: ['compression_ratio', 'kernel_size', 'window_size']"
    )


def test_the_config_check_reads_a_press_of_a_users_module_from_its_class(tmp_path, monkeypatch):
    from pathlib import Path

    from kvdiverge.config.reading import ConfigError, read_yaml
    from kvdiverge.config.workflow import validate

    (tmp_path / "ownpresses2.py").write_text(
        "from dataclasses import dataclass\nfrom kvpress import SnapKVPress\n\n\n"
        "@dataclass\nclass WidePress(SnapKVPress):\n    window_size: int = 200\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(catalogue, "_OWN", {})
    config = read_yaml(Path(__file__).resolve().parents[1] / "config" / "smoke.yaml")
    config["policies"]["wide"] = {"press": "ownpresses2:WidePress", "compression_ratio": 0.5}
    assert validate(config)["policies"]["wide"]["press"] == "ownpresses2:WidePress"
    assert catalogue.min_prompt_tokens(config["policies"]["wide"]) == 201
    config["policies"]["wide"] = {"press": "nomodule:WidePress", "compression_ratio": 0.5}
    with pytest.raises(ConfigError) as info:
        validate(config)
    assert "  policies.wide: press 'nomodule:WidePress': cannot import module 'nomodule'" in str(info.value)
    assert _engine_problem(config["policies"]["wide"]).startswith("press 'nomodule:WidePress': cannot import module")
