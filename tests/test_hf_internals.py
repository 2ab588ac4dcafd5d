"""The transformers internals kvdiverge uses: each one named, found, and behaving as the engine needs.

A transformers release that moves one of them fails here with a sentence naming it and its use
(``kvdiverge.engine.hf.INTERNALS``). The names are listed here again on purpose: a name dropped
from the module's table is a test failure too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from kvdiverge.engine import hf

SRC = Path(__file__).resolve().parents[1] / "src" / "kvdiverge"

#: Every internal the package uses, by its full name.
NAMES = {
    "transformers.AttentionInterface",
    "transformers.masking_utils.AttentionMaskInterface",
    "transformers.masking_utils.sdpa_mask",
    "transformers.masking_utils.create_causal_mask",
    "transformers.integrations.sdpa_attention.sdpa_attention_forward",
    "transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS",
    "transformers.PretrainedConfig._attn_implementation",
    "transformers.models.llama.modeling_llama.repeat_kv",
    "transformers.models.llama.modeling_llama.rotate_half",
    "transformers.models.llama.modeling_llama.LlamaAttention.forward",
    "transformers.DynamicCache",
    "transformers.cache_utils.Cache",
    "transformers.cache_utils.CacheLayerMixin",
    "transformers.cache_utils.CacheLayerMixin.lazy_initialization",
    "transformers.cache_utils.CacheLayerMixin.get_mask_sizes",
    "transformers.cache_utils.DynamicLayer",
    "transformers.cache_utils.QuantizedLayer",
    "transformers.cache_utils.QuantoQuantizedLayer",
    "transformers.cache_utils.HQQQuantizedLayer",
    "transformers.cache_utils.HQQQuantizedLayer._quantize",
    "transformers.cache_utils.HQQQuantizedLayer._dequantize",
    "transformers.convert_slow_tokenizer.generate_merges",
    "transformers.modeling_gguf_pytorch_utils.tqdm",
}


def test_the_table_names_every_internal_once():
    paths = [i.path for i in hf.INTERNALS]
    assert len(paths) == len(set(paths))
    assert set(paths) == NAMES


@pytest.mark.parametrize("internal", hf.INTERNALS, ids=lambda i: i.path)
def test_each_internal_is_where_the_engine_looks(internal):
    assert internal.problem() is None, internal.problem()


def test_a_moved_internal_is_named_with_its_use():
    moved = hf.Internal("transformers.cache_utils", "NoSuchLayer", "as an example")
    assert moved.problem().endswith("has no transformers.cache_utils.NoSuchLayer, which kvdiverge uses as an example")
    assert moved.problem().startswith(f"transformers {hf.TESTED_TRANSFORMERS} (tested: {hf.TESTED_TRANSFORMERS})")
    lost = hf.Internal("transformers.cache_utils", "CacheLayerMixin.update", "as an example", parameter="nope")
    assert "transformers.cache_utils.CacheLayerMixin.update takes no 'nope'" in lost.problem()
    assert hf.problems() == []


def test_only_this_module_imports_transformers_internals():
    """Outside ``engine/hf.py`` the package imports transformers' public names only."""
    public = {
        "AutoConfig",
        "AutoModelForCausalLM",
        "AutoTokenizer",
        "LlamaConfig",
        "Qwen2Config",
        "Gemma3TextConfig",
        "PreTrainedTokenizerFast",
    }
    found = []
    for path in SRC.rglob("*.py"):
        if path.name == "hf.py" and path.parent.name == "engine":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("transformers"):
                if node.module != "transformers" or {a.name for a in node.names} - public:
                    if node.module != "transformers.utils":  # logging: public
                        found.append(f"{path.relative_to(SRC)}: from {node.module} import ...")
            elif isinstance(node, ast.Import) and any(a.name.startswith("transformers") for a in node.names):
                found.append(f"{path.relative_to(SRC)}: import {node.names[0].name}")
    assert found == []


def test_the_tested_version_is_the_installed_and_pinned_one():
    import transformers

    pins = (SRC.parents[1] / "constraints.txt").read_text()
    assert f"\ntransformers=={hf.TESTED_TRANSFORMERS}\n" in pins
    assert transformers.__version__ == hf.TESTED_TRANSFORMERS


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def test_attention_modules_receive_cache_position_and_the_cache(tiny_llama):
    """The presses' forward hooks read ``cache_position`` and ``past_key_values`` from the attention kwargs."""
    seen = []
    attn = tiny_llama.model.layers[0].self_attn
    handle = attn.register_forward_hook(lambda m, a, kw, out: seen.append(kw), with_kwargs=True)
    try:
        cache = hf.DynamicCache()
        with torch.no_grad():
            tiny_llama(torch.tensor([[1, 2, 3, 4, 5]]), past_key_values=cache, use_cache=True)
            tiny_llama(torch.tensor([[6]]), past_key_values=cache, use_cache=True)
    finally:
        handle.remove()
    assert [kw["cache_position"].tolist() for kw in seen] == [[0, 1, 2, 3, 4], [5]]
    assert all(kw["past_key_values"] is cache for kw in seen)
    layer = cache.layers[0]
    assert isinstance(layer, hf.DynamicLayer) and not layer.is_sliding
    assert layer.keys.shape == layer.values.shape == (1, 2, 6, 4)  # (rows, kv heads, positions, head dim)
    assert layer.get_seq_length() == 6


def test_the_attention_implementation_is_a_settable_config_name(tiny_llama):
    config = tiny_llama.config
    assert config._attn_implementation == "sdpa"
    assert "sdpa" in hf.ALL_ATTENTION_FUNCTIONS
    assert hf.ALL_ATTENTION_FUNCTIONS["sdpa"] is not None


def test_a_cache_takes_the_engines_own_layers():
    keys, values = torch.zeros(1, 2, 3, 4), torch.ones(1, 2, 3, 4)
    layer = hf.DynamicLayer()
    layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values
    cache = hf.Cache(layers=[layer])
    assert cache.layers == [layer] and cache.get_seq_length() == 3


def test_repeat_kv_and_rotate_half_compute_what_the_prefill_expects():
    x = torch.arange(8.0).reshape(1, 1, 2, 4)  # (batch, kv heads, positions, head dim)
    assert torch.equal(hf.repeat_kv(x, 3), x.expand(1, 3, 2, 4))
    assert hf.rotate_half(torch.tensor([1.0, 2.0, 3.0, 4.0])).tolist() == [-3.0, -4.0, 1.0, 2.0]
