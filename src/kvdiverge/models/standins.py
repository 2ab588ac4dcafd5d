"""Stand-in models: the paper's two architectures, exact and in miniature, with random weights.

``config/paper.yaml`` runs Llama-3.1-8B-Instruct and Qwen2.5-7B-Instruct. Their
architectures are written out here from the public ``config.json`` of each hub repository
(``meta-llama/Llama-3.1-8B-Instruct``, ``Qwen/Qwen2.5-7B-Instruct``), so that they can be
built with random weights and no download: a config's ``source: miniature`` model entry
(:func:`kvdiverge.models.loading.load_model`, the rehearsal configs), the GPU benchmark
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
workflow's torch-free stages can import :mod:`kvdiverge.models.loading`.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "GEMMA",
    "PAPER",
    "PEAKED_INIT",
    "MINIATURE",
    "build_config",
    "random_model",
    "small_vocabulary",
    "truncated_tokenizer",
]

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


#: Weight std of a small-vocabulary stand-in (transformers' ``initializer_range``; 0.02 by default).
#: At 0.8 the random Llama-3.1 stand-in's next-token distributions are as peaked as a trained
#: instruct model's: entropy about 1.5 nats, a top-p 0.95 nucleus of about 8 tokens (median over
#: random prompts; 3,800 of 4,096 tokens at 0.02). The nucleus then costs what it costs on the real
#: models, not the full sort of a flat distribution.
PEAKED_INIT = 0.8


def small_vocabulary(values: dict[str, Any], size: int) -> dict[str, Any]:
    """An architecture's values with a vocabulary of ``size`` ids, its EOS ids the last ones,
    and peaked next-token distributions.

    The real models' EOS ids (Llama-3.1's three, Qwen2.5's two) lie beyond a small
    vocabulary; the stand-in keeps how many there are and puts them at the top of its
    vocabulary, ``size - n .. size - 1``, as :data:`MINIATURE` does. Its BOS is id 0. Its
    weights are drawn with standard deviation :data:`PEAKED_INIT` (``initializer_range``).

    Parameters
    ----------
    values : dict
        An entry of :data:`PAPER` or :data:`MINIATURE`.
    size : int
        Vocabulary size (ids), at least 1,024.

    Raises
    ------
    ValueError
        If ``size`` is smaller than 1,024.
    """
    if int(size) < 1024:
        raise ValueError(f"vocab_size {size}: a stand-in's vocabulary needs at least 1024 ids")
    eos = values["eos_token_id"]
    n = len(eos) if isinstance(eos, list) else 1
    return {
        **values,
        "vocab_size": int(size),
        "bos_token_id": 0,
        "eos_token_id": list(range(int(size) - n, int(size))),
        "initializer_range": PEAKED_INIT,
    }


def truncated_tokenizer(tokenizer, size: int):
    """A byte-level BPE tokenizer cut to its first ``size`` ids: its vocabulary below ``size``
    and the merges that make them.

    A BPE vocabulary grows one merge at a time, and its ids follow the order of the merges
    (SmolLM2's: 17 special tokens, 235 bytes, then merge ``k`` makes id ``252 + k``). The
    first ``size`` ids with their merges are the tokenizer that BPE training on the same text
    stops at ``size`` ids gives (Sennrich et al. 2016, "Neural Machine Translation of Rare Words
    with Subword Units"): every text still encodes, into more tokens (about 1.3 times as many
    as SmolLM2's 49,152 ids at 4,096 ids on English prose), and decodes back unchanged. Added
    tokens at or above ``size`` (SmolLM2's infilling tokens) are dropped; the chat template
    and the special tokens below ``size`` are kept.

    Parameters
    ----------
    tokenizer : transformers tokenizer
        A fast tokenizer whose model is BPE with ids in merge order.
    size : int
        Vocabulary size (ids).

    Returns
    -------
    transformers.PreTrainedTokenizerFast
        Every id it gives is below ``size``.

    Raises
    ------
    ValueError
        If the tokenizer is not BPE, or its ids do not follow its merges.
    """
    import json

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    model = spec["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"only a BPE tokenizer can be cut to {size} ids, not a {model.get('type')} one")
    vocab = model["vocab"]
    merges = [m.split(" ") if isinstance(m, str) else m for m in model["merges"]]
    if any(vocab["".join(m)] < max(vocab[m[0]], vocab[m[1]]) for m in merges):
        raise ValueError("the tokenizer's ids do not follow its merges: cutting it at an id would break words")
    model["vocab"] = {token: i for token, i in vocab.items() if i < size}
    model["merges"] = [m for m in merges if "".join(m) in model["vocab"]]
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["id"] < size]
    specials = {
        k: getattr(tokenizer, k) for k in ("bos_token", "eos_token", "unk_token", "pad_token") if getattr(tokenizer, k)
    }
    specials = {k: v for k, v in specials.items() if tokenizer.convert_tokens_to_ids(v) < size}
    # a plain fast tokenizer: the embedded one's class (CodeLlamaTokenizer, from the GGUF file) would add
    # its infilling tokens back, above ``size``
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)), chat_template=tokenizer.chat_template, **specials
    )
