"""Nested presses wherever a press is named: config entries, press expressions on the command line."""

import pytest
from kvpress import AdaKVPress, ComposedPress, KeyRerotationPress, KnormPress, SnapKVPress

from kvdiverge.engine.core.errors import PressError, PressExpressionError
from kvdiverge.engine.presses.expressions import parse_press_call, policy_entry, press_spec
from kvdiverge.engine.presses.policies import Policy, min_prompt_tokens, press_from_spec
from kvdiverge.engine.presses.registry import ROWS, refusal

ADAKV = {
    "press": "AdaKVPress",
    "compression_ratio": 0.5,
    "params": {"press": {"press": "SnapKVPress", "window_size": 16}},
}


def test_the_policy_ratio_goes_to_the_inner_scorer_of_a_wrapper():
    policy = Policy.from_config("adakv", ADAKV)
    press = policy.build_press(100)
    assert isinstance(press, AdaKVPress) and isinstance(press.press, SnapKVPress)
    assert press.press.compression_ratio == 0.5 and press.press.window_size == 16
    assert policy.min_prompt_tokens == 17  # the inner press's window
    budget = Policy.from_config("adakv-b", {**ADAKV, "compression_ratio": None, "budget": 40})
    assert int(100 * (1 - budget.build_press(100).press.compression_ratio)) == 40
    assert budget.min_prompt_tokens == 57
    twice = {
        "press": "ComposedPress",
        "budget": 8,
        "params": {"presses": [{"press": "KeyRerotationPress", "params": {"press": {"press": "KnormPress"}}}]},
    }
    press = Policy.from_config("deep", twice).build_press(100)
    inner = press.presses[0].press
    assert isinstance(inner, KnormPress) and inner.compression_ratio == 1 - 8.5 / 100
    with pytest.raises(
        PressError,
        match=r"policy 'kvpress-assert': KeyRerotationPress\(press=AdaKVPress\(.*\)\) "
        r"failed: AssertionError: no message",
    ):
        Policy.from_config(
            "kvpress-assert",
            {
                **twice,
                "press": "KeyRerotationPress",
                "params": {"press": {"press": "AdaKVPress", "params": {"press": {"press": "KnormPress"}}}},
            },
        )
    composed = Policy.from_config(
        "c",
        {
            "press": "ComposedPress",
            "compression_ratio": 0.25,
            "params": {"presses": [{"press": "StreamingLLMPress", "n_sink": 2}]},
        },
    )
    press = composed.build_press(64)
    assert isinstance(press, ComposedPress) and press.presses[0].compression_ratio == 0.25
    assert press.presses[0].n_sink == 2


def test_nested_press_errors_name_the_press_and_parameter():
    bad = {**ADAKV, "params": {"press": {"press": "SnapKVPress", "windowsize": 16}}}
    with pytest.raises(
        PressError,
        match=r"policy 'a': SnapKVPress has no parameter\(s\) \['windowsize'\]; "
        r"accepted: \['compression_ratio', 'kernel_size', 'window_size'\]",
    ):
        Policy.from_config("a", bad)
    with pytest.raises(PressError, match="unknown press 'SnapKV'"):
        Policy.from_config("a", {**ADAKV, "params": {"press": {"press": "SnapKV"}}})
    with pytest.raises(PressError, match="compression_ratio is given twice"):
        Policy.from_config("a", {**ADAKV, "params": {"press": {"press": "SnapKVPress", "compression_ratio": 0.3}}})
    with pytest.raises(PressError, match=r"AdaKVPress\(\) failed: TypeError: .*missing 1 required"):
        Policy.from_config("a", {"press": "AdaKVPress"})  # no inner press: nothing takes a ratio
    with pytest.raises(PressError, match="ThinKPress takes no compression ratio; give neither"):
        Policy.from_config("t", {"press": "ThinKPress", "compression_ratio": 0.5})
    assert min_prompt_tokens(ADAKV) == 17


def test_press_expressions_are_parsed_not_evaluated():
    assert parse_press_call("AdaKVPress(press=SnapKVPress(compression_ratio=0.5))") == {
        "press": "AdaKVPress",
        "params": {"press": {"press": "SnapKVPress", "params": {"compression_ratio": 0.5}}},
    }
    assert parse_press_call("KnormPress(0.25)") == {"press": "KnormPress", "params": {"compression_ratio": 0.25}}
    assert parse_press_call("ComposedPress([KnormPress(), StreamingLLMPress(n_sink=-4)])")["params"] == {
        "presses": [{"press": "KnormPress", "params": {}}, {"press": "StreamingLLMPress", "params": {"n_sink": -4}}]
    }
    for text, why in [
        ("__import__('os').system('true')", "expected PressName"),
        ("SnapKVPress(window_size=__import__('os'))", "unknown press '__import__'"),
        ("SnapKVPress(window_size=x)", "'x' is neither a literal nor a press"),
        ("SnapKVPress(window_size=1 + 2)", "neither a literal nor a press"),
        ("SnapKVPress(**{'a': 1})", "given twice or unpacked"),
        ("SnapKVPress(0.5, window_size=8, compression_ratio=0.1)", "given twice"),
        ("SnapKVPress(0.5", "not a press expression"),
        ("os.system('true')", "expected PressName"),
    ]:
        with pytest.raises(PressExpressionError, match=why):
            parse_press_call(text)


def test_command_line_entries_carry_the_ratio_or_the_budget():
    assert policy_entry("AdaKVPress(press=SnapKVPress(compression_ratio=0.5, window_size=8))") == {
        "press": "AdaKVPress",
        "compression_ratio": 0.5,
        "params": {"press": {"press": "SnapKVPress", "params": {"window_size": 8}}},
    }
    assert policy_entry("SnapKVPress:compression_ratio=0.5,window_size=16") == {
        "press": "SnapKVPress",
        "compression_ratio": 0.5,
        "params": {"window_size": 16},
    }
    assert policy_entry("KnormPress", budget=64) == {"press": "KnormPress", "budget": 64, "params": {}}
    assert policy_entry("KnormPress")["compression_ratio"] == 0.0  # kvpress's default
    assert policy_entry("PermutationPress(seed=2)") == {"press": "PermutationPress", "params": {"seed": 2}}
    with pytest.raises(PressExpressionError, match="give --budget or compression_ratio, not both"):
        policy_entry("KnormPress(0.5)", budget=64)
    with pytest.raises(PressExpressionError, match="takes no compression ratio, so no --budget"):
        policy_entry("PermutationPress", budget=64)
    policy = Policy.from_config("x", policy_entry("AdaKVPress(SnapKVPress(window_size=8))", budget=20))
    assert int(80 * (1 - policy.build_press(80).press.compression_ratio)) == 20
    press = press_from_spec(press_spec("KeyRerotationPress(press=KnormPress(0.5))"), None, "press")
    assert isinstance(press, KeyRerotationPress) and press.press.compression_ratio == 0.5
    decoding = press_from_spec(press_spec("DecodingPress(base_press=KnormPress())"), None, "press")
    assert decoding.base_press.compression_ratio == 0.0 and refusal(decoding) is None  # decode-time, measured
    cam = press_from_spec(press_spec("CAMPress(base_press=KnormPress())"), None, "press")
    assert refusal(cam) == ROWS["CAMPress"].refused
    assert ROWS["CAMPress"].refused.startswith("CAMPress draws its merge mask from torch's global random generator")


def test_the_command_line_refuses_before_loading_anything(capsys):
    from kvdiverge.doors.cli import main

    assert main(["measure", "embedded", "--sotu", "1", "--press", "CAMPress(base_press=KnormPress(0.5))"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        "kvdiverge measure: error: policy 'CAMPress(base_press=KnormPress(0.5))': "
        "CAMPress draws its merge mask from torch's global random generator"
    )
    assert main(["measure", "embedded", "--sotu", "1", "--budget", "0", "--press", "KnormPress"]) == 2
    assert "--budget must be >= 1, got 0" in capsys.readouterr().err
    assert main(["measure", "embedded", "--sotu", "1", "--press", "SnapKVPress(window_size=eval('1'))"]) == 2
    assert "unknown press 'eval'" in capsys.readouterr().err
