"""The measurement settings: one check for the config, ``kvdiverge.measure`` and the command line.

:func:`kvdiverge.settings.checks.check_settings` checks each value against the config
schema's entry for it, so a value the API or the command line refuses is exactly one the
config refuses (a property test over random values), in one sentence naming the setting as
the door spells it, the value and what is allowed.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvdiverge.config.workflow import ConfigError, validate
from kvdiverge.settings.checks import SETTINGS, check_settings, setting_problems, token_id_problems

ROOT = Path(__file__).resolve().parents[1]
SMOKE = yaml.safe_load((ROOT / "config" / "smoke.yaml").read_text())


def test_each_refusal_names_the_setting_the_value_and_what_is_allowed():
    got = setting_problems(
        {
            "temperature": math.nan,
            "max_new_tokens": 2.7,
            "bootstrap": 0,
            "top_p": 0,
            "confidence": 1.0,
            "batch_documents": 0,
            "seed": -1,
            "window": "8",
            "replicates": True,
            "memory_budget_gb": -1,
        }
    )
    assert got == [
        "temperature: nan is not a finite number; allowed: a number >= 0",
        "max_new_tokens: 2.7 is not an integer; allowed: an integer >= 1",
        "bootstrap: 0 is not allowed; allowed: an integer >= 1",
        "top_p: 0 is not allowed; allowed: a number > 0 and <= 1",
        "confidence: 1.0 is not allowed; allowed: a number > 0 and < 1",
        "batch_documents: 0 is not allowed; allowed: an integer >= 1 or 'auto'",
        "seed: -1 is not allowed; allowed: an integer >= 0",
        "window: '8' is not allowed; allowed: an integer >= 1",
        "replicates: True is not allowed; allowed: an integer >= 1",
        "memory_budget_gb: -1 is not allowed; allowed: a number > 0 or None",
    ]
    assert setting_problems({"temperature": math.inf}, {"temperature": "--temperature"}) == [
        "--temperature: inf is not a finite number; allowed: a number >= 0"
    ]
    with pytest.raises(ValueError, match=r"^max_new_tokens: 2\.7 is not an integer; allowed: an integer >= 1$"):
        check_settings({"max_new_tokens": 2.7})


def test_accepted_values_come_back_as_plain_python_numbers():
    got = check_settings(
        {
            "temperature": np.float32(0.5),
            "max_new_tokens": 4.0,
            "replicates": np.int64(3),
            "batch_documents": "auto",
            "memory_budget_gb": None,
            "top_p": 1,
        }
    )
    assert got == {
        "temperature": 0.5,
        "max_new_tokens": 4,
        "replicates": 3,
        "batch_documents": "auto",
        "memory_budget_gb": None,
        "top_p": 1,
    }
    assert type(got["max_new_tokens"]) is int and type(got["temperature"]) is float


def test_token_ids_outside_the_vocabulary_are_named():
    assert token_id_problems("a", [0, 5, 9], 10) == []
    assert token_id_problems("a", [3, -1, 10, 2.0, True], 10) == [
        "prompt 'a': token ids -1, 10, 2.0, ... are outside the model's vocabulary; allowed: integers from 0 to 9"
    ]


values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 5000),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, 0.0, 1.0, 2.0, 0.5, -0.0, "auto", "4", [1]]),
    st.text(max_size=3),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(SETTINGS)), values)
def test_the_api_refuses_a_setting_exactly_when_the_config_does(arg, value):
    refused = bool(setting_problems({arg: value}))
    if refused:
        with pytest.raises(ValueError) as info:
            check_settings({arg: value})
        assert str(info.value).startswith(f"{arg}: {value!r} ")
    config = copy.deepcopy(SMOKE)
    *parents, last = SETTINGS[arg].split(".")
    node = config
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    try:
        validate(config)
        config_refused = False
    except ConfigError as exc:  # the config's cross-checks (lag windows within T) are not the API's
        config_refused = f"{SETTINGS[arg]}: " in str(exc) or f"{SETTINGS[arg]}\n" in str(exc)
    assert refused == config_refused, (arg, value)
