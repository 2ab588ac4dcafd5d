"""Screen presses with the teacher-forced pass only: ``kvdiverge.screen`` and ``kvdiverge measure --screen``.

:func:`screen` takes the same prompts and presses as :func:`kvdiverge.measure` (a frontier
too: ``ratios``, ``budgets``, ``caches``) and runs only the teacher-forced pass
(:mod:`kvdiverge.engine.forced`): per prompt one continuation (the caller's, else the
full-cache model's greedy continuation), or with ``target="reconstruction"`` the prompt's own
text after a repeat instruction, fed to both sides after each press's prefill, one forward per
press for prefill-only presses; the key tokens (LongPPL's) marked on either. It ranks a frontier in a fraction of the
coupled run's time (``docs/teacher-forced.md`` gives the measured ratio); the coupled
estimator then spends its time on the points that matter.

Example::

    s = kvdiverge.screen(model, tokenizer, prompts, {"snapkv": "SnapKVPress"}, frontier={"ratios": [0.25, 0.5, 0.75]})
    print(s.format())       # llama.cpp's headline numbers per press, ranked by mean KLD
    s.table                 # kvdiverge.estimation.teacher_forced.summary_table
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import polars as pl

from kvdiverge.config.frontier import FrontierSpec
from kvdiverge.config.inputs import (
    check_model_inputs,
    is_noise_floor,
    model_eos,
    model_label,
    plan_presses,
    prepare_documents,
    reconstruction_targets,
)
from kvdiverge.data.prompts import REPEAT_INSTRUCTION
from kvdiverge.engine.forced import TeacherPass, teacher_forced_policies
from kvdiverge.engine.llm.teacher import DEFAULT_LENGTH, TeacherForcing
from kvdiverge.estimation.bootstrap import Bootstrap
from kvdiverge.estimation.key_tokens import KeyTokens, missing_key_lines
from kvdiverge.estimation.teacher_forced import document_table, summary_table
from kvdiverge.io.files import save_table
from kvdiverge.report.formatting import teacher_text
from kvdiverge.settings.checks import SCREEN_SETTINGS, check_settings, text_problems

__all__ = ["Screen", "ScreenOptions", "run_screen", "screen", "teacher_forced_tables"]


@dataclass
class Screen:
    """What :func:`screen` measured.

    Attributes
    ----------
    positions : polars.DataFrame
        :data:`kvdiverge.estimation.teacher_forced.POSITION_SCHEMA`, one row per (press, prompt, position).
    documents : polars.DataFrame
        Per (press, prompt): the headline means (:func:`kvdiverge.estimation.teacher_forced.document_table`).
    table : polars.DataFrame
        Per press: llama.cpp's statistics with document-bootstrap intervals, the noise floor beside
        (:func:`kvdiverge.estimation.teacher_forced.summary_table`).
    settings : dict
        ``model``, ``split``, ``length``, ``seed``, ``target``, ``key_tokens`` (the rule's ``short``, ``alpha``,
        ``beta``), ``bootstrap``, ``confidence``, ``presses``, ``noise_floor``.
    """

    positions: pl.DataFrame
    documents: pl.DataFrame
    table: pl.DataFrame
    settings: dict[str, Any]

    def format(self) -> str:
        """Per press, ranked by mean KLD: KLD, PPL ratio, Same top p, RMS Δp and the key tokens' measures
        (:func:`kvdiverge.report.formatting.teacher_text`); then a line for the prompts without a key
        position, if any (:func:`kvdiverge.estimation.key_tokens.missing_key_lines`)."""
        text = teacher_text(self.table, self.settings.get("noise_floor"))
        return "\n".join([text, *missing_key_lines(self.table)])

    def __repr__(self) -> str:
        return self.format()

    def save(self, directory: str | os.PathLike) -> list[Path]:
        """Write ``teacher_forced_positions``, ``teacher_forced_documents`` and ``teacher_forced`` (parquet; CSV for
        the last two), atomically; returns the files written."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        files = []
        for name, frame, csv in (
            ("teacher_forced_positions", self.positions, False),
            ("teacher_forced_documents", self.documents, True),
            ("teacher_forced", self.table, True),
        ):
            save_table(frame, str(out / f"{name}.parquet"), str(out / f"{name}.csv") if csv else None)
            files += [out / f"{name}.parquet"] + ([out / f"{name}.csv"] if csv else [])
        return files


def teacher_forced_tables(positions: pl.DataFrame, floor: str | None, boot: Bootstrap):
    """``(documents, table)`` of a positions table (:mod:`kvdiverge.estimation.teacher_forced`), with the
    intervals of ``boot`` (:class:`kvdiverge.estimation.bootstrap.Bootstrap`)."""
    table = summary_table(positions, floor=floor, boot=boot)
    return document_table(positions), table


@dataclass(frozen=True)
class ScreenOptions:
    """Settings of :func:`screen`.

    Attributes
    ----------
    length : int
        Continuation tokens per prompt (cut to what the context leaves).
    seed : int
        Master seed (prefill seeds of presses that draw, the bootstrap).
    instruction, system : str or None
        Appended instruction and system message of text prompts.
    model_name : str or None
        ``model`` column, enters the seeds; None: the model's ``name_or_path`` basename.
    split : str
        ``split`` column (enters the bootstrap seeds).
    eos_ids : sequence of int or None
        End-of-sequence token ids; None: from ``model.generation_config``.
    bootstrap : int
        Document-bootstrap resamples of the intervals (a count).
    confidence : float
        Interval coverage (a fraction in (0, 1)).
    block : bool
        Feed the continuation in one forward where the press allows it.
    target : str
        ``"continuation"`` (the tokens after the prompt) or ``"reconstruction"`` (the prompt's own text
        after ``repeat_instruction``), as the config's ``teacher_forced.target``.
    repeat_instruction : str
        The reconstruction's instruction (``teacher_forced.repeat_instruction``; KVzip's by default).
    key_short, key_alpha, key_beta : int, float, float
        LongPPL's key-token rule (:class:`kvdiverge.estimation.key_tokens.KeyTokens`,
        ``teacher_forced.key_tokens``): the short context's tokens, the least long-short difference and
        the least long-context log-probability, nats.
    """

    length: int = DEFAULT_LENGTH
    seed: int = 0
    instruction: str | None = None
    system: str | None = None
    model_name: str | None = None
    split: str = "measure"
    eos_ids: Sequence[int] | None = None
    bootstrap: int = 2000
    confidence: float = 0.95
    block: bool = True
    target: str = "continuation"
    repeat_instruction: str = REPEAT_INSTRUCTION
    key_short: int = KeyTokens.short
    key_alpha: float = KeyTokens.alpha
    key_beta: float = KeyTokens.beta

    def forcing(self) -> TeacherForcing:
        """The pass's :class:`kvdiverge.engine.llm.teacher.TeacherForcing`: length, forward, target, key tokens."""
        key = KeyTokens(self.key_short, self.key_alpha, self.key_beta)
        return TeacherForcing(length=self.length, block=bool(self.block), target=self.target, key=key)


def screen(
    model,
    tokenizer,
    prompts,
    presses,
    *,
    continuations: Mapping[str, Sequence[int]] | None = None,
    frontier: FrontierSpec | Mapping[str, Any] | None = None,
    options: ScreenOptions | Mapping[str, Any] | None = None,
) -> Screen:
    """Run only the teacher-forced pass of ``presses`` on ``prompts``.

    Parameters
    ----------
    model, tokenizer, prompts, presses
        As :func:`kvdiverge.measure`.
    continuations : mapping of str to sequence of int, optional
        Per prompt id, the tokens to feed (e.g. the text that follows a document); prompts
        without one get the full-cache model's greedy continuation. Not read with
        ``options.target="reconstruction"``, which feeds each prompt's own text.
    frontier : kvdiverge.config.frontier.FrontierSpec or mapping, optional
        ``ratios``, ``budgets``, ``caches``, ``cache_ratios``: as :func:`kvdiverge.measure`
        (a mapping gives them by name; another key is refused).
    options : ScreenOptions or mapping, optional
        Length, seed, prompt rendering, bootstrap and forward settings (:class:`ScreenOptions`;
        a mapping gives its fields by name, another key refused); None: the defaults.

    Returns
    -------
    Screen

    Raises
    ------
    ValueError
        As :func:`kvdiverge.measure`: a model that is not one, bad prompts, presses, lengths or
        frontier values, an option the config's rule for that setting refuses (``options.length``:
        ``teacher_forced.length``; ``options.target``, ``options.key_short``, ...: ``teacher_forced.*``;
        ``options.bootstrap``, ``options.confidence``, ``options.seed``, ``options.instruction``,
        ``options.system``), an ``options.model_name`` or ``options.split`` that is not a non-empty
        string, ``options.eos_ids`` outside the model's vocabulary, or ``options`` or ``frontier`` of
        another kind or with an unknown key, named in one sentence; the reconstruction without a tokenizer.
    """
    opt, spec = _checked(_options(options)), _frontier(frontier)
    forcing = opt.forcing()
    documents = prepare_documents(prompts, tokenizer, instruction=opt.instruction, system=opt.system)
    if forcing.target == "reconstruction":
        continuations = reconstruction_targets(prompts, tokenizer, opt.repeat_instruction, "options.target")
    check_model_inputs(model, documents, 1)  # room for 1 token: the continuation is cut to what the context leaves
    eos = model_eos(model, opt.eos_ids, "options.eos_ids")
    sources, _ = plan_presses(documents, presses, 1, spec)
    sampling = forcing.sampling(opt.seed, opt.model_name or model_label(model), eos)
    return run_screen(model, documents, sources, sampling, forcing, opt, continuations)


def _options(options: Any) -> ScreenOptions:
    """:func:`screen`'s ``options`` as :class:`ScreenOptions`, or ``ValueError`` naming what it is not."""
    return _of_kind(options, ScreenOptions, "options", "a mapping of its fields ({})")


def _frontier(frontier: Any) -> FrontierSpec:
    """:func:`screen`'s ``frontier`` as a :class:`~kvdiverge.config.frontier.FrontierSpec`, or ``ValueError``
    naming what it is not (its values: :func:`~kvdiverge.config.inputs.plan_presses`)."""
    return _of_kind(frontier, FrontierSpec, "frontier", "a mapping of {}")


def _of_kind(value: Any, kind: type, name: str, mapping: str):
    """``value`` as the dataclass ``kind`` (None: its defaults; a mapping: its fields by name), or
    ``ValueError`` naming the argument ``name``: a value of another kind (what is allowed: ``kind``'s name
    or ``mapping`` with the fields filled in), or a mapping's first unknown key."""
    fields = [f.name for f in dataclasses.fields(kind)]
    if value is None or isinstance(value, kind):
        return value or kind()
    if not isinstance(value, Mapping):
        allowed = f"a {kind.__name__} or " + mapping.format(", ".join(fields))
        raise ValueError(f"{name}: {value!r} is not allowed; allowed: {allowed}")
    unknown = [k for k in value if k not in fields]
    if unknown:
        raise ValueError(f"{name}: unknown key {unknown[0]!r}; allowed: {', '.join(fields)}")
    return kind(**value)


def _checked(opt: ScreenOptions) -> ScreenOptions:
    """``opt`` with its counts as ``int``, or ``ValueError`` naming each field (``options.bootstrap``) the
    config's rule for that setting refuses (:data:`kvdiverge.settings.checks.SCREEN_SETTINGS`), or the
    first that is not a string where one is asked (``options.instruction``, ``options.split``)."""
    fields = {**SCREEN_SETTINGS, **{f: f for f in ("instruction", "system") if getattr(opt, f) is not None}}
    values = {setting: getattr(opt, field) for field, setting in fields.items()}
    names = {setting: f"options.{field}" for field, setting in fields.items()}
    checked = check_settings(values, names)
    texts = {"split": opt.split, **({} if opt.model_name is None else {"model_name": opt.model_name})}
    problems = text_problems(texts, {k: f"options.{k}" for k in texts})
    if problems:
        raise ValueError(problems[0])
    return replace(opt, **{field: checked[setting] for field, setting in SCREEN_SETTINGS.items()})


def run_screen(model, documents, sources, sampling, forcing, options: ScreenOptions, continuations=None) -> Screen:
    """The teacher-forced pass of prepared documents and policies, and its tables.

    Parameters
    ----------
    model : transformers.PreTrainedModel
    documents : sequence of kvdiverge.engine.runner.Document
    sources : mapping of str to PressSource
        Name -> policy (:func:`kvdiverge.config.inputs.prepare_presses`); a noise-floor press
        among them (:func:`kvdiverge.config.inputs.is_noise_floor`) is set beside the others.
    sampling : kvdiverge.engine.core.sampling.Sampling
        ``seed``, ``model_name``, ``eos_ids`` (:func:`kvdiverge.engine.forced.teacher_forced_policies`).
    forcing : kvdiverge.engine.llm.teacher.TeacherForcing
    options : ScreenOptions
        Its ``split``, ``bootstrap`` and ``confidence`` (the length, seed and names are ``forcing``'s and
        ``sampling``'s).
    continuations : mapping of str to sequence of int, optional
        As :func:`screen`'s.
    """
    split = options.split
    positions = teacher_forced_policies(
        model,
        documents,
        sources,
        settings=TeacherPass(sampling, forcing, split),
        continuations=continuations,
    )
    floors = [n for n, s in sources.items() if is_noise_floor(n, s)]
    floor = floors[0] if floors else None
    boot = Bootstrap(options.bootstrap, options.confidence, sampling.seed)
    docs, table = teacher_forced_tables(positions, floor, boot)
    settings = {"model": sampling.model_name, "split": split, "length": forcing.length, "seed": sampling.seed,
                "target": forcing.target, "key_tokens": asdict(forcing.key) if forcing.key else None}  # fmt: skip
    settings.update(bootstrap=boot.n_boot, confidence=boot.confidence, presses=list(sources), noise_floor=floor)
    return Screen(positions, docs, table, settings)
