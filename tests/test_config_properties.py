"""Property-based tests of the config validator: a random config validates or raises ConfigError.

Random edits of the shipped configs (a value replaced by a random one of any JSON type,
NaN and infinities included; a key removed; an unknown key added; a policy's press or
parameters replaced) must either validate or stop with :class:`ConfigError`, whose lines
each name a key, never any other exception.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvdiverge.config.workflow import ConfigError, validate

ROOT = Path(__file__).resolve().parents[1]
BASES = {name: yaml.safe_load((ROOT / "config" / name).read_text()) for name in ("smoke.yaml", "frontier.yaml")}
PRESSES = [
    "SnapKVPress",
    "KnormPress",
    "AdaKVPress",
    "PermutationPress",
    "DecodingPress",
    "NoSuchPress",
    "FinchPress",
    "ThinKPress",
    "PyramidKVPress",
    "DMSPress",
    "BasePress",
    "ScorerPress",
]
PARAMETERS = [
    "compression_ratio",
    "budget",
    "window_size",
    "press",
    "seed",
    "n_sink",
    "decoding",
    "threshold",
    "key_channel_compression_ratio",
    "params",
    "press@",
    "",
]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=True),
    st.sampled_from([math.nan, math.inf, -math.inf, -1, 0, 0.0, 0.5, 1.0, 1.5, 10**12]),
    st.text(max_size=12),
    st.sampled_from(PRESSES + PARAMETERS),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(PARAMETERS + PRESSES), inner, max_size=3)
    ),
    max_leaves=6,
)


def paths(node, prefix=()):
    """Every key path of a nested config (mapping keys and list indices)."""
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for k, v in node.items():
            out += paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += paths(v, prefix + (i,))
    return out


def _number(config, path) -> bool:
    node = config
    for key in path:
        node = node[key]
    return isinstance(node, (int, float)) and not isinstance(node, bool)


@st.composite
def edited_configs(draw):
    config = copy.deepcopy(BASES[draw(st.sampled_from(sorted(BASES)))])
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(paths(config)))
        parent = config
        for key in where[:-1]:
            parent = parent[key]
        kind = draw(st.sampled_from(["replace", "number", "number", "number", "remove", "add", "press"]))
        if kind == "number":  # a number where one stands: NaN, infinities, out of range, a fraction for a count
            numbers = [p for p in paths(config) if _number(config, p)]
            if numbers:
                where = draw(st.sampled_from(numbers))
                parent = config
                for key in where[:-1]:
                    parent = parent[key]
                parent[where[-1]] = draw(st.sampled_from([math.nan, math.inf, -math.inf, -1, 0, 2.7, 1e300, True]))
        elif kind == "replace":
            parent[where[-1]] = draw(values)
        elif kind == "remove":
            del parent[where[-1]]
        elif kind == "add" and isinstance(parent, dict):
            parent[draw(st.sampled_from(PARAMETERS + ["unknown", "policies", "runs"]))] = draw(values)
        elif kind == "press":
            config.setdefault("policies", {})
            if isinstance(config["policies"], dict):
                entry = {"press": draw(st.sampled_from(PRESSES))}
                entry.update(draw(st.dictionaries(st.sampled_from(PARAMETERS), values, max_size=3)))
                config["policies"][draw(st.sampled_from(["snapkv-50", "new", "noise-floor"]))] = entry
        if not paths(config):
            break
    return config


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(edited_configs())
def test_a_random_config_validates_or_raises_config_error(config):
    try:
        validate(config)
    except ConfigError as exc:
        lines = str(exc).splitlines()
        assert lines and all(line.strip() for line in lines), str(exc)


SPECIAL = [math.nan, math.inf, -math.inf, -1, 0, 2.7, 1e300, True, "0.5", None]
NUMBER_EDITS = [
    (base, path, value)
    for base in sorted(BASES)
    for path in paths(BASES[base])
    if _number(BASES[base], path)
    for value in SPECIAL
]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(NUMBER_EDITS))
def test_a_special_number_at_any_numeric_key_validates_or_raises_config_error(edit):
    base, path, value = edit
    config = copy.deepcopy(BASES[base])
    parent = config
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    try:
        validate(config)
    except ConfigError as exc:
        key = [p for p in path if isinstance(p, str)][-1]
        assert key in str(exc), (path, value, str(exc))  # the refusal names the key
