"""The KV bytes of one cache element, full precision or quantized, by arithmetic alone.

A module of its own, with no import beyond the standard library, so that the engine's quantized
cache and the frontier's points (:mod:`kvdiverge.estimation.frontier`) read the same figure, and the
engine does not load the frontier's statistics (numpy, polars, scipy) to get it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["GGML_BITS", "ggml_bits", "kv_bytes_per_element"]

#: Bits per element of llama.cpp's KV cache types, each block's scale (and minimum) included: ggml's
#: block sizes (``ggml/src/ggml-common.h``: ``block_q8_0`` holds 32 int8 values and an f16 scale, 34 bytes
#: per 32 elements; ``block_q4_0`` 32 nibbles and an f16 scale, 18 bytes; ``block_q4_1`` adds an f16
#: minimum, 20 bytes; ``block_q5_0`` 22 and ``block_q5_1`` 24 bytes; ``block_iq4_nl`` 18 bytes).
GGML_BITS: dict[str, float] = {
    "f16": 16.0,
    "q8_0": 8.5,
    "q5_1": 6.0,
    "q5_0": 5.5,
    "q4_1": 5.0,
    "q4_0": 4.5,
    "iq4_nl": 4.5,
}


def ggml_bits(type_k: str, type_v: str) -> float:
    """Mean bits per cached element of a llama.cpp cache of ``type_k`` keys and ``type_v`` values
    (:data:`GGML_BITS`, scales included; f16 and q4_0: 10.25).

    Raises
    ------
    KeyError
        A type outside :data:`GGML_BITS`.
    """
    return (GGML_BITS[type_k] + GGML_BITS[type_v]) / 2


def kv_bytes_per_element(cache: Mapping[str, Any] | None, element_bytes: float) -> float:
    """KV bytes stored per key or value element of the prompt cache, scales and zero points included.

    Full precision: ``element_bytes`` (the model's dtype: 4 for float32, 2 for float16 and
    bfloat16). A quantized cache (KIVI-style groups of ``q_group_size`` elements along the
    head dimension, one scale and one zero point per group)::

        data_bits / 8 + 2 * element_bytes / q_group_size

    with ``data_bits = nbits``, except HQQ's 3 bits, which packs ten values into one 32-bit
    word (3.2 bits). The scale and the zero point are stored in the cache's dtype: quanto's
    ``MaxOptimizer`` returns ``scale`` and ``shift`` in the dtype of the tensor it
    quantizes, and HQQ casts its ``scale`` and ``zero`` to ``compute_dtype``, the cache's
    dtype (``transformers.cache_utils.HQQQuantizedLayer``); measured on optimum-quanto 0.2.7
    and hqq 0.2.8 (float32: 0.625 bytes at 4 bits and 0.375 at 2 bits, groups of 64).
    Every prompt token is stored quantized (the prompt cache is quantized whole on the first
    forward after the prefill); the full-precision residual (at most ``residual_length``
    newest tokens) holds generated tokens only and is not counted. The KV bytes per prompt
    token of a point are then ``retention * elements_per_token * kv_bytes_per_element``,
    ``elements_per_token = layers * kv_heads * head_dim * 2`` (keys and values) over the
    full-attention layers; a model's sliding-window layers add their uncompressed
    ``min(prompt_len, sliding_window - 1) / prompt_len * sliding_elements_per_token``.

    A llama.cpp cache (``backend: llama_cpp``) stores ``type_k`` and ``type_v`` blocks of
    :data:`GGML_BITS` bits per element, scales included, whatever the model's dtype: the mean of
    the two over 8 (f16: 2 bytes, q8_0: 1.0625, q4_0: 0.5625).

    Parameters
    ----------
    cache : mapping or None
        ``backend``, ``nbits`` and ``q_group_size`` of a quantized cache, or ``backend: llama_cpp``
        with ``type_k`` and ``type_v``; None for full precision.
    element_bytes : float
        Bytes of one full-precision element (the model's dtype).

    Returns
    -------
    float
        Bytes per element.
    """
    if cache is None:
        return float(element_bytes)
    if cache["backend"] == "llama_cpp":
        return ggml_bits(cache["type_k"], cache["type_v"]) / 8
    bits = 3.2 if (cache["backend"], int(cache["nbits"])) == ("hqq", 3) else float(cache["nbits"])
    return bits / 8 + 2.0 * float(element_bytes) / int(cache["q_group_size"])
