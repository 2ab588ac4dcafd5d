"""Eviction policies: config entries mapped onto NVIDIA kvpress presses.

A policy is a config entry such as::

    snapkv-50:   {press: SnapKVPress, compression_ratio: 0.5, window_size: 64, kernel_size: 5}
    snapkv-b512: {press: SnapKVPress, budget: 512, window_size: 64, kernel_size: 5}
    recent-50:   {press: StreamingLLMPress, compression_ratio: 0.5, n_sink: 4}
    none:        {press: SnapKVPress, compression_ratio: 0.0}

Any press that ``kvpress`` exports can be named, and the project's own presses
(:data:`kvdiverge.engine.presses.project.PROJECT_PRESSES`, e.g. the noise-floor control
``PermutationPress``, which keeps every position and takes neither a ratio nor a
budget)::

    noise-floor: {press: PermutationPress, seed: 0}

Parameters other than
``compression_ratio`` / ``budget`` are passed to its constructor (``params`` holds
extra ones). A parameter whose value is a press is a nested spec of the same shape, a
mapping with the class name under ``press`` and its parameters beside it (or under its
own ``params``)::

    adakv-50: {press: AdaKVPress, compression_ratio: 0.5,
               params: {press: {press: SnapKVPress, window_size: 64}}}

The policy's ``compression_ratio`` (or the ratio of its ``budget``) goes to the press that
takes one: the named press itself, else the first press it wraps that does (the inner
scorer of a wrapper such as ``AdaKVPress``). Prefill presses compress the prompt cache once,
after each layer's prefill forward; decode-time presses (``DecodingPress``,
``SlidingWindowPress``, ...) also evict while tokens are generated
(:func:`kvdiverge.engine.presses.registry.is_decode_time`; kvpress,
https://github.com/NVIDIA/kvpress). Presses that kvdiverge cannot measure are refused with
one sentence (:func:`kvdiverge.engine.presses.registry.refusal`) when the policy is built,
before any work.

A fixed token ``budget`` becomes a per-document compression ratio chosen so that
kvpress keeps exactly ``budget`` positions (``kvpress.utils.compute_n_kept``).

A **quantized cache** (:mod:`kvdiverge.engine.presses.quantized`) is ``cache: quantized``
with its settings, alone or after any prefill press (evict, then quantize what is kept)::

    quanto-4:        {cache: quantized, backend: quanto, nbits: 4, q_group_size: 64, residual_length: 128}
    snapkv-50-int2:  {press: SnapKVPress, compression_ratio: 0.5, window_size: 64,
                      cache: quantized, nbits: 2}

Alone it runs without eviction (internally the ratio-0 ``SnapKVPress``, which keeps every
position). Its press is a :class:`kvdiverge.engine.presses.quantized.QuantizedCachePress`
around the policy's press, a decode-time policy.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from kvdiverge.engine.core.errors import PressError
from kvdiverge.engine.presses.adapters import inner, is_press_spec, spec_parameters, walk
from kvdiverge.engine.presses.catalogue import CACHE_KEYS as _CACHE_KEYS
from kvdiverge.engine.presses.catalogue import POLICY_KEYS as _POLICY_KEYS
from kvdiverge.engine.presses.catalogue import ratio_sentence
from kvdiverge.engine.presses.quantized import QuantizedCachePress, QuantizedCacheSpec
from kvdiverge.engine.presses.registry import adapter_of, is_decode_time, kept_promise, press_class, refusal

#: Placeholder ratio the policy's press is built with to check it (a budget's ratio depends on the prompt).
_PROBE_RATIO = 0.5


@dataclass(frozen=True)
class Policy:
    """One eviction policy of the config.

    Parameters
    ----------
    name : str
        Policy name (config key), e.g. ``"snapkv-50"``.
    press : str
        Name of a press class exported by ``kvpress`` or the project, e.g. ``"SnapKVPress"``,
        or ``module:Class`` for a press of another module.
    compression_ratio : float or None
        Fraction of prompt positions evicted (retention = 1 - compression_ratio).
    budget : int or None
        Fixed number of prompt positions kept (tokens); exclusive with
        ``compression_ratio``.
    params : dict
        Other constructor parameters of the press (``window_size``, ``kernel_size``,
        ``n_sink``, ...); a press-valued one is a nested spec (module docstring).
    """

    name: str
    press: str
    compression_ratio: float | None = None
    budget: int | None = None
    params: dict[str, Any] = field(default_factory=dict)
    quantized: Any = None  # a QuantizedCacheSpec, or None for a full-precision cache

    @classmethod
    def from_config(cls, name: str, spec: dict[str, Any], check: bool = True) -> "Policy":
        """Build a policy from its config entry and check it (by building its press once).

        With ``check=False`` the registry is not asked (:meth:`check`): a caller that checks
        the press with the model before running it
        (:func:`kvdiverge.engine.refusals.check_policy`) asks once.

        Raises
        ------
        kvdiverge.engine.core.errors.PressError
            (a ``ValueError``) If the press is unknown, a parameter (of it or of a press it
            wraps) is not accepted, both or neither of ``compression_ratio`` and ``budget``
            are given for a press that takes a ratio (a press that takes none, such as
            ``PermutationPress``, takes neither), kvpress rejects the parameters, or
            kvdiverge refuses the press (the message says what it needs).
        """
        owner = f"policy {name!r}"
        quantized = _quantized_spec(owner, spec)
        if quantized is not None and spec.get("press") is None:  # quantization alone: no eviction
            spec = {**spec, "press": "SnapKVPress", "compression_ratio": 0.0}
        press = spec.get("press")
        if not isinstance(press, str) or not press:
            raise PressError(owner, f"'press' must name a press class, got {press!r}")
        params = {k: v for k, v in spec.items() if k not in _POLICY_KEYS}
        params.update(spec.get("params") or {})
        try:
            problem = ratio_problem(
                press, params, spec.get("compression_ratio") is not None, spec.get("budget") is not None
            )
        except ValueError as exc:  # an unknown press, here or nested
            raise PressError(owner, str(exc)) from None
        if problem:
            raise PressError(owner, problem)
        policy = cls(
            name=name,
            press=press,
            compression_ratio=spec.get("compression_ratio"),
            budget=spec.get("budget"),
            params=params,
            quantized=quantized,
        )
        if check:
            policy.check()
        return policy

    @cached_property
    def _probe(self):
        """The press built once at a placeholder ratio: for checks and its windows."""
        ratio = (
            None
            if not self.takes_ratio
            else (_PROBE_RATIO if self.compression_ratio is None else float(self.compression_ratio))
        )
        return press_from_spec({"press": self.press, "params": self.params}, ratio, f"policy {self.name!r}")

    @property
    def takes_ratio(self) -> bool:
        """True when the press (or one it wraps) takes the policy's compression ratio."""
        return takes_ratio(self.press, self.params)

    def check(self) -> None:
        """Build the press once and ask the registry whether kvdiverge measures it.

        Raises
        ------
        kvdiverge.engine.core.errors.PressError
            As :meth:`from_config`.
        """
        reason = refusal(self.probe_press)
        if reason:
            raise PressError(f"policy {self.name!r}", reason)

    @property
    def probe_press(self):
        """The press built once at a placeholder ratio (inside its quantized cache, if any): what the
        checks that need no prompt read."""
        return self._probe if self.quantized is None else self._wrap(self._probe)

    def _wrap(self, press):
        """``press`` inside the policy's quantized cache (:class:`QuantizedCachePress`)."""
        return QuantizedCachePress(self.quantized, press)

    @property
    def min_prompt_tokens(self) -> int:
        """Shortest prompt (tokens) the policy can compress: :func:`press_min_prompt_tokens`; 1 for
        the ratio-0 control (score-based presses return the cache untouched before any window)."""
        if self.is_control or (self.budget is None and self.compression_ratio == 0.0):
            return 1
        return press_min_prompt_tokens(self._probe, self.budget)

    @property
    def is_control(self) -> bool:
        """True for the ratio-0 control (no eviction: both caches are identical)."""
        return self.budget is None and self.compression_ratio == 0.0 and self.quantized is None

    def ratio_for(self, prompt_len: int) -> float:
        """Compression ratio applied to a prompt of ``prompt_len`` tokens.

        For a fixed budget the ratio is ``1 - (budget + 0.5) / prompt_len`` so that
        ``int(prompt_len * (1 - ratio)) == budget`` exactly.

        Raises
        ------
        ValueError
            If the prompt is shorter than :attr:`min_prompt_tokens` of this policy.
        """
        need = self.min_prompt_tokens
        if prompt_len < need:
            raise ValueError(f"policy {self.name!r} needs a prompt of at least {need} tokens, got {prompt_len}")
        if self.budget is None:
            return float(self.compression_ratio or 0.0)
        return 1.0 - (self.budget + 0.5) / prompt_len

    def kept_tokens(self, prompt_len: int) -> int:
        """Prompt positions kept per layer and head after compression (tokens).

        ``kvpress.utils.compute_n_kept`` at :meth:`ratio_for`; every position for a press that
        keeps every position (:func:`keeps_every_position`).
        """
        from kvpress.utils import compute_n_kept

        if keeps_every_position(self.press):
            return int(prompt_len)
        return int(compute_n_kept(int(prompt_len), float(self.ratio_for(prompt_len))))

    def expected_kept(self, prompt_len: int, press):
        """What ``press`` must keep of a prompt of ``prompt_len`` tokens, checked after prefill.

        :func:`kvdiverge.engine.presses.registry.kept_promise` of the press built for this prompt
        (at :meth:`ratio_for`, so a budget's press promises the budget): an int for presses
        that keep the same count in every layer and head, a
        :class:`kvdiverge.engine.presses.promises.KeptPromise` for head-wise and per-layer presses,
        ``None`` for others (only checked to compress).

        Returns
        -------
        int, KeptPromise or None
        """
        return kept_promise(press if self.quantized is None else press.press, prompt_len)

    def build_press(self, prompt_len: int):
        """Instantiate the press (and the presses it wraps) for a prompt of ``prompt_len`` tokens.

        Raises
        ------
        kvdiverge.engine.core.errors.PressError
            As :meth:`from_config`.
        ValueError
            If the prompt is shorter than :attr:`min_prompt_tokens`.
        """
        ratio = self.ratio_for(prompt_len) if self.takes_ratio else None
        press = press_from_spec({"press": self.press, "params": self.params}, ratio, f"policy {self.name!r}")
        return press if self.quantized is None else self._wrap(press)


def _quantized_spec(owner: str, spec: Mapping[str, Any]):
    """The entry's :class:`QuantizedCacheSpec`, or None without ``cache``; one-sentence errors."""
    keys = {k for k in _CACHE_KEYS if k in spec}
    if not keys:
        return None
    if spec.get("cache") != "quantized":
        raise PressError(
            owner,
            f"'cache' must be 'quantized' (with backend, nbits, q_group_size, "
            f"residual_length), got {spec.get('cache')!r}",
        )
    try:
        return QuantizedCacheSpec(**{k: spec[k] for k in keys - {"cache"}})
    except ValueError as exc:
        raise PressError(owner, str(exc)) from None


def press_parameters(cls) -> set[str]:
    """Constructor parameters of a press class (its ``__init__`` signature; dataclass fields with ``init``)."""
    return set(inspect.signature(cls).parameters)


def keeps_every_position(press) -> bool:
    """True for a press that keeps every prompt position (class attribute ``keeps_every_position``).

    Parameters
    ----------
    press : str, type or press
        A press name, class or object; an unknown name is False.
    """
    if isinstance(press, str):
        try:
            press = press_class(press)
        except ValueError:
            return False
    return bool(getattr(press, "keeps_every_position", False))


def _settable(cls) -> tuple[str, ...]:
    return adapter_of(cls).settable


def takes_ratio(press: str, params: Mapping[str, Any]) -> bool:
    """True when press ``press`` with ``params`` takes a policy's compression ratio.

    The press takes it itself when its constructor has ``compression_ratio`` (and its
    registry row does not say otherwise), else the first nested press spec that does.

    Raises
    ------
    ValueError
        An unknown press name (here or nested).
    """
    cls = press_class(press)
    if not adapter_of(cls).takes_ratio:
        return False
    if "compression_ratio" in press_parameters(cls):
        return True
    return any(takes_ratio(s["press"], spec_parameters(s)) for s in inner({"press": press, "params": params}))


def ratio_problem(press: str, params: Mapping[str, Any], has_ratio: bool, has_budget: bool) -> str | None:
    """What is wrong with a policy's ``compression_ratio`` / ``budget``, or ``None``.

    A press that takes a ratio (:func:`takes_ratio`) needs exactly one of the two; one that
    takes none (``PermutationPress`` keeps every position) neither.

    Raises
    ------
    ValueError
        An unknown press name (here or nested).
    """
    return ratio_sentence(press, takes_ratio(press, params), keeps_every_position(press), has_ratio, has_budget)


def _build_value(value: Any, ratio: float | None, owner: str) -> tuple[Any, float | None]:
    """A parameter value with its nested specs built; the ratio is handed to the first that takes it."""
    if is_press_spec(value):
        take = ratio is not None and takes_ratio(value["press"], spec_parameters(value))
        return press_from_spec(value, ratio if take else None, owner), None if take else ratio
    if isinstance(value, list) and value and all(is_press_spec(v) for v in value):
        built = []
        for v in value:
            press, ratio = _build_value(v, ratio, owner)
            built.append(press)
        return built, ratio
    return value, ratio


def press_from_spec(spec: Mapping[str, Any], ratio: float | None, owner: str):
    """Build the press of a (nested) spec, its nested presses first; ``ratio`` to the press that takes it.

    Parameters
    ----------
    spec : mapping
        ``{"press": Name, **params}`` (or ``params`` under ``"params"``); press-valued
        parameters are specs of the same shape (lists of them for ``presses``).
    ratio : float or None
        The policy's compression ratio: set as ``compression_ratio`` on this press when it
        takes one, else on the first nested press that does (:func:`takes_ratio`).
    owner : str
        Who named the press, for messages (``"policy 'adakv-50'"``).

    Raises
    ------
    kvdiverge.engine.core.errors.PressError
        An unknown press or parameter (the message lists the accepted ones), a ratio given
        twice or to a press that takes none, or the constructor's own error (kvpress checks
        with ``assert``), naming the press and the cause.
    """
    try:
        cls = press_class(spec["press"])
    except ValueError as exc:
        raise PressError(owner, str(exc)) from None
    params, settable = spec_parameters(spec), _settable(cls)
    accepted = press_parameters(cls)
    unknown = sorted(set(params) - accepted - set(settable))
    if unknown:
        raise PressError(
            owner, f"{cls.__name__} has no parameter(s) {unknown}; accepted: {sorted(accepted | set(settable))}"
        )
    own = ratio is not None and "compression_ratio" in accepted and takes_ratio(spec["press"], params)
    if own and "compression_ratio" in params:
        raise PressError(owner, f"{cls.__name__}: compression_ratio is given twice (by the policy and as a parameter)")
    kwargs, rest = {}, None if own else ratio
    for key, value in params.items():
        if key not in settable:
            kwargs[key], rest = _build_value(value, rest, owner)
    if rest is not None:
        raise PressError(owner, f"{cls.__name__} takes no compression_ratio")
    if own:
        kwargs["compression_ratio"] = ratio
    try:
        press = cls(**kwargs)
    except (ImportError, AssertionError, TypeError, ValueError, AttributeError, KeyError) as exc:
        cause = str(exc).strip() or "no message"
        raise PressError(
            owner, f"{cls.__name__}({_format_kwargs(kwargs)}) failed: {type(exc).__name__}: {cause}"
        ) from None
    for key in settable:
        if key in params:
            setattr(press, key, params[key])
    return press


def _format_kwargs(kwargs: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


def press_min_prompt_tokens(press, budget: int | None = None) -> int:
    """Shortest prompt (tokens) a press can compress meaningfully.

    ``max(window_size, n_sink) + 1`` over the press and every press it wraps (an observation
    window or attention sinks must leave something to evict); a fixed ``budget`` needs
    ``budget + window_size + 1`` tokens.
    """
    window = sinks = 0
    for p in walk(press):
        for attr in ("window_size", "n_sink"):
            value = getattr(p, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                if attr == "window_size":
                    window = max(window, value)
                else:
                    sinks = max(sinks, value)
    need = max(window, sinks) + 1
    if budget is not None:
        need = max(need, int(budget) + window + 1)
    return need


def min_prompt_tokens(source) -> int:
    """Shortest prompt (tokens) a policy, press policy, config entry or other ``PressSource`` needs.

    Parameters
    ----------
    source : Policy, PressPolicy, dict or PressSource
        A config entry is read as :meth:`Policy.from_config`; a source without a
        ``min_prompt_tokens`` attribute needs 1 token.
    """
    if isinstance(source, Mapping):
        source = Policy.from_config(str(source.get("press")), dict(source))
    return int(getattr(source, "min_prompt_tokens", 1) or 1)


def policies_from_config(config: dict[str, Any]) -> dict[str, Policy]:
    """All policies of a validated config, by name."""
    return {name: Policy.from_config(name, spec) for name, spec in config["policies"].items()}


def press_build_problems(policies: Mapping[str, Any]) -> list[str]:
    """What kvpress's own checks refuse of each policy's press (an ``assert`` in its constructor), one line
    each, ``policies.<name>: <problem>``: each press built once (:meth:`Policy.from_config`). The workflow
    asks it once when a run starts (the Snakefile's ``onstart``), not at every job's parse, which reads the
    torch-free catalogue (:func:`kvdiverge.config.workflow.policy_problems`)."""
    problems = []
    for name, spec in policies.items():
        try:
            Policy.from_config(name, spec)
        except PressError as exc:
            problems.append(f"policies.{name}: {exc.problem}")
    return problems


@dataclass(frozen=True)
class PressPolicy:
    """A press object as a policy: the same press for every prompt.

    Satisfies :class:`kvdiverge.engine.refusals.PressSource`, so any kvpress press, or a user's own
    ``kvpress.BasePress`` subclass, runs through the one engine path
    (:func:`kvdiverge.engine.runner.run_policies`).

    Parameters
    ----------
    name : str
        Name of the policy in the tables (``policy`` column).
    press : kvpress.BasePress
        The press; used as it is for every prompt (a prefill press holds no per-prompt state),
        copied for each prompt when it evicts while decoding (its state after a prompt's prefill,
        the sliding window's kept lengths, is that prompt's).
    """

    name: str
    press: Any

    @property
    def min_prompt_tokens(self) -> int:
        """Shortest prompt (tokens) the press can compress: :func:`press_min_prompt_tokens`."""
        return press_min_prompt_tokens(self.press)

    @property
    def compression_ratio(self) -> float | None:
        """The press's ``compression_ratio`` (fraction of prompt positions evicted), if it has one."""
        ratio = getattr(self.press, "compression_ratio", None)
        return None if ratio is None else float(ratio)

    def build_press(self, prompt_len: int):
        """The press (a copy of it for a decode-time press), after checking that a prompt of ``prompt_len``
        tokens is long enough.

        Raises
        ------
        ValueError
            If ``prompt_len`` is below :attr:`min_prompt_tokens`.
        """
        need = self.min_prompt_tokens
        if prompt_len < need:
            raise ValueError(f"press {self.name!r} needs a prompt of at least {need} tokens, got {prompt_len}")
        return copy.deepcopy(self.press) if is_decode_time(self.press) else self.press

    def expected_kept(self, prompt_len: int, press):
        """What ``press`` must keep of a prompt of ``prompt_len`` tokens:
        :func:`kvdiverge.engine.presses.registry.kept_promise` (int, KeptPromise or ``None``)."""
        return kept_promise(press, prompt_len)
