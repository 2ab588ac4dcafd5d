"""The torch-free facts of a cache and of a model's layers that the config check reads beside the presses.

A quantized cache's settings (:class:`QuantizedCacheSpec`, its backends :data:`BACKENDS`), its bits per
element (:func:`kv_bits_per_element`, by :func:`kvdiverge.estimation.kv_bytes.kv_bytes_per_element`) and
whether its backend is installed (:func:`backend_refusal`); a model's attention layer types
(:func:`layer_types`, :func:`sliding_window`, :func:`full_layers`, :func:`describe`), the key and value elements a
token stores (:func:`kv_elements_per_token`, :func:`kv_elements_by_layer_type`), and what the engine refuses of them
(:func:`layers_refusal`, :func:`model_sliding_refusal`, :func:`question_after_refusal`). Importing it loads
neither torch, transformers nor kvpress: the engine's quantized cache
(:mod:`kvdiverge.engine.presses.quantized`) and layer types (:mod:`kvdiverge.engine.presses.layer_types`)
read them from here, and the config check (:mod:`kvdiverge.config.layers`,
:mod:`kvdiverge.engine.presses.catalogue`) too, from a model's config read without its weights.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

from kvdiverge.estimation.kv_bytes import kv_bytes_per_element

__all__ = [
    "BACKENDS",
    "FULL",
    "SLIDING",
    "QuantizedCacheSpec",
    "backend_refusal",
    "describe",
    "full_layers",
    "has_sliding_layers",
    "kv_bits_per_element",
    "kv_elements_by_layer_type",
    "kv_elements_per_token",
    "layer_types",
    "layers_refusal",
    "model_sliding_refusal",
    "question_after_refusal",
    "sliding_window",
]

# --------------------------------------------------------------------------- quantized caches

#: Backend -> (import name checked, allowed nbits, axis that groups along the last dimension, pip package).
BACKENDS: dict[str, tuple[str, tuple[int, ...], int, str]] = {
    "quanto": ("optimum.quanto", (2, 4), 0, "optimum-quanto"),
    "hqq": ("hqq", (1, 2, 3, 4, 8), 1, "hqq"),
}


@dataclass(frozen=True)
class QuantizedCacheSpec:
    """Settings of a quantized cache (the policy entry's ``backend``, ``nbits``, ...).

    Parameters
    ----------
    backend : str
        ``"quanto"`` (default) or ``"hqq"``.
    nbits : int
        Bits per stored element (quanto: 2 or 4; hqq: 1, 2, 3, 4 or 8).
    q_group_size : int
        Elements sharing one scale and zero point, along the head dimension (must divide it).
    residual_length : int
        Newest tokens kept in full precision before a flush quantizes them (tokens, >= 1).

    Raises
    ------
    ValueError
        Unknown backend, ``nbits`` the backend does not offer, or a non-positive group
        size or residual length; the message names the key, the value and what is allowed.
    """

    backend: str = "quanto"
    nbits: int = 4
    q_group_size: int = 64
    residual_length: int = 128

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"quantized cache: backend must be one of {sorted(BACKENDS)}, got {self.backend!r}")
        bits = BACKENDS[self.backend][1]
        if isinstance(self.nbits, bool) or self.nbits not in bits:
            raise ValueError(
                f"quantized cache: nbits must be one of {list(bits)} for backend {self.backend!r}, got {self.nbits!r}"
            )
        for key in ("q_group_size", "residual_length"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"quantized cache: {key} must be an integer >= 1, got {v!r}")

    @property
    def axis(self) -> int:
        """The backend's ``axis`` whose groups run along the last (head) dimension."""
        return BACKENDS[self.backend][2]

    def describe(self) -> dict[str, Any]:
        """The settings as a config mapping (``cache: quantized`` and the four keys)."""
        return {
            "cache": "quantized",
            "backend": self.backend,
            "nbits": self.nbits,
            "q_group_size": self.q_group_size,
            "residual_length": self.residual_length,
        }


def kv_bits_per_element(spec: QuantizedCacheSpec | None, full_bits: int = 16) -> float:
    """Stored bits per key or value element: the data bits plus a scale and a zero point per group
    (:func:`kvdiverge.estimation.kv_bytes.kv_bytes_per_element`, in bits).

    Parameters
    ----------
    spec : QuantizedCacheSpec or None
        None: the full-precision cache, ``full_bits`` per element.
    full_bits : int
        Bits of a full-precision element and of each scale and zero point (16 for fp16/bf16).

    Returns
    -------
    float
        ``nbits + 2 * full_bits / q_group_size`` (HQQ's 3 bits: 3.2, ten values per 32-bit word;
        the residual's full-precision tokens are not counted: at most ``residual_length`` of
        them, whatever the prompt length).
    """
    return 8 * kv_bytes_per_element(None if spec is None else spec.describe(), full_bits / 8)


def backend_refusal(spec: QuantizedCacheSpec) -> str | None:
    """Why a quantized cache's backend cannot run here (its package not installed), or ``None``."""
    module, _, _, package = BACKENDS[spec.backend]
    if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
        return (
            f"the quantized cache's backend {spec.backend!r} needs the package {package!r}, which is not "
            f"installed (pip install -c constraints.txt {package})"
        )
    return None


# --------------------------------------------------------------------------- attention layer types

FULL = "full_attention"
SLIDING = "sliding_attention"


def _text(config):
    return getattr(config, "get_text_config", lambda: config)()


def layer_types(config) -> list[str]:
    """Each decoder layer's attention type (``config.layer_types``; all ``"full_attention"``
    when the config names none)."""
    config = _text(config)
    types = getattr(config, "layer_types", None)
    return list(types) if types else [FULL] * int(config.num_hidden_layers)


def sliding_window(config) -> int | None:
    """Tokens a sliding layer attends to, the query included (``config.sliding_window``);
    ``None`` when no layer slides."""
    config = _text(config)
    return int(config.sliding_window) if SLIDING in layer_types(config) else None


def has_sliding_layers(config) -> bool:
    """True when some decoder layer attends to a sliding window."""
    return SLIDING in layer_types(config)


def full_layers(config) -> list[int]:
    """Indices of the full-attention layers, the ones a press compresses."""
    return [i for i, kind in enumerate(layer_types(config)) if kind == FULL]


def describe(config) -> str:
    """The model's layers in words, the opening of every refusal about them: "the model has 3
    full-attention and 15 sliding-window layers (512 tokens)"."""
    kinds = layer_types(config)
    return (
        f"the model has {kinds.count(FULL)} full-attention and {kinds.count(SLIDING)} sliding-window layers "
        f"({sliding_window(config)} tokens)"
    )


def question_after_refusal(config) -> str | None:
    """Why a question prefilled after compression cannot run on this model's layers, in one sentence;
    ``None`` when it can: on sliding-window layers, whose caches hold different lengths, it cannot."""
    if not has_sliding_layers(config):
        return None
    return (
        f"{describe(config)}: a question prefilled after compression is not supported there (its layers hold "
        f"caches of different lengths)"
    )


def layers_refusal(config, tokens: int | None = None) -> str | None:
    """Why the engine cannot run this model's layers, in one sentence; ``None`` when it can.

    Refused: a layer type other than full and sliding attention (chunked, linear); a
    ``sliding_window`` in force on every layer of a config that names no layer types
    (Mistral-style, Phi-3) once a row's cache spans more than the window, ``tokens`` columns
    (the longest prompt and the columns decoding adds, rewound ones included): transformers
    then counts the window in cache columns, which after a rewind are not positions. With
    ``tokens`` None only the layer types are checked.
    """
    config = _text(config)
    kinds = sorted(set(layer_types(config)))
    other = [k for k in kinds if k not in (FULL, SLIDING)]
    if other:
        return f"the model's layer types are {kinds}; the engine honours only {FULL!r} and {SLIDING!r} layers"
    window = getattr(config, "sliding_window", None)
    uses = getattr(config, "use_sliding_window", True)
    if window and uses and not getattr(config, "layer_types", None) and tokens is not None and tokens > window:
        return (
            f"the model attends through a sliding window of {window} tokens on every layer and its config "
            f"names no layer types, and a row's cache reaches {tokens} columns; the engine honours sliding windows "
            f"only on configs with layer_types"
        )
    return None


def model_sliding_refusal(config) -> str | None:
    """What a model's layers tell against every press (``None`` without a config or sliding layers): its
    layer types (:func:`layers_refusal`), and eager attention beside sliding-window layers."""
    if config is None:
        return None
    reason = layers_refusal(config)
    if reason or not has_sliding_layers(config):
        return reason
    if getattr(config, "_attn_implementation", None) == "eager":
        return (
            f"{describe(config)}: their caches have different widths, whose padding kvpress's per-head key masks "
            f"cover only under sdpa attention; load the model with attn_implementation: sdpa"
        )
    return None


def kv_elements_per_token(model_config: Any) -> int:
    """Key and value elements one token stores in one row: layers x kv heads x head dim x 2.

    Parameters
    ----------
    model_config : transformers.PretrainedConfig
        Reads ``num_hidden_layers``, ``num_key_value_heads`` (default
        ``num_attention_heads``) and ``head_dim`` (default ``hidden_size //
        num_attention_heads``); a multimodal config's text config.

    Returns
    -------
    int
        Elements per token per row.

    Raises
    ------
    ValueError
        If the config lacks ``num_hidden_layers`` or the attention sizes.
    """
    model_config = getattr(model_config, "get_text_config", lambda: model_config)()
    try:
        layers = int(model_config.num_hidden_layers)
        heads = int(model_config.num_attention_heads)
        kv_heads = int(getattr(model_config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(model_config, "head_dim", None) or model_config.hidden_size // heads)
    except AttributeError as err:
        raise ValueError(f"model config lacks an attention size the planner needs: {err}") from None
    return layers * kv_heads * head_dim * 2


def kv_elements_by_layer_type(model_config: Any) -> dict[str, int]:
    """Key and value elements one prompt token stores in one row, by layer type.

    A press compresses the full-attention layers (``elements_per_token``: those layers x kv
    heads x head dim x 2); a sliding-window layer keeps at most its window of the prompt,
    as the model's own cache does (``sliding_elements_per_token`` and ``sliding_window``,
    tokens; only when some layer slides). :func:`kv_elements_per_token` counts every layer:
    what the engine's caches hold.

    Raises
    ------
    ValueError
        As :func:`kv_elements_per_token`.
    """
    per_layer = kv_elements_per_token(model_config) // len(layer_types(model_config))
    full = len(full_layers(model_config))
    sizes = {"elements_per_token": full * per_layer}
    if sliding_window(model_config):
        sizes["sliding_elements_per_token"] = (len(layer_types(model_config)) - full) * per_layer
        sizes["sliding_window"] = sliding_window(model_config)
    return sizes
