"""The project's presses: the noise-floor control PermutationPress on a tiny random Llama."""

import pytest
import torch

from kvdiverge.engine.core.coupled import run_document
from kvdiverge.engine.core.sampling import Decoding
from kvdiverge.engine.llm.llm_pair import LLMKernelPair
from kvdiverge.engine.presses.policies import Policy
from kvdiverge.engine.presses.project import PermutationPress

T = 6


@pytest.fixture(scope="module")
def tiny_llama():
    """A 2-layer Llama with random weights (grouped-query attention), float32, eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=299,
        bos_token_id=0,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger logits than the init's: distributions far from uniform
        model.lm_head.weight.mul_(40.0)
    return model.eval()


PROMPT = [int(i) for i in torch.randint(1, 299, (120,), generator=torch.Generator().manual_seed(1))]


def prefill(model, press=None):
    from transformers import DynamicCache

    cache = DynamicCache()
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        if press is None:
            model(input_ids=ids, past_key_values=cache, use_cache=True)
        else:
            with press(model):
                model(input_ids=ids, past_key_values=cache, use_cache=True)
    return cache


def test_permutation_press_keeps_every_key_in_another_order(tiny_llama):
    press = PermutationPress(seed=4)
    full, permuted = prefill(tiny_llama), prefill(tiny_llama, press)
    n = len(PROMPT)
    for layer, (a, b) in enumerate(zip(full.layers, permuted.layers)):
        assert b.keys.shape == a.keys.shape == (1, 2, n, 16)  # every position kept
        assert not torch.equal(a.keys, b.keys)  # another order ...
        perm = press.permutation(layer, 2, n)
        assert not torch.equal(perm[0], perm[1])  # ... per key-value head
        # ... of exactly the same key and value vectors, paired as before
        back = torch.argsort(perm, dim=-1)[None, :, :, None].expand_as(b.keys)
        assert torch.equal(b.keys.gather(2, back), a.keys)
        assert torch.equal(b.values.gather(2, back), a.values)
    other = prefill(tiny_llama, PermutationPress(seed=5))
    assert not torch.equal(other.layers[0].keys, permuted.layers[0].keys)  # the seed matters
    policy = Policy.from_config("noise-floor", {"press": "PermutationPress", "seed": 4})
    assert policy.expected_kept(n, policy.build_press(n)) == n


@pytest.mark.parametrize("dtype,bound", [(torch.float64, 1e-12), (torch.float32, 1e-4)])
def test_permutation_is_an_ordering_change_and_nothing_else(tiny_llama, dtype, bound):
    """In float64 the permuted kernel equals the full one to rounding: TV <= 1e-12 every step."""
    model = tiny_llama.to(dtype)
    try:
        pair = LLMKernelPair(
            model,
            PROMPT,
            PermutationPress(seed=4),
            decoding=Decoding(temperature=1.0, top_p=1.0, eos_ids=[299]),
            expected_kept=len(PROMPT),
        )
        records = run_document(pair, T, 2, 0, "tiny", "doc")
    finally:
        tiny_llama.to(torch.float32)
    tv = torch.tensor([r["tv"] for r in records])
    assert tv.shape == (2, T) and torch.isfinite(tv).all()  # the chain ran every step
    assert tv[:, 0].eq(0).all()  # step 1: the prefill's own logits, before the press acts
    assert tv.max() <= bound
    if dtype == torch.float32:
        assert tv.max() > 0  # float32 rounding is visible: the order really changed the sums
