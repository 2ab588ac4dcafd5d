"""Press expressions: the text that names a press and its parameters, parsed into a press spec.

Two forms, both read into the spec of :func:`kvdiverge.engine.presses.policies.press_from_spec`
(``{"press": Name, "params": {...}}``, press-valued parameters as specs of the same shape):

- ``NAME[:param=value,...]`` (:func:`parse_press`): a press class name (kvpress's, the
  project's, or ``module:Class``) and constructor parameters; values are read by
  :func:`parse_value`;
- ``Name(arg, param=value, ...)`` (:func:`parse_press_call`): a call, nested calls for
  nested presses, parsed with :mod:`ast` and never evaluated.

:func:`policy_entry` turns either into a policy entry as in the config, the policy's
``compression_ratio`` (or a ``budget``) on the entry and off the press that takes it. The
command line (``kvdiverge measure --press``) reads its presses with it.
"""

from __future__ import annotations

from typing import Any

from kvdiverge.engine.core.errors import PressExpressionError
from kvdiverge.engine.presses.adapters import inner, spec_parameters
from kvdiverge.engine.presses.policies import press_parameters, takes_ratio
from kvdiverge.engine.presses.registry import press_class

__all__ = ["parse_press", "parse_press_call", "parse_value", "policy_entry", "press_spec"]


def parse_value(text: str) -> Any:
    """A parameter value from the command line: int, float, bool (true/false), none, else str."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_press(spec: str) -> tuple[str, dict[str, Any]]:
    """Split ``NAME[:param=value,...]`` into the class reference and its parameters.

    ``NAME`` is a kvpress class name (``SnapKVPress``) or ``module:Class`` for a press
    kvpress does not ship; ``module:Class:param=value,...`` then adds parameters.

    Raises
    ------
    PressExpressionError
        If a parameter is not ``name=value`` or is given twice.
    """
    parts = spec.split(":")
    if len(parts) >= 2 and "=" not in parts[1]:
        ref, rest = f"{parts[0]}:{parts[1]}", ":".join(parts[2:])
    else:
        ref, rest = parts[0], ":".join(parts[1:])
    if not ref or ref.endswith(":"):
        raise PressExpressionError(f"press {spec!r}: expected NAME[:param=value,...] or module:Class[:param=value,...]")
    params: dict[str, Any] = {}
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise PressExpressionError(f"press {spec!r}: parameter {item!r} is not name=value")
        if key.strip() in params:
            raise PressExpressionError(f"press {spec!r}: parameter {key.strip()!r} given twice")
        params[key.strip()] = parse_value(value)
    return ref, params


def parse_press_call(text: str) -> dict[str, Any]:
    """A press expression such as ``AdaKVPress(press=SnapKVPress(compression_ratio=0.5))`` as a spec.

    Parsed with :mod:`ast`, never evaluated: only calls of kvpress or project press class
    names, with literal arguments (numbers, strings, booleans, ``None``, lists, tuples,
    dicts) or other such calls. Positional arguments follow the constructor's parameter
    order.

    Returns
    -------
    dict
        ``{"press": Name, "params": {...}}``, press-valued arguments as specs of the same
        shape (:func:`kvdiverge.engine.presses.policies.press_from_spec`).

    Raises
    ------
    PressExpressionError
        Not a call of a known press class, an argument that is not a literal or a press,
        a parameter given twice.
    """
    import ast

    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as exc:
        raise PressExpressionError(f"press {text!r}: not a press expression ({exc.msg})") from None
    return _press_call(tree.body, text)


def _press_call(node, text: str) -> dict[str, Any]:
    import ast
    import inspect

    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
        raise PressExpressionError(f"press {text!r}: expected PressName(param=value, ...)")
    try:
        cls = press_class(node.func.id)
    except ValueError as exc:
        raise PressExpressionError(f"press {text!r}: {exc}") from None
    names = list(inspect.signature(cls).parameters)
    if len(node.args) > len(names):
        raise PressExpressionError(f"press {text!r}: {cls.__name__} takes at most {len(names)} positional arguments")
    params: dict[str, Any] = {names[i]: _literal(arg, text) for i, arg in enumerate(node.args)}
    for kw in node.keywords:
        if kw.arg is None or kw.arg in params:
            raise PressExpressionError(
                f"press {text!r}: parameter {kw.arg or '**'!r} of {cls.__name__} given twice or unpacked"
            )
        params[kw.arg] = _literal(kw.value, text)
    return {"press": cls.__name__, "params": params}


def _literal(node, text: str) -> Any:
    import ast

    if isinstance(node, ast.Call):
        return _press_call(node, text)
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e, text) for e in node.elts]
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) for k in node.keys):
        return {k.value: _literal(v, text) for k, v in zip(node.keys, node.values)}
    try:
        return ast.literal_eval(node)  # constants, and signed numbers
    except ValueError:
        raise PressExpressionError(f"press {text!r}: {ast.unparse(node)!r} is neither a literal nor a press") from None


def press_spec(text: str) -> dict[str, Any]:
    """The press spec of a ``--press`` value: ``Name(...)`` (:func:`parse_press_call`) or ``NAME[:param=value,...]``."""
    if "(" in text:
        return parse_press_call(text)
    ref, params = parse_press(text)
    return {"press": ref, "params": params}


def _ratio_target(spec: dict[str, Any]) -> dict[str, Any] | None:
    """The spec (``spec`` or one nested in it) that takes a policy's compression ratio."""
    if not takes_ratio(spec["press"], spec_parameters(spec)):
        return None
    if "compression_ratio" in press_parameters(press_class(spec["press"])):
        return spec
    return next((found for s in inner(spec) if (found := _ratio_target(s)) is not None), None)


def policy_entry(text: str, budget: int | None = None, default_ratio: float | None = 0.0) -> dict[str, Any]:
    """The policy entry (as in the config) of a ``--press`` value, with ``--budget`` if given.

    The ``compression_ratio`` of the press that takes the policy's ratio (the named press,
    or the inner scorer of a wrapper) becomes the entry's ``compression_ratio``
    (``default_ratio`` if not given: kvpress's default 0; ``None`` leaves the entry without
    one, for a frontier whose ratios set it); with ``budget`` that press must not be given a ratio.

    Raises
    ------
    PressExpressionError
        A bad expression, an unknown press, ``budget`` with a ratio or for a press that takes none.
    """
    spec = press_spec(text)
    try:
        target = _ratio_target(spec)
    except ValueError as exc:
        raise PressExpressionError(f"press {text!r}: {exc}") from None
    entry: dict[str, Any] = {"press": spec["press"], "params": spec["params"]}
    if target is None:
        if budget is not None:
            raise PressExpressionError(f"press {text!r}: {spec['press']} takes no compression ratio, so no --budget")
        return entry
    given = [d.pop("compression_ratio") for d in (target, target.get("params") or {}) if "compression_ratio" in d]
    if budget is not None:
        if given:
            raise PressExpressionError(f"press {text!r}: give --budget or compression_ratio, not both")
        entry["budget"] = int(budget)
    else:
        if given:  # as given (None too): a value that is not a ratio is refused with the config's checks
            entry["compression_ratio"] = float(given[0]) if _real(given[0]) else given[0]
        elif default_ratio is not None:
            entry["compression_ratio"] = default_ratio
    return entry


def _real(value: Any) -> bool:
    """True for an int or float (not a bool): a value ``float()`` turns into a ratio unchanged."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
