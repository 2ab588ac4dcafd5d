"""The measurement settings, checked once for every door: config, ``kvdiverge.measure``, command line.

Each setting a measurement takes is a key of the workflow config, whose JSON schema
(``kvdiverge/schemas/config.schema.yaml``, package data) states what it allows; :func:`setting_problems`
checks the API's arguments and the command line's options against that same schema entry,
so the three doors refuse the same values with the same sentence, naming the argument as
that door spells it::

    check_settings({"temperature": float("nan"), "max_new_tokens": 2.7})
    # ValueError: temperature: nan is not a finite number; allowed: a number >= 0;
    #             max_new_tokens: 2.7 is not an integer; allowed: an integer >= 1

:func:`token_id_problems` and :func:`eos_id_problems` check token ids against a vocabulary size,
:func:`text_problems` the names a door takes as strings, :func:`window_problems` named lag
windows, :func:`model_problem` the model argument. Nothing here
imports torch or loads a model: the checks run before any work.
"""

from __future__ import annotations

import math
import numbers
import reprlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvdiverge.engine.core.sampling import Decoding, Sampling, decoding_options
from kvdiverge.settings.schema import load_schema

__all__ = [
    "SCREEN_SETTINGS",
    "SETTINGS",
    "allowed",
    "check_settings",
    "check_task",
    "config_sampling",
    "eos_id_problems",
    "model_problem",
    "setting_problems",
    "spelled",
    "task_problems",
    "text_problems",
    "token_id_problems",
    "vocab_size",
    "window_problems",
]

#: Each setting by its ``kvdiverge.measure`` argument name (the teacher-forced pass's repeat instruction
#: and key-token rule, which only :class:`kvdiverge.doors.screening.ScreenOptions` takes, by a name of their
#: own): its config key (the decoding settings of :func:`kvdiverge.engine.core.sampling.decoding_options`
#: as ``decoding.<name>``).
SETTINGS: dict[str, str] = {
    "max_new_tokens": "decoding.max_new_tokens",
    "replicates": "replicates",
    **{name: f"decoding.{name}" for name in decoding_options()},
    "seed": "seed",
    "window": "window",
    "bootstrap": "analysis.bootstrap",
    "confidence": "analysis.confidence",
    "batch_documents": "generation.batch_documents",
    "memory_budget_gb": "generation.memory_budget_gb",
    "teacher_tokens": "teacher_forced.length",
    "instruction": "prompt.instruction",
    "system": "prompt.system",
    "teacher_target": "teacher_forced.target",
    "teacher_repeat_instruction": "teacher_forced.repeat_instruction",
    "teacher_key_short": "teacher_forced.key_tokens.short",
    "teacher_key_alpha": "teacher_forced.key_tokens.alpha",
    "teacher_key_beta": "teacher_forced.key_tokens.beta",
}

#: The settings of :class:`kvdiverge.doors.screening.ScreenOptions` checked against the schema, by field
#: name: the :data:`SETTINGS` name each one is.
SCREEN_SETTINGS: dict[str, str] = {
    "length": "teacher_tokens",
    "target": "teacher_target",
    "repeat_instruction": "teacher_repeat_instruction",
    "key_short": "teacher_key_short",
    "key_alpha": "teacher_key_alpha",
    "key_beta": "teacher_key_beta",
    "seed": "seed",
    "bootstrap": "bootstrap",
    "confidence": "confidence",
}


def _entry(key: str) -> dict[str, Any]:
    """The schema entry of a dotted config key, with the schema's ``$defs``."""
    schema = load_schema()
    node = schema
    for part in key.split("."):
        node = node["properties"][part]
    return {"$defs": schema.get("$defs", {}), **node}


def allowed(entry: Mapping[str, Any]) -> str:
    """What a schema entry allows, in words: ``an integer >= 1``, ``a number > 0 and <= 1``, ..."""
    if "oneOf" in entry or "anyOf" in entry:
        return " or ".join(allowed(e) for e in entry.get("oneOf", entry.get("anyOf")))
    if "const" in entry:
        return repr(entry["const"])
    if "enum" in entry:
        return "one of " + ", ".join(repr(v) for v in entry["enum"])
    types = entry.get("type", "number")
    types = [types] if isinstance(types, str) else list(types)
    if types == ["array"]:
        least = entry.get("minItems", 0)
        return ("a non-empty list of " if least == 1 else "a list of ") + allowed(entry.get("items", {})).replace(
            "a ", "", 1
        ).replace("an ", "", 1).replace("number", "numbers", 1).replace("integer", "integers", 1)
    words = {
        "integer": "an integer",
        "number": "a number",
        "null": "None",
        "string": "a string",
        "boolean": "True or False",
    }
    bounds = [
        f"{op} {entry[k]}"
        for k, op in (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="), ("exclusiveMaximum", "<"))
        if k in entry
    ]
    if entry.get("minLength", 0) >= 1:
        words["string"] = "a non-empty string"
    kinds = [
        words.get(t, t) + (" " + " and ".join(bounds) if bounds and t in ("integer", "number") else "") for t in types
    ]
    return " or ".join(kinds)


def _plain(value: Any) -> Any:
    """numpy and other numbers as Python ``int`` / ``float`` (``bool`` stays ``bool``)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def _value_problem(entry: Mapping[str, Any], name: str, value: Any) -> str | None:
    """The sentence refusing ``value`` under the schema ``entry`` (spelled ``name``), or None.

    NaN and infinities are refused wherever a number is (a JSON schema's bounds let NaN
    through), also inside an array; an integral float is taken where only an integer is."""
    from jsonschema import Draft202012Validator

    plain = _plain(value)
    what = allowed(entry)
    integer_only = entry.get("type") == "integer"
    items = plain if isinstance(plain, (list, tuple)) else [plain]
    if any(isinstance(_plain(v), float) and not math.isfinite(_plain(v)) for v in items):
        return f"{name}: {value!r} is not a finite number; allowed: {what}"
    if isinstance(plain, float) and integer_only and not plain.is_integer():
        return f"{name}: {value!r} is not an integer; allowed: {what}"
    plain = int(plain) if isinstance(plain, float) and integer_only else plain
    plain = [_plain(v) for v in plain] if isinstance(plain, tuple) else plain
    if next(Draft202012Validator(entry).iter_errors(plain), None) is not None:
        return f"{name}: {value!r} is not allowed; allowed: {what}"
    return None


def setting_problems(values: Mapping[str, Any], names: Mapping[str, str] | None = None) -> list[str]:
    """One sentence per setting whose value the config schema does not allow.

    Parameters
    ----------
    values : mapping of str to object
        Settings by their :data:`SETTINGS` name (``kvdiverge.measure``'s arguments).
    names : mapping of str to str, optional
        How the door spells each setting (``{"temperature": "--temperature"}``); default
        the argument name.

    Returns
    -------
    list of str
        ``"<name>: <value> is ...; allowed: <what the schema allows>"``, in the order of
        ``values``; empty when every value is allowed.

    Raises
    ------
    KeyError
        A name that is not a setting (a programming error, not bad input).
    """
    out = []
    for arg, value in values.items():
        problem = _value_problem(_entry(SETTINGS[arg]), (names or {}).get(arg, arg), value)
        if problem:
            out.append(problem)
    return out


def check_settings(values: Mapping[str, Any], names: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The settings as plain Python values, or ``ValueError`` naming every one not allowed.

    Integral floats stay as given where a number is allowed, and become ``int`` where only
    an integer is (``max_new_tokens=4.0`` is 4; ``4.5`` is refused, never truncated).

    Raises
    ------
    ValueError
        ``"; "``-joined :func:`setting_problems` sentences.
    """
    problems = setting_problems(values, names)
    if problems:
        raise ValueError("; ".join(problems))
    out = {}
    for arg, value in values.items():
        plain = _plain(value)
        if isinstance(plain, float) and _entry(SETTINGS[arg]).get("type") == "integer":
            plain = int(plain)
        out[arg] = plain
    return out


def task_problems(task: Any, name: str = "task") -> list[str]:
    """One sentence per problem of a task given to a door: the config's ``task`` block rules.

    Parameters
    ----------
    task : str or mapping
        A task name (``"niah"``) or a ``task`` block (``{"name": "niah", "digits": 7, ...}``),
        each key checked against its schema entry (``kvdiverge/schemas/config.schema.yaml``,
        ``task``): the same rules as the config's, for :func:`kvdiverge.measure` and the
        command line.
    name : str
        How the door spells the task (``task``, ``--task``).

    Returns
    -------
    list of str
        ``"task.digits: 2.5 is not an integer; allowed: ..."``; empty when the task is allowed.
    """
    if isinstance(task, str):
        task = {"name": task}
    if not isinstance(task, Mapping):
        return [
            f"{name}: {task!r} is not a task; allowed: a task name ('niah') or a mapping of the config's "
            f"task keys ({{'name': 'niah', 'question': 'after'}})"
        ]
    properties = _entry("task")["properties"]
    out = []
    for key, value in task.items():
        if key not in properties:
            out.append(f"{name}: unknown key {key!r}; allowed: {', '.join(properties)}")
            continue
        problem = _value_problem(_entry(f"task.{key}"), f"{name}.{key}", value)
        if problem:
            out.append(problem)
    return out


def check_task(task: Any, name: str = "task") -> dict[str, Any] | None:
    """The task as a config ``task`` block (``{"name": ..., **settings}``), or ``ValueError`` naming
    every problem (:func:`task_problems`); None stays None. A block without ``name`` names the
    schema's default task, as the config's ``task: {}`` does."""
    if task is None:
        return None
    problems = task_problems(task, name)
    if problems:
        raise ValueError("; ".join(problems))
    block = {"name": task} if isinstance(task, str) else {k: _plain(v) for k, v in task.items()}
    block.setdefault("name", _entry("task.name")["default"])
    if isinstance(block.get("digits"), float):
        block["digits"] = int(block["digits"])
    return block


def spelled(message: str, names: Mapping[str, str] | None = None) -> str:
    """``message`` with each setting's config key (:data:`SETTINGS`, ``decoding.max_new_tokens``) spelled
    as a door spells it: ``names`` maps a setting to its spelling (``{"max_new_tokens":
    "-T/--max-new-tokens"}``); a setting not in ``names`` takes its argument name."""
    for arg, key in sorted(SETTINGS.items(), key=lambda item: -len(item[1])):
        message = message.replace(key, (names or {}).get(arg, arg))
    return message


def token_id_problems(name: str, ids: Sequence[Any], vocab_size: int) -> list[str]:
    """Sentences for the token ids of prompt ``name`` that are not integers in ``[0, vocab_size)``."""
    return _id_problems(f"prompt {name!r}", ids, vocab_size)


def _id_problems(label: str, ids: Sequence[Any], vocab_size: int | None) -> list[str]:
    """The sentence naming the ids of ``label`` that are not integers in ``[0, vocab_size)`` (``>= 0``
    without a vocabulary size), or none."""
    top = math.inf if vocab_size is None else vocab_size
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= int(t) < top]
    if not bad:
        return []
    shown = ", ".join(repr(t) for t in bad[:3]) + (", ..." if len(bad) > 3 else "")
    allowed = "integers >= 0" if vocab_size is None else f"integers from 0 to {vocab_size - 1}"
    return [f"{label}: token ids {shown} are outside the model's vocabulary; allowed: {allowed}"]


def eos_id_problems(name: str, value: Any, vocab_size: int | None = None) -> list[str]:
    """The sentence refusing end-of-sequence ids ``value`` (spelled ``name``, e.g. ``eos_ids``), or none.

    Parameters
    ----------
    name : str
        How the door spells the argument.
    value : object
        A list of token ids (any iterable of integers but a string or mapping; a tensor or array
        through its ``tolist``); empty: generation never stops early.
    vocab_size : int, optional
        The model's vocabulary size; each id must lie in ``[0, vocab_size)``.
    """
    value = value.tolist() if hasattr(value, "tolist") else value
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        top = "" if vocab_size is None else f" from 0 to {vocab_size - 1}"
        return [f"{name}: {value!r} is not a list of token ids; allowed: a list of integers{top}"]
    return _id_problems(name, list(value), vocab_size)


def window_problems(windows: Any, horizon: int | None = None, name: str = "windows") -> list[str]:
    """One sentence per problem of named lag windows (``{"early": [1, 4]}``), spelled ``name``.

    Each window is ``[a, b]``, integers with ``1 <= a <= b`` (the config's ``lag_window``), and
    with a ``horizon`` ``T`` (``max_new_tokens``) ``b <= T - 1``, the last lag a branch can reach,
    as the config asks of its confirmatory windows.
    """
    if not isinstance(windows, Mapping):
        return [
            f"{name}: {windows!r} is not a mapping of names to lag windows; allowed: a mapping of name "
            f"to [a, b], integers with 1 <= a <= b ({{'early': [1, 4]}})"
        ]
    out = []
    for key, window in windows.items():
        label = f"{name}[{key!r}]"
        pair = list(window) if isinstance(window, (list, tuple)) else None
        if not pair or len(pair) != 2 or not all(_is_int(v) for v in pair) or not 1 <= pair[0] <= pair[1]:
            out.append(f"{label}: {window!r} is not a lag window; allowed: [a, b], integers with 1 <= a <= b")
        elif horizon is not None and pair[1] > horizon - 1:
            out.append(
                f"{label}: {window!r} reaches past the last observable lag T - 1 = {horizon - 1} "
                f"(max_new_tokens = {horizon})"
            )
    return out


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def model_problem(model: Any) -> str | None:
    """The sentence refusing a ``model`` argument that is not a loaded model (an object with a
    ``config`` and a ``forward``, as transformers' causal language models are), or None."""
    if hasattr(model, "config") and callable(getattr(model, "forward", None)):
        return None
    return (
        f"model: {reprlib.repr(model)} is not a model; allowed: a loaded transformers causal language model "
        f"(a torch.nn.Module with a config, as kvdiverge.models.loading.load_model returns)"
    )


def vocab_size(model: Any) -> int | None:
    """``model.config.vocab_size``, or None where the model does not say."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    return vocab if _is_int(vocab) else None


def text_problems(values: Mapping[str, Any], names: Mapping[str, str] | None = None) -> list[str]:
    """One sentence per value that is not a non-empty string: the names a door's arguments give
    (``model_name``, ``split``), which enter the seeds and the tables' columns."""
    return [
        f"{(names or {}).get(arg, arg)}: {value!r} is not allowed; allowed: a non-empty string"
        for arg, value in values.items()
        if not isinstance(value, str) or not value
    ]


def config_sampling(config: Mapping[str, Any], model_name: str):
    """The :class:`kvdiverge.engine.core.sampling.Sampling` of a validated workflow config.

    Parameters
    ----------
    config : mapping
        Validated config: ``decoding`` (``max_new_tokens`` and any of
        :func:`kvdiverge.engine.core.sampling.decoding_options`; one not given is neutral),
        ``replicates``, ``seed``.
    model_name : str
        Key of ``config['models']``; enters the seeds and the ``model`` column.

    Returns
    -------
    kvdiverge.engine.core.sampling.Sampling
        End-of-sequence ids ``None``: the model's own.
    """
    decoding = config["decoding"]
    return Sampling(
        T=int(decoding["max_new_tokens"]),
        replicates=int(config["replicates"]),
        decoding=Decoding(**{name: decoding[name] for name in decoding_options() if name in decoding}),
        seed=int(config["seed"]),
        model_name=model_name,
    )
