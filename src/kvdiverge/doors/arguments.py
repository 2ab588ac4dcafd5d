"""What the command line's arguments mean: policy entries, prompts and the options of one measurement.

``kvdiverge measure`` (:mod:`kvdiverge.doors.cli`) parses its arguments and hands them here: they are
checked before any work as the config checks the same settings (:func:`check_arguments`), read as
policies (:func:`argument_sources`: ``--press``, ``--cache``, ``--ratios``; :func:`llama_sources` with
``--backend llama_cpp``) and prompts
(:func:`argument_prompts`), and turned into :func:`kvdiverge.plan`'s keywords (:func:`measure_keywords`,
:data:`OPTIONS` the spelling of its refusals), whose plan the command line checks with the tokenizer
and the model's config before the weights load. A refusal is an
:class:`~kvdiverge.config.inputs.InputError` naming the option as the command line spells it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvdiverge.config.frontier import FrontierSpec
from kvdiverge.config.inputs import InputError, frontier_presses, model_entry, prepare_presses
from kvdiverge.config.prompt_sources import read_prompts, sotu_prompts
from kvdiverge.config.task_checks import reconstruction_problem
from kvdiverge.data.prompts import SOTU_INSTRUCTION
from kvdiverge.doors.plan import Plan, build_plan
from kvdiverge.engine.core.sampling import decoding_options
from kvdiverge.engine.llamacpp.caches import parse_cache
from kvdiverge.engine.presses.expressions import parse_press, policy_entry
from kvdiverge.engine.presses.quantized import BACKENDS
from kvdiverge.engine.refusals import PressSource
from kvdiverge.jobs.devices import device_problem
from kvdiverge.models.loading import load_model_config, load_tokenizer
from kvdiverge.models.sources import gguf_path
from kvdiverge.settings.checks import check_settings

__all__ = [
    "OPTIONS",
    "ArgumentPlan",
    "argument_prompts",
    "argument_sources",
    "cache_entry",
    "check_arguments",
    "cli_entries",
    "llama_sources",
    "measure_keywords",
    "plan_arguments",
    "task_block",
]

#: The command line's spelling of each measurement setting (:data:`kvdiverge.settings.checks.SETTINGS`).
OPTIONS = {
    "max_new_tokens": "-T/--max-new-tokens",
    "replicates": "-R/--replicates",
    **{name: "--" + name.replace("_", "-") for name in decoding_options()},
    "seed": "--seed",
    "window": "-W/--window",
    "bootstrap": "--bootstrap",
    "confidence": "--confidence",
    "batch_documents": "--batch-documents",
    "teacher_tokens": "--teacher-tokens",
    "instruction": "--instruction",
    "system": "--system",
    "teacher_target": "--teacher-target",
}


def cache_entry(text: str) -> dict[str, Any]:
    """The quantized-cache keys of a ``--cache`` value ``BACKEND[:param=value,...]``.

    ``quanto:nbits=4,q_group_size=64,residual_length=128`` gives ``{"cache": "quantized",
    "backend": "quanto", "nbits": 4, "q_group_size": 64, "residual_length": 128}``
    (:class:`kvdiverge.engine.presses.cache_facts.QuantizedCacheSpec`, checked when the policy is built).

    Raises
    ------
    InputError
        An unknown backend or parameter.
    """
    try:
        backend, params = parse_press(text)
    except ValueError as exc:
        raise InputError(f"--cache {text!r}: {exc}") from None
    if backend not in BACKENDS:
        raise InputError(f"--cache {text!r}: the backend must be one of {sorted(BACKENDS)}, got {backend!r}")
    unknown = sorted(set(params) - {"nbits", "q_group_size", "residual_length"})
    if unknown:
        raise InputError(
            f"--cache {text!r}: unknown parameter {unknown[0]!r}; allowed: nbits, q_group_size, residual_length"
        )
    return {"cache": "quantized", "backend": backend, **params}


def cli_entries(
    presses: Sequence[str], caches: Sequence[str], budget: int | None, default_ratio: float | None
) -> dict[str, dict[str, Any]]:
    """Policy entries of ``--press`` and ``--cache`` values, by name.

    Each press is a policy; each quantized cache is one alone (named by its value) and one
    after each press (``<press>+<cache>``: evict, then quantize what is kept).
    """
    entries = {spec: policy_entry(spec, budget, default_ratio) for spec in presses}
    quantized = {text: cache_entry(text) for text in caches}
    out = dict(entries)
    for text, keys in quantized.items():
        out[text] = dict(keys)
        for spec, entry in entries.items():
            out[f"{spec}+{text}"] = {**entry, **keys}
    return out


def check_arguments(args: Any) -> None:
    """Refuse before any work a setting the config would refuse (the same check:
    :func:`kvdiverge.settings.checks.check_settings`), a device this torch does not have,
    out-of-range counts of the command line's own, no press or cache, a repeated one,
    --cache-ratios without --cache and --ratios, --question without --task, --task with
    --screen (the screen scores no task) or with a temperature other than 0 (a task scores
    greedy answers). An unset ``--temperature`` is filled in first: 0 (greedy) with
    ``--task``, else 0.7.

    Parameters
    ----------
    args : argparse.Namespace
        The parsed ``kvdiverge measure`` arguments.

    Raises
    ------
    InputError
        The first refused argument, in one sentence.
    """
    if getattr(args, "temperature", 0.7) is None:  # greedy for a task, else sampled
        args.temperature = 0.0 if getattr(args, "task", None) else 0.7
    unset_allowed = {"batch_documents", "teacher_tokens", "teacher_target", "instruction", "system", *decoding_options()}  # fmt: skip
    values = {k: getattr(args, k, None) for k in OPTIONS}
    values = {k: v for k, v in values.items() if k not in unset_allowed or v is not None}  # None: the default
    try:
        check_settings(values, OPTIONS)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    for name, value, low in (
        ("--budget", 1 if args.budget is None else args.budget, 1),
        ("--threads", 1 if args.threads is None else args.threads, 1),
    ):
        if value < low:
            raise InputError(f"{name} must be >= {low}, got {value}")
    if not args.press and not args.cache:
        raise InputError("give at least one --press or --cache")
    if len(set(args.press)) != len(args.press) or len(set(args.cache)) != len(args.cache):
        raise InputError("the same --press or --cache is given twice")
    if args.cache_ratios and not (args.cache and args.ratios):
        raise InputError(
            "--cache-ratios needs --ratios and at least one --cache (the presses' ratios before each cache)"
        )
    task, question = getattr(args, "task", None), getattr(args, "question", None)
    if question is not None and not task:
        raise InputError("--question places a task's question: give --task too")
    if task and getattr(args, "screen", False):
        raise InputError("--task scores the coupled run's greedy answers; the teacher-forced --screen runs no task")
    if task and args.temperature != 0:
        raise InputError(f"--task scores greedy answers: --temperature must be 0, got {args.temperature:g}")
    problem = reconstruction_problem(getattr(args, "teacher_target", None), task, "--teacher-target")
    if problem:
        raise InputError(problem)
    problem = device_problem(args.device, "--device")
    if problem:
        raise InputError(problem)


def argument_sources(args: Any) -> tuple[dict[str, Any], dict[str, PressSource], dict[str, dict[str, Any]] | None]:
    """``(presses, sources, caches)``: what :func:`kvdiverge.measure` gets (``presses``, ``caches``)
    and the policies measured (``sources``), each press built and checked once (:func:`~kvdiverge.config.inputs.prepare_presses`).

    Without ``--ratios``: each ``--press`` and ``--cache`` as policy entries, a cache alone and
    after each press (:func:`cli_entries`), ``presses = sources`` and ``caches`` None. With
    ``--ratios``, a frontier (:func:`~kvdiverge.config.inputs.frontier_presses`, the config's expansion): ``presses``
    the ``--press`` entries without their ratio and ``caches`` the ``--cache`` settings by their
    value (``quanto:nbits=4``): at each of ``--cache-ratios`` (default: 0 and every ratio) each
    press with each cache, named ``<press>@<ratio>+<cache>``, ratio 0 being the cache alone
    (named by its value).

    Raises
    ------
    InputError
        A bad press, cache or ratio, or a press that refuses its parameters.
    """
    caches = None
    if args.ratios:  # refused here, before the tokenizer loads, by the expansion the plan makes (frontier_presses)
        presses = {spec: policy_entry(spec, args.budget, None) for spec in args.press}  # the frontier sets the ratio
        caches = {text: {k: v for k, v in cache_entry(text).items() if k != "cache"} for text in args.cache} or None
        try:
            spec = FrontierSpec(args.ratios, caches=caches, cache_ratios=args.cache_ratios)
            expanded, _ = frontier_presses(presses, spec)
        except ValueError as exc:
            text = str(exc).replace("cache_ratios: ", "cache-ratios: ", 1)
            raise InputError(
                f"--{text}" if text.startswith(("ratios: ", "cache-ratios: ")) else f"--ratios: {text}"
            ) from None
    else:
        presses = expanded = cli_entries(args.press, args.cache, args.budget, 0.0)
    try:
        sources = prepare_presses(expanded)  # refusals and bad parameters stop here
    except ValueError as exc:
        raise InputError(str(exc)) from None
    return (presses if args.ratios else sources), sources, caches


def llama_sources(args: Any) -> tuple[dict[str, Any], None]:
    """``(presses, None)`` of ``--backend llama_cpp``: the ``f16`` control, then each ``--cache`` type
    (:func:`kvdiverge.engine.llamacpp.caches.parse_cache`), by its name.

    Raises
    ------
    InputError
        A kvpress option (``--press``, ``--ratios``, ``--budget``, ``--screen``), no ``--cache``, or a cache
        type llama.cpp does not have, in one sentence.
    """
    refused = [f"--{o}" for o in ("press", "ratios", "budget", "screen") if getattr(args, o, None)]
    if refused or not args.cache:
        raise InputError(
            "--backend llama_cpp measures the --cache types (q8_0, q4_0, q4_0/q8_0, q4_0:norot, ...) against f16; "
            + (f"{refused[0]} is a kvpress option: leave it out" if refused else "give at least one --cache")
        )
    try:
        caches = [parse_cache(text) for text in args.cache]
    except ValueError as exc:
        raise InputError(str(exc)) from None
    return {"f16": parse_cache("f16"), **{c.name: c for c in caches}}, None


def argument_prompts(args: Any) -> tuple[dict[str, str], str | None]:
    """``(prompts, instruction)`` of ``--sotu`` (with :data:`kvdiverge.data.prompts.SOTU_INSTRUCTION` unless
    ``--instruction`` is given) or ``--prompts`` (:func:`~kvdiverge.config.prompt_sources.sotu_prompts`,
    :func:`~kvdiverge.config.prompt_sources.read_prompts`)."""
    if args.sotu is not None:
        instruction = SOTU_INSTRUCTION if args.instruction is None else args.instruction
        return sotu_prompts(args.sotu, *args.words), instruction
    return read_prompts(args.prompts, args.field, args.id_field), args.instruction


def task_block(args: Any) -> dict[str, Any] | None:
    """The config ``task`` block of ``--task`` and ``--question`` (None without ``--task``)."""
    if not args.task:
        return None
    return {"name": args.task, **({"question": args.question} if args.question else {})}


#: :func:`kvdiverge.measure`'s keywords that the command line passes as they are, by option name.
_PLAIN = ("max_new_tokens", "ratios", "cache_ratios", "replicates", "seed", "window", "system", "bootstrap",
          "confidence", "batch_documents", "teacher_tokens", "teacher_target")  # fmt: skip


def measure_keywords(args: Any, model_name: str, instruction: str | None, caches, task) -> dict[str, Any]:
    """:func:`kvdiverge.measure`'s keyword options of the parsed arguments: the settings as given, the
    decoding settings given (an unset one takes ``measure``'s default), ``caches`` and ``task`` as
    :func:`argument_sources` and :func:`task_block` read them."""
    decoding = {name: getattr(args, name) for name in decoding_options() if getattr(args, name) is not None}
    plain = {name: getattr(args, name) for name in _PLAIN}
    return {**plain, **decoding, "instruction": instruction, "caches": caches, "task": task,
            "model_name": model_name, "progress": not args.quiet}  # fmt: skip


@dataclass(frozen=True)
class ArgumentPlan:
    """The command line's run before the weights load.

    Attributes
    ----------
    plan : kvdiverge.doors.plan.Plan
        The checked plan (with the model's config too, on transformers).
    name : str
        The model's name (an embedded model's, or the path or hub id given).
    entry : dict
        The model entry (:func:`kvdiverge.config.inputs.model_entry`) that loads the weights.
    tokenizer : object
        The tokenizer the plan was checked with.
    gguf : str or None
        The GGUF file that llama.cpp loads (``--backend llama_cpp``); None on transformers.
    """

    plan: Plan
    name: str
    entry: dict[str, Any]
    tokenizer: Any
    gguf: str | None


def plan_arguments(args: Any) -> ArgumentPlan:
    """Parse to plan: the arguments checked (:func:`check_arguments`; llama.cpp's cache types first), read as
    policies and prompts, and built into a :class:`~kvdiverge.doors.plan.Plan` that is checked with the
    tokenizer and then with the model's config (:meth:`~kvdiverge.doors.plan.Plan.check_config`; llama.cpp's
    cache types are checked on the model when it runs), all before any weights load. Each refusal is spelled
    as the command line spells the option (:data:`OPTIONS`).

    Raises
    ------
    InputError
        A bad argument, prompt or setting, in one sentence naming its option.
    kvdiverge.models.sources.ModelNotFoundError
        A model that is not there.
    """
    llama = args.backend == "llama_cpp"
    presses, caches = llama_sources(args) if llama else (None, None)  # refused before the other checks
    check_arguments(args)
    if not llama:
        presses, _, caches = argument_sources(args)
    prompts, instruction = argument_prompts(args)
    name, entry = model_entry(args.model, args.dtype, args.device)
    config = None if llama else load_model_config(entry, name)  # what the config decides, before the weights
    gguf = gguf_path(entry, name) if llama else None
    tokenizer = load_tokenizer(entry, name)
    keywords = measure_keywords(args, name, instruction, caches, task_block(args))
    plan = build_plan(prompts, presses, tokenizer, keywords, {**OPTIONS, "question": "--question"})
    if config is not None:
        plan.check_config(config, screen=args.screen)
    return ArgumentPlan(plan, name, entry, tokenizer, gguf)
