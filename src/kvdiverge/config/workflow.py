"""Workflow config: load, validate against the JSON schema, check cross-references.

The schema is package data, ``kvdiverge/schemas/config.schema.yaml``
(:data:`kvdiverge.settings.schema.SCHEMA_PATH`, read by :func:`kvdiverge.settings.schema.load_schema`, both
importable from here too); the workflow validates with it through :func:`validate` (once,
``workflow/rules/common.smk``), and
:func:`load_config` reads and validates a file outside Snakemake (tests, notebooks)::

    from kvdiverge.config.workflow import load_config, runs
    config = load_config("config/config.yaml")   # defaults filled in
    runs(config)   # [("smollm2-135m", "snapkv-50", "exploratory"), ...]

A ``frontier`` section (presses without their ratio, a list of ratios, optionally fixed
budgets) is expanded here, through :mod:`kvdiverge.config.frontier`, into one ordinary policy per
(press, ratio) named ``<press>@<ratio>`` (``<press>@b<budget>``) and scheduled on the
frontier's split (:func:`expand_frontier`): every stage, :func:`runs`, sharding, caching
and provenance then treat them as any policy.

Errors are :class:`~kvdiverge.config.reading.ConfigError` with one line per problem, naming the key path
(e.g. ``corpus.min_words``) and the allowed values.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Collection, Mapping
from typing import Any

from kvdiverge.config.backends import backend_problems, llama_models
from kvdiverge.config.frontier import (
    entry_takes_ratio,
    frontier_points,
    frontier_policy,
    frontier_problems,
    frontier_split,
)
from kvdiverge.config.layers import layer_problems
from kvdiverge.config.reading import ConfigError as ConfigError  # re-exported: the config's one error
from kvdiverge.config.reading import format_error, non_finite_problems, read_yaml, schema_validator
from kvdiverge.config.task_checks import prediction_block_problems, task_block_problems
from kvdiverge.data.prompts import parse_date
from kvdiverge.engine.llamacpp.caches import is_cache_entry
from kvdiverge.engine.presses import catalogue
from kvdiverge.estimation.drift import drift_problems
from kvdiverge.estimation.frontier import FrontierPoint
from kvdiverge.models.loading import miniature_values
from kvdiverge.settings.schema import SCHEMA_PATH as SCHEMA_PATH  # re-exported: the schema the workflow reads
from kvdiverge.settings.schema import load_schema

SPLITS = ("exploratory", "confirmatory")


def validate(
    config: dict[str, Any], schema_path: str | os.PathLike | None = None, set_defaults: bool = True
) -> dict[str, Any]:
    """Validate ``config`` against the schema and return a copy with defaults filled.

    Raises
    ------
    ConfigError
        Listing every schema violation and every broken cross-reference.
    """
    schema = load_schema(schema_path)
    given = set(config)  # the top-level keys as written, before the schema's defaults
    config = copy.deepcopy(config)
    validator = schema_validator(schema, set_defaults)
    lines = list(non_finite_problems(config))
    try:
        errors = sorted(validator.iter_errors(config), key=lambda e: list(map(str, e.absolute_path)))
    except TypeError:  # a complex number, which the schema's bounds cannot compare: named in lines
        errors = []
    if errors or lines:
        # the oneOf/anyOf parents repeat their children's messages: keep the leaves first
        for e in errors:
            line = format_error(e)
            if line not in lines:
                lines.append(line)
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines))
    config = expand_frontier(config, schema)
    check(config, given)
    return config


def load_config(path: str | os.PathLike, schema_path: str | os.PathLike | None = None) -> dict[str, Any]:
    """Read a YAML config file, validate it and fill the defaults.

    Raises
    ------
    ConfigError
        If the file does not validate (the message names the keys), or a key appears
        twice in one mapping (:func:`~kvdiverge.config.reading.read_yaml`).
    """
    config = read_yaml(path) or {}
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: the config must be a mapping, got {type(config).__name__}")
    try:
        return validate(config, schema_path)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def policy_entry_problems(entry: Any) -> list[str]:
    """What the config schema refuses in one policy entry (``{"press": ..., "compression_ratio": ...}``).

    The check of a config's ``policies.<name>``, for the doors that take one entry
    (``kvdiverge.measure``'s policy entries, the command line's ``--press``). Parameters
    the schema names (``window_size``, ``kernel_size``, ``n_sink``, ``seed``) are checked
    wherever the entry puts them, beside the press or under its ``params``.

    Returns
    -------
    list of str
        One line per problem, starting with the key (``window_size: -4 is out of range;
        allowed: >= 1``); empty when the schema allows the entry.
    """
    schema = load_schema()
    policy = schema["$defs"]["policy"]
    if isinstance(entry, dict) and isinstance(entry.get("params"), dict):
        params = dict(entry["params"])
        # a press-valued parameter (params.press) is a nested press, not the policy's own press
        named = {k: params.pop(k) for k in list(params) if k in policy["properties"] and k not in ("press", "params")}
        entry = {**entry, **named, "params": params}
    validator = schema_validator({"$defs": schema["$defs"], **policy}, False)
    lines = [
        line
        for key in policy["properties"]
        if isinstance(entry, dict) and key in entry
        for line in non_finite_problems(entry[key], (key,))
    ]
    if lines:  # the schema's bounds cannot compare them
        return lines
    kinds = ("type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "not")
    for e in sorted(validator.iter_errors(entry), key=lambda e: list(map(str, e.absolute_path))):
        # the values of the policy's own keys; unknown parameters and presses are the press's to name
        if e.validator in kinds and len(e.absolute_path) <= 1:
            line = format_error(e).removeprefix("<top level>: ")
            if line not in lines:
                lines.append(line)
    return lines


def policy_problems(policies: dict[str, Any]) -> list[str]:
    """What is wrong with each policy, by the press catalogue (:func:`kvdiverge.engine.presses.catalogue.entry_problem`:
    unknown presses and parameters of nested presses, ratio or budget, refused presses and what they need),
    one line each, in the engine's sentences; kvpress's own checks of a value run where the press is built
    (:func:`kvdiverge.engine.presses.policies.press_build_problems`). A llama.cpp cache (``cache: llama_cpp``)
    is no press: :func:`kvdiverge.config.backends.backend_problems` checks it."""
    return [
        f"policies.{name}: {p}"
        for name, spec in policies.items()
        if not is_cache_entry(spec) and (p := catalogue.entry_problem(spec))
    ]


def own_presses(config: Mapping[str, Any]) -> None:
    """Give the catalogue a record of each press of a user's module (``module:Class``) that the config's
    policies or frontier name (:func:`kvdiverge.engine.presses.catalogue.register`), read from its class by the
    engine; a config without one loads nothing."""
    entries = [
        *(config.get("policies") or {}).values(),
        *((config.get("frontier") or {}).get("presses") or {}).values(),
    ]
    own = sorted({n for e in entries for n in catalogue.press_names(e) if ":" in n})
    if not own:
        return
    # lazy: a press of the user's own module is read from its class, which loads kvpress (only such a config does)
    from kvdiverge.engine.presses.registry import catalogue_record

    for name in own:
        try:
            catalogue.register(name, catalogue_record(name))
        except ValueError as exc:  # the module or class is not there: the engine's sentence
            catalogue.register(name, str(exc))


def check(config: dict[str, Any], given: Collection[str] | None = None) -> None:
    """Check the cross-references a schema cannot express.

    Every policy must name presses and parameters that exist, and kvdiverge must measure them
    (:mod:`kvdiverge.engine.presses.catalogue`); the noise-floor policy's press must keep every
    position. Policies named in ``runs``, ``confirmatory`` and ``analysis.gaps`` must be defined;
    the confirmatory policy must run on the confirmatory split; gap policies must run
    on the exploratory split; word and lag ranges must be ordered; ``prompt.date`` must be
    a real calendar date; the loop settings must fit the horizon. What a job would refuse is
    refused here, by the functions the jobs and :func:`kvdiverge.measure` call: the task blocks
    (:mod:`kvdiverge.config.task_checks`), a miniature's vocabulary, and what a model's
    sliding-window layers refuse (:mod:`kvdiverge.config.layers`), and what a model's backend cannot run
    (:func:`kvdiverge.config.backends.backend_problems`; ``given``, the top-level keys the file gave before
    the schema's defaults, says whether a ``teacher_forced`` section was asked for; None: every key).

    Raises
    ------
    ConfigError
        Listing every problem found.
    """
    own_presses(config)
    problems: list[str] = []
    policies = config.get("policies", {})
    defined = ", ".join(sorted(policies)) or "none"

    def need_policy(key: str, name: str) -> bool:
        if name not in policies:
            problems.append(f"{key}: policy {name!r} is not defined under policies (defined: {defined})")
            return False
        return True

    for part in (
        _run_problems,
        _confirmatory_problems,
        _gap_problems,
        _value_problems,
        _task_problems,
        _prediction_problems,
        _model_problems,
    ):
        part(config, need_policy, problems)
    problems += backend_problems(config, scheduled_policies(config), given)
    if problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))


def _run_problems(config: dict[str, Any], need_policy, problems: list[str]) -> None:
    """:func:`check` of ``runs``: scheduled, control and floor policies, and their document counts."""
    policies, run = config.get("policies", {}), config.get("runs", {})
    for split in SPLITS:
        for i, name in enumerate(run.get(split, [])):
            need_policy(f"runs.{split}[{i}]", name)
    control = run.get("control")
    if control:
        need_policy("runs.control.policy", control["policy"])
        docs = config.get("corpus", {}).get("documents", {}).get(control["split"])
        if docs is not None and control["documents"] > docs:
            problems.append(
                f"runs.control.documents: {control['documents']} exceeds corpus.documents.{control['split']} = {docs}"
            )

    problems += policy_problems(policies)
    floor = run.get("floor")
    if floor and need_policy("runs.floor.policy", floor["policy"]):
        press = policies[floor["policy"]].get("press")
        if not catalogue.keeps_every_position(press):
            problems.append(
                f"runs.floor.policy: {floor['policy']!r} must be a noise-floor policy, whose press keeps "
                f"every position (PermutationPress), not {press}"
            )
        for split in SPLITS:
            docs = config.get("corpus", {}).get("documents", {}).get(split)
            if run.get(split) and floor.get("documents") and docs is not None and floor["documents"] > docs:
                problems.append(f"runs.floor.documents: {floor['documents']} exceeds corpus.documents.{split} = {docs}")


def _confirmatory_problems(config: dict[str, Any], need_policy, problems: list[str]) -> None:
    """:func:`check` of ``confirmatory``: its policy runs on the confirmatory split; ordered lag windows."""
    run = config.get("runs", {})
    conf = config.get("confirmatory")
    if conf:
        if need_policy("confirmatory.policy", conf["policy"]) and conf["policy"] not in run.get("confirmatory", []):
            problems.append(
                f"confirmatory.policy: {conf['policy']!r} must be listed in runs.confirmatory "
                f"(now: {run.get('confirmatory', [])})"
            )
        horizon = config.get("decoding", {}).get("max_new_tokens")
        for key in ("early", "late"):
            a, b = conf.get(key, (1, 1))
            if a > b:
                problems.append(f"confirmatory.{key}: [{a}, {b}] must have a <= b")
            if horizon is not None and b > horizon - 1:
                problems.append(
                    f"confirmatory.{key}: [{a}, {b}] reaches past the last observable lag "
                    f"T - 1 = {horizon - 1} (decoding.max_new_tokens = {horizon})"
                )
        if "early" in conf and "late" in conf and conf["early"][1] >= conf["late"][0]:
            problems.append(f"confirmatory: early {conf['early']} must end before late {conf['late']} starts")


def _gap_problems(config: dict[str, Any], need_policy, problems: list[str]) -> None:
    """:func:`check` of ``analysis.gaps``: two different policies, both run on the exploratory split."""
    run = config.get("runs", {})
    for i, pair in enumerate(config.get("analysis", {}).get("gaps", [])):
        for j, name in enumerate(pair):
            if need_policy(f"analysis.gaps[{i}][{j}]", name) and name not in run.get("exploratory", []):
                problems.append(
                    f"analysis.gaps[{i}][{j}]: {name!r} must be listed in runs.exploratory "
                    f"(gaps are exploratory; now: {run.get('exploratory', [])})"
                )
        if len(pair) == 2 and pair[0] == pair[1]:
            problems.append(f"analysis.gaps[{i}]: the two policies must differ, got {pair}")


def _value_problems(config: dict[str, Any], need_policy, problems: list[str]) -> None:
    """:func:`check` of single values: ``prompt.date`` a calendar date, the word range ordered, a loop period
    within the horizon."""
    date = config.get("prompt", {}).get("date")
    if isinstance(date, str):
        try:
            parse_date(date)
        except ValueError as exc:
            problems.append(str(exc))

    drift, horizon = config.get("drift") or {}, config.get("decoding", {}).get("max_new_tokens")
    if horizon is not None:  # the settings given (the schema fills no default)
        problems += drift_problems(horizon, drift.get("max_period"), drift.get("min_repeats"))

    corpus = config.get("corpus", {})
    if "min_words" in corpus and "max_words" in corpus and corpus["min_words"] > corpus["max_words"]:
        problems.append(
            f"corpus.min_words ({corpus['min_words']}) must not exceed corpus.max_words ({corpus['max_words']})"
        )


def _task_problems(config: dict[str, Any], need_policy, problems: list[str]) -> None:
    """:func:`check` of ``task``: :func:`kvdiverge.config.task_checks.task_block_problems` (a policy not
    defined is named by ``need_policy``)."""
    problems += task_block_problems(config, scheduled_policies(config))


def _prediction_problems(config: dict[str, Any], need_policy, problems: list[str]) -> None:
    """:func:`check` of ``prediction``: :func:`kvdiverge.config.task_checks.prediction_block_problems`."""
    problems += prediction_block_problems(config)


def _model_problems(config: dict[str, Any], need_policy, problems: list[str]) -> None:
    """:func:`check` of ``models``: a miniature's vocabulary (:func:`kvdiverge.models.loading.miniature_values`),
    and what a model's sliding-window layers refuse of the policies and tasks
    (:func:`kvdiverge.config.layers.layer_problems`)."""
    for name, spec in config.get("models", {}).items():
        if spec.get("source") == "miniature":
            try:
                miniature_values(spec, name)
            except ValueError as exc:
                problems.append(str(exc))
    problems += layer_problems(config, scheduled_policies(config))


def scheduled_policies(config: dict[str, Any]) -> list[str]:
    """Every policy the config runs, once each in config order: the runs of each split (a frontier's
    points among them once expanded), then the ``none`` control and the noise floor."""
    run = config.get("runs", {})
    names = [n for split in SPLITS for n in run.get(split, [])]
    names += [run[k]["policy"] for k in ("control", "floor") if run.get(k)]
    return list(dict.fromkeys(names))


def floor_policy(config: dict[str, Any]) -> str | None:
    """Name of the noise-floor control policy (config ``runs.floor.policy``), or None."""
    floor = config.get("runs", {}).get("floor")
    return floor["policy"] if floor else None


def runs(config: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Every ``(model, policy, split)`` the workflow generates, the controls included.

    Ordered by model (config order), then split (exploratory first), then policy
    (config order in ``runs``); the noise floor (``runs.floor``) follows the policies of
    every split that has any; the ``none`` control comes last unless it is already listed.
    """
    out: list[tuple[str, str, str]] = []
    run = config.get("runs", {})
    floor = floor_policy(config)
    for model in config["models"]:
        for split in SPLITS:
            for policy in run.get(split, []):
                out.append((model, policy, split))
            if floor and run.get(split) and (model, floor, split) not in out:
                out.append((model, floor, split))
        control = run.get("control")
        if control:
            item = (model, control["policy"], control["split"])
            if item not in out:
                out.append(item)
    return out


def control_documents(config: dict[str, Any], policy: str, split: str) -> int | None:
    """How many documents the ``(policy, split)`` run takes: a control's count, or None (all).

    The ``none`` control (``runs.control``) runs on the first ``runs.control.documents``
    usable documents of its split only, and the noise floor (``runs.floor``) on the
    first ``runs.floor.documents`` of each split when that key is given, unless the same
    policy is also scheduled on that split in full (then it takes every document and
    this returns None).
    """
    runs_ = config.get("runs", {})
    if policy in runs_.get(split, []):
        return None
    control = runs_.get("control") or {}
    if control.get("policy") == policy and control.get("split") == split:
        return int(control["documents"])
    floor = runs_.get("floor") or {}
    if floor.get("policy") == policy and floor.get("documents"):
        return int(floor["documents"])
    return None


# --------------------------------------------------------------------------- frontier (kvdiverge.config.frontier expands it)


def _frontier_entry_problems(key: str, entry: dict[str, Any], name: str, policy_validator) -> list[str]:
    """What is wrong with one expanded frontier entry, named by the frontier's key (``frontier.presses.snapkv``,
    ``frontier.caches.int4``): a press that takes no ratio, the policy schema's problems, the press built once."""
    path = key.split(".")
    problems: list[str] = []
    errors = sorted(policy_validator.iter_errors(entry), key=lambda e: list(map(str, e.absolute_path)))
    for e in errors:
        e.path.extendleft(reversed(path))  # name the frontier's key
        line = format_error(e)
        if line not in problems:
            problems.append(line)
    if errors:  # the schema's problems first: the checks below read the entry's keys
        return problems
    if "press" in entry:
        try:
            takes = entry_takes_ratio(entry)
        except (ValueError, LookupError):
            takes = None  # an unknown press: the catalogue names it below (policy_problems)
        if takes is False:
            return [
                f"{key}: {entry['press']} takes no compression_ratio (nor does a press "
                f"nested in its params), so a frontier cannot vary it"
            ]
    # the policy built once, its problems named by the frontier's key
    return [f"{key}: {p.split(': ', 1)[1]}" for p in policy_problems({name: entry})]


def expand_frontier(config: dict[str, Any], schema: dict[str, Any] | None = None) -> dict[str, Any]:
    """A copy of ``config`` with its ``frontier`` section expanded into ordinary policies.

    Each press of ``frontier.presses`` (a policy entry without its ratio) and each of
    ``frontier.ratios`` (and ``frontier.budgets``) gives the policy ``<press>@<ratio>``
    (``<press>@b<budget>``): the press's entry with that ``compression_ratio`` (``budget``).
    Each cache of ``frontier.caches`` gives ``<cache>``, the cache alone (``cache:
    quantized`` and its settings), when ``frontier.cache_ratios`` holds 0, and
    ``<press>@<ratio>+<cache>`` for each press and each cache ratio above 0: the press's
    entry at that ratio with the cache's keys (evict, then quantize what is kept). Every
    point is added to ``policies`` and appended to ``runs.<frontier.split>``. They share the
    split's documents, the seeds and so the common random numbers (the policy never enters
    the seeds), and the noise floor (``runs.floor``, required) runs beside them. Expanding an
    expanded config changes nothing. A config with a model of ``backend: llama_cpp`` keeps its
    frontier unexpanded, for the config check to refuse
    (:func:`kvdiverge.config.backends.backend_problems`).

    Parameters
    ----------
    config : dict
        A config that passed the schema.
    schema : dict, optional
        The loaded schema (its ``$defs.policy`` checks each expanded entry).

    Returns
    -------
    dict
        ``config`` itself when it has no ``frontier`` section, else an expanded copy.

    Raises
    ------
    ConfigError
        Naming the key: a press that takes no compression ratio, a press entry or cache that
        does not make a valid policy (``frontier.caches.int3: quantized cache: nbits must be
        one of [2, 4] ...``), a user policy whose name holds ``@`` (reserved for the
        frontier) or collides with a frontier policy, or no ``runs.floor``.
    """
    own_presses(config)
    policies = config.get("policies", {})
    f = config.get("frontier")
    problems: list[str] = []
    try:
        grid = frontier_points(config) if f else []
    except ValueError as exc:  # a value the schema's bounds cannot express (two points of one name)
        raise ConfigError(f"invalid config:\n  frontier: {exc}") from None
    made = {p.policy for p in grid}
    problems += frontier_problems((), policies=[name for name in policies if name not in made])
    if not f or llama_models(config):  # llama.cpp runs no frontier: the config check refuses it unexpanded
        if problems:
            raise ConfigError("invalid config:\n  " + "\n  ".join(problems))
        return config
    config = copy.deepcopy(config)
    problems += _expand_points(config, grid, policies, schema or load_schema())
    if not config["runs"].get("floor"):
        problems.append(
            "frontier: needs runs.floor, the noise floor that runs beside the frontier "
            "(runs.floor.policy: a PermutationPress policy)"
        )
    if problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))
    return config


def _expand_points(
    config: dict[str, Any], grid: list[FrontierPoint], policies: Mapping[str, Any], schema: dict[str, Any]
) -> list[str]:
    """Add each frontier point to ``config`` (policies and the split's runs); the problems, by frontier key.

    Each press is checked once (its first full-precision point), each cache once (alone, whatever
    ``cache_ratios``).
    """
    f = config["frontier"]
    policy_validator = schema_validator({"$defs": schema["$defs"], **schema["$defs"]["policy"]}, False)
    scheduled = config.setdefault("runs", {}).setdefault(frontier_split(config), [])
    problems: list[str] = []
    checked: set[str] = set()
    for point in grid:
        entry = frontier_policy(f["presses"][point.press] if point.press else None, point)
        name = point.policy
        key, probe = (
            (f"frontier.presses.{point.press}", entry)
            if point.cache is None
            else (f"frontier.caches.{point.cache}", {"cache": "quantized", **point.cache_settings})
        )
        if key not in checked:
            checked.add(key)
            problems += _frontier_entry_problems(key, probe, name, policy_validator)
        own = (
            f"frontier.presses.{point.press} at {name.split('@', 1)[1]}"
            if point.press
            else f"frontier.caches.{point.cache}"
        )
        if name in policies and policies[name] != entry:
            problems.append(f"policies.{name}: the name belongs to the frontier point {own}; rename the policy")
        config["policies"][name] = entry
        if name not in scheduled:
            scheduled.append(name)
    return problems
