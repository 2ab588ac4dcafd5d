"""A measurement's plan: every check that needs no weights before any model, and ``measure`` equal to
``plan(...).run(model)``.

On a two-layer miniature of Llama-3.1 with random weights (:mod:`kvdiverge.models.standins`) and
token-id prompts, so no tokenizer and no download: the plan refuses bad settings, presses and
frontier values with no model at all; its config check refuses a prompt longer than the model's
context from the config alone; and its run gives the tables ``kvdiverge.measure`` gives.
"""

from __future__ import annotations

import inspect
import json
import warnings

import pytest
import torch
from polars.testing import assert_frame_equal

import kvdiverge
from kvdiverge.config.provenance import settings_hash
from kvdiverge.doors.measuring import MeasureOptions
from kvdiverge.doors.plan import OPTIONS, Plan
from kvdiverge.estimation.bootstrap import Bootstrap
from kvdiverge.models.standins import MINIATURE, random_model

pytestmark = pytest.mark.miniature

SETTINGS = {"max_new_tokens": 5, "replicates": 2, "bootstrap": 40, "progress": False, "eos_ids": [3, 7]}


@pytest.fixture(scope="module")
def model():
    return random_model(MINIATURE["llama-3.1-8b"], num_hidden_layers=2)


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(0)
    return {f"p{i}": torch.randint(1, 500, (40,), generator=gen).tolist() for i in range(2)}


PRESSES = {
    "none": {"press": "SnapKVPress", "compression_ratio": 0.0},
    "knorm": {"press": "KnormPress", "compression_ratio": 0.5},
}


def test_the_plan_expands_the_frontier_and_builds_the_documents_without_a_model(prompts):
    p = kvdiverge.plan(prompts, {"knorm": {"press": "KnormPress"}}, ratios=[0.25, 0.5], **SETTINGS)
    assert isinstance(p, Plan)
    assert list(p.sources) == ["knorm@0.25", "knorm@0.5", "noise-floor"]
    assert [point.policy for point in p.grid] == ["knorm@0.25", "knorm@0.5"]
    assert [d.doc_id for d in p.documents] == ["p0", "p1"]
    assert list(p.documents[0].input_ids) == prompts["p0"]
    assert p.options.max_new_tokens == 5 and p.horizon == 8  # 2T - 2 cache columns beyond the prompt


@pytest.mark.parametrize(
    ("settings", "presses", "message"),
    [
        ({"max_new_tokens": 0}, PRESSES, "max_new_tokens: 0"),
        ({"ratios": [1.5]}, {"knorm": {"press": "KnormPress"}}, "1.5"),
        ({}, {"a": {"press": "NoSuchPress"}}, "NoSuchPress"),
        ({}, {}, "no presses given"),
        ({"cache_ratios": [0.5]}, PRESSES, "cache_ratios"),
    ],
)
def test_the_plan_refuses_bad_input_before_any_model(prompts, settings, presses, message):
    with pytest.raises(ValueError, match=message):
        kvdiverge.plan(prompts, presses, **{**SETTINGS, **settings})


def test_an_unknown_keyword_is_a_type_error(prompts):
    with pytest.raises(TypeError, match="unexpected keyword argument 'temprature'"):
        kvdiverge.plan(prompts, PRESSES, temprature=0.5)


def test_the_config_check_refuses_a_prompt_longer_than_the_context_before_the_weights():
    config = random_model(MINIATURE["llama-3.1-8b"], num_hidden_layers=1, max_position_embeddings=64).config
    p = kvdiverge.plan({"long": list(range(1, 61))}, PRESSES, **SETTINGS)  # 60 prompt tokens
    with pytest.raises(ValueError, match=r"prompt 'long': 60 tokens \+ 5 new tokens exceed the model context of 64"):
        p.check_config(config)
    p.check_config(config, screen=True)  # the screen needs room for 1 token


def test_measure_is_the_plan_run_on_the_model(model, prompts):
    with pytest.warns(UserWarning, match="press 'none' left the cache untouched") as measured_warning:
        measured = kvdiverge.measure(model, None, prompts, PRESSES, **SETTINGS)
    with pytest.warns(UserWarning, match="press 'none' left the cache untouched") as planned_warning:
        planned = kvdiverge.plan(prompts, PRESSES, **SETTINGS).run(model)
    assert measured_warning[0].filename == planned_warning[0].filename == __file__  # the caller's line
    timing = [c for c in measured.trajectories.columns if "seconds" in c]
    assert_frame_equal(measured.trajectories.drop(timing), planned.trajectories.drop(timing))
    assert_frame_equal(measured.summary, planned.summary)
    assert measured.settings == planned.settings
    none = planned.trajectories.filter(planned.trajectories["policy"] == "none")
    assert none["tv"].list.max().max() == 0  # ratio 0: the caches are the same


def test_the_plan_runs_again_on_the_same_model_with_the_same_tables(model, prompts):
    p = kvdiverge.plan(prompts, PRESSES, **SETTINGS)
    with pytest.warns(UserWarning, match="left the cache untouched"):
        a, b = p.run(model), p.run(model)
    timing = [c for c in a.trajectories.columns if "seconds" in c]
    assert_frame_equal(a.trajectories.drop(timing), b.trajectories.drop(timing))


def test_the_run_checks_the_model_itself(prompts):
    p = kvdiverge.plan({"p": [1, 2, 10_000_000]}, PRESSES, **SETTINGS)
    small = random_model(MINIATURE["llama-3.1-8b"], num_hidden_layers=1)
    with pytest.raises(ValueError, match="token ids 10000000 are outside the model's vocabulary"):
        p.run(small)
    with pytest.raises(ValueError, match="model"):
        p.run(None)


def test_the_plan_screens_with_its_teacher_settings(model, prompts):
    s = kvdiverge.plan(prompts, PRESSES, teacher_tokens=4, **SETTINGS).screen(model)
    assert s.settings["length"] == 4 and s.settings["presses"] == ["none", "knorm"]
    none = s.positions.filter(s.positions["policy"] == "none")
    assert none.height == 8 and (none["kld"] == 0).all()  # 2 prompts x 4 positions, identical caches


def test_a_saved_measurement_loads_back_with_every_table_and_line(model, prompts, tmp_path):
    presses = {**PRESSES, "floor": {"press": "PermutationPress"}}
    with pytest.warns(UserWarning, match="left the cache untouched"):
        m = kvdiverge.plan(prompts, presses, teacher_tokens=3, **SETTINGS).run(model)
    m.save(tmp_path)
    back = kvdiverge.Measurement.load(tmp_path)
    for name in ("trajectories", "replicates", "documents", "pooled", "survival", "variance", "summary", "gaps"):
        assert_frame_equal(getattr(back, name), getattr(m, name))
    assert_frame_equal(back.teacher_forced.table, m.teacher_forced.table)
    assert back.settings == m.settings and back.eos_ids == (3, 7) and back.noise_floor == "floor"
    assert back.format_summary() == m.format_summary()
    with pytest.raises(FileNotFoundError, match="measure.json is missing"):
        kvdiverge.Measurement.load(tmp_path / "elsewhere")


#: The settings record (``measure.json``, insertion order) and its hash of two measurements, as the
#: dict-built settings gave them: the typed settings must give them byte for byte.
PINNED = [
    (
        PRESSES,
        {},
        '{"model": "model", "split": "measure", "T": 5, "R": 2, "temperature": 0.7, "top_p": 0.95, "seed": 0, '
        '"window": 8, "bootstrap": 40, "confidence": 0.95, "instruction": null, "system": null, "presses": '
        '{"none": {"press": "SnapKVPress", "compression_ratio": 0.0}, "knorm": {"press": "KnormPress", '
        '"compression_ratio": 0.5}}}',
        "3ff8bdb04bb3f0f0",
    ),
    (
        {"knorm": {"press": "KnormPress"}},
        {
            "ratios": [0.5],
            "top_k": 5,
            "confidence": 0.9,
            "seed": 3,
            "split": "other",
            "model_name": "mini",
            "instruction": "Say:",
        },  # fmt: skip
        '{"model": "mini", "split": "other", "T": 5, "R": 2, "temperature": 0.7, "top_p": 0.95, "seed": 3, '
        '"window": 8, "bootstrap": 40, "confidence": 0.9, "instruction": "Say:", "system": null, "presses": '
        '{"knorm@0.5": {"press": "KnormPress", "compression_ratio": 0.5}, "noise-floor": "PermutationPress(seed=0)"}, '
        '"decoding": {"top_k": 5}, "frontier": [{"policy": "knorm@0.5", "press": "knorm", "compression_ratio": 0.5, '
        '"budget": null, "cache": null, "cache_settings": null}], "kv_sizes": {"mini": {"elements_per_token": 64, '
        '"element_bytes": 4}}}',
        "6729ee3bfa097cea",
    ),
]


@pytest.mark.parametrize(("presses", "extra", "record", "digest"), PINNED)
def test_the_settings_record_and_its_hash_are_pinned(model, prompts, presses, extra, record, digest, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the untouched press's warning
        m = kvdiverge.plan(prompts, presses, **SETTINGS, **extra).run(model)
    assert json.dumps(m.settings.record()) == record
    assert settings_hash(m.settings.record()) == digest
    m.save(tmp_path)
    assert (tmp_path / "measure.json").read_text() == json.dumps(json.loads(record), indent=2) + "\n"
    back = kvdiverge.Measurement.load(tmp_path)
    assert back.settings == m.settings and back.settings.record() == m.settings.record()
    assert back.settings.bootstrap == Bootstrap(40, extra.get("confidence", 0.95), extra.get("seed", 0))


def test_the_options_default_as_measure_does():
    signature = inspect.signature(kvdiverge.measure).parameters
    fields = MeasureOptions.__dataclass_fields__
    assert OPTIONS <= set(signature)
    assert {n: fields[n].default for n in OPTIONS} == {n: signature[n].default for n in OPTIONS}
    assert fields["max_new_tokens"].default == 32 and fields["bootstrap"].default == 2000  # two by hand


#: the settings the command line, ``kvdiverge.measure`` and the workflow config share: option name, schema key path
SHARED_DEFAULTS = {
    "max_new_tokens": ("decoding", "max_new_tokens"),
    "replicates": ("replicates",),
    "seed": ("seed",),
    "window": ("window",),
    "bootstrap": ("analysis", "bootstrap"),
    "confidence": ("analysis", "confidence"),
}


def _schema_default(schema, path):
    node = schema
    for key in path:
        node = node["properties"][key]
    return node.get("default")


def test_the_command_line_and_the_config_schema_default_as_measure_does():
    """Each shared setting's default is measure()'s: the command line's parser and the config schema hold the same
    value (and each decoding setting's, from the one table of decoding options, is the schema's)."""
    from kvdiverge.doors.cli import _parser
    from kvdiverge.engine.core.sampling import decoding_options
    from kvdiverge.settings.schema import load_schema

    fields, schema = MeasureOptions.__dataclass_fields__, load_schema()
    measure = _parser()._subparsers._group_actions[0].choices["measure"]
    parsed = measure.parse_args(["embedded", "--sotu", "1"])
    want = {name: fields[name].default for name in SHARED_DEFAULTS}
    assert {name: getattr(parsed, name) for name in SHARED_DEFAULTS} == want
    assert {name: _schema_default(schema, path) for name, path in SHARED_DEFAULTS.items()} == want
    decoding = schema["properties"]["decoding"]["properties"]
    options = decoding_options()
    assert {n: decoding[n].get("default") for n in options if options[n]["recorded"]} == {
        n: o["default"] for n, o in options.items() if o["recorded"]
    }
