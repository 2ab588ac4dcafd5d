"""Every press kvdiverge can be asked to measure: its status, what it needs, a test instance.

One row per press class that ``kvpress`` exports (read from ``kvpress.__all__`` at import,
so a new kvpress release adds its presses by itself, as measured prefill presses until a
row here says otherwise) and per project press (:data:`kvdiverge.engine.presses.project.PROJECT_PRESSES`).
A row is data, never a code path:

- ``needs``: engine capabilities the press needs (:data:`CAPABILITIES`); a press whose
  capability the engine lacks is refused with that capability's sentence
  (:data:`CAPABILITY_SENTENCES`). ``needs_if`` adds a capability while a parameter is set
  (``DMSPress(decoding=True)``, ``PrefillDecodingPress(decoding_press=...)``).
- ``refused``: one sentence saying what the press needs that kvdiverge cannot give it
  (a hub file, a model it was trained for, a reloadable tokenizer).
- ``required``: parameters without which kvpress fails; the press is refused, with the
  sentence, while one is unset.
- ``settable``: attributes that kvpress sets after construction (``init=False``) and that a
  policy may give as parameters (Finch's ``delimiter_token_id``).
- ``global_rng``: the press draws from torch's global random generator (no seed of its own);
  the engine seeds that generator per document prefill (:func:`kvdiverge.engine.llm.prefill.seeded`),
  so a document keeps the same positions alone or in a batch, and from run to run.
- ``config_attributes``: attributes of the model's config that the press reads (a model
  whose config lacks one is refused once the model is known).
- ``per_layer_list``: a parameter holding one value per layer (checked against the model's
  ``num_hidden_layers`` once the model is known).
- ``takes_ratio``: False for a press whose own parameter replaces the policy's
  ``compression_ratio`` (``PerLayerCompressionPress``'s ``compression_ratios``).
- ``note``: one sentence on how kvdiverge measures the press, where that departs from the
  plain prefill path (added to its README row).
- ``test_params``: parameters of the press matrix's test instance (``tests/test_press_matrix.py``);
  nested presses are specs ``{"press": Name, **params}``. Required inner presses default to
  :data:`INNER_TEST_PRESS`.

:func:`refusal` walks a built press and every press it wraps. Policies
(:mod:`kvdiverge.engine.presses.policies`) refuse before any work: at config validation, in
``kvdiverge.measure``'s argument checks and while the command line is parsed.
:mod:`kvdiverge.engine.presses.status` builds each row's test instance, says its status and
renders the README's press table from these rows.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import kvpress
from kvpress.presses.duo_attention_press import PATTERNS_DICT

from kvdiverge.engine.presses.project import PROJECT_PRESSES

__all__ = ["CAPABILITIES", "PENDING", "PressRow", "ROWS", "nested_presses", "refusal"]

#: What the engine can do for a press. Flip one value when the engine gains the capability.
CAPABILITIES: dict[str, bool] = {
    "head-wise": True,     # masks keys per key-value head (module.masked_key_indices)
    "per-layer": True,     # layers keep different counts
    "eager": True,         # the evicted prefill runs in eager attention (attention weights)
    "decode-time": True,   # evicts during decoding, not only at prefill (engine.decode_pair)
    "channels": True,      # prunes key channels and keeps every position (its promise: all positions)
}

#: Capabilities marked True above whose engine code is not on this branch yet: the press
#: matrix expects the presses needing them to fail (``xfail``). Empty once the engine lands.
PENDING: frozenset[str] = frozenset()

#: The refusal of a press needing a capability the engine lacks (``{press}``: its class name).
CAPABILITY_SENTENCES: dict[str, str] = {
    "head-wise": "{press} evicts per key-value head by masking keys; kvdiverge refuses it until the "
                 "head-wise engine is built.",
    "per-layer": "{press} keeps a different number of positions per layer; kvdiverge refuses it until "
                 "per-layer budgets are built.",
    "eager": "{press} reads the attention weights, which only eager attention returns: set the model's "
             "`attn_implementation: eager` in the config (attn_implementation='eager' when loading it).",
    "channels": "{press} prunes key channels and keeps every position; kvdiverge refuses it until the "
                "engine checks that promise.",
    "decode-time": "{press} evicts during decoding; kvdiverge refuses it until decode-time eviction is "
                   "built (measured at prefill only, it would show no divergence at all).",
}

#: The inner press of wrappers in test instances (a score-based press with a short window).
INNER_TEST_PRESS: dict[str, Any] = {"press": "SnapKVPress", "window_size": 8, "kernel_size": 3}

#: Parameters whose value is another press (or a list of presses) in kvpress's wrappers.
PRESS_PARAMETERS = ("press", "base_press", "prefilling_press", "decoding_press", "presses")

_HUB_COPY = "offline, a copy in the Hugging Face cache (HF_HUB_CACHE) read with HF_HUB_OFFLINE=1"
_DUO_MODELS = ", ".join(sorted(PATTERNS_DICT))
_REFUSED_KVZIP = ("{press} reloads the tokenizer with AutoTokenizer.from_pretrained(model.config.name_or_path) "
                  "and replays the context through the model, so it needs a model loaded from a hub id or a "
                  "directory with tokenizer files (an in-memory or GGUF model fails with a bare ImportError) "
                  "and the head-wise engine.")


@dataclass(frozen=True)
class PressRow:
    """What kvdiverge knows of one press class (see the module docstring for each field)."""

    name: str
    needs: tuple[str, ...] = ()
    needs_if: Mapping[str, str] = field(default_factory=dict)
    refused: str | None = None
    required: Mapping[str, str] = field(default_factory=dict)
    settable: tuple[str, ...] = ()
    takes_ratio: bool = True
    global_rng: bool = False
    config_attributes: tuple[str, ...] = ()
    per_layer_list: str | None = None
    note: str | None = None
    test_params: Mapping[str, Any] = field(default_factory=dict)


_SPECIAL: dict[str, dict[str, Any]] = {
    "AdaKVPress": {"needs": ("head-wise",)},
    "CriticalAdaKVPress": {"needs": ("head-wise",), "config_attributes": ("head_dim",),
                           "test_params": {"press": INNER_TEST_PRESS}},
    "CriticalKVPress": {"config_attributes": ("head_dim",)},
    "KVComposePress": {"needs": ("head-wise", "per-layer")},
    "PyramidKVPress": {"needs": ("per-layer",), "test_params": {"window_size": 8, "kernel_size": 3}},
    "PerLayerCompressionPress": {"needs": ("per-layer",), "takes_ratio": False, "per_layer_list": "compression_ratios",
                                 "test_params": {"press": INNER_TEST_PRESS, "compression_ratios": [0.25, 0.75]}},
    "DMSPress": {
        "needs": ("head-wise",), "needs_if": {"decoding": "decode-time"}, "takes_ratio": False,
        "required": {"threshold": "DMSPress evicts the keys scored below a threshold and has none by default: "
                                  "give params.threshold (kvpress otherwise fails with TypeError: '<' not "
                                  "supported between Tensor and NoneType)."},
        "test_params": {"press": {"press": "KnormPress"}, "threshold": -0.45, "sliding_window_size": 8}},
    "ObservedAttentionPress": {"needs": ("eager",)},
    "LeverageScorePress": {"global_rng": True},
    "CompactorPress": {"global_rng": True},
    "RandomPress": {"test_params": {"seed": 0}},
    "SnapKVPress": {"test_params": {"window_size": 8, "kernel_size": 3}},
    "ThinKPress": {"needs": ("channels",), "test_params": {"key_channel_compression_ratio": 0.5, "window_size": 8}},
    "SimLayerKVPress": {"needs": ("per-layer",), "test_params": {"lazy_threshold": 0.5, "n_recent": 16, "n_initial": 4}},
    "DecodingPress": {"needs": ("decode-time",), "test_params": {"base_press": {"press": "KnormPress"}}},
    "SlidingWindowPress": {"needs": ("decode-time",)},
    "CompressionRatioDecodingPress": {"needs": ("decode-time",),
                                      "test_params": {"base_press": {"press": "KnormPress"}}},
    "CAMPress": {"needs": ("decode-time",), "test_params": {"base_press": {"press": "KnormPress"}},
                 "refused": "CAMPress draws its merge mask from torch's global random generator once for all "
                            "rows of a batch, so its evicted kernel is not a function of the history and a "
                            "branch cannot be replayed exactly."},
    "PrefillDecodingPress": {
        "needs_if": {"decoding_press": "decode-time"},
        "test_params": {"prefilling_press": INNER_TEST_PRESS,
                        "decoding_press": {"press": "DecodingPress", "base_press": {"press": "KnormPress"}}}},
    "KeyRerotationPress": {"note": "it re-rotates the kept keys to the compacted positions, so on the evicted side "
                                   "generated tokens take RoPE positions from the compressed cache length, as in "
                                   "kvpress's pipeline (the reference side from the prompt length)."},
    "FinchPress": {
        "note": "with rerotate_keys (its default) generated tokens on the evicted side take RoPE positions from the "
                "compressed cache length, as in kvpress's pipeline.",
        "settable": ("delimiter_token_id",),
        "required": {"delimiter_token_id": "FinchPress needs the id of a delimiter token that separates "
                                           "context and question, once in every prompt: give it as "
                                           "params.delimiter_token_id (FinchPress(delimiter_token_id=ID) on "
                                           "the command line)."}},
    "ExpectedAttentionStatsPress": {
        "required": {"stats_folder": "ExpectedAttentionStatsPress needs precomputed query statistics: give "
                                     "the local folder written by `python -m kvpress.presses."
                                     "expected_attention_with_stats --model_name <model>` as "
                                     "params.stats_folder (without it they come from the hub collection "
                                     "alessiodevoto/expectedattentionstats)."}},
    "RestoreKVPress": {"refused": "RestoreKVPress needs the hub repository higokri/RestoreKV-<model name> "
                                  "(restore_embeddings.safetensors and a LoRA adapter, published for "
                                  "Llama-3.1-8B-Instruct and Qwen3-8B), found by the model's name_or_path; "
                                  f"{_HUB_COPY}."},
    "QFilterPress": {"refused": "QFilterPress needs the learned filters of the hub repository "
                                "nthngdy/<model name>_qfilt, found by the model's name_or_path; "
                                f"{_HUB_COPY}."},
    "KVzapPress": {"refused": "KVzapPress needs the surrogate model of the hub repository "
                              "nvidia/KVzap-<model_type>-<model name> (model_type mlp or linear), found by the "
                              f"model's name_or_path; {_HUB_COPY}."},
    "FastKVzipPress": {"refused": "FastKVzipPress needs the gate weights <model name>/q<group>_dim16_sink16.pt "
                                  "of the hub repository Jang-Hyun/Fast-KVzip and the model's config by "
                                  f"AutoConfig.from_pretrained(name_or_path); {_HUB_COPY}."},
    "LUKVPress": {"refused": "LUKVPress needs a per-layer, per-head budget curve (.npy of shape [99, layers, "
                             "kv heads]) listed in kvpress.presses.lukv_press.BUDGET_CURVE_URLS for the model's "
                             "name_or_path and scorer (only meta-llama/Llama-3.1-8B-Instruct with "
                             "ExpectedAttentionPress), fetched over HTTP with no offline copy."},
    "DuoAttentionPress": {"refused": "DuoAttentionPress needs per-head attention patterns, fetched over HTTP "
                                     "from github.com/mit-han-lab/duo-attention and published only for "
                                     f"{_DUO_MODELS} (on_the_fly_scoring needs the kmfoda/booksum dataset "
                                     "from the hub instead)."},
    "KVzipPress": {"refused": _REFUSED_KVZIP.format(press="KVzipPress")},
    "KVgradPress": {"refused": _REFUSED_KVZIP.format(press="KVgradPress")},
}


def _press_classes() -> dict[str, type]:
    """Project presses, then every ``kvpress.__all__`` press class but the two bases."""
    out: dict[str, type] = dict(PROJECT_PRESSES)
    for name in kvpress.__all__:
        cls = getattr(kvpress, name, None)
        if (isinstance(cls, type) and issubclass(cls, kvpress.BasePress)
                and cls not in (kvpress.BasePress, kvpress.ScorerPress)):
            out[name] = cls
    return out


def _default_test_params(cls: type) -> dict[str, Any]:
    """An inner press for every press-valued parameter without a default (or with default None)."""
    params: dict[str, Any] = {}
    for name, p in inspect.signature(cls).parameters.items():
        if name in PRESS_PARAMETERS and (p.default is inspect.Parameter.empty or p.default is None):
            params[name] = [INNER_TEST_PRESS] if name == "presses" else INNER_TEST_PRESS
    return params


def _row(name: str, cls: type) -> PressRow:
    special = dict(_SPECIAL.get(name, {}))
    special["test_params"] = {**_default_test_params(cls), **special.get("test_params", {})}
    return PressRow(name=name, **special)


#: Every press class kvdiverge knows, by class name.
PRESS_CLASSES: dict[str, type] = _press_classes()
#: One row per press class, by class name.
ROWS: dict[str, PressRow] = {name: _row(name, cls) for name, cls in PRESS_CLASSES.items()}


def nested_presses(press) -> list:
    """``press`` and every press it wraps (press-valued attributes, :data:`PRESS_PARAMETERS`)."""
    out, todo = [], [press]
    while todo:
        p = todo.pop(0)
        out.append(p)
        for attr in PRESS_PARAMETERS:
            inner = getattr(p, attr, None)
            for q in inner if isinstance(inner, (list, tuple)) else [inner]:
                if isinstance(q, kvpress.BasePress) and q is not p:
                    todo.append(q)
    return out


def refusal(press, model=None) -> str | None:
    """Why kvdiverge refuses ``press`` (one sentence), or ``None`` when it can measure it.

    Walks ``press`` and every press it wraps (:func:`nested_presses`); a class without a
    row (a user's own press) is measured as a prefill press. With ``model`` (a
    ``transformers`` model), also the config attributes the press reads.
    """
    from kvdiverge.engine.presses.quantized import QuantizedCachePress, refusal as quantized_refusal

    for p in nested_presses(press):
        if isinstance(p, QuantizedCachePress):
            reason = quantized_refusal(p.spec, model)
            if reason:
                return reason
            continue
        row = ROWS.get(type(p).__name__)
        if row is None:
            continue
        if row.refused:
            return row.refused
        for param, sentence in row.required.items():
            if getattr(p, param, None) is None:
                return sentence
        caps = list(row.needs) + [c for a, c in row.needs_if.items() if getattr(p, a, None) not in (None, False)]
        for cap in caps:
            if not CAPABILITIES.get(cap, False):
                return CAPABILITY_SENTENCES[cap].format(press=row.name)
        reason = _model_refusal(row, p, getattr(model, "config", None))
        if reason:
            return reason
    return None


def _model_refusal(row: PressRow, press, config) -> str | None:
    """What the model's config tells against ``press`` (``None`` without a config)."""
    if config is None:
        return None
    for attr in row.config_attributes:
        if not hasattr(config, attr):
            return (f"{row.name} reads model.config.{attr}, which this model's {type(config).__name__} "
                    f"does not have (kvpress would fail with AttributeError).")
    values, layers = getattr(press, row.per_layer_list or "", None), getattr(config, "num_hidden_layers", None)
    if row.per_layer_list and values is not None and layers is not None and len(values) != layers:
        return (f"{row.name} needs one value per layer in {row.per_layer_list}: it has {len(values)}, "
                f"the model has {layers} layers.")
    return None



