"""Reading a workflow config: YAML refusing duplicate keys, the schema's validator, and its errors as sentences.

:func:`read_yaml` composes a file before loading it, so that a key given twice in one mapping is named
with its lines instead of silently replaced. :func:`schema_validator` validates against the config
schema and fills its defaults; :func:`format_error` turns each ``jsonschema.ValidationError`` into one
line naming the key path (:func:`key_path`) and what is allowed; :func:`non_finite_problems` names the
NaN and infinite numbers a schema bound lets through. :mod:`kvdiverge.config.workflow` composes them
into :func:`~kvdiverge.config.workflow.validate` and :func:`~kvdiverge.config.workflow.load_config`,
and raises :class:`ConfigError` (importable from there too).
"""

from __future__ import annotations

import copy
import datetime
import math
import os
from pathlib import Path
from typing import Any, Iterable

import yaml

__all__ = ["ConfigError", "read_yaml", "key_path", "format_error", "schema_validator", "non_finite_problems"]


class ConfigError(ValueError):
    """The config is invalid; the message names every offending key."""


def _duplicate_keys(node, parts: tuple = ()) -> Iterable[str]:
    """Sentences naming each key that appears twice in one mapping of a composed YAML node tree."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key, value in node.value:
            name = key.value if isinstance(key, yaml.ScalarNode) else None
            line = key.start_mark.line + 1
            if name is not None and name != "<<" and name in seen:
                where = f" in {key_path(parts)}" if parts else ""
                yield (
                    f"duplicate key {name!r}{where} at lines {seen[name]} and {line} "
                    f"(a key may appear once in a mapping; the later entry would silently replace the earlier)"
                )
            elif name is not None:
                seen[name] = line
            yield from _duplicate_keys(value, parts + (name,))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            yield from _duplicate_keys(item, parts + (i,))


def read_yaml(path: str | os.PathLike) -> Any:
    """Read a YAML file, refusing a key that appears twice in one mapping.

    PyYAML (and so Snakemake's ``--configfile``) keeps the last of two equal keys without
    a word; here the file is composed first and every duplicate is named with its lines.

    Raises
    ------
    ConfigError
        A duplicate key (``path: duplicate key 'snapkv-50' in policies at lines 12 and 15 ...``),
        a file that is not YAML, or one that is not text (UTF-8).
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not a text file: byte {exc.object[exc.start]:#04x} at offset {exc.start} is not UTF-8; "
            f"a config is a YAML text file"
        ) from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
    duplicates = list(_duplicate_keys(node)) if node is not None else []
    if duplicates:
        raise ConfigError(f"{path}: " + "; ".join(duplicates))
    return yaml.safe_load(text)


def key_path(parts: Iterable[Any]) -> str:
    """A key path as the config spells it: ``policies.snapkv-50.compression_ratio``, ``frontier.ratios[2]``."""
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "<top level>"


def _allowed_keys(schema: dict[str, Any]) -> list[str]:
    return sorted(schema.get("properties", {}))


def _foreign_source_key(error, where: str) -> str:
    """:func:`format_error` of an entry's key that belongs to another kind (the schema's ``dependentSchemas``:
    a model entry's key of another ``source``, a policy's key of another ``cache``), naming the key, its
    kinds and the entry's."""
    path, at = list(error.schema_path), list(error.absolute_path)
    key = key_path([*at[:-1], path[path.index("dependentSchemas") + 1]])
    kind = str(at[-1]) if at else "source"
    return (
        f"{key}: a key of {kind} {' or '.join(error.validator_value)}, which {kind} {error.instance!r} "
        f"({where}) would ignore; remove it or change the {kind}"
    )


def format_error(error) -> str:
    """One readable line for a ``jsonschema.ValidationError``: key path, problem, allowed values."""
    where = key_path(error.absolute_path)
    v, s = error.validator, error.schema
    if v == "additionalProperties" and isinstance(error.instance, dict):
        known = set(s.get("properties", {}))
        extra = sorted(k for k in error.instance if k not in known)
        keys = ", ".join(key_path([*error.absolute_path, k]) for k in extra)
        return f"unknown config key {keys}; allowed keys at {where}: {', '.join(_allowed_keys(s)) or 'none'}"
    if v == "required":
        missing = [k for k in error.validator_value if k not in error.instance]
        keys = ", ".join(key_path([*error.absolute_path, k]) for k in missing)
        return f"missing config key {keys}"
    if "dependentSchemas" in error.schema_path and v == "enum":  # a key of another model source
        return _foreign_source_key(error, where)
    if v == "enum":
        allowed = ", ".join(repr(x) for x in error.validator_value)
        return f"{where}: {error.instance!r} is not allowed; allowed values: {allowed}"
    if v == "const":
        return f"{where}: must be {error.validator_value!r}, got {error.instance!r}"
    if v == "type" and isinstance(error.instance, datetime.date):
        return (
            f"{where}: {error.instance!r} has the wrong type; expected a string: quote the "
            f'date ("{error.instance.isoformat()}"), YAML reads an unquoted date as a date object'
        )
    if v == "type":
        return f"{where}: {error.instance!r} has the wrong type; expected {error.validator_value}"
    if v in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        rng = []
        if "minimum" in s:
            rng.append(f">= {s['minimum']}")
        if "exclusiveMinimum" in s:
            rng.append(f"> {s['exclusiveMinimum']}")
        if "maximum" in s:
            rng.append(f"<= {s['maximum']}")
        if "exclusiveMaximum" in s:
            rng.append(f"< {s['exclusiveMaximum']}")
        return f"{where}: {error.instance!r} is out of range; allowed: {' and '.join(rng)}"
    if v == "not" and "frontier" in list(map(str, error.absolute_path)):
        return (
            f"{where}: give the press without compression_ratio or budget; "
            f"frontier.ratios and frontier.budgets set them"
        )
    if v == "not" and isinstance(error.instance, dict) and "press" in error.instance:
        return f"{where}: give exactly one of compression_ratio or budget"
    if v == "dependentRequired" and isinstance(error.instance, dict):
        for key, needs in error.validator_value.items():
            missing = [d for d in needs if key in error.instance and d not in error.instance]
            if missing:
                return (
                    f"{key_path([*error.absolute_path, key])}: given without "
                    f"{', '.join(key_path([*error.absolute_path, d]) for d in missing)}, which it needs"
                )
    if v == "pattern":
        return f"{where}: {error.instance!r} does not match the pattern {error.validator_value!r}"
    if v in ("minItems", "maxItems"):
        return f"{where}: {error.instance!r} must have {v[:3]} {error.validator_value} items"
    if v == "propertyNames":
        return f"{where}: name {error.instance!r} is not allowed: {error.message}"
    return f"{where}: {error.message}"


def schema_validator(schema: dict[str, Any], set_defaults: bool):
    """A JSON Schema (draft 2020-12) validator of ``schema``; with ``set_defaults``, one that fills each missing
    property's ``default`` into the instance as it validates (jsonschema's documented extension recipe)."""
    from jsonschema import Draft202012Validator, validators

    if not set_defaults:
        return Draft202012Validator(schema)
    validate_properties = Draft202012Validator.VALIDATORS["properties"]

    def set_default(validator, properties, instance, subschema):
        if isinstance(instance, dict):
            for name, prop in properties.items():
                if "default" in prop and name not in instance:
                    instance[name] = copy.deepcopy(prop["default"])
        yield from validate_properties(validator, properties, instance, subschema)

    cls = validators.extend(Draft202012Validator, {"properties": set_default})
    return cls(schema)


def non_finite_problems(node, parts: tuple = ()) -> Iterable[str]:
    """A sentence for each NaN or infinite number in ``node``, naming its key path.

    JSON Schema bounds compare with ``<``, which NaN passes, so a NaN would slip past every
    ``minimum``; no setting of the config takes a non-finite number.
    """
    if isinstance(node, float) and not math.isfinite(node):
        yield f"{key_path(parts)}: {node} is not a finite number (the config takes no NaN or infinity)"
    elif isinstance(node, complex):
        yield f"{key_path(parts)}: {node!r} is not a real number"
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from non_finite_problems(v, parts + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from non_finite_problems(v, parts + (i,))
