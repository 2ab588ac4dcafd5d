"""Sliding-window layers: the window by position, presses on the full-attention layers only, refusals.

On the Gemma 3 miniature (:data:`kvdiverge.models.standins.MINIATURE`: 2 full-attention and
4 sliding-window layers of 64 tokens) a decoding side whose cache holds a rewound branch
must give the logits of a fresh forward over the tokens the row kept: its cache columns are
then not its positions, and a window counted in columns cuts one token too many.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from kvdiverge.engine.llm import side as side_module
from kvdiverge.engine.llm.side import CacheSide
from kvdiverge.engine.presses import layer_types
from kvdiverge.engine.presses.registry import refusal
from kvdiverge.models.standins import MINIATURE, build_config, random_model

pytestmark = pytest.mark.miniature

N = 80  # prompt tokens: the 64-token window starts inside the prompt


@pytest.fixture(scope="module")
def mini_gemma():
    return random_model(MINIATURE["gemma-3-270m"], initializer_range=0.1, seed=1)


def _fresh(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids]), past_key_values=DynamicCache(config=model.config)).logits[0, -1]


def _side_after_rewind(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Decode ``tokens[0]``, ``tokens[1]``; rewind ``tokens[1]``; decode ``tokens[2]``: its logits."""
    with torch.inference_mode():
        cache = DynamicCache()
        model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True)
        side = CacheSide(cache, torch.ones(1, len(prompt), dtype=torch.bool), len(prompt), capacity=len(prompt) + 8)
        side.forward(model, torch.tensor([tokens[0]]))
        side.forward(model, torch.tensor([tokens[1]]))
        side.rewind(torch.tensor([1]))
        return side.forward(model, torch.tensor([tokens[2]]))[0]


def test_a_rewound_column_does_not_shift_the_window(mini_gemma, monkeypatch):
    prompt = torch.randint(1, 500, (N,), generator=torch.Generator().manual_seed(5)).tolist()
    a, b, c = 17, 230, 411
    want = _fresh(mini_gemma, prompt + [a, c])
    got = _side_after_rewind(mini_gemma, prompt, [a, b, c])
    assert (got - want).abs().max().item() < 1e-5
    # counted in columns, the window of the last token would drop prompt token 18 as well
    monkeypatch.setattr(side_module, "has_sliding_layers", lambda config: False)
    by_column = _side_after_rewind(mini_gemma, prompt, [a, b, c])
    assert (by_column - want).abs().max().item() > 1e-3


def test_layer_type_masks_by_position_enumerated():
    """Window 3 over columns at positions 0, 1, 2, (rewound 3), 3, 4: the last query (position 4)
    sees positions 2, 3, 4; the rewound column never."""
    config = build_config(MINIATURE["gemma-3-270m"], sliding_window=3)

    class Stub(torch.nn.Module):
        dtype = torch.float32

    model = Stub()
    model.config = config
    config._attn_implementation = "sdpa"
    cache = DynamicCache()
    cache.update(torch.zeros(1, 1, 5, 16), torch.zeros(1, 1, 5, 16), 0)
    valid = torch.tensor([[True, True, True, False, True, True]])
    positions = torch.tensor([[0, 1, 2, 3, 3, 4]])
    masks = layer_types.layer_type_masks(model, cache, valid, positions, 1)
    full = masks["full_attention"].reshape(-1).tolist()
    sliding = masks["sliding_attention"].reshape(-1).tolist()
    assert full == [True, True, True, False, True, True]
    assert sliding == [False, False, True, False, True, True]


def test_a_press_hooks_only_the_full_attention_layers(mini_gemma):
    from kvpress import SnapKVPress

    press = SnapKVPress(compression_ratio=0.5)

    def hooked():
        return [i for i, layer in enumerate(mini_gemma.model.layers) if layer.self_attn._forward_hooks]

    with layer_types.on_full_layers(press, mini_gemma) as layers:
        assert hooked() == layers == [2, 5]
    assert hooked() == []
    with press(mini_gemma):  # kvpress itself hooks every layer of a Gemma3ForCausalLM
        assert hooked() == list(range(6))


def test_layer_types_of_the_configs():
    mini_gemma = build_config(MINIATURE["gemma-3-270m"])
    llama = build_config(MINIATURE["llama-3.1-8b"])
    assert layer_types.full_layers(mini_gemma) == [2, 5] and layer_types.sliding_window(mini_gemma) == 64
    assert layer_types.full_layers(llama) == [0, 1] and layer_types.sliding_window(llama) is None
    assert layer_types.refusal(mini_gemma) is None and layer_types.refusal(llama) is None
    chunked = build_config(MINIATURE["gemma-3-270m"])
    chunked.layer_types = ["chunked_attention"] * 6
    assert "'chunked_attention'" in layer_types.refusal(chunked)
    # a window on every layer and no layer types (Mistral v0.1): refused once a sequence passes it
    from transformers import MistralConfig

    mistral = MistralConfig(sliding_window=4096)
    assert layer_types.refusal(mistral) is None and layer_types.refusal(mistral, 4096) is None
    assert "a row's cache reaches 4097 columns" in layer_types.refusal(mistral, 4097)


def test_decode_time_presses_are_refused_on_sliding_layers(mini_gemma):
    from kvpress import DecodingPress, KnormPress, SnapKVPress, StreamingLLMPress

    assert refusal(SnapKVPress(compression_ratio=0.5), mini_gemma) is None
    assert refusal(StreamingLLMPress(compression_ratio=0.5), mini_gemma) is None
    sentence = refusal(DecodingPress(base_press=KnormPress(), compression_interval=4, target_size=32), mini_gemma)
    assert sentence.startswith("the model has 2 full-attention and 4 sliding-window layers (64 tokens)")
    assert "a press that evicts while decoding (DecodingPress)" in sentence


def test_kv_elements_by_layer_type_of_gemma_3_270m():
    from kvdiverge.engine.llm.planner import kv_elements_by_layer_type, kv_elements_per_token
    from kvdiverge.models.standins import GEMMA, PAPER

    config = build_config(GEMMA["gemma-3-270m"])
    # one key-value head of 256 dimensions, keys and values: 512 elements per layer
    assert kv_elements_by_layer_type(config) == {
        "elements_per_token": 3 * 512,
        "sliding_elements_per_token": 15 * 512,
        "sliding_window": 512,
    }
    assert kv_elements_per_token(config) == 18 * 512  # what the engine's caches hold
    llama = build_config(PAPER["llama-3.1-8b"])
    assert kv_elements_by_layer_type(llama) == {"elements_per_token": 32 * 8 * 128 * 2}


def test_frontier_counts_the_sliding_layers_window():
    import polars as pl

    from kvdiverge.estimation.frontier import _sliding

    g = pl.DataFrame({"prompt_len": [400, 800, 1024]})
    sizes = {"elements_per_token": 1536, "sliding_elements_per_token": 7680, "sliding_window": 512}
    # each document's sliding layers keep min(n, 511) of n prompt tokens (transformers'
    # DynamicSlidingWindowLayer: the window less the query)
    assert _sliding(g, sizes) == pytest.approx(7680 * (1 + 511 / 800 + 511 / 1024) / 3)
    assert _sliding(g, {"elements_per_token": 1536}) == 0.0


def test_the_provenance_names_the_compressed_layers():
    from kvdiverge.config.provenance import compressed_layers

    assert compressed_layers({"compressed": list(range(30)), "layers": 30, "sliding_window": None}) == "all 30"
    mini_gemma = {"compressed": [5, 11, 17], "layers": 18, "sliding_window": 512}
    assert compressed_layers(mini_gemma) == "3 of 18 (5, 11, 17); 15 sliding-window layers of 512 tokens kept whole"
    assert compressed_layers({}) == ""


@pytest.mark.parametrize("press", ["snapkv", "streaming", "pyramidkv", "adakv"])
def test_teacher_forced_pass_on_sliding_layers(mini_gemma, press):
    """The continuation in one forward equals stepping it (the window by position within the
    block too), and the reference side equals a fresh forward on the model's own cache."""
    import kvpress

    from kvdiverge.engine.core.sampling import Decoding, Sampling
    from kvdiverge.engine.llm.teacher import TeacherForcing, forced_pass
    from kvdiverge.engine.presses.policies import PressPolicy
    from kvdiverge.engine.runner import Document, build_pair

    snap = kvpress.SnapKVPress(0.5, window_size=8)
    presses = {
        "snapkv": snap,
        "streaming": kvpress.StreamingLLMPress(0.5, n_sink=4),
        "pyramidkv": kvpress.PyramidKVPress(0.5, window_size=8),
        "adakv": kvpress.AdaKVPress(kvpress.SnapKVPress(0.5, window_size=8)),
    }
    sampling = Sampling(T=20, replicates=1, decoding=Decoding(temperature=1.0, eos_ids=()), seed=5, model_name="g")
    prompt = torch.randint(1, 500, (N,), generator=torch.Generator().manual_seed(3)).tolist()
    tokens = torch.randint(1, 500, (20,), generator=torch.Generator().manual_seed(4)).tolist()

    def run(block):
        pair = build_pair(mini_gemma, [Document("d", prompt)], PressPolicy("p", presses[press]), sampling)
        return forced_pass(pair, tokens, TeacherForcing(length=len(tokens), block=block))

    (block, one), (steps, _) = run(True), run(False)
    assert one
    for key in ("kld", "ll_ref", "ll_ev"):
        assert torch.allclose(block[key], steps[key], atol=1e-5, rtol=0), key
    assert bool((block["kld"] > 1e-3).any())
    with torch.inference_mode():
        logits = mini_gemma(
            input_ids=torch.tensor([prompt + tokens]), past_key_values=DynamicCache(config=mini_gemma.config)
        )
        fresh = logits.logits[0, N - 1 : -1].double().log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    assert torch.allclose(block["ll_ref"].double(), fresh, atol=1e-5, rtol=0)


def test_reconstruction_and_key_tokens_on_sliding_layers(mini_gemma):
    """The reconstruction target (5 instruction tokens, then the prompt's first 30 tokens) in one forward
    equals stepping it; the key tokens' short-context forward (70 prompt tokens, then the 35 fed ones: past
    the 64-token window) equals stepping it through a cache."""
    import kvpress
    import polars as pl

    from kvdiverge.engine.core.sampling import Decoding, Sampling
    from kvdiverge.engine.forced import Continuation, TeacherPass, teacher_forced_policies
    from kvdiverge.engine.llm.teacher import TeacherForcing
    from kvdiverge.engine.presses.policies import PressPolicy
    from kvdiverge.engine.runner import Document
    from kvdiverge.estimation.key_tokens import KeyTokens

    sampling = Sampling(T=1, replicates=1, decoding=Decoding(temperature=1.0, eos_ids=()), seed=5, model_name="g")
    prompt = torch.randint(1, 500, (N,), generator=torch.Generator().manual_seed(3)).tolist()
    target = Continuation(tuple(prompt), "prompt", (7, 8, 9, 10, 11))
    rule = KeyTokens(short=70, alpha=0.5, beta=-40.0)

    def run(block):
        forcing = TeacherForcing(length=30, block=block, target="reconstruction", key=rule)
        snap = PressPolicy("p", kvpress.SnapKVPress(0.5, window_size=8))
        pass_ = TeacherPass(sampling, forcing, "s")
        return teacher_forced_policies(mini_gemma, [Document("d", prompt)], {"p": snap}, settings=pass_,
                                       continuations={"d": target})  # fmt: skip

    block, steps = run(True), run(False)
    assert block["one_forward"].all() and not steps["one_forward"].any()
    assert block["token"].to_list() == prompt[:30]
    for key in ("kld", "ll_ref", "ll_ev", "ll_short"):
        assert np.allclose(block[key].to_numpy(), steps[key].to_numpy(), atol=1e-5, rtol=0), key
    assert float(block["kld"].max()) > 1e-3 and 0 < int(block["key"].sum()) < 30
    with torch.inference_mode():  # the short context and the fed tokens, stepped through a cache
        cache, fed = DynamicCache(config=mini_gemma.config), list(target.fed)[:35]
        logits = [mini_gemma(input_ids=torch.tensor([prompt[-70:]]), past_key_values=cache).logits[0, -1]]
        for t in fed[:-1]:
            logits.append(mini_gemma(input_ids=torch.tensor([[t]]), past_key_values=cache).logits[0, -1])
        stepped = torch.stack(logits).double().log_softmax(-1)[torch.arange(len(fed)), torch.tensor(fed)][5:]
    assert np.allclose(block["ll_short"].to_numpy(), stepped.numpy(), atol=1e-5, rtol=0)
    assert block.filter(pl.col("key"))["ll_ref"].min() > rule.beta


def test_a_question_after_compression_is_refused_on_sliding_layers(mini_gemma):
    from kvdiverge.engine.core.errors import PressError
    from kvdiverge.engine.presses.policies import Policy
    from kvdiverge.engine.refusals import check_policy
    from kvdiverge.engine.runner import Document

    policy = Policy.from_config("snapkv-50", {"press": "SnapKVPress", "compression_ratio": 0.5, "window_size": 8})
    assert check_policy(mini_gemma, [Document("d", list(range(1, 101)))], policy, "policy 'snapkv-50'") is False
    with pytest.raises(
        PressError,
        match=r"the model has 2 full-attention and 4 sliding-window layers \(64 tokens\): a question prefilled after",
    ):
        check_policy(mini_gemma, [Document("d", list(range(1, 101)), 6)], policy, "policy 'snapkv-50'")


def test_measure_names_the_compressed_layers(mini_gemma):
    import kvdiverge

    prompt = torch.randint(1, 500, (N,), generator=torch.Generator().manual_seed(5)).tolist()
    spec = {"press": "SnapKVPress", "compression_ratio": 0.5, "params": {"window_size": 8}}
    m = kvdiverge.measure(
        mini_gemma, None, {"p": prompt}, {"snap": spec}, max_new_tokens=4, replicates=2, progress=False
    )
    layers = "2 of 6 (2, 5); 4 sliding-window layers of 64 tokens kept whole"
    assert m.settings.compressed_layers == m.settings.record()["compressed_layers"] == layers
    assert f"kept: of the prompt in the layers a press compresses, {layers}" in m.format_summary()
    assert m.documents["kept_len"].to_list() == [N // 2]


def _sampled(model, docs, policy, T):
    from kvdiverge.engine.core.sampling import Decoding, Sampling
    from kvdiverge.engine.runner import RunOptions, run_documents

    sampling = Sampling(T=T, replicates=2, decoding=Decoding(temperature=1.0, eos_ids=[]), seed=3, model_name="m")
    return run_documents(model, docs, policy, sampling, RunOptions(batch_documents=len(docs)))


def test_a_window_on_every_layer_is_refused_once_a_rewound_cache_can_pass_it():
    """Mistral-style: window 100 on every layer, no layer types. A 60-token prompt at T = 40 spans
    60 + 2T - 2 = 138 columns after a branch's rewind: refused before any forward; at T = 21 (100)
    it runs."""
    import kvpress
    from transformers import MistralConfig, MistralForCausalLM

    from kvdiverge.engine.core.errors import PressError
    from kvdiverge.engine.presses.policies import PressPolicy
    from kvdiverge.engine.runner import Document

    config = MistralConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=100, max_position_embeddings=1024, eos_token_id=511,
    )  # fmt: skip
    torch.manual_seed(1)
    model = MistralForCausalLM(config).eval()
    docs = [Document("d", list(range(1, 61)))]
    policy = PressPolicy("snap", kvpress.SnapKVPress(0.5, window_size=8))
    with pytest.raises(PressError, match="a row's cache reaches 138 columns"):
        _sampled(model, docs, policy, 40)
    assert len(_sampled(model, docs, policy, 21)) == 2


def test_eager_attention_on_sliding_layers_is_refused_before_any_forward():
    import kvpress

    eager = random_model(MINIATURE["gemma-3-270m"], initializer_range=0.1, seed=1, attn_implementation="eager")
    sentence = refusal(kvpress.SnapKVPress(compression_ratio=0.5), eager)
    assert sentence.startswith("the model has 2 full-attention and 4 sliding-window layers (64 tokens)")
    assert "load the model with attn_implementation: sdpa" in sentence


def test_a_finished_presss_key_masks_never_reach_the_reference(mini_gemma):
    """kvpress's own generate under a head-wise press leaves ``masked_key_indices`` on the attention
    modules; the pair drops them: the control's TV stays exactly 0 on the stock kernels."""
    import kvpress

    from kvdiverge.engine.llm.pair_base import stock_kernels
    from kvdiverge.engine.presses.policies import Policy
    from kvdiverge.engine.runner import Document

    ids = torch.randint(1, 500, (N,), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode(), kvpress.AdaKVPress(kvpress.SnapKVPress(0.5, window_size=8))(mini_gemma):
        x = ids[None]
        mini_gemma.generate(x, max_new_tokens=3, do_sample=False, attention_mask=torch.ones_like(x))
    left = [m for m in mini_gemma.modules() if getattr(m, "masked_key_indices", None) is not None]
    assert left  # the state kvpress leaves
    none = Policy.from_config("none", {"press": "SnapKVPress", "compression_ratio": 0.0})
    with stock_kernels():
        records = _sampled(mini_gemma, [Document("d", ids.tolist())], none, 20)
    assert all(tv == 0.0 for r in records for tv in r["tv"])
    assert all(getattr(m, "masked_key_indices", None) is None for m in mini_gemma.modules())
