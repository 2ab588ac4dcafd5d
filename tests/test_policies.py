"""Eviction policies: config entries -> kvpress presses, budgets, minimum lengths."""

from pathlib import Path

import pytest
import yaml

from kvdiverge.engine.core.sampling import Decoding
from kvdiverge.engine.presses.policies import Policy, min_prompt_tokens, policies_from_config, press_class

ROOT = Path(__file__).resolve().parents[1]


def test_budget_keeps_exactly_budget_positions():
    policy = Policy.from_config("b512", {"press": "SnapKVPress", "budget": 512, "window_size": 64})
    for n in range(577, 5000, 7):
        ratio = policy.ratio_for(n)
        assert int(n * (1 - ratio)) == 512, n  # kvpress.utils.compute_n_kept
        assert policy.kept_tokens(n) == 512
        assert policy.build_press(n).compression_ratio == ratio


def test_ratio_policy_kept_tokens_follow_kvpress():
    from kvpress.utils import compute_n_kept

    policy = Policy.from_config("s50", {"press": "SnapKVPress", "compression_ratio": 0.5})
    assert [policy.kept_tokens(n) for n in (65, 100, 101, 999)] == [32, 50, 50, 499]
    assert all(policy.kept_tokens(n) == compute_n_kept(n, 0.5) for n in range(65, 300))
    control = Policy.from_config("none", {"press": "SnapKVPress", "compression_ratio": 0.0})
    assert control.is_control and control.kept_tokens(300) == 300 and not policy.is_control


def test_min_prompt_tokens():
    assert min_prompt_tokens({"press": "SnapKVPress", "budget": 512, "window_size": 64}) == 577
    assert min_prompt_tokens({"press": "SnapKVPress", "compression_ratio": 0.5, "window_size": 64}) == 65
    assert min_prompt_tokens({"press": "StreamingLLMPress", "compression_ratio": 0.5, "n_sink": 4}) == 5
    assert min_prompt_tokens({"press": "KnormPress", "compression_ratio": 0.5}) == 1
    policy = Policy.from_config("b", {"press": "SnapKVPress", "budget": 100, "window_size": 16})
    with pytest.raises(ValueError, match="at least 117 tokens, got 116"):
        policy.ratio_for(116)


def test_bad_policies_are_named():
    with pytest.raises(ValueError, match="exactly one of compression_ratio or budget"):
        Policy.from_config("x", {"press": "SnapKVPress", "compression_ratio": 0.5, "budget": 10})
    with pytest.raises(ValueError, match="exactly one"):
        Policy.from_config("x", {"press": "SnapKVPress"})
    with pytest.raises(ValueError, match="unknown press 'SnapPress'; available: .*SnapKVPress"):
        Policy.from_config("x", {"press": "SnapPress", "compression_ratio": 0.5}).build_press(100)
    with pytest.raises(ValueError, match=r"SnapKVPress has no parameter\(s\) \['n_sink'\]; accepted: .*window_size"):
        Policy.from_config("x", {"press": "SnapKVPress", "compression_ratio": 0.5, "n_sink": 4}).build_press(100)


def test_the_noise_floor_is_a_project_press_named_like_any_press():
    from kvdiverge.engine.presses.project import PermutationPress

    policy = Policy.from_config("noise-floor", {"press": "PermutationPress", "seed": 3})
    assert press_class("PermutationPress") is PermutationPress
    press = policy.build_press(700)
    assert isinstance(press, PermutationPress) and press.seed == 3
    assert policy.kept_tokens(700) == 700 and policy.expected_kept(700, press) == 700
    assert not policy.is_control and min_prompt_tokens(policy) == 1
    with pytest.raises(ValueError, match="PermutationPress keeps every position; give neither"):
        Policy.from_config("x", {"press": "PermutationPress", "compression_ratio": 0.0})
    with pytest.raises(ValueError, match=r"PermutationPress has no parameter\(s\) \['window_size'\]"):
        Policy.from_config("x", {"press": "PermutationPress", "window_size": 4}).build_press(100)


@pytest.mark.parametrize("config", ["config.yaml", "smoke.yaml", "paper.yaml"])
def test_every_shipped_policy_builds_its_press(config):
    cfg = yaml.safe_load((ROOT / "config" / config).read_text())
    for name, policy in policies_from_config(cfg).items():
        n = max(min_prompt_tokens(policy), 1000)
        press = policy.build_press(n)
        assert type(press) is press_class(policy.press)
        assert policy.kept_tokens(n) <= n


# Score-based presses that need no calibration data: the test matrix over presses.
PRESSES = [
    "SnapKVPress",
    "StreamingLLMPress",
    "KnormPress",
    "TOVAPress",
    "RandomPress",
    "ExpectedAttentionPress",
    "KeyDiffPress",
    "LagKVPress",
]


@pytest.fixture(scope="module")
def llm(embedded):
    """The embedded model and tokenizer, converted and loaded once per session (tests/conftest.py)."""
    return embedded


@pytest.mark.llm
@pytest.mark.parametrize("press_name", PRESSES)
def test_every_press_compresses_to_its_kept_count_and_decodes(llm, press_name):
    from kvpress import ScorerPress

    from kvdiverge.engine.core.coupled import run_document
    from kvdiverge.engine.llm.llm_pair import LLMKernelPair

    model, tokenizer = llm
    messages = [{"role": "user", "content": "Fellow citizens, " * 60 + "\nSummarize."}]
    ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])
    policy = Policy.from_config(press_name, {"press": press_name, "compression_ratio": 0.5})
    press = policy.build_press(len(ids))
    expected = policy.kept_tokens(len(ids)) if isinstance(press, ScorerPress) else None
    pair = LLMKernelPair(model, ids, press, decoding=Decoding(temperature=1.0), expected_kept=expected)
    records = run_document(pair, 3, 2, 0, "m", press_name)
    assert pair.kept_lens == [len(ids) // 2]
    assert len(records) == 2 and all(len(r["tv"]) == 3 for r in records)
