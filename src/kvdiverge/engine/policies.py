"""Eviction policies: config entries mapped onto NVIDIA kvpress presses.

A policy is a config entry such as::

    snapkv-50:   {press: SnapKVPress, compression_ratio: 0.5, window_size: 64, kernel_size: 5}
    snapkv-b512: {press: SnapKVPress, budget: 512, window_size: 64, kernel_size: 5}
    recent-50:   {press: StreamingLLMPress, compression_ratio: 0.5, n_sink: 4}
    none:        {press: SnapKVPress, compression_ratio: 0.0}

Any press that ``kvpress`` exports can be named, and the project's own presses
(:data:`kvdiverge.engine.presses.PROJECT_PRESSES`, e.g. the noise-floor control
``PermutationPress``, which keeps every position and takes neither a ratio nor a
budget)::

    noise-floor: {press: PermutationPress, seed: 0}

Parameters other than
``compression_ratio`` / ``budget`` are passed to its constructor (``params`` holds
extra ones). Presses compress the prompt cache once, during prefill
(kvpress, https://github.com/NVIDIA/kvpress).

A fixed token ``budget`` becomes a per-document compression ratio chosen so that
kvpress keeps exactly ``budget`` positions (``kvpress.utils.compute_n_kept``).
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any

#: Keys of a policy entry that are not constructor parameters of the press.
_POLICY_KEYS = {"press", "compression_ratio", "budget", "params"}


@dataclass(frozen=True)
class Policy:
    """One eviction policy of the config.

    Parameters
    ----------
    name : str
        Policy name (config key), e.g. ``"snapkv-50"``.
    press : str
        Name of a press class exported by ``kvpress``, e.g. ``"SnapKVPress"``.
    compression_ratio : float or None
        Fraction of prompt positions evicted (retention = 1 - compression_ratio).
    budget : int or None
        Fixed number of prompt positions kept (tokens); exclusive with
        ``compression_ratio``.
    params : dict
        Other constructor parameters of the press (``window_size``, ``kernel_size``,
        ``n_sink``, ...).
    """

    name: str
    press: str
    compression_ratio: float | None = None
    budget: int | None = None
    params: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_config(cls, name: str, spec: dict[str, Any]) -> "Policy":
        """Build a policy from its config entry.

        Raises
        ------
        ValueError
            If both or neither of ``compression_ratio`` and ``budget`` are given (a
            press that keeps every position, such as ``PermutationPress``, takes neither).
        """
        has_ratio = spec.get("compression_ratio") is not None
        has_budget = spec.get("budget") is not None
        keeps_all = keeps_every_position(spec.get("press", ""))
        if keeps_all and (has_ratio or has_budget):
            raise ValueError(
                f"policy {name!r}: {spec['press']} keeps every prompt position; "
                f"give neither 'compression_ratio' nor 'budget'"
            )
        if not keeps_all and has_ratio == has_budget:
            raise ValueError(
                f"policy {name!r}: give exactly one of 'compression_ratio' or 'budget'"
            )
        params = {k: v for k, v in spec.items() if k not in _POLICY_KEYS}
        params.update(spec.get("params") or {})
        return cls(
            name=name,
            press=spec["press"],
            compression_ratio=spec.get("compression_ratio"),
            budget=spec.get("budget"),
            params=params,
        )

    @property
    def is_control(self) -> bool:
        """True for the ratio-0 control (no eviction: both caches are identical)."""
        return self.budget is None and self.compression_ratio == 0.0

    def ratio_for(self, prompt_len: int) -> float:
        """Compression ratio applied to a prompt of ``prompt_len`` tokens.

        For a fixed budget the ratio is ``1 - (budget + 0.5) / prompt_len`` so that
        ``int(prompt_len * (1 - ratio)) == budget`` exactly.

        Raises
        ------
        ValueError
            If the prompt is shorter than ``min_prompt_tokens`` of this policy.
        """
        need = min_prompt_tokens(self)
        if prompt_len < need:
            raise ValueError(
                f"policy {self.name!r} needs a prompt of at least {need} tokens, got {prompt_len}"
            )
        if self.budget is None:
            return float(self.compression_ratio or 0.0)
        return 1.0 - (self.budget + 0.5) / prompt_len

    def kept_tokens(self, prompt_len: int) -> int:
        """Prompt positions kept per layer and head after compression (tokens).

        Follows ``kvpress.utils.compute_n_kept`` for score-based presses.
        """
        if keeps_every_position(self.press):
            return int(prompt_len)
        ratio = self.ratio_for(prompt_len)
        if ratio == 0:
            return prompt_len
        return max(1, int(prompt_len * (1 - ratio)))

    def expected_kept(self, prompt_len: int, press):
        """What ``press`` must keep of a prompt of ``prompt_len`` tokens, checked after prefill.

        Score-based presses (``kvpress.ScorerPress``) that shorten every layer alike keep
        exactly :meth:`kept_tokens` in every layer and head (an int); project presses say
        themselves (``press.kept_tokens(prompt_len)``: ``PermutationPress`` keeps all
        ``prompt_len``); head-wise and per-layer presses (AdaKV, CriticalAdaKV, PyramidKV,
        ``PerLayerCompressionPress``, structured KVCompose) get their
        :class:`kvdiverge.engine.promises.KeptPromise`; other presses ``None`` (only
        checked to compress).

        Returns
        -------
        int, KeptPromise or None
        """
        from kvpress import PyramidKVPress, ScorerPress

        from kvdiverge.engine.promises import kept_promise

        if isinstance(press, ScorerPress) and not isinstance(press, PyramidKVPress):
            return self.kept_tokens(prompt_len)
        own = getattr(press, "kept_tokens", None)
        if callable(own):
            return int(own(prompt_len))
        return kept_promise(press, prompt_len)

    def build_press(self, prompt_len: int):
        """Instantiate the kvpress press for a prompt of ``prompt_len`` tokens.

        Raises
        ------
        ValueError
            If ``press`` is not a press exported by kvpress, or a parameter is not
            accepted by it (the message lists the accepted ones).
        """
        cls = press_class(self.press)
        names = press_parameters(cls)
        unknown = sorted(set(self.params) - names)
        if unknown:
            raise ValueError(
                f"policy {self.name!r}: {cls.__name__} has no parameter(s) {unknown}; "
                f"accepted: {sorted(names)}"
            )
        kwargs = dict(self.params)
        if "compression_ratio" in names:
            kwargs["compression_ratio"] = self.ratio_for(prompt_len)
        elif self.budget is not None or self.compression_ratio:
            raise ValueError(f"policy {self.name!r}: {cls.__name__} takes no compression_ratio")
        return cls(**kwargs)


def press_parameters(cls) -> set[str]:
    """Constructor parameters of a press class: its dataclass fields, else its signature."""
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls) if f.init}
    return set(inspect.signature(cls).parameters)


#: Project presses that keep every prompt position (no ratio, no budget).
_KEEP_ALL_PRESSES = {"PermutationPress"}


def keeps_every_position(press: str) -> bool:
    """True for a project press that keeps every prompt position (``PermutationPress``)."""
    return press in _KEEP_ALL_PRESSES


def press_class(name: str):
    """Return the press class called ``name``: a project press or one kvpress exports.

    Project presses (:data:`kvdiverge.engine.presses.PROJECT_PRESSES`) are looked up first.

    Raises
    ------
    ValueError
        If neither the project nor kvpress has a press of that name (the message lists
        the presses).
    """
    import kvpress

    from kvdiverge.engine.presses import PROJECT_PRESSES

    if name in PROJECT_PRESSES:
        return PROJECT_PRESSES[name]
    cls = getattr(kvpress, name, None)
    if not (isinstance(cls, type) and issubclass(cls, kvpress.BasePress)):
        presses = sorted(
            [n for n in dir(kvpress)
             if isinstance(getattr(kvpress, n), type) and issubclass(getattr(kvpress, n), kvpress.BasePress)]
            + list(PROJECT_PRESSES)
        )
        raise ValueError(f"unknown press {name!r}; available: {', '.join(presses)}")
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

    import kvpress

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

def min_prompt_tokens(policy: Policy | dict[str, Any]) -> int:
    """Shortest prompt (tokens) the policy can compress meaningfully.

    A fixed budget needs ``budget + window_size + 1`` tokens (something must be
    evicted outside the observation window); a press with an observation window
    needs ``window_size + 1`` tokens; a press with attention sinks ``n_sink + 1``.

    Parameters
    ----------
    policy : Policy or dict
        A policy or its config entry.
    """
    if isinstance(policy, dict):
        params = {k: v for k, v in policy.items() if k not in _POLICY_KEYS}
        params.update(policy.get("params") or {})
        budget = policy.get("budget")
    else:
        params, budget = policy.params, policy.budget
    window = int(params.get("window_size", 0) or 0)
    sinks = int(params.get("n_sink", 0) or 0)
    need = max(window, sinks) + 1
    if budget is not None:
        need = max(need, int(budget) + window + 1)
    return need


def policies_from_config(config: dict[str, Any]) -> dict[str, Policy]:
    """All policies of a validated config, by name."""
    return {name: Policy.from_config(name, spec) for name, spec in config["policies"].items()}


def _nested_presses(press) -> list:
    """``press`` and every press it wraps (``.press`` of wrappers, ``.presses`` of compositions)."""
    out, todo = [], [press]
    while todo:
        p = todo.pop()
        out.append(p)
        inner = getattr(p, "press", None)
        if inner is not None and inner is not p:
            todo.append(inner)
        todo.extend(getattr(p, "presses", None) or [])
    return out


@dataclass(frozen=True)
class PressPolicy:
    """A press object as a policy: the same press for every prompt.

    Satisfies :class:`kvdiverge.engine.runner.PressSource`, so any kvpress press, or a user's own
    ``kvpress.BasePress`` subclass, runs through the one engine path
    (:func:`kvdiverge.engine.runner.run_documents`).

    Parameters
    ----------
    name : str
        Name of the policy in the tables (``policy`` column).
    press : kvpress.BasePress
        The press; used as it is for every prompt (presses hold no per-prompt state).
    """

    name: str
    press: Any

    @property
    def min_prompt_tokens(self) -> int:
        """Shortest prompt (tokens) the press can compress: like :func:`min_prompt_tokens`,
        ``max(window_size, n_sink) + 1`` over the press and the presses it wraps."""
        need = 1
        for p in _nested_presses(self.press):
            for attr in ("window_size", "n_sink"):
                value = getattr(p, attr, None)
                if isinstance(value, int) and not isinstance(value, bool):
                    need = max(need, value + 1)
        return need

    @property
    def compression_ratio(self) -> float | None:
        """The press's ``compression_ratio`` (fraction of prompt positions evicted), if it has one."""
        ratio = getattr(self.press, "compression_ratio", None)
        return None if ratio is None else float(ratio)

    def build_press(self, prompt_len: int):
        """The press, after checking that a prompt of ``prompt_len`` tokens is long enough.

        Raises
        ------
        ValueError
            If ``prompt_len`` is below :attr:`min_prompt_tokens`.
        """
        need = self.min_prompt_tokens
        if prompt_len < need:
            raise ValueError(
                f"press {self.name!r} needs a prompt of at least {need} tokens, got {prompt_len}"
            )
        return self.press

    def expected_kept(self, prompt_len: int, press):
        """What ``press`` must keep (tokens): ``kvpress.utils.compute_n_kept`` in every layer
        and head for score-based presses that shorten every layer alike (all of them at ratio
        0, an int), a :class:`kvdiverge.engine.promises.KeptPromise` for head-wise and
        per-layer presses, ``None`` for others."""
        from kvpress import PyramidKVPress, ScorerPress

        from kvdiverge.engine.promises import kept_promise

        if not isinstance(press, ScorerPress) or isinstance(press, PyramidKVPress):
            return kept_promise(press, prompt_len)
        ratio = float(press.compression_ratio)
        return prompt_len if ratio == 0 else max(1, int(prompt_len * (1 - ratio)))
