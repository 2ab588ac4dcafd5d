"""One adapter per press class: everything the engine asks about a press, in one frozen dataclass.

In kvpress's own style (one small dataclass per press): a :class:`PressAdapter` says what
kvdiverge knows of a press class, and nothing else in the engine asks "which press is
this?". :data:`ADAPTERS` holds the rows written here; the registry
(:mod:`kvdiverge.engine.presses.registry`) gives every other press class a row built from
its class (:func:`resolve`). The fields:

- ``refused``: one sentence saying what the press needs that kvdiverge cannot give it
  (a hub file, a model it was trained for, a reloadable tokenizer); the press is refused
  with it.
- ``required``: parameters without which kvpress fails, each with the sentence it is
  refused with while unset.
- ``settable``: attributes that kvpress sets after construction (``init=False``) and that a
  policy may give as parameters (Finch's ``delimiter_token_id``).
- ``takes_ratio``: False for a press whose own parameter replaces the policy's
  ``compression_ratio`` (``PerLayerCompressionPress``'s ``compression_ratios``).
- ``promise``: the kept-count promise, ``promise(press, prompt_len)`` -> int,
  :class:`kvdiverge.engine.presses.promises.KeptPromise` or ``None``
  (:mod:`kvdiverge.engine.presses.promises`); ``None``: only checked to compress.
- ``prefill``: ``"shared"`` when the full cache is copied from the press's own prefill
  forward (the press enters through kvpress's ``BasePress.__call__``: forward hooks on the
  attention modules, nothing else), ``"two"`` when the press has its own context manager
  (it may change the forward) and the reference side gets a prefill of its own
  (:mod:`kvdiverge.engine.llm.prefill`).
- ``attentions``: the press scores with the attention weights, which the shared prefill's
  hook computes as eager attention does (``ObservedAttentionPress``).
- ``decode_time``: the press evicts while tokens are generated, not only at prefill
  (:mod:`kvdiverge.engine.llm.decode_pair`): True, False, or the name of a parameter that
  makes it so while set (``DMSPress(decoding=True)``, ``PrefillDecodingPress(decoding_press=...)``).
- ``rerotates``: the press re-rotates the kept keys to the compacted positions, so
  generated tokens on the evicted side take RoPE positions from the compressed cache
  length instead of the prompt length (True, False or a parameter name, as ``decode_time``).
- ``row_state``: the press's prefill leaves tensors with a batch dimension in the press
  object (``DMSPress``), so a decode-time replay lane prefills anew instead of copying the
  chain's one-row prefill (:mod:`kvdiverge.engine.llm.decode_pair`).
- ``merge_lanes``: the press's decode-time state is fixed at prefill and the same for every
  lane of a document (no step counter, nothing with a batch dimension), and every row's
  cache holds the same number of positions per layer whatever its history
  (``SlidingWindowPress``); a document's decode-time lanes then decode as the rows of one
  forward, and rows that leave are cut out of it (:mod:`kvdiverge.engine.llm.decode_pair`).
  Not inherited: a subclass may keep state of its own.
- ``global_rng``: the press draws from torch's global random generator (no seed of its
  own); the engine seeds that generator per document prefill
  (:func:`kvdiverge.engine.llm.prefill.seeded`), so a document keeps the same positions
  alone or in a batch, and from run to run.
- ``engine``: the engine parts the press uses besides plain prefill eviction
  (``"head-wise"``: masks keys per key-value head; ``"per-layer"``: layers keep different
  counts; ``"channels"``: prunes key channels and keeps every position), for the press table.
- ``config_attributes``: attributes of the model's config that the press reads (a model
  whose config lacks one is refused once the model is known).
- ``per_layer_list``: a parameter holding one value per layer (checked against the model's
  ``num_hidden_layers`` once the model is known).
- ``note``: one sentence on how kvdiverge measures the press, where that departs from the
  plain prefill path (added to its press-table row).
- ``test_params``: parameters of the press matrix's test instance (``tests/test_press_matrix.py``);
  nested presses are specs ``{"press": Name, **params}``. Required inner presses default to
  :data:`INNER_TEST_PRESS`.

``promise``, ``attentions``, ``decode_time``, ``rerotates`` and ``row_state`` left unset in a row are
inherited from the nearest base class with a row (as ``isinstance`` would), else take their
defaults: a ``kvpress.ScorerPress`` promises ``compute_n_kept`` in every head, other
presses promise nothing.

:func:`walk` is the one walker over nested presses: a press object and the presses in its
press-valued fields (:data:`PRESS_PARAMETERS`), or a spec (a mapping naming a press class
under ``press``) and the specs among its parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import kvpress

from kvdiverge.engine.presses import promises
from kvdiverge.engine.presses.catalogue import CATALOGUE, is_press_spec, spec_parameters

__all__ = [
    "ADAPTERS",
    "INNER_TEST_PRESS",
    "PRESS_PARAMETERS",
    "PressAdapter",
    "inner",
    "is_press_spec",
    "resolve",
    "spec_parameters",
    "walk",
]

#: The inner press of wrappers in test instances (a score-based press with a short window).
INNER_TEST_PRESS: dict[str, Any] = {"press": "SnapKVPress", "window_size": 8, "kernel_size": 3}

#: Fields of kvpress's wrappers whose value is another press (or a list of presses).
PRESS_PARAMETERS = ("press", "base_press", "prefilling_press", "decoding_press", "presses")


class _Inherited:
    """Marks a field a row leaves to its base classes (:func:`resolve`)."""

    def __repr__(self) -> str:
        return "INHERITED"


INHERITED: Any = _Inherited()
#: Fields inherited from the nearest base class with a row when a row leaves them unset.
_INHERITABLE = ("promise", "attentions", "decode_time", "rerotates", "row_state")


@dataclass(frozen=True)
class PressAdapter:
    """What kvdiverge knows of one press class (the module docstring describes each field)."""

    name: str
    refused: str | None = None
    required: Mapping[str, str] = field(default_factory=dict)
    settable: tuple[str, ...] = ()
    takes_ratio: bool = True
    promise: Callable[[Any, int], Any] | None = INHERITED
    prefill: str | None = None
    attentions: bool = INHERITED
    decode_time: bool | str = INHERITED
    rerotates: bool | str = INHERITED
    row_state: bool = INHERITED
    merge_lanes: bool = False
    global_rng: bool = False
    engine: tuple[str, ...] = ()
    config_attributes: tuple[str, ...] = ()
    per_layer_list: str | None = None
    note: str | None = None
    test_params: Mapping[str, Any] = field(default_factory=dict)

    def decodes(self, node) -> bool:
        """True when ``node`` (a press of this class, or its spec) evicts while tokens are generated."""
        return _holds(self.decode_time, node)

    def generation_start(self, press, prompt_len: int, cache_len: int) -> int:
        """RoPE position of the first generated token on the evicted side (estimators.md §1).

        ``prompt_len`` (the uncompressed prompt length), or ``cache_len`` for a press that
        re-rotates the kept keys to the compacted positions ``0 .. cache_len - 1``
        (``KeyRerotationPress``, ``FinchPress(rerotate_keys=True)``), as kvpress's own
        pipeline does (``KVPressTextGenerationPipeline._forward`` sets
        ``context_length = cache.get_seq_length()`` for them).
        """
        return int(cache_len) if _holds(self.rerotates, press) else int(prompt_len)


def _holds(value: bool | str, node) -> bool:
    """A flag of a row on a press or spec: the bool itself, or whether the named parameter is set."""
    if not isinstance(value, str):
        return bool(value)
    got = spec_parameters(node).get(value) if isinstance(node, Mapping) else getattr(node, value, None)
    return got is not None and got is not False


def inner(node) -> list:
    """The presses (or specs) directly inside ``node``, in field order.

    Parameters
    ----------
    node : kvpress.BasePress or mapping
        A press object (its :data:`PRESS_PARAMETERS` fields holding presses or lists of
        them) or a press spec (its parameters that are specs or lists of specs).
    """
    if isinstance(node, Mapping):
        values, keep = list(spec_parameters(node).values()), is_press_spec
    else:
        values = [getattr(node, attr, None) for attr in PRESS_PARAMETERS]
        keep = lambda v: isinstance(v, kvpress.BasePress) and v is not node  # noqa: E731
    return [v for value in values for v in (value if isinstance(value, (list, tuple)) else [value]) if keep(v)]


def walk(node) -> list:
    """``node`` and every press or spec nested in it (:func:`inner`), outer first, each once."""
    out, todo = [], [node]
    while todo:
        p = todo.pop(0)
        if any(p is q for q in out):
            continue
        out.append(p)
        todo.extend(inner(p))
    return out


#: The sentences of the refused presses and of their required parameters live in the catalogue
#: (:data:`kvdiverge.engine.presses.catalogue.CATALOGUE`), which the config check reads without kvpress.
_REFUSED = {name: r.refused for name, r in CATALOGUE.items() if r.refused}
_REQUIRED = {name: dict(r.required) for name, r in CATALOGUE.items() if r.required}
_KNORM = {"press": "KnormPress"}

#: The rows written here, by class name; every other press class gets the row of its class (:func:`resolve`).
ADAPTERS: dict[str, PressAdapter] = {
    a.name: a
    for a in (
        PressAdapter("AdaKVPress", engine=("head-wise",), promise=promises.head_wise),
        PressAdapter(
            "CriticalAdaKVPress",
            engine=("head-wise",),
            promise=promises.head_wise,
            config_attributes=("head_dim",),
            test_params={"press": INNER_TEST_PRESS},
        ),
        PressAdapter("CriticalKVPress", config_attributes=("head_dim",)),
        PressAdapter("KVComposePress", engine=("head-wise", "per-layer"), promise=promises.composed),
        PressAdapter(
            "PyramidKVPress",
            engine=("per-layer",),
            promise=promises.pyramid,
            test_params={"window_size": 8, "kernel_size": 3},
        ),
        PressAdapter(
            "PerLayerCompressionPress",
            engine=("per-layer",),
            promise=promises.per_layer,
            takes_ratio=False,
            per_layer_list="compression_ratios",
            test_params={"press": INNER_TEST_PRESS, "compression_ratios": [0.25, 0.75]},
        ),
        PressAdapter(
            "DMSPress",
            engine=("head-wise",),
            decode_time="decoding",
            row_state=True,
            takes_ratio=False,
            required=_REQUIRED["DMSPress"],
            test_params={"press": _KNORM, "threshold": -0.45, "sliding_window_size": 8},
        ),
        PressAdapter("ObservedAttentionPress", attentions=True),
        PressAdapter("LeverageScorePress", global_rng=True),
        PressAdapter("CompactorPress", global_rng=True),
        PressAdapter("RandomPress", test_params={"seed": 0}),
        PressAdapter("SnapKVPress", test_params={"window_size": 8, "kernel_size": 3}),
        PressAdapter(
            "ThinKPress",
            engine=("channels",),
            promise=promises.every_position,
            test_params={"key_channel_compression_ratio": 0.5, "window_size": 8},
        ),
        PressAdapter(
            "SimLayerKVPress",
            engine=("per-layer",),
            promise=promises.sim_layer,
            test_params={"lazy_threshold": 0.5, "n_recent": 16, "n_initial": 4},
        ),
        PressAdapter("DecodingPress", decode_time=True, test_params={"base_press": _KNORM}),
        PressAdapter("SlidingWindowPress", decode_time=True, merge_lanes=True),
        # a quantized cache (kvdiverge.engine.presses.quantized): its flushes follow the history's length
        PressAdapter("QuantizedCachePress", decode_time=True, promise=None),
        PressAdapter("CompressionRatioDecodingPress", decode_time=True, test_params={"base_press": _KNORM}),
        PressAdapter("CAMPress", decode_time=True, test_params={"base_press": _KNORM}, refused=_REFUSED["CAMPress"]),
        PressAdapter(
            "PrefillDecodingPress",
            decode_time="decoding_press",
            test_params={
                "prefilling_press": INNER_TEST_PRESS,
                "decoding_press": {"press": "DecodingPress", "base_press": _KNORM},
            },
        ),
        PressAdapter(
            "KeyRerotationPress",
            rerotates=True,
            note="it re-rotates the kept keys to the compacted positions, so on the evicted side "
            "generated tokens take RoPE positions from the compressed cache length, as in "
            "kvpress's pipeline (the reference side from the prompt length).",
        ),
        PressAdapter(
            "FinchPress",
            rerotates="rerotate_keys",
            settable=("delimiter_token_id",),
            note="with rerotate_keys (its default) generated tokens on the evicted side take RoPE positions "
            "from the compressed cache length, as in kvpress's pipeline.",
            required=_REQUIRED["FinchPress"],
        ),
        PressAdapter("ExpectedAttentionStatsPress", required=_REQUIRED["ExpectedAttentionStatsPress"]),
        PressAdapter("RestoreKVPress", refused=_REFUSED["RestoreKVPress"]),
        PressAdapter("QFilterPress", refused=_REFUSED["QFilterPress"]),
        PressAdapter("KVzapPress", refused=_REFUSED["KVzapPress"]),
        PressAdapter("FastKVzipPress", refused=_REFUSED["FastKVzipPress"]),
        PressAdapter("LUKVPress", refused=_REFUSED["LUKVPress"]),
        PressAdapter("DuoAttentionPress", refused=_REFUSED["DuoAttentionPress"]),
        PressAdapter("ValueNormPress", promise=promises.scorer),  # test instance: compression_ratio 0.5
        PressAdapter("KVzipPress", refused=_REFUSED["KVzipPress"]),
        PressAdapter("KVgradPress", refused=_REFUSED["KVgradPress"]),
    )
}

#: How kvpress enters a press that leaves the forward alone: its own ``__call__``, or a decoding
#: wrapper's, which only adds a reset of its decoding state.
_PLAIN_ENTRY = (kvpress.BasePress.__call__, kvpress.DecodingPress.__call__, kvpress.PrefillDecodingPress.__call__)


def _inherited(cls: type, name: str, rows: Mapping[str, PressAdapter]) -> Any:
    """Field ``name`` of the nearest base class of ``cls`` whose row sets it, else its default."""
    for base in cls.__mro__[1:]:
        row = rows.get(base.__name__)
        if row is not None and getattr(row, name) is not INHERITED:
            return getattr(row, name)
    if name == "promise":
        return promises.scorer if issubclass(cls, kvpress.ScorerPress) else None
    return False


def _default_test_params(cls: type) -> dict[str, Any]:
    """An inner press for every press-valued parameter without a default (or with default None)."""
    import inspect

    params: dict[str, Any] = {}
    for name, p in inspect.signature(cls).parameters.items():
        if name in PRESS_PARAMETERS and (p.default is inspect.Parameter.empty or p.default is None):
            params[name] = [INNER_TEST_PRESS] if name == "presses" else INNER_TEST_PRESS
    return params


def resolve(cls: type, rows: Mapping[str, PressAdapter] = ADAPTERS) -> PressAdapter:
    """The complete row of press class ``cls``: its row in ``rows`` (or an empty one), every field set.

    Inheritable fields left unset come from the nearest base class with a row; ``prefill``
    from how the class is entered (``_PLAIN_ENTRY``: ``"shared"``, else ``"two"``);
    ``test_params`` gain an inner test press for every press-valued parameter without a default.
    """
    row = rows.get(cls.__name__) or PressAdapter(cls.__name__)
    fill = {name: _inherited(cls, name, rows) for name in _INHERITABLE if getattr(row, name) is INHERITED}
    if row.prefill is None:
        fill["prefill"] = "shared" if cls.__call__ in _PLAIN_ENTRY else "two"
    fill["test_params"] = {**_default_test_params(cls), **row.test_params}
    return dataclasses.replace(row, name=cls.__name__, **fill)
