"""A frontier's points as policies: the one expansion the config, :func:`kvdiverge.measure` and the command line share.

Each point is an ordinary policy named ``<press>@<ratio>`` (``snapkv@0.5``), ``<press>@b<budget>``
(``snapkv@b128``), ``<cache>`` (a quantized cache alone, ``int4``) or ``<press>@<ratio>+<cache>``
(evict, then quantize what is kept: ``snapkv@0.5+int4``; :func:`frontier_name`).
:func:`frontier_grid` makes the points (:class:`kvdiverge.estimation.frontier.FrontierPoint`)
from the presses and a :class:`FrontierSpec` (the ratios, budgets, caches and cache ratios),
after :func:`frontier_problems` has checked the labels and values, one sentence per problem.
Each point then becomes the policy it runs as (:func:`frontier_policy`: a config entry at the
point's ratio, budget and cache, or a press object at the point's ratio, :func:`press_at_ratio`).
The config schedules them (:func:`kvdiverge.config.workflow.expand_frontier`); ``kvdiverge.measure``
and ``kvdiverge measure --ratios`` name them the same way
(:func:`kvdiverge.config.inputs.frontier_presses`).
"""

from __future__ import annotations

import copy
import dataclasses
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvdiverge.engine.presses import catalogue
from kvdiverge.engine.presses.cache_facts import QuantizedCacheSpec
from kvdiverge.estimation.frontier import FrontierPoint

__all__ = [
    "FrontierSpec",
    "cache_settings",
    "entry_takes_ratio",
    "frontier_grid",
    "frontier_name",
    "frontier_points",
    "frontier_problems",
    "frontier_policy",
    "frontier_split",
    "press_at_ratio",
    "spec_problems",
]

#: Settings of a quantized cache the frontier's bytes need (``backend``, ``nbits``, ``q_group_size``).
_CACHE_KEYS = ("backend", "nbits", "q_group_size")


# --------------------------------------------------------------------------- names and the grid


def frontier_name(
    press: str | None, ratio: float | None = None, budget: int | None = None, cache: str | None = None
) -> str:
    """Policy name of one frontier point.

    ``press@<ratio>`` or ``press@b<budget>`` at full precision; ``press@<ratio>+<cache>``
    with a quantized cache after the press; ``<cache>`` for a cache alone (``press`` None,
    no ratio or budget). The ratio is written in the shortest ``%g`` form (``0.5``, ``0``).

    Raises
    ------
    ValueError
        If not exactly one of ``ratio`` and ``budget`` is given with a press, a cache
        alone gets a ratio or budget, or a budget comes with a cache.
    """
    if press is None:
        if cache is None or ratio is not None or budget is not None:
            raise ValueError("a frontier point without a press is a quantized cache alone: give only the cache")
        return cache
    if (ratio is None) == (budget is None):
        raise ValueError(f"frontier point of {press!r}: give exactly one of ratio or budget")
    if cache is not None and budget is not None:
        raise ValueError(f"frontier point of {press!r}: a quantized cache goes with ratios, not budgets")
    name = f"{press}@{float(ratio):g}" if ratio is not None else f"{press}@b{int(budget)}"
    return name if cache is None else f"{name}+{cache}"


@dataclass(frozen=True)
class FrontierSpec:
    """What a frontier varies besides its presses: ratios, budgets, quantized caches, ratios before a cache.

    Holds the values as given (the lists as tuples, a mapping of caches as a dict, None as
    empty; a value of another kind, such as a single number, as it is); :func:`frontier_problems`
    checks them, :func:`frontier_grid` expands them into points.

    Parameters
    ----------
    ratios : sequence of float
        Compression ratios, fractions of prompt positions evicted, in ``[0, 1)`` (config
        ``frontier.ratios``).
    budgets : sequence of int
        Fixed numbers of prompt positions kept (tokens), ``>= 1``; full precision only
        (``frontier.budgets``).
    caches : mapping of str to mapping
        Quantized caches by label (``frontier.caches``): ``backend``, ``nbits``,
        ``q_group_size`` (and ``residual_length``); a label's settings may be None where only
        the labels are checked.
    cache_ratios : sequence of float or None
        Ratios of the press before each cache, in ``[0, 1)``; 0 is the cache alone
        (``frontier.cache_ratios``). None: 0 and every ratio of ``ratios``.
    """

    ratios: Sequence[Any] = ()
    budgets: Sequence[Any] = ()
    caches: Mapping[str, Any] = field(default_factory=dict)
    cache_ratios: Sequence[Any] | None = None

    def __post_init__(self) -> None:  # a value of the wrong kind stays as given, for spec_problems to name
        for name in ("ratios", "budgets", "cache_ratios"):
            value = getattr(self, name)
            if value is None and name != "cache_ratios":
                object.__setattr__(self, name, ())
            elif _listlike(value):
                object.__setattr__(self, name, tuple(value))
        caches = {} if self.caches is None else self.caches
        object.__setattr__(self, "caches", dict(caches) if isinstance(caches, Mapping) else caches)

    @classmethod
    def of(cls, block: FrontierSpec | Mapping[str, Any] | None) -> FrontierSpec:
        """``block`` itself, or the spec of a config's ``frontier`` section or a mapping of the fields
        (other keys, such as ``presses`` and ``split``, ignored); None or empty: no ratio, budget or cache."""
        if isinstance(block, cls):
            return block
        block = block or {}
        return cls(*(block.get(k) for k in ("ratios", "budgets", "caches", "cache_ratios")))


def _listlike(value: Any) -> bool:
    """A collection of values: iterable, and not a string, bytes or a mapping."""
    return isinstance(value, Iterable) and not isinstance(value, (str, bytes, Mapping))


#: What each list of a :class:`FrontierSpec` holds, in words.
_LISTS = {
    "ratios": ("compression ratios", "numbers in [0, 1)"),
    "budgets": ("token budgets", "integers >= 1"),
    "cache_ratios": ("compression ratios", "numbers in [0, 1)"),
}


def spec_problems(spec: FrontierSpec) -> list[str]:
    """What is wrong with the kinds of a spec's values and how they go together, one sentence each.

    ``ratios``, ``budgets`` and ``cache_ratios`` must be lists (a string or a single number is
    not), ``caches`` a mapping of label to settings; ``cache_ratios`` needs ``caches``, and caches
    are frontier points, so they need ``ratios`` or ``budgets``. :func:`frontier_problems` asks
    this first; the values inside are its own to check.
    """
    problems = [
        f"{key}: {value!r} is not a list of {what}; allowed: a list of {allowed}"
        for key, (what, allowed) in _LISTS.items()
        if (value := getattr(spec, key)) is not None and not isinstance(value, tuple)
    ]
    if not isinstance(spec.caches, Mapping):
        problems.append(
            f"caches must map a label to a quantized cache's settings ({{'int4': {{'nbits': 4}}}}), "
            f"got {type(spec.caches).__name__}"
        )
    elif spec.cache_ratios is not None and not spec.caches:
        problems.append("cache_ratios: given without caches, which it needs")
    elif spec.caches and not spec.ratios and not spec.budgets:
        problems.append(
            "caches and cache_ratios are frontier points: give ratios too (or pass a quantized cache "
            "as a press, {'int4': {'cache': 'quantized', 'nbits': 4}})"
        )
    return problems


def _ratio_problem(key: str, r: Any) -> str | None:
    if isinstance(r, bool) or not isinstance(r, numbers.Real) or not 0 <= float(r) < 1:
        return f"{key}: {r!r} is not a compression ratio; allowed: numbers in [0, 1)"
    return None


def frontier_problems(
    presses: Iterable[str], spec: FrontierSpec = FrontierSpec(), policies: Iterable[str] = ()
) -> list[str]:
    """What is wrong with a frontier's labels and values, one sentence each: the one check every door uses.

    The config (:func:`kvdiverge.config.workflow.expand_frontier`), :func:`kvdiverge.measure`
    and the command line (:func:`kvdiverge.config.inputs.frontier_presses`) expand a frontier
    through :func:`frontier_grid`, which raises the first of these.

    Parameters
    ----------
    presses : iterable of str
        Press labels: no ``@`` or ``+`` (reserved for the points' names).
    spec : FrontierSpec
        Its kinds first (:func:`spec_problems`; when they are wrong, only those are returned).
        Its ``ratios`` and ``cache_ratios`` must be numbers in ``[0, 1)``, its ``budgets``
        integers ``>= 1``; its ``caches``: no ``@`` or ``+`` in a label, no label equal to a
        press label, settings with ``backend``, ``nbits`` and ``q_group_size`` (None: not
        checked).
    policies : iterable of str
        Names of the other policies beside the frontier (a config's own): no ``@``.

    Returns
    -------
    list of str
        Empty when the frontier is well formed.
    """
    presses, caches, problems = [str(p) for p in presses], spec.caches, spec_problems(spec)
    if problems:  # the values inside are read only when the lists are lists
        return problems
    problems += [
        f"press {p!r}: {mark!r} in a press name is reserved for the frontier's {form} names; rename it"
        for p in presses
        for mark, form in (("@", "<press>@<ratio>"), ("+", "<press>@<ratio>+<cache>"))
        if mark in p
    ]
    problems += [
        q
        for key, rs in (("ratios", spec.ratios), ("cache_ratios", spec.cache_ratios or ()))
        for r in rs
        if (q := _ratio_problem(key, r))
    ]
    problems += [
        f"budgets: {b!r} is not a number of tokens; allowed: integers >= 1"
        for b in spec.budgets
        if isinstance(b, bool) or not isinstance(b, numbers.Integral) or b < 1
    ]
    for c, settings in caches.items():
        if "@" in str(c) or "+" in str(c):
            problems.append(
                f"cache {c!r}: '@' and '+' in a cache label are reserved for the frontier's "
                f"<press>@<ratio>+<cache> names; rename it"
            )
        if c in presses:
            problems.append(f"cache {c!r}: the label is also a press label; give the cache another label")
        missing = [k for k in _CACHE_KEYS if not isinstance(settings, Mapping) or settings.get(k) is None]
        if missing and settings is not None:
            problems.append(f"cache {c!r}: its settings need {', '.join(_CACHE_KEYS)} (missing {', '.join(missing)})")
    problems += [
        f"policies.{name}: '@' in a policy name is reserved for the frontier's <press>@<ratio> policies"
        for name in policies
        if "@" in name
    ]
    return problems


def frontier_grid(presses: Iterable[str], spec: FrontierSpec) -> list[FrontierPoint]:
    """Every frontier point: each press at each ratio and budget, then each cache alone and after each press.

    Parameters
    ----------
    presses : iterable of str
        Press labels (config ``frontier.presses`` keys).
    spec : FrontierSpec
        The ratios, budgets, quantized caches (their settings complete) and ratios before
        each cache; a cache ratio of 0 is the cache alone (one point per cache, whatever
        the press).

    Returns
    -------
    list of FrontierPoint
        A cache alone has ``press`` None and ratio 0; full-precision points have ``cache``
        and ``cache_settings`` None; the unused one of ratio and budget is None. In press
        order (ratios, then budgets), then cache order (alone, then each press at each
        cache ratio above 0).

    Raises
    ------
    ValueError
        The first of :func:`frontier_problems`, or two points with the same name.
    """
    presses = list(presses)
    problems = frontier_problems(presses, spec)
    if problems:
        raise ValueError(problems[0])
    cache_ratios = (0.0, *spec.ratios) if spec.cache_ratios is None else spec.cache_ratios
    out: list[FrontierPoint] = []
    for press in presses:
        out += [FrontierPoint(frontier_name(press, ratio=r), press, float(r)) for r in spec.ratios]
        out += [FrontierPoint(frontier_name(press, budget=b), press, None, int(b)) for b in spec.budgets]
    for cache, settings in spec.caches.items():
        if any(float(r) == 0 for r in cache_ratios):
            out.append(FrontierPoint(frontier_name(None, cache=cache), None, 0.0, None, cache, dict(settings)))
        out += [
            FrontierPoint(frontier_name(press, ratio=r, cache=cache), press, r, None, cache, dict(settings))
            for press in presses
            for r in dict.fromkeys(float(r) for r in cache_ratios)
            if r > 0
        ]
    names = [p.policy for p in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"frontier points share the names {dup}: give ratios that differ in %g form")
    return out


# --------------------------------------------------------------------------- points as policies


def entry_takes_ratio(entry: dict[str, Any]) -> bool:
    """True when the press of a policy entry, or a press nested in it, takes a ``compression_ratio``
    (:func:`kvdiverge.engine.presses.catalogue.takes_ratio`; the top-level ratio goes to the press that takes it).

    Raises
    ------
    ValueError, LookupError
        As :func:`kvdiverge.engine.presses.catalogue.record`, for an unknown press here or nested.
    """
    name = entry.get("press")
    return isinstance(name, str) and catalogue.takes_ratio(name, catalogue.spec_parameters(entry))


def cache_settings(settings: Mapping[str, Any] | None) -> dict[str, Any]:
    """A quantized cache's settings with the defaults filled in (``backend``, ``nbits``,
    ``q_group_size``, ``residual_length``: those of
    :class:`kvdiverge.engine.presses.cache_facts.QuantizedCacheSpec`), unchecked."""
    defaults = {f.name: f.default for f in dataclasses.fields(QuantizedCacheSpec)}
    return {**defaults, **{k: v for k, v in (settings or {}).items() if k != "cache"}}


def frontier_points(config: dict[str, Any]) -> list[FrontierPoint]:
    """The frontier's points (:class:`kvdiverge.estimation.frontier.FrontierPoint`) per (press,
    ratio), (press, budget), cache alone and (press, cache ratio, cache), in config order;
    empty without a ``frontier`` section (:func:`frontier_grid`; the caches' settings with their
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
        A point of :func:`frontier_grid`.

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
