"""The transformers internals kvdiverge uses, in one module.

The engine reaches below transformers' documented API: it registers an attention function and
its mask builder (``AttentionInterface``, ``AttentionMaskInterface``), subclasses the cache
layers (``CacheLayerMixin``, ``HQQQuantizedLayer``'s private ``_quantize``), calls the
Llama modelling helpers, switches a config's private ``_attn_implementation``, reads the
``cache_position`` an attention module receives, and the model loader silences a private
progress bar of the GGUF reader. Every such name is imported here and only here; the rest of
the package imports it from this module. :data:`INTERNALS` names each one with its use.

Tested with transformers :data:`TESTED_TRANSFORMERS` (kvpress 0.5.5 requires transformers
< 5.3; ``pyproject.toml``). When a transformers release moves one of these names, importing
this module raises :class:`ImportError` with one sentence per moved name, saying what it is
used for, instead of an ``AttributeError`` deep inside a run; ``tests/test_hf_internals.py``
checks each name (and the behaviour behind it) by name.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

#: The transformers version the test suite runs on (``constraints.txt``).
TESTED_TRANSFORMERS = "5.2.0"


@dataclass(frozen=True)
class Internal:
    """One transformers internal: where it lives and what kvdiverge uses it for.

    Parameters
    ----------
    module : str
        The module that defines it, e.g. ``"transformers.cache_utils"``.
    name : str
        Its attribute path in ``module``, dotted for a member (``"CacheLayerMixin.get_mask_sizes"``).
    use : str
        What kvdiverge does with it (a clause for the sentence of :meth:`problem`).
    parameter : str, optional
        A parameter the callable must take (``cache_position``).
    """

    module: str
    name: str
    use: str
    parameter: str | None = None

    @property
    def path(self) -> str:
        """The full dotted name, ``module.name``."""
        return f"{self.module}.{self.name}"

    def find(self) -> object:
        """The object itself.

        Raises
        ------
        ImportError
            If the module cannot be imported.
        AttributeError
            If the module has no such attribute (or member).
        """
        obj: object = importlib.import_module(self.module)
        for part in self.name.split("."):
            obj = getattr(obj, part)
        return obj

    def problem(self) -> str | None:
        """One sentence when this transformers lacks the internal (or the parameter); else ``None``."""
        import transformers

        where = f"transformers {transformers.__version__} (tested: {TESTED_TRANSFORMERS})"
        try:
            obj = self.find()
        except (ImportError, AttributeError):
            return f"{where} has no {self.path}, which kvdiverge uses {self.use}"
        if self.parameter is not None:
            try:
                params = inspect.signature(obj).parameters
            except (TypeError, ValueError):
                params = {}
            if self.parameter not in params:
                return f"{where}: {self.path} takes no {self.parameter!r}, which kvdiverge uses {self.use}"
        return None


_CU = "transformers.cache_utils"
_LLAMA = "transformers.models.llama.modeling_llama"

#: Every transformers internal kvdiverge uses, with its use.
INTERNALS: tuple[Internal, ...] = (
    Internal("transformers", "AttentionInterface", "to register the grouped decoding attention (engine.llm.attention)"),
    Internal(
        "transformers.masking_utils",
        "AttentionMaskInterface",
        "to register the mask builder of the grouped decoding attention (engine.llm.attention)",
    ),
    Internal("transformers.masking_utils", "sdpa_mask", "as the grouped decoding attention's mask builder"),
    Internal(
        "transformers.masking_utils",
        "create_causal_mask",
        "to build a mixed-attention model's masks by layer type, the window by position (engine.presses.layer_types)",
        parameter="and_mask_function",
    ),
    Internal(
        "transformers.integrations.sdpa_attention",
        "sdpa_attention_forward",
        "for every attention call the grouped decoding attention does not handle itself",
    ),
    Internal(
        "transformers.modeling_utils",
        "ALL_ATTENTION_FUNCTIONS",
        "to check that a model's attention function carries kvpress's per-head mask patch",
    ),
    Internal(
        "transformers",
        "PretrainedConfig._attn_implementation",
        "to read and switch a model's attention implementation (engine.llm.side, engine.llm.attention)",
    ),
    Internal(_LLAMA, "repeat_kv", "to compute the attention weights of a prefill that needs them (engine.llm.prefill)"),
    Internal(_LLAMA, "rotate_half", "to apply RoPE to the queries of that prefill (engine.llm.prefill)"),
    Internal(
        _LLAMA,
        "LlamaAttention.forward",
        "as the prefill/decoding test of the presses' forward hooks (kvpress, SlidingWindowPress)",
        parameter="cache_position",
    ),
    Internal("transformers", "DynamicCache", "as both sides' KV cache"),
    Internal(_CU, "Cache", "to build caches from the engine's own layers (Cache(layers=...))", parameter="layers"),
    Internal(_CU, "CacheLayerMixin", "as the base class of the capacity layer (engine.llm.cache)"),
    Internal(_CU, "CacheLayerMixin.lazy_initialization", "as a method the capacity layer overrides"),
    Internal(
        _CU,
        "CacheLayerMixin.get_mask_sizes",
        "as a method the capacity layer overrides",
        parameter="cache_position",
    ),
    Internal(_CU, "DynamicLayer", "to tell the plain layers a quantized cache may replace"),
    Internal(_CU, "QuantizedLayer", "to tell the layers already quantized"),
    Internal(_CU, "QuantoQuantizedLayer", "as the quanto quantized cache's layer"),
    Internal(_CU, "HQQQuantizedLayer", "as the base of the row-wise HQQ quantized layer"),
    Internal(_CU, "HQQQuantizedLayer._quantize", "as the private method the row-wise HQQ layer overrides"),
    Internal(_CU, "HQQQuantizedLayer._dequantize", "as the private method the row-wise HQQ layer overrides"),
    Internal(
        "transformers.convert_slow_tokenizer",
        "generate_merges",
        "to rebuild the merges of a Gemma GGUF file's tokenizer (models.gguf_tokenizer)",
    ),
    Internal(
        "transformers.modeling_gguf_pytorch_utils",
        "tqdm",
        "to silence the GGUF reader's progress bar while loading a .gguf model (models.loading)",
    ),
)


def problems() -> list[str]:
    """One sentence for each internal of :data:`INTERNALS` this transformers lacks; empty when all are there."""
    return [p for p in (i.problem() for i in INTERNALS) if p is not None]


_MISSING = problems()
if _MISSING:
    raise ImportError(
        "kvdiverge cannot use this transformers: "
        + "; ".join(_MISSING)
        + ". Install the tested versions: pip install -c constraints.txt kvdiverge (docs/install.md)."
    )

import transformers.modeling_gguf_pytorch_utils as gguf_reader  # noqa: E402  (the module whose tqdm is replaced)
from transformers import (  # noqa: E402
    CONFIG_MAPPING,  # noqa: F401  (kvdiverge.models.gguf_config)
    AttentionInterface,
    DynamicCache,
)
from transformers.cache_utils import (  # noqa: E402
    Cache,
    CacheLayerMixin,
    DynamicLayer,
    HQQQuantizedLayer,
    QuantizedLayer,
    QuantoQuantizedLayer,
)
from transformers.convert_slow_tokenizer import generate_merges  # noqa: E402
from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING  # noqa: E402,F401
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, create_causal_mask, sdpa_mask  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402
from transformers.models.llama.modeling_llama import repeat_kv, rotate_half  # noqa: E402

__all__ = [
    "ALL_ATTENTION_FUNCTIONS",
    "INTERNALS",
    "TESTED_TRANSFORMERS",
    "AttentionInterface",
    "AttentionMaskInterface",
    "Cache",
    "CacheLayerMixin",
    "DynamicCache",
    "DynamicLayer",
    "HQQQuantizedLayer",
    "Internal",
    "QuantizedLayer",
    "QuantoQuantizedLayer",
    "create_causal_mask",
    "generate_merges",
    "gguf_reader",
    "problems",
    "repeat_kv",
    "rotate_half",
    "sdpa_attention_forward",
    "sdpa_mask",
]
