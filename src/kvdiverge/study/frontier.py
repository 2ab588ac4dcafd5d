"""A frontier's points as policies: the one expansion the config, :func:`kvdiverge.measure` and the command line share.

The points come from :func:`kvdiverge.estimation.frontier.frontier_grid`, which checks the
labels and values (:func:`kvdiverge.estimation.frontier.frontier_problems`); here each point
becomes the policy it runs as (:func:`frontier_policy`: a config entry at the point's ratio,
budget and cache, or a press object at the point's ratio, :func:`press_at_ratio`). The config
schedules them (:func:`kvdiverge.study.config.expand_frontier`); ``kvdiverge.measure`` and
``kvdiverge measure --ratios`` name them the same way
(:func:`kvdiverge.study.inputs.frontier_presses`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from kvdiverge.estimation.frontier import FrontierPoint, FrontierSpec, frontier_grid

__all__ = [
    "cache_settings",
    "entry_takes_ratio",
    "frontier_points",
    "frontier_policy",
    "frontier_split",
    "press_at_ratio",
]


def entry_takes_ratio(entry: dict[str, Any]) -> bool:
    """True when the press of a policy entry, or a press nested in it, takes a ``compression_ratio``
    (:func:`kvdiverge.engine.presses.policies.takes_ratio`; the top-level ratio goes to the press that takes it)."""
    # lazy: kvpress loads when a press is asked; the Snakefile imports this module without torch
    from kvdiverge.engine.presses.adapters import spec_parameters
    from kvdiverge.engine.presses.policies import takes_ratio

    name = entry.get("press")
    return isinstance(name, str) and takes_ratio(name, spec_parameters(entry))


def cache_settings(settings: Mapping[str, Any] | None) -> dict[str, Any]:
    """A quantized cache's settings with the defaults filled in (``backend``, ``nbits``,
    ``q_group_size``, ``residual_length``: those of
    :class:`kvdiverge.engine.presses.quantized.QuantizedCacheSpec`), unchecked."""
    import dataclasses

    # lazy: kvpress loads when a press is asked; the Snakefile imports this module without torch
    from kvdiverge.engine.presses.quantized import QuantizedCacheSpec

    defaults = {f.name: f.default for f in dataclasses.fields(QuantizedCacheSpec)}
    return {**defaults, **{k: v for k, v in (settings or {}).items() if k != "cache"}}


def frontier_points(config: dict[str, Any]) -> list[FrontierPoint]:
    """The frontier's points (:class:`kvdiverge.estimation.frontier.FrontierPoint`) per (press,
    ratio), (press, budget), cache alone and (press, cache ratio, cache), in config order;
    empty without a ``frontier`` section
    (:func:`kvdiverge.estimation.frontier.frontier_grid`; the caches' settings with their
    defaults, :func:`cache_settings`)."""
    f = config.get("frontier")
    if not f:
        return []
    caches = {label: cache_settings(c) for label, c in (f.get("caches") or {}).items()}
    return frontier_grid(
        list(f["presses"]), FrontierSpec(f.get("ratios"), f.get("budgets"), caches, f.get("cache_ratios"))
    )


def frontier_split(config: dict[str, Any]) -> str | None:
    """The split the frontier runs on (``frontier.split``, default exploratory), or None."""
    f = config.get("frontier")
    return f.get("split", "exploratory") if f else None


def press_at_ratio(press: Any, ratio: float, name: str) -> Any:
    """A copy of a press object with ``compression_ratio = ratio`` set on the press that takes
    it (the press itself, else the press it wraps, ``.press``).

    Raises
    ------
    ValueError
        If neither the press nor a press it wraps takes a ``compression_ratio``.
    """
    import dataclasses

    if dataclasses.is_dataclass(press) and not isinstance(press, type):
        fields = {f.name for f in dataclasses.fields(press) if f.init}
        if "compression_ratio" in fields:
            return dataclasses.replace(press, compression_ratio=float(ratio))
        if "press" in fields and getattr(press, "press", None) is not None:
            return dataclasses.replace(press, press=press_at_ratio(press.press, ratio, name))
    raise ValueError(
        f"press {name!r}: {type(press).__name__} takes no compression_ratio (nor does a press "
        f"it wraps), so a frontier cannot vary it"
    )


def frontier_policy(press: Any, point: FrontierPoint) -> Any:
    """The policy of one frontier point: the press's entry with the point's
    ``compression_ratio`` (or ``budget``) and, at a quantized-cache point, the cache's keys
    (``cache: quantized``, ``backend``, ``nbits``, ...); a cache alone is the cache's keys
    only; or a press object at the point's ratio (:func:`press_at_ratio`).

    Parameters
    ----------
    press : mapping, kvpress press or None
        A policy entry without its ratio (``{"press": "SnapKVPress", "window_size": 16}``),
        or a press object; None for a cache alone.
    point : kvdiverge.estimation.frontier.FrontierPoint
        A point of :func:`kvdiverge.estimation.frontier.frontier_grid`.

    Raises
    ------
    ValueError
        An entry that already gives ``compression_ratio``, ``budget`` or a cache key, a
        budget or a quantized cache for a press object, or a press object that takes no ratio.
    """
    cache = point.cache_settings
    keys = {} if cache is None else {"cache": "quantized", **cache}
    if point.press is None:
        return keys
    label = point.press
    if isinstance(press, Mapping):
        for key in ("compression_ratio", "budget", "cache", "backend", "nbits", "q_group_size", "residual_length"):
            if press.get(key) is not None:
                raise ValueError(f"press {label!r}: give it without {key}; the frontier sets it")
        extra = {"compression_ratio": point.compression_ratio} if point.budget is None else {"budget": point.budget}
        return {**copy.deepcopy(dict(press)), **extra, **keys}
    if point.budget is not None or cache is not None:
        what = "a fixed budget" if cache is None else "a quantized cache"
        raise ValueError(
            f"press {label!r}: {what} needs a policy entry ({{'press': 'SnapKVPress', ...}}), not a press object"
        )
    return press_at_ratio(press, point.compression_ratio, label)
