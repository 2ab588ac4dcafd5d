"""Stand-in models: the paper's two architectures, exact and in miniature, with random weights.

``config/paper.yaml`` runs Llama-3.1-8B-Instruct and Qwen2.5-7B-Instruct. Their
architectures are written out here from the public ``config.json`` of each hub repository
(``meta-llama/Llama-3.1-8B-Instruct``, ``Qwen/Qwen2.5-7B-Instruct``), so that they can be
built with random weights and no download: a config's ``source: miniature`` model entry
(:func:`kvdiverge.study.models.load_model`, the rehearsal configs), the GPU benchmark
(``benchmarks/gpu_speed.py``) and the CPU tests (``tests/test_miniatures.py``). The
miniatures keep every structural feature that the engine and kvpress touch, at toy sizes:

=============================  ==============================  ==============================
feature                        Llama-3.1                       Qwen2.5
=============================  ==============================  ==============================
grouped-query attention        32 : 8 heads (4:1)              28 : 4 heads (7:1)
RoPE                           theta 5e5, ``llama3`` scaling   theta 1e6, no scaling
                               (factor 8, low 1, high 4,
                               original context 8192)
q/k/v projection biases        no                              yes
embeddings                     untied                          untied
=============================  ==============================  ==============================

torch and transformers are imported when a model or config is built, so that the
workflow's torch-free stages can import :mod:`kvdiverge.study.models`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["GEMMA", "PAPER", "MINIATURE", "build_config", "random_model"]

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

#: Exact architectures (config.json values) by the model names of config/paper.yaml.
PAPER: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": dict(_LLAMA3_ROPE),
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
    },
    "qwen-2.5-7b": {
        "model_type": "qwen2",
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": [151645, 151643],
    },
}

#: Gemma 3 270M (``google/gemma-3-270m``'s config.json): five sliding-window layers (512 tokens,
#: RoPE theta 1e4) to one full-attention layer (RoPE theta 1e6), one key-value head, tied embeddings.
GEMMA: dict[str, dict[str, Any]] = {
    "gemma-3-270m": {
        "model_type": "gemma3_text",
        "vocab_size": 262144,
        "hidden_size": 640,
        "intermediate_size": 2048,
        "num_hidden_layers": 18,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 512,
        "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3,
        "max_position_embeddings": 32768,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "pad_token_id": 0,
    },
}

#: Toy sizes with the same structural features (2 layers, head dim 8, vocabulary 512).
MINIATURE: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        **PAPER["llama-3.1-8b"],
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "bos_token_id": 0,
        "eos_token_id": [509, 510, 511],
    },
    "qwen-2.5-7b": {
        **PAPER["qwen-2.5-7b"],
        "vocab_size": 512,
        "hidden_size": 56,
        "intermediate_size": 112,
        "num_hidden_layers": 2,
        "num_attention_heads": 7,
        "num_key_value_heads": 1,
        "bos_token_id": 0,
        "eos_token_id": [510, 511],
    },
    # the sliding window shorter than every test prompt, so that it cuts each one; untied
    # embeddings (random tied ones make the greedy path repeat the last token)
    "gemma-3-270m": {
        **GEMMA["gemma-3-270m"],
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": 64,
        "layer_types": ["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"],
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "pad_token_id": 0,
        "eos_token_id": [510, 511],
    },
}


def build_config(values: dict[str, Any], **overrides):
    """A ``transformers`` config (``LlamaConfig``, ``Qwen2Config`` or ``Gemma3TextConfig``) from written-out values.

    Parameters
    ----------
    values : dict
        An entry of :data:`PAPER` or :data:`MINIATURE` (``model_type`` picks the class).
    **overrides
        Extra config attributes, e.g. ``initializer_range``.

    Raises
    ------
    ValueError
        If ``model_type`` is not ``llama``, ``qwen2`` or ``gemma3_text``.
    """
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config

    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config, "gemma3_text": Gemma3TextConfig}
    values = {**values, **overrides}
    kind = values.pop("model_type")
    if kind not in classes:
        raise ValueError(f"model_type {kind!r}: expected one of {sorted(classes)}")
    return classes[kind](**values)


def random_model(
    values: dict[str, Any],
    *,
    dtype="float32",
    device="cpu",
    seed: int = 0,
    attn_implementation: str = "sdpa",
    **overrides,
):
    """A causal LM of the given architecture with random weights, in eval mode.

    Parameters
    ----------
    values : dict
        An entry of :data:`PAPER` or :data:`MINIATURE`.
    dtype : str or torch.dtype
        Parameter dtype (e.g. ``"bfloat16"``).
    device : str
        Where the weights are created (``"cuda"`` initialises on the GPU directly).
    seed : int
        ``torch.manual_seed`` before initialisation (same seed, same weights).
    attn_implementation : str
        ``"sdpa"`` (default), ``"eager"`` or ``"flash_attention_2"``.
    **overrides
        Config attributes, e.g. ``initializer_range`` (weight std).

    Returns
    -------
    transformers.PreTrainedModel
        With ``generation_config.eos_token_id`` and ``pad_token_id`` set from the config.
    """
    import torch
    from transformers import AutoModelForCausalLM

    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    config = build_config(values, **overrides)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    eos = config.eos_token_id
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos[0] if isinstance(eos, list) else eos
    return model.eval()
