"""The press catalogue: what the config check, the planner and the cost model know of each press, without torch.

One :class:`PressRecord` per press class kvdiverge measures or refuses (every press ``kvpress`` exports and
the project's own, :data:`kvdiverge.engine.presses.project.PROJECT_PRESSES`), by class name in
:data:`CATALOGUE`, in kvpress's style (one small frozen dataclass per press): the constructor's parameters,
whether it takes the policy's compression ratio (a budget is that ratio per prompt), keeps every position,
evicts while decoding, re-rotates kept keys or gets a prefill of its own, the sentence it is refused with,
and the defaults the minimum prompt length reads. The functions below answer the config's questions of a
policy entry from the records alone (:func:`entry_problem`, :func:`takes_ratio`, :func:`min_prompt_tokens`,
:func:`is_decode_time`, :func:`shares_prefill`, :func:`question_after_problem`, :func:`sliding_refusal`),
in the sentences of the engine, which asks the same of a built press (:mod:`kvdiverge.engine.presses.registry`).

Importing it loads neither torch, transformers nor kvpress (the engine's packages import nothing), so every
Snakemake job's parse checks the config without them. The records cannot say what kvpress's own checks of a
value (an ``assert`` in a press's ``__post_init__``) refuse: the engine builds each press for that
(:meth:`kvdiverge.engine.presses.policies.Policy.from_config`). ``tests/test_catalogue.py`` holds each record
equal to the registry's reading of the real class (:func:`kvdiverge.engine.presses.registry.catalogue_record`)
and every press kvpress exports catalogued or refused (:data:`ABSTRACT`); a press of a user's module
(``module:Class``) gets its record from the engine the same way (:func:`register`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvdiverge.engine.presses.cache_facts import (
    QuantizedCacheSpec,
    backend_refusal,
    describe,
    has_sliding_layers,
    model_sliding_refusal,
)


@dataclass(frozen=True)
class PressRecord:
    """What the config check knows of one press class.

    Parameters
    ----------
    name : str
        The class name, as a policy's ``press`` names it.
    parameters : tuple of str
        The constructor's parameters (its signature), the only keys a policy entry may give
        besides ``settable``.
    settable : tuple of str
        Attributes kvpress sets after construction that a policy may give (Finch's ``delimiter_token_id``).
    takes_ratio : bool
        False for a press whose own parameter replaces the policy's compression ratio
        (``PerLayerCompressionPress``'s ``compression_ratios``); else it takes the ratio when
        ``compression_ratio`` is among its parameters, or through the first press it wraps that does.
    keeps_every_position : bool
        The press keeps every prompt position (``PermutationPress``): it takes neither ratio nor budget.
    decode_time, rerotates : bool or str
        The press evicts while decoding / re-rotates kept keys: True, False, or the parameter that
        makes it so while set (its default in ``defaults``).
    prefill : str
        ``"shared"``: one prefill forward gives both caches; ``"two"``: the reference side gets its own.
    engine : tuple of str
        Engine parts beyond plain prefill eviction: ``"head-wise"``, ``"per-layer"``, ``"channels"``.
    defaults : mapping
        Class defaults the facts read when an entry leaves them out: ``window_size``, ``n_sink``
        (:func:`min_prompt_tokens`) and the parameters named by ``decode_time`` / ``rerotates``.
    refused : str or None
        The sentence the press is refused with (what it needs that kvdiverge cannot give it).
    required : mapping of str to str
        Parameters without which kvpress fails, each with the sentence it is refused with while unset.
    """

    name: str
    parameters: tuple[str, ...]
    settable: tuple[str, ...] = ()
    takes_ratio: bool = True
    keeps_every_position: bool = False
    decode_time: bool | str = False
    rerotates: bool | str = False
    prefill: str = "shared"
    engine: tuple[str, ...] = ()
    defaults: Mapping[str, Any] = field(default_factory=dict)
    refused: str | None = None
    required: Mapping[str, str] = field(default_factory=dict)

    def holds(self, flag: bool | str, params: Mapping[str, Any]) -> bool:
        """A flag of this record (``decode_time``, ``rerotates``) on a press given ``params``: the bool
        itself, or whether the named parameter is set (its default when the entry leaves it out)."""
        if not isinstance(flag, str):
            return bool(flag)
        got = params.get(flag, self.defaults.get(flag))
        return got is not None and got is not False


# --------------------------------------------------------------------------- the sentences of the refused presses

_HUB_COPY = "kvdiverge refuses it whether or not a copy is in the Hugging Face cache (HF_HUB_CACHE, HF_HUB_OFFLINE=1 changes nothing)"
_REPLAY = (
    "{press} reloads the tokenizer with AutoTokenizer.from_pretrained(model.config.name_or_path) "
    "and replays the context through the model, so it needs a model loaded from a hub id or a "
    "directory with tokenizer files (an in-memory or GGUF model fails with a bare ImportError)."
)
#: The models DuoAttentionPress finds patterns for (kvpress's ``PATTERNS_DICT``; tests/test_catalogue.py reads it).
_DUO_MODELS = (
    "meta-llama/Meta-Llama-3.1-8B-Instruct, mistralai/Mistral-7B-Instruct-v0.2, mistralai/Mistral-7B-Instruct-v0.3, "
    "togethercomputer/Llama-2-7B-32K-Instruct"
)
_DUO_UNREACHABLE = "gradientai/Llama-3-8B-Instruct-Gradient-1048k and gradientai/Llama-3-8B-Instruct-Gradient-4194k"
_REFUSED = {
    "CAMPress": "CAMPress draws its merge mask from torch's global random generator once for all rows of a batch, "
    "so its evicted kernel is not a function of the history and a branch cannot be replayed exactly.",
    "DuoAttentionPress": "DuoAttentionPress needs per-head attention patterns, fetched over HTTP from "
    f"github.com/mit-han-lab/duo-attention and published only for {_DUO_MODELS} (on_the_fly_scoring needs the "
    f"kmfoda/booksum dataset from the hub instead); kvpress lists {_DUO_UNREACHABLE} under ids with a double "
    "slash, which no model's name_or_path matches.",
    "FastKVzipPress": "FastKVzipPress needs the gate weights <model name>/q<group>_dim16_sink16.pt of the hub "
    "repository Jang-Hyun/Fast-KVzip and the model's config by AutoConfig.from_pretrained(name_or_path); "
    f"{_HUB_COPY}.",
    "KVgradPress": _REPLAY.format(press="KVgradPress"),
    "KVzapPress": "KVzapPress needs the surrogate model of the hub repository nvidia/KVzap-<model_type>-<model name> "
    f"(model_type mlp or linear), found by the model's name_or_path; {_HUB_COPY}.",
    "KVzipPress": _REPLAY.format(press="KVzipPress"),
    "LUKVPress": "LUKVPress needs a per-layer, per-head budget curve (.npy of shape [99, layers, kv heads]) listed "
    "in kvpress.presses.lukv_press.BUDGET_CURVE_URLS for the model's name_or_path and scorer (only "
    "meta-llama/Llama-3.1-8B-Instruct with ExpectedAttentionPress), fetched over HTTP with no offline copy.",
    "QFilterPress": "QFilterPress needs the learned filters of the hub repository nthngdy/<model name>_qfilt, "
    f"found by the model's name_or_path; {_HUB_COPY}.",
    "RestoreKVPress": "RestoreKVPress needs the hub repository higokri/RestoreKV-<model name> "
    "(restore_embeddings.safetensors and a LoRA adapter, published for Llama-3.1-8B-Instruct and Qwen3-8B), "
    f"found by the model's name_or_path; {_HUB_COPY}.",
}
_REQUIRED = {
    "DMSPress": {
        "threshold": "DMSPress evicts the keys scored below a threshold and has none by default: give "
        "params.threshold (kvpress otherwise fails with TypeError: '<' not supported between Tensor and NoneType)."
    },
    "ExpectedAttentionStatsPress": {
        "stats_folder": "ExpectedAttentionStatsPress needs precomputed query statistics: give the local folder "
        "written by `python -m kvpress.presses.expected_attention_with_stats --model_name <model>` as "
        "params.stats_folder (without it they come from the hub collection alessiodevoto/expectedattentionstats)."
    },
    "FinchPress": {
        "delimiter_token_id": "FinchPress needs the id of a delimiter token that separates context and question, "
        "once in every prompt: give it as params.delimiter_token_id (FinchPress(delimiter_token_id=ID) on the "
        "command line)."
    },
}

_ROTARY = "calls the layer's rotary embedding without a layer type, which a mixed-attention model's rotary needs"
#: Prefill presses that cannot run on the full-attention layers alone, with what fails: measured
#: on the Gemma 3 miniature (tests/test_press_matrix.py).
SLIDING_FAILS: dict[str, str] = {
    "CapPress": _ROTARY,
    "ExpectedAttentionPress": _ROTARY,
    "KVgradPress": _ROTARY,
    "KVComposePress": "runs its own prefill forward, which compresses the sliding-window layers too",
    "KVzipPress": "refuses Gemma 3 itself (kvpress: not supported for Gemma3ForCausalLM)",
    "SimLayerKVPress": "records one decision per hooked layer, not one per layer of the model",
}

# --------------------------------------------------------------------------- the records

_R = PressRecord
_SINK4 = {"n_sink": 4}
#: Every press kvdiverge knows, by class name: kvpress's exports (but its two abstract bases) and the project's.
CATALOGUE: dict[str, PressRecord] = {
    r.name: r
    for r in (
        _R("AdaKVPress", ("press", "alpha_safeguard"), engine=("head-wise",)),
        _R("BlockPress", ("press", "block_size")),
        _R("CAMPress", ("base_press", "compression_interval", "target_size", "hidden_states_buffer_size",
                        "merge_budget"), decode_time=True, refused=_REFUSED["CAMPress"]),
        _R("CURPress", ("compression_ratio", "num_sinks", "leverage_type", "use_random_leverage",
                        "use_local_approximation", "local_window_size")),
        _R("CapPress", ("compression_ratio", "tau", "n_future_positions", "n_sink", "epsilon"), defaults=_SINK4),
        _R("ChunkKVPress", ("press", "chunk_length")),
        _R("ChunkPress", ("press", "chunk_length")),
        _R("CompactorPress", ("compression_ratio", "sink_size_start", "sink_size_end", "chunk_size",
                              "sketch_dimension", "blending", "_leverage_press", "_non_causal_press")),
        _R("ComposedPress", ("presses",)),
        _R("CompressionRatioDecodingPress", ("base_press", "compression_interval", "hidden_states_buffer_size",
                                             "target_compression_ratio"), decode_time=True),
        _R("CriticalAdaKVPress", ("press", "alpha_safeguard", "epsilon", "first_stage_ratio"), engine=("head-wise",)),
        _R("CriticalKVPress", ("press", "epsilon", "first_stage_ratio")),
        _R("DMSPress", ("press", "threshold", "sliding_window_size", "decoding"), takes_ratio=False,
           decode_time="decoding", engine=("head-wise",), required=_REQUIRED["DMSPress"]),
        _R("DecodingPress", ("base_press", "compression_interval", "target_size", "hidden_states_buffer_size"),
           decode_time=True),
        _R("DuoAttentionPress", ("head_compression_ratio", "on_the_fly_scoring"),
           refused=_REFUSED["DuoAttentionPress"]),
        _R("EntropyGatedChunkKVPress", ("press", "chunk_length", "low_entropy_chunk_length")),
        _R("ExpectedAttentionPress", ("compression_ratio", "n_future_positions", "n_sink", "use_covariance",
                                      "use_vnorm", "epsilon"), defaults=_SINK4),
        _R("ExpectedAttentionStatsPress", ("compression_ratio", "n_future_positions", "n_sink", "use_covariance",
                                           "use_vnorm", "epsilon", "sample_seq_len", "num_samples", "dataset_name",
                                           "stats_folder"), defaults=_SINK4,
           required=_REQUIRED["ExpectedAttentionStatsPress"]),
        _R("FastKVzipPress", ("compression_ratio", "layerwise", "n_sink", "window_size", "window_ratio"),
           prefill="two", defaults={"window_size": 4096, "n_sink": 4}, refused=_REFUSED["FastKVzipPress"]),
        _R("FinchPress", ("compression_ratio", "chunk_length", "normalize_scores", "rerotate_keys"),
           settable=("delimiter_token_id",), rerotates="rerotate_keys", prefill="two",
           defaults={"rerotate_keys": True}, required=_REQUIRED["FinchPress"]),
        _R("KVComposePress", ("structured", "compression_ratio", "agg_task", "agg_group", "agg_head", "add_v_norm",
                              "add_mean_across_heads", "keep_token_lower_bound"), prefill="two",
           engine=("head-wise", "per-layer")),
        _R("KVgradPress", ("compression_ratio", "layerwise", "n_sink", "chunk_size"), prefill="two",
           defaults=_SINK4, refused=_REFUSED["KVgradPress"]),
        _R("KVzapPress", ("compression_ratio", "model_type"), refused=_REFUSED["KVzapPress"]),
        _R("KVzipPress", ("compression_ratio", "layerwise", "n_sink", "kvzip_plus_normalization", "chunk_size"),
           prefill="two", defaults=_SINK4, refused=_REFUSED["KVzipPress"]),
        _R("KeyDiffPress", ("compression_ratio",)),
        _R("KeyRerotationPress", ("press",), rerotates=True),
        _R("KnormPress", ("compression_ratio",)),
        _R("LUKVPress", ("press", "compression_ratio", "sink", "window"), refused=_REFUSED["LUKVPress"]),
        _R("LagKVPress", ("compression_ratio", "n_sink", "lag_size", "cross_scoring"), defaults=_SINK4),
        _R("LeverageScorePress", ("compression_ratio", "sketch_dimension")),
        _R("MergingPress", ("press", "similarity_threshold", "merge_fraction")),
        _R("NonCausalAttnPress", ("compression_ratio", "chunk_size")),
        _R("ObservedAttentionPress", ("compression_ratio",)),
        _R("PerLayerCompressionPress", ("press", "compression_ratios"), takes_ratio=False, engine=("per-layer",)),
        _R("PermutationPress", ("seed",), keeps_every_position=True),
        _R("PrefillDecodingPress", ("prefilling_press", "decoding_press"), decode_time="decoding_press"),
        _R("PyramidKVPress", ("compression_ratio", "window_size", "kernel_size", "beta"), engine=("per-layer",),
           defaults={"window_size": 64}),
        _R("QFilterPress", ("compression_ratio",), refused=_REFUSED["QFilterPress"]),
        _R("RandomPress", ("compression_ratio", "seed")),
        _R("RestoreKVPress", ("compression_ratio", "layerwise", "n_sink", "kvzip_plus_normalization", "chunk_size"),
           prefill="two", defaults=_SINK4, refused=_REFUSED["RestoreKVPress"]),
        _R("SimLayerKVPress", ("lazy_threshold", "n_last", "n_recent", "n_initial"), engine=("per-layer",)),
        _R("SlidingWindowPress", ("compression_ratio", "n_sink"), decode_time=True, defaults=_SINK4),
        _R("SnapKVPress", ("compression_ratio", "window_size", "kernel_size"), defaults={"window_size": 64}),
        _R("StreamingLLMPress", ("compression_ratio", "n_sink"), defaults=_SINK4),
        _R("TOVAPress", ("compression_ratio",)),
        _R("ThinKPress", ("key_channel_compression_ratio", "window_size"), engine=("channels",),
           defaults={"window_size": 32}),
        _R("ValueNormPress", ("compression_ratio",)),
    )
}  # fmt: skip

#: The press of a quantized-cache policy (:class:`kvdiverge.engine.presses.quantized.QuantizedCachePress`):
#: it quantizes while decoding, around the policy's press.
QUANTIZED_CACHE = PressRecord("QuantizedCachePress", ("spec", "press"), decode_time=True)

#: kvpress's abstract bases, which it exports beside the presses, each refused with its sentence
#: (:func:`kvdiverge.engine.presses.bases.abstract_reason`).
ABSTRACT: dict[str, str] = {
    "BasePress": "BasePress is an abstract press (kvpress.BasePress: its compress raises NotImplementedError); "
    "name a press, such as KnormPress, or subclass it and override compress",
    "ScorerPress": "ScorerPress is an abstract press (kvpress.ScorerPress: its score raises NotImplementedError); "
    "name a press that scores, such as SnapKVPress, or subclass it and override score",
}

#: Presses of a user's module (``module:Class``), read from their class by the engine (:func:`register`):
#: the record, or the sentence the engine refuses the name with (a module that does not import).
_OWN: dict[str, PressRecord | str] = {}


def register(name: str, rec: PressRecord | str) -> None:
    """Add the record of a press ``module:Class``, or the sentence :func:`record` refuses it with."""
    _OWN[name] = rec


def record(name: str) -> PressRecord:
    """The record of the press a policy names.

    Raises
    ------
    ValueError
        An unknown name (the message lists the presses) or an abstract kvpress base (:data:`ABSTRACT`).
    LookupError
        A ``module:Class`` press not registered (:func:`register`): only the engine can read it.
    """
    if name in CATALOGUE:
        return CATALOGUE[name]
    if ":" in name:
        if isinstance(_OWN.get(name), PressRecord):
            return _OWN[name]
        if name in _OWN:
            raise ValueError(_OWN[name])
        raise LookupError(f"press {name!r} is a class of another module, which only the engine reads")
    if name in ABSTRACT:
        raise ValueError(ABSTRACT[name])
    raise ValueError(f"unknown press {name!r}; available: {', '.join(sorted(CATALOGUE))}")


# --------------------------------------------------------------------------- policy entries

#: Keys of a quantized cache in a policy entry (:class:`kvdiverge.engine.presses.cache_facts.QuantizedCacheSpec`).
CACHE_KEYS = frozenset({"cache", "backend", "nbits", "q_group_size", "residual_length"})
#: Keys of a policy entry that are not constructor parameters of the press.
POLICY_KEYS = frozenset({"press", "compression_ratio", "budget", "params"}) | CACHE_KEYS
_SPEC_KEYS = frozenset({"press", "params"})


def is_press_spec(value: Any) -> bool:
    """True for a nested press spec: a mapping naming a press class under ``press``."""
    return isinstance(value, Mapping) and isinstance(value.get("press"), str)


def spec_parameters(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Constructor parameters of a nested press spec: its keys but ``press``, then its ``params``."""
    params = {k: v for k, v in spec.items() if k not in _SPEC_KEYS}
    params.update(spec.get("params") or {})
    return params


def _entry_parameters(entry: Mapping[str, Any]) -> dict[str, Any]:
    """A policy entry's constructor parameters: its keys but the policy's own, then its ``params``."""
    params = {k: v for k, v in entry.items() if k not in POLICY_KEYS}
    params.update(entry.get("params") or {})
    return params


def _inner(spec: Mapping[str, Any]) -> list:
    """The specs directly inside ``spec``, in parameter order (lists of specs included)."""
    values = list(spec_parameters(spec).values())
    return [v for value in values for v in (value if isinstance(value, (list, tuple)) else [value]) if is_press_spec(v)]


def _walk(spec: Mapping[str, Any]) -> list:
    """``spec`` and every spec nested in it, outer first, each once."""
    out, todo = [], [spec]
    while todo:
        s = todo.pop(0)
        if not any(s is q for q in out):
            out.append(s)
            todo.extend(_inner(s))
    return out


def press_names(entry: Mapping[str, Any]) -> list[str]:
    """The class names of the press of a policy entry and of every press nested in it, outer first (its own
    alone when its ``params`` is not a mapping, which the schema names)."""
    if not is_press_spec(entry):
        return []
    try:
        return [s["press"] for s in _walk(entry)]
    except (TypeError, ValueError, AttributeError):
        return [entry["press"]]


def takes_ratio(press: str, params: Mapping[str, Any]) -> bool:
    """True when press ``press`` with ``params`` takes a policy's compression ratio: itself when its record
    takes one and ``compression_ratio`` is among its parameters, else the first nested spec that does.

    Raises
    ------
    ValueError, LookupError
        As :func:`record`, for this press or a nested one.
    """
    rec = record(press)
    if not rec.takes_ratio:
        return False
    if "compression_ratio" in rec.parameters:
        return True
    return any(takes_ratio(s["press"], spec_parameters(s)) for s in _inner({"press": press, "params": params}))


def keeps_every_position(press: Any) -> bool:
    """True for a press name whose record keeps every prompt position; False for any other value."""
    try:
        return isinstance(press, str) and record(press).keeps_every_position
    except (ValueError, LookupError):
        return False


def ratio_problem(press: str, params: Mapping[str, Any], has_ratio: bool, has_budget: bool) -> str | None:
    """What is wrong with a policy's ``compression_ratio`` / ``budget``, or ``None``: a press that takes a
    ratio needs exactly one of the two, one that takes none neither. Raises ``ValueError`` or
    ``LookupError`` as :func:`record`, for this press or a nested one."""
    return ratio_sentence(press, takes_ratio(press, params), keeps_every_position(press), has_ratio, has_budget)


def ratio_sentence(press: str, takes: bool, keeps_every: bool, has_ratio: bool, has_budget: bool) -> str | None:
    """:func:`ratio_problem`'s sentence given what the press does (``takes`` a ratio, ``keeps_every`` position),
    said here for the catalogue's and the policies' (:func:`kvdiverge.engine.presses.policies.ratio_problem`)."""
    if takes:
        return None if has_ratio != has_budget else "give exactly one of compression_ratio or budget"
    what = "keeps every position" if keeps_every else "takes no compression ratio"
    return f"{press} {what}; give neither compression_ratio nor budget" if has_ratio or has_budget else None


def _value_problem(value: Any, ratio: bool) -> tuple[str | None, bool]:
    """A parameter value's nested specs checked; whether the policy's ratio is still to be handed on."""
    if is_press_spec(value):
        take = ratio and takes_ratio(value["press"], spec_parameters(value))
        return _spec_problem(value, take), ratio and not take
    if isinstance(value, list) and value and all(is_press_spec(v) for v in value):
        for v in value:
            problem, ratio = _value_problem(v, ratio)
            if problem:
                return problem, ratio
    return None, ratio


def _spec_problem(spec: Mapping[str, Any], ratio: bool) -> str | None:
    """What stops the press of a (nested) spec from being built, as the engine names it
    (:func:`kvdiverge.engine.presses.policies.press_from_spec`): an unknown press or parameter, a
    ratio given twice or to a press that takes none; ``ratio`` says whether the policy hands one on."""
    name = spec["press"]
    rec = record(name)
    params = spec_parameters(spec)
    accepted, settable = set(rec.parameters), set(rec.settable)
    unknown = sorted(set(params) - accepted - settable)
    if unknown:
        return f"{rec.name} has no parameter(s) {unknown}; accepted: {sorted(accepted | settable)}"
    own = ratio and "compression_ratio" in accepted and takes_ratio(name, params)
    if own and "compression_ratio" in params:
        return f"{rec.name}: compression_ratio is given twice (by the policy and as a parameter)"
    rest = ratio and not own
    for key, value in params.items():
        if key not in settable:
            problem, rest = _value_problem(value, rest)
            if problem:
                return problem
    return f"{rec.name} takes no compression_ratio" if rest else None


def _policy_entry(entry: Mapping[str, Any]) -> tuple[Mapping[str, Any], QuantizedCacheSpec | None]:
    """The entry as the engine reads it (quantization alone: the ratio-0 ``SnapKVPress``) and its quantized cache.

    Raises
    ------
    ValueError
        A ``cache`` key other than ``quantized``, or a setting :class:`kvdiverge.engine.presses.cache_facts.QuantizedCacheSpec` refuses.
    """
    keys = {k for k in CACHE_KEYS if k in entry}
    if not keys:
        return entry, None
    if entry.get("cache") != "quantized":
        raise ValueError(
            f"'cache' must be 'quantized' (with backend, nbits, q_group_size, "
            f"residual_length), got {entry.get('cache')!r}"
        )
    quantized = QuantizedCacheSpec(**{k: entry[k] for k in keys - {"cache"}})
    if entry.get("press") is None:
        entry = {**entry, "press": "SnapKVPress", "compression_ratio": 0.0}
    return entry, quantized


def _press_spec(entry: Mapping[str, Any]) -> dict[str, Any]:
    """The press spec of an entry read by :func:`_policy_entry`."""
    return {"press": entry.get("press"), "params": _entry_parameters(entry)}


def build_problem(entry: Mapping[str, Any]) -> str | None:
    """What stops a policy entry's press from being built, or ``None`` (the checks of
    :meth:`kvdiverge.engine.presses.policies.Policy.from_config` before its refusals, but kvpress's own).

    Raises
    ------
    LookupError
        A ``module:Class`` press not registered (:func:`register`).
    """
    try:
        entry, _ = _policy_entry(entry)
    except ValueError as exc:
        return str(exc)
    spec = _press_spec(entry)
    press, params = spec["press"], spec["params"]
    if not isinstance(press, str) or not press:
        return f"'press' must name a press class, got {press!r}"
    try:
        return ratio_problem(
            press, params, entry.get("compression_ratio") is not None, entry.get("budget") is not None
        ) or _spec_problem(spec, takes_ratio(press, params))
    except ValueError as exc:  # an unknown press, here or nested
        return str(exc)


def _nodes(entry: Mapping[str, Any]) -> list[tuple[PressRecord, dict[str, Any]]]:
    """Each press of a buildable entry as (record, parameters), outer first: its quantized cache, then its
    press and every press nested in it (the engine's walk of the built press)."""
    entry, quantized = _policy_entry(entry)
    spec = _press_spec(entry)
    nodes = [(QUANTIZED_CACHE, {"press": spec})] if quantized is not None else []
    return nodes + [(record(s["press"]), spec_parameters(s)) for s in _walk(spec)]


def entry_problem(entry: Mapping[str, Any]) -> str | None:
    """Why kvdiverge refuses a policy entry, in the engine's sentence, or ``None``.

    :func:`build_problem`, then each press's refusal, outer first: a quantized cache's backend not
    installed or a decode-time press inside it, a refused press, a required parameter unset.

    Raises
    ------
    LookupError
        A ``module:Class`` press not registered (:func:`register`).
    """
    problem = build_problem(entry)
    if problem:
        return problem
    _, quantized = _policy_entry(entry)
    for rec, params in _nodes(entry):
        if rec is QUANTIZED_CACHE:
            inner = params["press"]
            problem = backend_refusal(quantized)
            if problem is None and is_decode_time(inner):
                problem = (
                    f"a quantized cache after the decode-time press {record(inner['press']).name} is not "
                    f"supported: the press would evict from a quantized cache while generating"
                )
            if problem:
                return problem
        if rec.refused:
            return rec.refused
        for param, sentence in rec.required.items():
            if params.get(param) is None:
                return sentence
    return None


def is_decode_time(spec: Any) -> bool:
    """True when the press of ``spec`` (a policy entry or nested spec), or a press it wraps, evicts while
    tokens are generated; anything else, a spec naming an unknown press included, is not."""
    if not is_press_spec(spec):
        return False
    try:
        return any(record(s["press"]).holds(record(s["press"]).decode_time, spec_parameters(s)) for s in _walk(spec))
    except (ValueError, LookupError):
        return False


def shares_prefill(spec: Mapping[str, Any]) -> bool:
    """True when the full cache can be copied from the press's own prefill forward (its record's ``prefill``);
    raises ``KeyError`` or ``TypeError`` for a spec without a press (a cache alone), else as :func:`record`."""
    return record(spec["press"]).prefill == "shared"


def question_after_problem(entry: Mapping[str, Any]) -> str | None:
    """Why a question prefilled after compression cannot follow a buildable policy entry, or None: a
    quantized cache (which quantizes while decoding) or a press that evicts while decoding cannot."""
    nodes = _nodes(entry)
    if not any(rec.holds(rec.decode_time, params) for rec, params in nodes):
        return None
    if nodes[0][0] is QUANTIZED_CACHE and not is_decode_time(nodes[0][1]["press"]):
        return "its quantized cache quantizes while decoding; a question after compression needs a prefill press"
    return "it evicts while decoding; a question after compression needs a prefill press"


def min_prompt_tokens(entry: Mapping[str, Any]) -> int:
    """Shortest prompt (tokens) a buildable policy entry can compress meaningfully.

    1 for the ratio-0 control and a quantized cache alone; else ``max(window_size, n_sink) + 1`` over
    the press and every press it wraps (given, or the class default), and with a fixed ``budget``
    at least ``budget + window_size + 1``
    (:func:`kvdiverge.engine.presses.policies.press_min_prompt_tokens`).
    """
    entry, _ = _policy_entry(entry)
    spec, budget = _press_spec(entry), entry.get("budget")
    if budget is None and entry.get("compression_ratio") == 0.0:
        return 1
    window = sinks = 0
    for s in _walk(spec):
        rec, params = record(s["press"]), spec_parameters(s)
        for attr in ("window_size", "n_sink"):
            value = params.get(attr, rec.defaults.get(attr))
            if isinstance(value, int) and not isinstance(value, bool):
                window, sinks = (max(window, value), sinks) if attr == "window_size" else (window, max(sinks, value))
    need = max(window, sinks) + 1
    return max(need, int(budget) + window + 1) if budget is not None else need


def node_sliding_refusal(rec: PressRecord, params: Mapping[str, Any], layers: str) -> str | None:
    """What sliding-window layers (``layers``: :func:`kvdiverge.engine.presses.cache_facts.describe`) tell against one press: a prefill press
    that fails there (:data:`SLIDING_FAILS`), a quantized cache, a press that evicts while decoding or
    one that re-rotates kept keys; ``None`` when it runs on the full-attention layers alone."""
    if rec.name in SLIDING_FAILS:
        return f"{layers}: {rec.name} {SLIDING_FAILS[rec.name]}"
    what = (
        "a quantized cache" if rec is QUANTIZED_CACHE
        else "a press that evicts while decoding" if rec.holds(rec.decode_time, params)
        else "a press that re-rotates kept keys" if rec.holds(rec.rerotates, params)
        else None
    )  # fmt: skip
    if what:
        return (
            f"{layers}: {what} ({rec.name}) is not supported there, only prefill presses on the full-attention layers"
        )
    return None


def sliding_refusal(entry: Mapping[str, Any] | None, config) -> str | None:
    """What a model with sliding-window layers tells against a buildable policy entry (``None`` without a
    config): the model alone (:func:`kvdiverge.engine.presses.cache_facts.model_sliding_refusal`), then each press, outer first
    (:func:`node_sliding_refusal`); the engine's :func:`kvdiverge.engine.presses.registry.sliding_refusal`
    of the built press."""
    reason = model_sliding_refusal(config)
    if reason or config is None or not has_sliding_layers(config) or entry is None:
        return reason
    layers = describe(config)
    for rec, params in _nodes(entry):
        reason = node_sliding_refusal(rec, params, layers)
        if reason:
            return reason
    return None
