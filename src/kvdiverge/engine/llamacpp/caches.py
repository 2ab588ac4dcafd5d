"""llama.cpp KV cache policies: the cache types of K and V, the Hadamard rotation, flash attention.

A policy is a :class:`LlamaCache`; :func:`parse_cache` reads the command line's spelling
(``q4_0``, ``q4_0/q8_0`` for K/V, a ``:norot`` suffix for rotation off), :func:`cache_from_entry` a
config's (``{cache: llama_cpp, type_k: q4_0, type_v: q4_0, rotation: false}``). The sentences in which
every door refuses what the backend does not run are here too (:func:`not_run_sentence`,
:func:`refused_policy`, :func:`penalty_problem`), so that the config check says what the engine says.
Nothing here imports torch or ``llama_cpp``: :func:`require_llama_cpp` does, and says in one sentence how
to install it.

Rotation: since llama.cpp PR #21038 a quantized KV cache of a head dimension divisible by 64 is
stored Hadamard-rotated; the library reads the environment variable ``LLAMA_ATTN_ROT_DISABLE``
when a context's KV cache is built, so :mod:`kvdiverge.engine.llamacpp.pair` sets it around each
context's creation and each context keeps its own setting.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from kvdiverge.estimation.kv_bytes import GGML_BITS, ggml_bits

__all__ = [
    "CACHE_TYPES",
    "CONFIG_CACHE",
    "ENTRY_KEYS",
    "INSTALL",
    "NOT_RUN",
    "LlamaCache",
    "cache_from_entry",
    "is_cache_entry",
    "not_run_sentence",
    "parse_cache",
    "penalty_problem",
    "refused_policy",
    "require_llama_cpp",
]

#: The KV cache types a policy may name, with their bits per element (ggml's block sizes, scales included).
CACHE_TYPES: dict[str, float] = GGML_BITS

#: How to install the backend, in the words every door uses.
INSTALL = (
    "the llama_cpp backend needs llama-cpp-python: install it with `pip install kvdiverge[llamacpp]` "
    "or `make llamacpp` (a source build of about 8-16 minutes on 2 cores; pip's wheel cache makes a rebuild free)"
)

#: The ``cache:`` value of a config's policy entry that is a llama.cpp cache.
CONFIG_CACHE = "llama_cpp"
#: The keys of such an entry (:func:`cache_from_entry`).
ENTRY_KEYS = ("cache", "type_k", "type_v", "rotation")

#: What the llama_cpp backend does not run, by its kind: each door names it by its own option or config key.
NOT_RUN = {
    "frontier": "a frontier of ratios or budgets (kvpress presses)",
    "quanto": "a frontier of quanto caches",
    "task": "a task",
    "teacher": "the teacher-forced pass",
    "prediction": "the prediction study (a frontier's task sides)",
}


def not_run_sentence(key: str, kind: str, beside: str) -> str:
    """The refusal of ``key``, a door's option or config key that asks for what the backend does not run
    (``kind``, a key of :data:`NOT_RUN`), beside ``beside`` (what makes it the llama_cpp backend)."""
    return (
        f"{key}: the llama_cpp backend runs the coupled measurement of KV cache types, not {NOT_RUN[kind]}; "
        f"leave {key} out with {beside}"
    )


def refused_policy(what: str, where: str = "the llama_cpp backend") -> str:
    """The refusal of a policy that is no llama.cpp cache (``what``: the policy, its press) on ``where``."""
    return (
        f"{what} cannot run on {where}: it measures KV cache types ({', '.join(CACHE_TYPES)}), "
        "not kvpress presses or quanto caches"
    )


def penalty_problem(key: str, value: float) -> str | None:
    """The refusal of a repetition penalty ``value`` (``key`` as the door spells it), or None for 1 (none)."""
    if value == 1:
        return None
    return f"{key} {value!r} is not supported by the llama_cpp backend; allowed: 1"


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
        return ggml_bits(self.type_k, self.type_v)

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


def is_cache_entry(entry: Any) -> bool:
    """True for a config's policy entry that is a llama.cpp cache (``cache: llama_cpp``)."""
    return isinstance(entry, Mapping) and entry.get("cache") == CONFIG_CACHE


def cache_from_entry(entry: Mapping[str, Any]) -> LlamaCache:
    """The :class:`LlamaCache` of a config's policy entry: ``type_k`` and ``type_v`` (each ``f16`` when
    absent), ``rotation`` (on when absent).

    Raises
    ------
    ValueError
        A cache type outside :data:`CACHE_TYPES` (the schema refuses it first).
    """
    return LlamaCache(
        type_k=str(entry.get("type_k", "f16")),
        type_v=str(entry.get("type_v", "f16")),
        rotation=bool(entry.get("rotation", True)),
    )


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
