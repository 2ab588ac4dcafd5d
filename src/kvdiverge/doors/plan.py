"""A measurement planned before any weights load: ``kvdiverge.plan``, and what it runs.

:func:`plan` takes what :func:`kvdiverge.measure` takes but the model, and does every check that
needs no weights, once: every setting (:meth:`~kvdiverge.doors.measuring.MeasureOptions.checked`),
the task's documents, the prompts rendered, the reconstruction's targets, the frontier's grid
(:func:`kvdiverge.config.inputs.plan_presses`), every press and its minimum prompt length, and a
question prefilled after compression (:func:`kvdiverge.engine.refusals.question_after_problems`).
Given the model's config alone (:meth:`Plan.check_config`), it also refuses what the model's
context and layers refuse, as the command line asks before the weights load.

:meth:`Plan.run` then checks the model itself (its vocabulary, its context) and runs the
coupled measurement; :meth:`Plan.screen` runs the teacher-forced pass alone. Every door runs
through a plan: ``kvdiverge.measure(...)`` is ``plan(...).run(model)``, and the command line is
parse, plan, load, run.

Example::

    p = kvdiverge.plan(prompts, {"snapkv": kvpress.SnapKVPress(compression_ratio=0.5)},
                       tokenizer=tokenizer, max_new_tokens=8)   # refuses bad input before any load
    m = p.run(model)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvdiverge.config.inputs import (
    check_context,
    check_lengths,
    check_model_inputs,
    model_eos,
    model_label,
    plan_presses,
    prepare_documents,
    reconstruction_targets,
)
from kvdiverge.config.provenance import compressed_layers
from kvdiverge.data.prompts import REPEAT_INSTRUCTION
from kvdiverge.doors import measuring
from kvdiverge.doors.llamacpp import is_llama_policies, llama_problems, run_llama_plan
from kvdiverge.doors.results import Measurement
from kvdiverge.doors.screening import Screen, ScreenOptions, run_screen
from kvdiverge.engine.llm.teacher import DEFAULT_LENGTH
from kvdiverge.engine.presses.layer_types import has_sliding_layers, layers_of
from kvdiverge.engine.refusals import check_policy, question_after_problems
from kvdiverge.engine.runner import run_policies
from kvdiverge.models.loading import context_length, kv_sizes
from kvdiverge.settings.checks import model_problem, token_id_problems

__all__ = ["Plan", "check_model", "plan", "run_plan"]

#: :func:`plan`'s keyword settings that are not decoding settings, as
#: :class:`kvdiverge.doors.measuring.MeasureOptions` takes them.
OPTIONS = frozenset(f for f in measuring.MeasureOptions.__dataclass_fields__ if f != "decoding")


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A measurement checked before the model loads (:func:`plan`); :meth:`run` measures it.

    Attributes
    ----------
    options : kvdiverge.doors.measuring.MeasureOptions
        Every setting, checked.
    documents : tuple of kvdiverge.engine.runner.Document
        The prompts as the engine takes them (the task's prompts with a task).
    sources : mapping of str to PressSource
        The policies measured, by name, the frontier's points expanded, each press checked.
    grid : tuple of kvdiverge.estimation.frontier.FrontierPoint or None
        The frontier's points; None without ratios or budgets.
    task : tuple or None
        ``(documents, prompts table)`` of the task (:func:`kvdiverge.doors.measuring.task_inputs`).
    targets : mapping of str to kvdiverge.engine.forced.Continuation or None
        The reconstruction's targets (``teacher_target="reconstruction"``), else None.
    tokenizer : transformers tokenizer or None
        The tokenizer the prompts were rendered with (the task's answers are decoded with it).
    backend : str
        ``"transformers"`` (kvpress presses and quanto caches), or ``"llama_cpp"`` when the policies are
        llama.cpp cache types (:mod:`kvdiverge.doors.llamacpp`: the coupled run alone, on a ``llama_cpp.Llama``).
    """

    options: measuring.MeasureOptions
    documents: tuple
    sources: Mapping[str, Any]
    grid: tuple | None = None
    task: tuple | None = None
    targets: Mapping[str, Any] | None = None
    tokenizer: Any = field(default=None, repr=False)
    backend: str = "transformers"

    @property
    def horizon(self) -> int:
        """Cache columns a row spans beyond its prompt: ``2T - 2`` for the coupled run, or the teacher-forced
        pass's length when longer (:func:`kvdiverge.engine.refusals.check_policy`)."""
        return max(2 * self.options.max_new_tokens - 2, self._teacher_length() or 0)

    def check_config(self, config, *, screen: bool = False) -> None:
        """Refuse, with the model's config alone (no weights), what the run would refuse of the model.

        A prompt that with ``T`` new tokens (with ``screen``, 1: the teacher-forced continuation is cut to
        the context) exceeds the model context, and each press the run's own check refuses on the
        model's layers or config (:func:`kvdiverge.engine.refusals.check_policy`, over the cache columns a
        row spans beyond its prompt: :attr:`horizon`, or with ``screen`` the teacher-forced length).

        Raises
        ------
        ValueError
            The prompt, its length and the context, in one sentence.
        kvdiverge.engine.core.errors.PressError
            Naming the press and what the model's layers or config refuse.
        """
        check_lengths(self.documents, {}, 1 if screen else self.options.max_new_tokens, context_length(config))
        model = _ConfigOnly(config)
        horizon = (self._teacher_length() or DEFAULT_LENGTH) if screen else self.horizon
        for name, source in self.sources.items():
            check_policy(model, self.documents, source, f"press {name!r}", horizon)

    def run(self, model) -> Measurement:
        """Measure the plan on ``model``: :func:`kvdiverge.measure`'s result (see its docstring).

        Raises
        ------
        ValueError
            A ``model`` that is not one, prompt token ids or ``eos_ids`` outside its vocabulary, a prompt
            too long for its context: each before any forward.
        kvdiverge.engine.core.errors.CompressionError
            A press that promises compression but does not keep the promised positions.
        """
        return run_plan(self, model, stacklevel=3)

    def screen(self, model) -> Screen:
        """The teacher-forced pass alone on ``model`` (:func:`kvdiverge.doors.screening.run_screen`): the plan's
        seed, names, bootstrap and ``teacher_tokens`` of ``teacher_target`` (defaults: the continuation,
        :data:`~kvdiverge.engine.llm.teacher.DEFAULT_LENGTH` tokens, cut to the context)."""
        if self.backend == "llama_cpp":
            raise ValueError("screen: the llama_cpp backend runs the coupled measurement of KV cache types alone")
        check_model_inputs(model, self.documents, 1)  # the continuation is cut to what the context leaves
        eos = model_eos(model, self.options.eos_ids)
        return _teacher_pass(self, model, self.options.sampling(self._model_name(model)), eos)

    def _model_name(self, model) -> str:
        return model_label(model) if self.options.model_name is None else self.options.model_name

    def _teacher_length(self) -> int | None:
        o = self.options
        if o.teacher_tokens is None and o.teacher_target is None:
            return None
        return DEFAULT_LENGTH if o.teacher_tokens is None else int(o.teacher_tokens)


@dataclass(frozen=True)
class _ConfigOnly:
    """A model as the engine's checks read it before its weights load: its config alone."""

    config: Any


def plan(prompts, presses, *, tokenizer=None, **settings: Any) -> Plan:
    """Check a measurement before any model loads: :func:`kvdiverge.measure` without its model.

    Parameters
    ----------
    prompts, presses
        As :func:`kvdiverge.measure`.
    tokenizer : transformers tokenizer or None
        Renders text prompts with the chat template (and builds a task's prompts); None for
        token-id prompts.
    **settings
        :func:`kvdiverge.measure`'s keyword options and decoding settings, by the same names and
        defaults.

    Returns
    -------
    Plan
        Run it with :meth:`Plan.run` (the measurement) or :meth:`Plan.screen` (the teacher-forced pass).

    Raises
    ------
    TypeError
        An unknown keyword, as Python's own.
    ValueError
        Everything :func:`kvdiverge.measure` refuses that needs no weights (settings, prompts, presses,
        frontier values, a task, a question after compression that a press cannot take), before any
        work, in one sentence naming the argument, the value and what is allowed.
    """
    return build_plan(prompts, presses, tokenizer, settings)


def build_plan(
    prompts, presses, tokenizer, settings: Mapping[str, Any], names: Mapping[str, str] | None = None, vocab=None
) -> Plan:
    """:func:`plan` with ``settings`` as one mapping, its refusals spelled as a door spells each setting
    (``names``: setting -> spelling, ``{"max_new_tokens": "-T/--max-new-tokens", "question": "--question"}``;
    :func:`kvdiverge.settings.checks.spelled`; None: :func:`kvdiverge.measure`'s keywords). ``vocab``, the
    model's vocabulary size where the door has the model in hand, checks the prompts' token ids."""
    decoding = {k: v for k, v in settings.items() if k not in OPTIONS}
    opts = measuring.MeasureOptions.checked(decoding, **{k: v for k, v in settings.items() if k in OPTIONS})
    if is_llama_policies(presses):  # llama.cpp cache types: the coupled run alone (kvdiverge.doors.llamacpp)
        problems = llama_problems(presses, opts)
        if problems:
            raise ValueError(problems[0])
        documents = prepare_documents(prompts, tokenizer, instruction=opts.instruction, system=opts.system)
        return Plan(options=opts, documents=tuple(documents), sources=dict(presses), tokenizer=tokenizer,
                    backend="llama_cpp")  # fmt: skip
    task = measuring.task_inputs(opts, prompts, tokenizer, names)
    prompts = {d.doc_id: list(d.input_ids) for d in task[0]} if task else prompts
    documents = prepare_documents(prompts, tokenizer, instruction=opts.instruction, system=opts.system)
    targets = None  # the reconstruction's, built (and refused) before any forward
    if opts.teacher_target == "reconstruction":
        targets = reconstruction_targets(prompts, tokenizer, REPEAT_INSTRUCTION, "teacher_target")
    documents = task[0] if task else documents
    problems = [q for doc in documents for q in token_id_problems(doc.doc_id, doc.input_ids, vocab)]
    if problems:  # without the model, ids that are no token ids at all; its vocabulary is the run's check
        raise ValueError(problems[0])
    sources, grid = plan_presses(documents, presses, opts.max_new_tokens, opts.frontier)
    if task and any(d.n_question for d in task[0]):
        problems = question_after_problems(sources)
        if problems:
            raise ValueError(f"{(names or {}).get('question', 'task.question')} after: {problems[0]}")
    return Plan(options=opts, documents=tuple(documents), sources=sources, grid=None if grid is None else tuple(grid),
                task=task, targets=targets, tokenizer=tokenizer)  # fmt: skip


def check_model(model, eos_ids=None) -> tuple[int, ...]:
    """Refuse a ``model`` that is not one (:func:`kvdiverge.settings.checks.model_problem`) and ``eos_ids``
    outside its vocabulary (:func:`kvdiverge.config.inputs.model_eos`): ``ValueError`` in one sentence.
    Returns the end-of-sequence ids the run stops at."""
    problem = model_problem(model)
    if problem:
        raise ValueError(problem)
    return model_eos(model, eos_ids)


def run_plan(p: Plan, model, stacklevel: int, eos: tuple[int, ...] | None = None) -> Measurement:
    """:meth:`Plan.run`, its untouched-cache warning ``stacklevel`` frames above this function's caller.

    ``eos``: the end-of-sequence ids of a model the door has checked (:func:`check_model`) and the plan's
    token ids checked against (``build_plan``'s ``vocab``), so only the context is checked here; None:
    every check of the model (:func:`kvdiverge.config.inputs.check_model_inputs`)."""
    if p.backend == "llama_cpp":
        return run_llama_plan(p, model, stacklevel)
    opts = p.options
    if eos is None:
        check_model_inputs(model, p.documents, opts.max_new_tokens)
        eos = model_eos(model, opts.eos_ids)
    else:
        check_context(model, p.documents, opts.max_new_tokens)
    sampling = opts.sampling(p._model_name(model))
    runs = run_policies(model, list(p.documents), p.sources, sampling, split=opts.split, options=opts.run_options())
    grid = None if p.grid is None else list(p.grid)
    settings = opts.recorded(sampling.replace(decoding=sampling.decoding.replace(eos_ids=eos)), p.sources, grid,
                             kv_sizes(model) if grid else None)  # fmt: skip
    if has_sliding_layers(model.config):  # a press compresses the full-attention layers only
        settings = settings.replace(compressed_layers=compressed_layers(layers_of(model.config)))
    result = Measurement.of_run(runs, settings, p.sources, eos)
    if p._teacher_length() is not None:
        result.teacher_forced = _teacher_pass(p, model, sampling, result.eos_ids)
    if p.task:
        args = (result.trajectories, result.documents, p.task[1], p.tokenizer, result.noise_floor)
        result.task = measuring.task_tables(opts, *args)
    result.warn_untouched(measuring.floors(p.sources), stacklevel=stacklevel)
    return result


def _teacher_pass(p: Plan, model, sampling, eos: tuple[int, ...]) -> Screen:
    """The teacher-forced pass of a plan's prompts and presses (:func:`kvdiverge.doors.screening.run_screen`):
    the coupled run's seed and names, its decoding transform off, the plan's teacher length and target."""
    opts = p.options
    options = ScreenOptions(length=p._teacher_length() or DEFAULT_LENGTH, seed=opts.seed, split=opts.split,
                            bootstrap=opts.bootstrap, confidence=opts.confidence, model_name=sampling.model_name,
                            target=opts.teacher_target or "continuation")  # fmt: skip
    forcing = options.forcing()
    forced = forcing.sampling(sampling.seed, sampling.model_name, eos)
    return run_screen(model, list(p.documents), p.sources, forced, forcing, options, p.targets)
