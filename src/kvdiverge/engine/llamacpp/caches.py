"""llama.cpp KV cache policies: the cache types of K and V, the Hadamard rotation, flash attention.

A policy is a :class:`LlamaCache`; :func:`parse_cache` reads the command line's spelling
(``q4_0``, ``q4_0/q8_0`` for K/V, a ``:norot`` suffix for rotation off). Nothing here imports
``llama_cpp``: :func:`require_llama_cpp` does, and says in one sentence how to install it.

Rotation: since llama.cpp PR #21038 a quantized KV cache of a head dimension divisible by 64 is
stored Hadamard-rotated; the library reads the environment variable ``LLAMA_ATTN_ROT_DISABLE``
when a context's KV cache is built, so :mod:`kvdiverge.engine.llamacpp.pair` sets it around each
context's creation and each context keeps its own setting.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from kvdiverge.estimation.kv_bytes import GGML_BITS

__all__ = ["CACHE_TYPES", "INSTALL", "LlamaCache", "parse_cache", "require_llama_cpp"]

#: The KV cache types a policy may name, with their bits per element (ggml's block sizes, scales included).
CACHE_TYPES: dict[str, float] = GGML_BITS

#: How to install the backend, in the words every door uses.
INSTALL = (
    "the llama_cpp backend needs llama-cpp-python: install it with `pip install kvdiverge[llamacpp]` "
    "or `make llamacpp` (a source build of about 8-16 minutes on 2 cores; pip's wheel cache makes a rebuild free)"
)


@dataclass(frozen=True)
class LlamaCache:
    """One llama.cpp KV cache policy.

    Parameters
    ----------
    type_k, type_v : str
        Cache types of K and V, keys of :data:`CACHE_TYPES`.
    rotation : bool
        The Hadamard rotation of a quantized cache (llama.cpp's default, on); off sets
        ``LLAMA_ATTN_ROT_DISABLE=1`` for this context only.

    Raises
    ------
    ValueError
        A cache type outside :data:`CACHE_TYPES`, named with its value.
    """

    type_k: str = "f16"
    type_v: str = "f16"
    rotation: bool = True

    def __post_init__(self) -> None:
        for key in ("type_k", "type_v"):
            value = getattr(self, key)
            if value not in CACHE_TYPES:
                raise ValueError(f"{key} must be one of {', '.join(CACHE_TYPES)}, got {value!r}")

    @property
    def name(self) -> str:
        """The policy's name in the tables: ``q4_0``, ``q4_0/q8_0``, with ``:norot`` when rotation is off."""
        base = self.type_k if self.type_k == self.type_v else f"{self.type_k}/{self.type_v}"
        return base if self.rotation else f"{base}:norot"

    @property
    def flash_attn(self) -> bool:
        """Flash attention, on for every cache: llama.cpp needs it for a quantized V cache, and on the CPU the
        f16 cache without it gives a one-token decode other logits than a multi-token one (a log-probability
        apart by 0.3 on SmolLM2), which would make a rewound branch differ from a fresh evaluation."""
        return True

    @property
    def bits(self) -> float:
        """Mean bits per cached element over K and V."""
        return (CACHE_TYPES[self.type_k] + CACHE_TYPES[self.type_v]) / 2

    def describe(self) -> dict:
        """The cache as a frontier point's ``cache_settings``: ``backend: llama_cpp``, the types and the rotation
        (:func:`kvdiverge.estimation.kv_bytes.kv_bytes_per_element` reads the types)."""
        return {"backend": "llama_cpp", "type_k": self.type_k, "type_v": self.type_v, "rotation": self.rotation}


def parse_cache(spec: str) -> LlamaCache:
    """A policy from its spelling: ``TYPE``, ``TYPE_K/TYPE_V``, either with ``:norot`` (rotation off).

    Raises
    ------
    ValueError
        An unknown type or suffix, in one sentence naming ``--cache`` and the value.
    """
    text, _, suffix = str(spec).partition(":")
    if suffix not in ("", "norot", "rot"):
        raise ValueError(f"--cache {spec!r}: the suffix must be :rot or :norot, got {suffix!r}")
    k, _, v = text.partition("/")
    if k not in CACHE_TYPES or (v and v not in CACHE_TYPES):
        raise ValueError(f"--cache {spec!r}: cache types must be among {', '.join(CACHE_TYPES)}")
    return LlamaCache(type_k=k, type_v=v or k, rotation=suffix != "norot")


def require_llama_cpp() -> ModuleType:
    """The ``llama_cpp`` module.

    Raises
    ------
    ModuleNotFoundError
        Without it, with :data:`INSTALL`.
    """
    try:
        return importlib.import_module("llama_cpp")
    except ImportError as exc:
        raise ModuleNotFoundError(INSTALL) from exc
