"""Gemma 3 270M through the engine: its sliding-window layers measured correctly.

The second embedded model (:data:`kvdiverge.models.embedded.GEMMA_MODEL`) has 15 sliding-window
layers of 512 tokens and 3 full-attention layers. On a prompt of 700 tokens, longer than the
window, greedy decoding through the engine must equal

- on the full-cache side, ``model.generate(do_sample=False)`` on the model's own cache
  (``DynamicCache(config=...)``: the sliding layers keep their window);
- on a SnapKV side, kvpress's ``generate`` with the full-attention layers hooked (kvpress's
  policy for Gemma 3) on that cache;

and the ``none`` control gives TV exactly 0 when sampling.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvdiverge.data.corpus import sotu_units
from kvdiverge.engine.core.sampling import Decoding, Sampling
from kvdiverge.engine.presses.policies import Policy
from kvdiverge.engine.runner import Document, RunOptions, run_documents
from kvdiverge.models.embedded import GEMMA_NAME
from kvdiverge.testing.generation import greedy_generate, greedy_sides, until_eos

pytestmark = [pytest.mark.llm, pytest.mark.long]  # Gemma 3 converted from its GGUF file, about a minute

N, T, R = 700, 12, 2


@pytest.fixture(scope="module")
def gemma_prompt(gemma):
    """``(model, prompt ids)``: the session's model (conftest) and the first 700 tokens of the first
    State of the Union address, ``<bos>`` first."""
    model, tokenizer = gemma
    text = next(iter(sotu_units())).text
    ids = tokenizer(text).input_ids[:N]
    assert ids[0] == 2 and len(ids) == N
    return model, ids


def _run(model, ids, policy, temperature=0.0):
    sampling = Sampling(
        T=T,
        replicates=R,
        decoding=Decoding(temperature=temperature, top_p=1.0 if temperature == 0 else 0.95),
        seed=3,
        model_name=GEMMA_NAME,
    )
    return run_documents(model, [Document("d", ids)], policy, sampling, RunOptions(batch_documents=1))


def test_gemma_greedy_sides_equal_generate_and_kvpress(gemma_prompt):
    model, ids = gemma_prompt
    policy = Policy.from_config("snapkv-50", {"press": "SnapKVPress", "compression_ratio": 0.5, "window_size": 64})
    records = _run(model, ids, policy)
    ref, ev = greedy_sides(records[0])
    eos = {int(model.generation_config.eos_token_id)}  # <eos> = 1
    want_ref = greedy_generate(model, ids, max_new_tokens=T)
    want_ev = greedy_generate(model, ids, policy.build_press(N), T)
    assert until_eos(ref, eos) == want_ref
    assert until_eos(ev, eos) == want_ev
    # the full-attention layers keep half the prompt; the sliding ones all of it (their window applies)
    assert records[0]["kept_len"] == N // 2
    # the press hooked on every layer, as kvpress does for Gemma3ForCausalLM, changes the path
    with torch.inference_mode(), policy.build_press(N)(model):
        x = torch.tensor([ids])
        wrong = model.generate(
            x, max_new_tokens=T, do_sample=False, attention_mask=torch.ones_like(x), past_key_values=DynamicCache()
        )[0, N:].tolist()
    assert wrong != want_ev


def test_gemma_none_control_has_exactly_zero_tv(gemma_prompt):
    model, ids = gemma_prompt
    control = Policy.from_config("none", {"press": "SnapKVPress", "compression_ratio": 0.0})
    records = _run(model, ids, control, temperature=0.7)
    assert len(records) == R
    assert all(tv == 0.0 for r in records for tv in r["tv"]) and all(r["t_star"] is None for r in records)


def test_the_config_check_reads_the_layers_the_loaded_model_has(gemma):
    """The config check's layers (read from the GGUF header, no weights) are the loaded model's, and the
    engine's refusals read them as they read its config."""
    from kvdiverge.config.layers import entry_layers
    from kvdiverge.engine.presses.registry import sliding_refusal
    from kvdiverge.models.embedded import GEMMA_MODEL

    model, _ = gemma
    layers = entry_layers(GEMMA_MODEL, GEMMA_NAME)
    assert layers.layer_types == list(model.config.layer_types)
    assert layers.sliding_window == model.config.sliding_window == 512
    window = Policy.from_config("w", {"press": "SlidingWindowPress", "compression_ratio": 0.5}).probe_press
    assert sliding_refusal(window, layers) == sliding_refusal(window, model.config) is not None
