"""Every press kvdiverge can be asked to measure, by class name, and the questions the engine asks of one.

One row (a :class:`kvdiverge.engine.presses.adapters.PressAdapter`) per press class that
``kvpress`` exports (read from ``kvpress.__all__`` at import, so a new kvpress release adds its
presses by itself, as measured prefill presses until a row in
:data:`kvdiverge.engine.presses.adapters.ADAPTERS` says otherwise) and per project press
(:data:`kvdiverge.engine.presses.project.PROJECT_PRESSES`). A press class without a row (a
user's own) gets the row of its class (:func:`kvdiverge.engine.presses.adapters.resolve`).

The engine asks a press only through these functions, each reading the press's row:
:func:`refusal` (whether kvdiverge measures it), :func:`is_decode_time` (whether it evicts
while generating), :func:`shares_prefill` and :func:`needs_attentions` (the prefill mode),
:func:`generation_start` (the RoPE start of generated tokens) and
:func:`kept_promise` (what it keeps). Policies
(:mod:`kvdiverge.engine.presses.policies`) refuse before any work: at config validation, in
``kvdiverge.measure``'s argument checks and while the command line is parsed.
:mod:`kvdiverge.engine.presses.status` builds each row's test instance, says its status and
renders the press table of ``docs/presses.md`` from these rows.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from functools import lru_cache

import kvpress

from kvdiverge.engine.presses import layer_types, promises
from kvdiverge.engine.presses.adapters import ADAPTERS, PressAdapter, is_press_spec, resolve, walk
from kvdiverge.engine.presses.bases import abstract_reason
from kvdiverge.engine.presses.cache_facts import model_sliding_refusal
from kvdiverge.engine.presses.catalogue import SLIDING_FAILS, PressRecord
from kvdiverge.engine.presses.project import PROJECT_PRESSES
from kvdiverge.engine.presses.quantized import QuantizedCachePress
from kvdiverge.engine.presses.quantized import refusal as quantized_refusal

__all__ = [
    "PRESS_CLASSES",
    "ROWS",
    "adapter_of",
    "catalogue_record",
    "draws_global_rng",
    "generation_start",
    "import_press",
    "is_decode_time",
    "kept_promise",
    "needs_attentions",
    "press_class",
    "question_after_problem",
    "refusal",
    "shares_prefill",
    "sliding_refusal",
    "SLIDING_FAILS",
]


def _press_classes() -> dict[str, type]:
    """Project presses, then every ``kvpress.__all__`` press class but the two bases."""
    out: dict[str, type] = dict(PROJECT_PRESSES)
    for name in kvpress.__all__:
        cls = getattr(kvpress, name, None)
        if (
            isinstance(cls, type)
            and issubclass(cls, kvpress.BasePress)
            and cls not in (kvpress.BasePress, kvpress.ScorerPress)
        ):
            out[name] = cls
    return out


#: Every press class kvdiverge knows, by class name.
PRESS_CLASSES: dict[str, type] = _press_classes()
#: One row per press class, by class name, every field set (:func:`kvdiverge.engine.presses.adapters.resolve`).
ROWS: dict[str, PressAdapter] = {name: resolve(cls, ADAPTERS) for name, cls in PRESS_CLASSES.items()}


@lru_cache(maxsize=None)
def _unlisted(cls: type) -> PressAdapter:
    return resolve(cls, ADAPTERS)


#: The row of no press (``None``: the ratio-free reference, a pair without eviction): nothing to ask.
_NO_PRESS = resolve(kvpress.BasePress, {})


def adapter_of(press) -> PressAdapter:
    """The row of a press (object or class) or of a spec's press: :data:`ROWS`, else the row of its class.

    ``None`` (no press) has a row that refuses nothing, promises nothing and decodes nothing.

    Raises
    ------
    ValueError
        For a spec naming an unknown press.
    """
    if press is None:
        return _NO_PRESS
    if isinstance(press, Mapping):
        press = press_class(press["press"])
    cls = press if isinstance(press, type) else type(press)
    return ROWS.get(cls.__name__) or _unlisted(cls)


def is_decode_time(press) -> bool:
    """True when ``press`` (an object or a policy's spec), or a press it wraps, evicts while tokens are
    generated (its row's ``decode_time``: ``DecodingPress`` and its subclasses, ``SlidingWindowPress``,
    ``PrefillDecodingPress`` with a decoding press, ``DMSPress(decoding=True)``). Anything else,
    a spec naming an unknown press included, is not."""
    if not (is_press_spec(press) or isinstance(press, kvpress.BasePress)):
        return False
    try:
        return any(adapter_of(p).decodes(p) for p in walk(press))
    except ValueError:
        return False


def question_after_problem(press) -> str | None:
    """Why a question prefilled after compression cannot follow ``press``, or None when it can.

    The question is prefilled onto the compressed cache and never evicted, so the press must
    act on the prefill alone: a quantized cache (which quantizes while decoding) or a press
    that evicts while decoding (:func:`is_decode_time`) cannot take it."""
    if not is_decode_time(press):
        return None
    if isinstance(press, QuantizedCachePress) and (press.press is None or not is_decode_time(press.press)):
        return "its quantized cache quantizes while decoding; a question after compression needs a prefill press"
    return "it evicts while decoding; a question after compression needs a prefill press"


def shares_prefill(press) -> bool:
    """True when the full cache can be copied from ``press``'s own prefill forward (its row's ``prefill``)."""
    return adapter_of(press).prefill == "shared"


def draws_global_rng(press) -> bool:
    """True when ``press`` or a press it wraps draws from torch's global random generator (its row's ``global_rng``)."""
    return any(adapter_of(p).global_rng for p in walk(press))


def needs_attentions(press) -> bool:
    """True when ``press`` or a press it wraps scores with the attention weights (its row's ``attentions``)."""
    return any(adapter_of(p).attentions for p in walk(press))


def generation_start(press, prompt_len: int, cache_len: int) -> int:
    """RoPE position of the first generated token on the evicted side: ``cache_len`` for a press that
    re-rotates the kept keys (its row's ``rerotates``), else ``prompt_len``
    (:meth:`kvdiverge.engine.presses.adapters.PressAdapter.generation_start`)."""
    return adapter_of(press).generation_start(press, prompt_len, cache_len)


def kept_promise(press, prompt_len: int) -> "int | promises.KeptPromise | None":
    """What ``press`` promises to keep of a prompt of ``prompt_len`` tokens, or ``None``.

    A press with a ``kept_tokens`` method (the project's presses) promises that count in
    every head; any other asks its adapter's ``promise``
    (:mod:`kvdiverge.engine.presses.adapters`), one of the functions below:

    - :func:`kvdiverge.engine.presses.promises.scorer` (any ``kvpress.ScorerPress`` without a row of its own):
      ``compute_n_kept(prompt_len, ratio)`` in every head;
    - :func:`kvdiverge.engine.presses.promises.every_position` (``ThinKPress``, which prunes key channels, not positions);
    - ``pyramid``, ``head_wise``, ``per_layer``, ``composed``, ``sim_layer`` of
      :mod:`kvdiverge.engine.presses.promises`;
    - none (thresholds, decode-time, compositions): ``None``, only checked to compress.

    Parameters
    ----------
    press : kvpress.BasePress
        The press, built for this prompt.
    prompt_len : int
        Uncompressed prompt length (tokens).

    Returns
    -------
    int, KeptPromise or None
        An int: every layer and head keeps exactly that many positions.
    """
    own = getattr(press, "kept_tokens", None)
    if callable(own):
        return int(own(int(prompt_len)))
    promise = adapter_of(press).promise
    return None if promise is None else promise(press, int(prompt_len))


def press_class(name: str):
    """Return the press class called ``name``: a project press, one kvpress exports, or ``module:Class``.

    Project presses (:data:`kvdiverge.engine.presses.project.PROJECT_PRESSES`) are looked up first;
    ``module:Class`` imports ``module`` (:func:`import_press`).

    Raises
    ------
    ValueError
        If neither the project nor kvpress has a press of that name (the message lists
        the presses), or it names an abstract base (``BasePress``, ``ScorerPress``:
        :func:`kvdiverge.engine.presses.bases.abstract_reason`).
    """
    if ":" in name:
        cls = import_press(name)
    elif name in PROJECT_PRESSES:
        return PROJECT_PRESSES[name]
    else:
        cls = getattr(kvpress, name, None)
        if not (isinstance(cls, type) and issubclass(cls, kvpress.BasePress)):
            raise ValueError(f"unknown press {name!r}; available: {', '.join(sorted(PRESS_CLASSES))}")
    reason = abstract_reason(cls)
    if reason:
        raise ValueError(reason)
    return cls


def import_press(ref: str):
    """A press class from a reference: a kvpress class name, or ``module:Class``.

    ``module:Class`` imports ``module`` (any importable module, e.g. the user's own) and
    takes its attribute ``Class``, so presses kvpress does not ship work too.

    Raises
    ------
    ValueError
        If the module or class does not exist, or the class is not a kvpress press
        (``kvpress.BasePress`` subclass); the message names the reference.
    """
    if ":" not in ref:
        return press_class(ref)
    import importlib

    module_name, _, cls_name = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"press {ref!r}: cannot import module {module_name!r} ({exc})") from None
    cls = getattr(module, cls_name, None)
    if cls is None:
        raise ValueError(f"press {ref!r}: module {module_name!r} has no attribute {cls_name!r}")
    if not (isinstance(cls, type) and issubclass(cls, kvpress.BasePress)):
        raise ValueError(f"press {ref!r}: {cls_name} is not a kvpress press (kvpress.BasePress subclass)")
    return cls


def refusal(press, model=None) -> str | None:
    """Why kvdiverge refuses ``press`` (one sentence), or ``None`` when it can measure it.

    Walks ``press`` and every press it wraps (:func:`kvdiverge.engine.presses.adapters.walk`)
    and reads each one's row: its ``refused`` sentence, the ``required`` parameters left unset. With ``model`` (a
    ``transformers`` model), also the config attributes the press reads, and the model's layer types
    (:func:`sliding_refusal`).
    """
    for p in walk(press):
        if isinstance(p, QuantizedCachePress):
            reason = _quantized_refusal(p, model)
            if reason:
                return reason
        row = adapter_of(p)
        if row.refused:
            return row.refused
        for param, sentence in row.required.items():
            if getattr(p, param, None) is None:
                return sentence
        reason = _model_refusal(row, p, getattr(model, "config", None))
        if reason:
            return reason
    return sliding_refusal(press, getattr(model, "config", None))


def sliding_refusal(press, config) -> str | None:
    """What a model with sliding-window layers tells against ``press`` (``None`` without a config).

    On such a model the engine compresses the full-attention layers only and applies the
    window by position (:mod:`kvdiverge.engine.presses.layer_types`); that holds for a press
    that acts once, at prefill, and keeps each kept key's position. A press that evicts while
    decoding, a quantized cache and a press that re-rotates kept keys change a sliding
    layer's cache or its positions after prefill, and are refused; so is eager attention (the
    full-attention layers' padded columns are masked per head, which kvpress's attention
    patch does under sdpa only).
    """
    reason = model_sliding_refusal(config)
    if reason or config is None or not layer_types.has_sliding_layers(config):
        return reason
    layers = layer_types.describe(config)
    for p in walk(press):
        row = adapter_of(p)
        if row.name in SLIDING_FAILS:
            return f"{layers}: {row.name} {SLIDING_FAILS[row.name]}"
        what = (
            "a quantized cache" if isinstance(p, QuantizedCachePress)
            else "a press that evicts while decoding" if row.decodes(p)
            else "a press that re-rotates kept keys" if row.generation_start(p, 2, 1) == 1  # starts at the cache length
            else None
        )  # fmt: skip
        if what:
            return f"{layers}: {what} ({row.name}) is not supported there, only prefill presses on the full-attention layers"
    return None


def _quantized_refusal(press, model) -> str | None:
    """What refuses a quantized cache: its backend or the model (:func:`kvdiverge.engine.presses.quantized.refusal`),
    or a decode-time press inside it."""
    reason = quantized_refusal(press.spec, model)
    if reason is None and press.press is not None and is_decode_time(press.press):
        reason = (
            f"a quantized cache after the decode-time press {type(press.press).__name__} is not supported: "
            f"the press would evict from a quantized cache while generating"
        )
    return reason


def _model_refusal(row: PressAdapter, press, config) -> str | None:
    """What the model's config tells against ``press`` (``None`` without a config)."""
    if config is None:
        return None
    for attr in row.config_attributes:
        if not hasattr(config, attr):
            return (
                f"{row.name} reads model.config.{attr}, which this model's {type(config).__name__} "
                f"does not have (kvpress would fail with AttributeError)."
            )
    values, layers = getattr(press, row.per_layer_list or "", None), getattr(config, "num_hidden_layers", None)
    if row.per_layer_list and values is not None and layers is not None and len(values) != layers:
        return (
            f"{row.name} needs one value per layer in {row.per_layer_list}: it has {len(values)}, "
            f"the model has {layers} layers."
        )
    return None


def catalogue_record(name: str) -> PressRecord:
    """The catalogue's record of the press called ``name`` (:func:`press_class`: a project press, one kvpress
    exports, or ``module:Class``), read from its class and its row: what
    :data:`kvdiverge.engine.presses.catalogue.CATALOGUE` must hold for it (``tests/test_catalogue.py``), and
    the record the config check registers for a press of a user's module.

    Raises
    ------
    ValueError
        As :func:`press_class`.
    """
    cls = press_class(name)
    row, signature = adapter_of(cls), inspect.signature(cls).parameters
    defaults = {}
    for key in ("window_size", "n_sink", *(f for f in (row.decode_time, row.rerotates) if isinstance(f, str))):
        given = signature.get(key)
        value = given.default if given is not None and given.default is not given.empty else getattr(cls, key, None)
        counted = key not in ("window_size", "n_sink") or (isinstance(value, int) and not isinstance(value, bool))
        if counted and value is not None and value is not False:
            defaults[key] = value
    return PressRecord(
        cls.__name__,
        tuple(signature),
        settable=tuple(row.settable),
        takes_ratio=row.takes_ratio,
        keeps_every_position=bool(getattr(cls, "keeps_every_position", False)),
        decode_time=row.decode_time,
        rerotates=row.rerotates,
        prefill=row.prefill,
        engine=tuple(row.engine),
        defaults=defaults,
        refused=row.refused,
        required=dict(row.required),
    )
