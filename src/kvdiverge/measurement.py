"""Measure presses in one call: the Python front door, ``kvdiverge.measure``.

:func:`measure` runs prompts through the same engine (:func:`kvdiverge.engine.runner.run_policies`),
estimators and analyses (:mod:`kvdiverge.estimation.tables`) as the workflow, for one model and any
number of presses on the same prompts, with common random numbers (the seeds derive from
(seed, model name, prompt id, replicate), never from the press). It returns a
:class:`Measurement` holding the same tables as ``results/trajectories``,
``results/estimates`` and ``results/analysis``.

Example (a notebook)::

    import kvdiverge, kvpress
    from kvdiverge.study.models import EMBEDDED_MODEL, load_model
    model, tokenizer = load_model(EMBEDDED_MODEL)
    m = kvdiverge.measure(model, tokenizer, ["Explain KV caches to a child."] * 2,
                          {"snapkv": kvpress.SnapKVPress(compression_ratio=0.5, window_size=8)},
                          max_new_tokens=8, replicates=2)
    m.summary

The mathematics and column names: ``docs/estimators.md``; the tables: ``docs/internals.md``.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from kvdiverge.estimation.bootstrap import Bootstrap
from kvdiverge.estimation.drift import (
    drift_replicates,
    drift_table,
    format_drift_line,
    length_ratios,
    length_survival,
    loop_settings,
    with_drift_columns,
)
from kvdiverge.estimation.frontier import measured_frontier
from kvdiverge.estimation.speculative import format_speculative_line, speculative_table
from kvdiverge.estimation.tables import compression_table, pairwise_gaps, press_gap, summary_table
from kvdiverge.estimation.teacher_forced import with_teacher_columns
from kvdiverge.report.formatting import frontier_text, summary_text
from kvdiverge.screening import ScreenOptions, run_screen
from kvdiverge.study import measuring
from kvdiverge.study.inputs import NOISE_FLOOR_PRESS, measure_inputs, model_label, prepare_documents
from kvdiverge.study.provenance import save_measurement

__all__ = ["Measurement", "measure"]

log = logging.getLogger(__name__)


@dataclass
class Measurement:
    """Everything :func:`measure` measured: the workflow's tables, for one model.

    Attributes
    ----------
    trajectories : polars.DataFrame
        One row per (press, prompt, replicate), shard schema
        (:data:`kvdiverge.estimation.schema.TRAJECTORY_SCHEMA`); ``policy`` is the press name.
    replicates, documents : polars.DataFrame
        Per-replicate and per-prompt estimates (``results/estimates``;
        :func:`kvdiverge.estimation.tables.estimate`).
    pooled, timing, survival, branch_tv, variance : polars.DataFrame
        Pooled over prompts with document-bootstrap intervals (``results/analysis``;
        :func:`kvdiverge.estimation.tables.pool`).
    settings : dict
        model, split, T, R, temperature, top_p, seed, window, bootstrap, confidence (and
        ``decoding``: the settings of :func:`kvdiverge.engine.core.sampling.decoding_options` not
        at their default, when any),
        presses (name -> description), quantized_caches (names of the quantized-cache policies, if any).
    noise_floor : str or None
        Name of the noise-floor press among the presses, if any.
    batch_documents : int or None
        Documents per batched forward ``B`` every press ran with (planned once per
        :func:`measure` call); not a setting, since results depend on it only by rounding.
    teacher_forced : kvdiverge.screening.Screen or None
        The teacher-forced pass (``measure(..., teacher_tokens=N)``): llama.cpp's KLD, PPL
        ratio, Same top p and RMS Δp per press (``docs/teacher-forced.md``); None when not run.
    task : dict of polars.DataFrame or None
        With :func:`measure`'s ``task``: the task's ``documents``, ``accuracy``,
        ``correlations`` and ``auc`` tables (:func:`kvdiverge.study.tasks.tables.task_tables`).
    eos_ids : tuple of int or None
        The end-of-sequence ids both generations stopped at (the length drift's stops).
    """

    trajectories: pl.DataFrame
    replicates: pl.DataFrame
    documents: pl.DataFrame
    pooled: pl.DataFrame
    timing: pl.DataFrame
    survival: pl.DataFrame
    branch_tv: pl.DataFrame
    variance: pl.DataFrame
    settings: dict[str, Any]
    noise_floor: str | None = None
    batch_documents: int | None = None
    teacher_forced: Any = None
    task: dict[str, pl.DataFrame] | None = None
    eos_ids: tuple[int, ...] | None = None
    _gaps: dict[tuple[str, str], pl.DataFrame] = field(default_factory=dict, repr=False)
    _cache: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def presses(self) -> list[str]:
        """Press names, in the order given."""
        return list(self.settings["presses"])

    def gap(self, a: str, b: str) -> pl.DataFrame:
        """Gap decomposition ``A - B`` of the expected token loss of presses ``a`` and ``b``, paired
        by prompt (§7): four rows (``term``: ``delta``, ``first_mismatch``, ``exposure``, ``rate``),
        ``value`` in tokens with its paired-bootstrap interval, ``share`` of the gap and
        ``value_M = value / T`` (:func:`kvdiverge.estimation.tables.press_gap`). Raises
        ``ValueError`` if ``a`` or ``b`` is not a measured press, or ``a == b``."""
        if (a, b) not in self._gaps:  # a refused pair is never stored
            self._gaps[(a, b)] = press_gap(self.documents, self.presses, a, b, self.settings)
        return self._gaps[(a, b)]

    @property
    def gaps(self) -> pl.DataFrame:
        """Gap decompositions of every pair ``(A, B)`` of presses, A before B in the given order."""
        return pairwise_gaps(self.gap, self.presses)

    @property
    def speculative(self) -> pl.DataFrame:
        """The self-speculative reading, per press (the press's cache drafts, the full cache is the
        target): rows ``k = 1..min(8, T)`` with document-bootstrap intervals of the accepted tokens
        ``A = sum_{j<=k} S_j`` of a first draft block of ``k``, ``tokens_per_forward = A + 1``, the
        per-step acceptance ``alpha`` and the i.i.d. formula
        (:func:`kvdiverge.estimation.speculative.speculative_table`)."""
        return self._memo("speculative", lambda: speculative_table(self.documents, Bootstrap.of(self.settings)))

    @property
    def drift_replicates(self) -> pl.DataFrame:
        """Per press, prompt and replicate: each side's length to EOS, stop, loop and repetition, paired
        (:func:`kvdiverge.estimation.drift.drift_replicates`)."""
        loops = loop_settings(None, self.settings["T"])
        return self._memo("drift_replicates", lambda: drift_replicates(self.trajectories, self.eos_ids or (), **loops))

    @property
    def drift(self) -> pl.DataFrame:
        """Length and loop drift per press: ``length_mean``, ``length_median`` (tokens), ``stop_rate``,
        ``loop_rate``, ``rep4``, ``distinct2`` on the full-cache and the compressed side and their paired
        difference, with document-bootstrap intervals (:func:`kvdiverge.estimation.drift.drift_table`)."""
        return self._memo("drift", lambda: drift_table(self.drift_replicates, Bootstrap.of(self.settings)))

    @property
    def length_survival(self) -> pl.DataFrame:
        """Per press and side, ``P(EOS step > t)`` for ``t = 0..T``: the Kaplan–Meier curve of the EOS time
        censored at ``T`` (:func:`kvdiverge.estimation.drift.length_survival`)."""
        return self._memo("length_survival", lambda: length_survival(self.drift_replicates))

    @property
    def compression(self) -> pl.DataFrame:
        """Per press and prompt: ``prompt_len``, ``kept_len`` (tokens), ``kept_fraction`` and
        ``untouched`` (the evicted side's kernel equals the reference side's: TV exactly 0 at
        every step of every replicate; :func:`kvdiverge.estimation.tables.compression_table`)."""
        return compression_table(self.documents, self.trajectories)

    @property
    def summary(self) -> pl.DataFrame:
        """One row per press: ``policy``, ``n_docs``, ``T``, ``R``, ``kept_fraction``, ``untouched``
        (TV exactly 0 at every step on every prompt), ``p_div``, ``tau_mean`` and ``E_L`` (steps),
        ``E_M`` (mismatch fraction), each with ``_lo``/``_hi`` bootstrap bounds, ``rho``,
        ``first_mismatch_term + exposure_rate_term = E_M``, ``exposure_share``; with a noise floor,
        ``E_M_minus_floor`` and ``p_div_minus_floor`` (:func:`kvdiverge.estimation.tables.summary_table`)."""
        out = summary_table(self.pooled, self.documents, self.presses, self.trajectories, self.noise_floor, self.gap)
        if self.teacher_forced is None:
            return out
        cols = ["kld_mean", "ppl_ratio", "same_top_p", "delta_p_rms"]
        return out.join(self.teacher_forced.table.select("policy", *cols), on="policy", how="left")

    def format_summary(self) -> str:
        """The summary as a plain-text table, with notes (what ``kvdiverge measure`` prints;
        :func:`kvdiverge.report.formatting.summary_text`), one line of the self-speculative
        reading: tokens per target forward of a first draft block of 4 (:attr:`speculative`), and
        one of the length drift: the paired differences in length, stop and loop rate (:attr:`drift`)."""
        text = (
            summary_text(self.summary, self.settings, self.noise_floor, NOISE_FLOOR_PRESS)
            + "\n"
            + format_speculative_line(self.speculative, self.presses)
            + "\n"
            + format_drift_line(self.drift, self.presses)
        )
        return text if self.teacher_forced is None else text + "\n" + self.teacher_forced.format()

    def __repr__(self) -> str:
        return self.format_summary()

    def save(self, directory: str | os.PathLike) -> list[Path]:
        """Write every table as parquet (and the scalar columns as CSV), atomically.

        Files: ``trajectories``, ``replicates``, ``documents``, ``pooled``, ``timing``, ``survival``,
        ``branch_tv``, ``variance``, ``gaps``, ``summary``, ``speculative``, ``drift``,
        ``length_survival``, for a frontier ``frontier``
        and ``frontier_areas``, with a task ``task_documents``, ``task_accuracy``, ``task_correlations``,
        ``task_auc`` (``.parquet``; ``.csv`` too except for trajectories and replicates),
        ``measure.json`` (the settings) and ``provenance.json``: ``settings_hash``
        (:func:`kvdiverge.study.provenance.settings_hash` of the settings), ``versions``
        (:func:`kvdiverge.study.provenance.library_versions`) and ``batch_documents`` (the ``B`` used).
        Returns the files written (list of pathlib.Path).
        """
        tables = {
            "trajectories": self.trajectories,
            "replicates": self.replicates,
            "documents": self.documents,
            "pooled": self.pooled,
            "timing": self.timing,
            "survival": self.survival,
            "branch_tv": self.branch_tv,
            "variance": self.variance,
            "gaps": self.gaps,
            "summary": self.summary,
            "speculative": self.speculative,
            "drift": self.drift,
            "length_survival": self.length_survival,
            **{f"task_{name}": table for name, table in (self.task or {}).items()},
        }
        if self.settings.get("frontier"):
            tables["frontier"], tables["frontier_areas"] = self._frontier()
        if self.teacher_forced is not None:
            tables["teacher_forced"] = self.teacher_forced.table
            tables["teacher_forced_documents"] = self.teacher_forced.documents
        return save_measurement(directory, tables, self.settings, self.batch_documents)

    def plot_survival(self, target=None):
        """Draw the survival figure ``S_t`` per press: into ``target`` Axes (returned), to a path
        (``.png``, ``.pdf``, ``.svg``; the path returned) or, with None, as a new figure
        (:func:`kvdiverge.report.figures.render_survival`)."""
        from kvdiverge.report.figures import render_survival

        return render_survival(self.survival, target, title=self.settings["model"])

    def _memo(self, key: str, compute):
        """``compute()``, computed once and kept (a failure is not kept)."""
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]

    def _frontier(self) -> tuple[pl.DataFrame, pl.DataFrame]:
        def compute():
            points, areas = measured_frontier(self.documents, self.settings, self.noise_floor)
            teacher = None if self.teacher_forced is None else self.teacher_forced.table
            ratios = length_ratios(self.drift_replicates, Bootstrap.of(self.settings))
            return with_drift_columns(with_teacher_columns(points, teacher), ratios), areas

        return self._memo("frontier", compute)

    def frontier(self) -> pl.DataFrame:
        """The frontier, the workflow's ``analysis/frontier``: one row per point (press and ratio,
        cache alone, press and ratio with a cache) with ``p_div``, ``tau_mean``, ``tau_median``,
        ``E_M``, ``first_mismatch_term``, ``exposure_rate_term``, ``rho`` with intervals, the KV
        bytes per prompt token, the floor's values, ``above_floor`` and ``rank``
        (:func:`kvdiverge.estimation.frontier.measured_frontier`), and with ``teacher_tokens`` the
        teacher-forced ``kld_mean`` (with its interval), ``ppl_ratio``, ``same_top_p`` and
        ``delta_p_rms`` (:func:`kvdiverge.estimation.teacher_forced.with_teacher_columns`). Raises
        ``ValueError`` if the measurement was not made with ``ratios``."""
        return self._frontier()[0]

    def frontier_areas(self) -> pl.DataFrame:
        """The frontier ranking: per curve (each press at full precision, each cache alone and
        after each press), the mean of its ``E[M]`` and ``p_div`` over the KV bytes per prompt
        token common to the curves, and the areas over its ratios, with paired intervals, best
        first (``analysis/frontier_areas``)."""
        return self._frontier()[1]

    def format_frontier(self) -> str:
        """The frontier ranking as plain text (what ``kvdiverge measure --ratios`` prints)."""
        points, areas = self._frontier()
        return frontier_text(points, areas, self.settings["confidence"])

    def plot_frontier(self, target=None):
        """Draw the frontier figure: into ``target``, a sequence of 3 Axes (returned), to a path
        (format from the suffix; the path returned) or, with None, as a new figure
        (:func:`kvdiverge.report.figures.render_frontier`)."""
        from kvdiverge.report.figures import render_frontier

        return render_frontier(self.frontier(), target, title=self.settings["model"])


# --------------------------------------------------------------------------- the call


def _measurement(runs, windows, settings: dict[str, Any], sources: Mapping[str, Any], eos_ids) -> Measurement:
    """The :class:`Measurement` of a coupled run: its estimates and pooled tables (window, bootstrap: ``settings``)."""
    from kvdiverge.estimation import tables

    reps, docs = tables.estimate(runs.trajectories, settings["window"], windows)
    pooled = tables.pool(docs, Bootstrap.of(settings))
    floors = measuring.floors(sources)
    return Measurement(
        trajectories=runs.trajectories,
        replicates=reps,
        documents=docs,
        settings=settings,
        noise_floor=floors[0] if floors else None,
        batch_documents=runs.batch_documents,
        eos_ids=eos_ids,
        **pooled,
    )


def _warn_untouched(result: Measurement, sources: Mapping[str, Any]) -> None:
    """Warn, from :func:`measure`'s caller, of each press but a noise floor that left the cache untouched."""
    untouched = result.summary.filter(pl.col("untouched"))["policy"].to_list()
    floors = measuring.floors(sources)
    for name in (n for n in untouched if n not in floors):  # the floor keeps every position by design
        warnings.warn(
            f"press {name!r} left the cache untouched (TV 0 at every step on every prompt: the same "
            f"kernel as the full cache)",
            stacklevel=3,
        )


def measure(
    model,
    tokenizer,
    prompts,
    presses,
    *,
    max_new_tokens: int = 32,
    replicates: int = 4,
    seed: int = 0,
    window: int = 8,
    instruction: str | None = None,
    system: str | None = None,
    windows: Mapping[str, Sequence[int]] | None = None,
    bootstrap: int = 2000,
    confidence: float = 0.95,
    model_name: str | None = None,
    split: str = "measure",
    eos_ids: Sequence[int] | None = None,
    progress: bool = True,
    batch_documents: int | None = None,
    memory_budget_gb: float | None = None,
    ratios: Sequence[float] | None = None,
    budgets: Sequence[int] | None = None,
    caches: Mapping[str, Mapping[str, Any]] | None = None,
    cache_ratios: Sequence[float] | None = None,
    teacher_tokens: int | None = None,
    task: str | Mapping[str, Any] | None = None,
    **decoding: float,
) -> Measurement:
    """Measure how each press changes what ``model`` generates on ``prompts``.

    Every press runs on the same prompts with common random numbers, through the
    workflow's engine (:func:`kvdiverge.engine.runner.run_policies`) and table functions
    (:mod:`kvdiverge.estimation.tables`): per prompt and replicate, an agreement chain of the
    full-cache and the compressed-cache generation under a stepwise maximal coupling,
    and one residual branch after their first divergence (``docs/estimators.md``).

    Parameters
    ----------
    model : transformers.PreTrainedModel
        Causal LM in eval mode that kvpress supports (any that transformers loads).
    tokenizer : transformers tokenizer or None
        Renders text prompts with the chat template; may be None for token-id prompts.
    prompts : sequence or mapping
        Strings (rendered as the workflow does: :func:`kvdiverge.study.inputs.prepare_documents`) or token-id
        sequences (used as they are); a mapping names them (ids enter the seeds).
    presses : mapping of str to press, policy entry or PressSource
        kvpress press objects (the user's own ``BasePress`` subclasses too), config policy
        entries (``{"press": "SnapKVPress", "compression_ratio": 0.5}``), or policies;
        see :func:`kvdiverge.study.inputs.prepare_presses`.
    max_new_tokens : int
        Horizon ``T`` (tokens = steps).
    replicates : int
        ``R`` coupled replicates per prompt (>= 2 for standard errors and variances).
    seed : int
        Master seed.
    window : int
        ``W``, divergence-aligned window width (lags) of the §4 interval.
    instruction, system : str, optional
        Appended instruction and system message of text prompts.
    windows : mapping of str to (a, b), optional
        Named lag windows of the §6 branch-aligned TV (adds ``btv_<name>`` columns).
    bootstrap : int
        Document-bootstrap resamples of the pooled intervals.
    confidence : float
        Interval coverage.
    model_name : str, optional
        ``model`` column, enters the seeds; default the model's ``name_or_path`` basename.
    split : str
        ``split`` column (enters the bootstrap seeds).
    eos_ids : sequence of int, optional
        End-of-sequence ids; default from ``model.generation_config``.
    progress : bool
        A tqdm bar per press on stderr.
    batch_documents : int or None
        Documents decoded together per forward (rows = documents x ``replicates``);
        None lets the memory planner choose (:func:`kvdiverge.engine.runner.plan_documents`,
        once per call, for every press).
        Grouping changes results only by rounding; 1 reproduces a workflow shard that
        holds one document exactly.
    memory_budget_gb : float or None
        Memory budget of the planner (GiB); None: 80% of free CUDA memory, 4 GiB on CPU.
    ratios, budgets : sequence, optional
        Measure a frontier: every press at every compression ratio (and fixed budget),
        named ``<press>@<ratio>`` (``<press>@b<budget>``), beside the noise floor (one is
        added when no ``PermutationPress`` is given); :func:`kvdiverge.study.inputs.frontier_presses`. Then
        :meth:`Measurement.frontier` and :meth:`Measurement.plot_frontier` draw it.
    caches, cache_ratios : optional
        Quantized caches of the frontier by label (``{"int4": {"backend": "quanto", "nbits": 4,
        "q_group_size": 64, "residual_length": 32}}``; a policy's ``cache: quantized`` keys, the
        same defaults), each alone (named by its label) and after each press (a policy entry)
        at each of ``cache_ratios`` above 0 (``<press>@<ratio>+<cache>``; default: 0 and every
        ratio; 0 is the cache alone), as a config's ``frontier.caches``. The frontier then
        ranks every curve on the KV bytes per prompt token it stores.
    teacher_tokens : int, optional
        Also run the teacher-forced pass (:func:`kvdiverge.screening.run_screen`): the full-cache
        model's greedy continuation of each prompt, this many tokens (an integer >= 1, the
        config's ``teacher_forced.length``; cut to what the model context leaves after each
        prompt), fed to both sides; its headline columns (``kld_mean``, ``ppl_ratio``,
        ``same_top_p``, ``delta_p_rms``) join the summary and :attr:`Measurement.teacher_forced`
        holds its tables. Checked before the coupled run. None (default): not run.
    task : str or mapping, optional
        A task score beside the measures (:mod:`kvdiverge.study.tasks`): ``"niah"`` or a
        config ``task`` block (``{"name": "niah", "depths": [0, 50, 100], "question":
        "after"}``), checked by the config's rules (:func:`kvdiverge.study.settings.check_task`).
        Text prompts become the task's prompts; needs ``temperature=0`` (the answers are the
        greedy coupled run's own), and with ``question: after`` presses that act on the prefill
        only. :attr:`Measurement.task` then holds the
        workflow's task tables (``documents``, ``accuracy``, ``correlations``, ``auc``:
        :func:`kvdiverge.study.tasks.tables.task_tables`).

    **decoding : float or int
        The decoding transform of both generations, by name
        (:func:`kvdiverge.engine.core.sampling.decoding_options`, ranges as
        :class:`kvdiverge.engine.core.sampling.Decoding`): ``temperature`` (default 0.7; 0 is
        greedy), ``top_k`` (default 0, none), ``top_p`` (default 0.95), ``repetition_penalty``
        (CTRL's, as ``model.generate``'s, :func:`kvdiverge.engine.core.decoding.penalize_repeats`;
        each side penalizes its own context; default 1, none) and ``min_p`` (min-p truncation
        after top-p; default 0, none). Another name raises ``TypeError``, as for any unknown
        keyword.

    Returns
    -------
    Measurement

    Raises
    ------
    ValueError
        Bad prompts or presses (see :func:`kvdiverge.study.inputs.prepare_documents`, :func:`kvdiverge.study.inputs.prepare_presses`),
        token ids outside the model's vocabulary, a prompt shorter than a press needs or
        too long for the model context, a setting the config would refuse (NaN, out of
        range, a fraction for a count: :func:`kvdiverge.study.settings.check_settings`,
        naming the argument, the value and what is allowed).
    kvdiverge.engine.core.errors.CompressionError
        A press that promises compression (``compression_ratio > 0``) but does not keep
        the promised number of positions. A press that promises nothing and leaves the
        kernel as the full cache's (TV 0 at every step) runs and is reported
        (``summary['untouched']``, and a warning).
    """
    from kvdiverge.engine.runner import run_policies
    from kvdiverge.study.models import kv_sizes

    opts = measuring.MeasureOptions.checked(decoding, **{k: v for k, v in locals().items() if k in _OPTIONS})
    task_docs = measuring.task_inputs(opts, prompts, tokenizer)
    prompts = {d.doc_id: list(d.input_ids) for d in task_docs[0]} if task_docs else prompts
    documents = prepare_documents(prompts, tokenizer, instruction=opts.instruction, system=opts.system)
    sources, grid = measure_inputs(model, documents, presses, opts.max_new_tokens, opts.frontier)
    if task_docs and any(d.n_question for d in task_docs[0]):
        _check_question_after(sources)
    documents = task_docs[0] if task_docs else documents
    sampling = opts.sampling(model_label(model) if model_name is None else model_name)
    runs = run_policies(model, documents, sources, sampling, split=split, options=opts.run_options())
    settings = opts.recorded(sampling, sources, grid, kv_sizes(model) if grid else None)
    result = _measurement(runs, windows, settings, sources, _eos(model, eos_ids))
    if teacher_tokens is not None:
        result.teacher_forced = _teacher_pass(model, documents, sources, opts, sampling, result.eos_ids)
    if task_docs:
        args = (result.trajectories, result.documents, task_docs[1], tokenizer, result.noise_floor)
        result.task = measuring.task_tables(opts, *args)
    _warn_untouched(result, sources)
    return result


#: :func:`measure`'s keyword options, as :class:`kvdiverge.study.measuring.MeasureOptions` takes them.
_OPTIONS = frozenset(f for f in measuring.MeasureOptions.__dataclass_fields__ if f != "decoding")


def _eos(model, eos_ids) -> tuple[int, ...]:
    """The end-of-sequence ids the generations stopped at: ``eos_ids``, else the model's."""
    from kvdiverge.engine.llm.pair_base import model_eos_ids

    return tuple(int(e) for e in (model_eos_ids(model) if eos_ids is None else eos_ids))


def _check_question_after(sources) -> None:
    """Refuse, before any forward, a policy that cannot take a question prefilled after compression
    (:func:`kvdiverge.engine.runner.question_after_problems`)."""
    from kvdiverge.engine.runner import question_after_problems

    problems = question_after_problems(sources)
    if problems:
        raise ValueError(problems[0])


def _teacher_pass(model, documents, sources, opts: measuring.MeasureOptions, sampling, eos: tuple[int, ...]):
    """The teacher-forced pass of a measurement's prompts and presses (:func:`kvdiverge.screening.run_screen`):
    the coupled run's seed and names, its decoding transform off, ``opts.teacher_tokens`` tokens."""
    from kvdiverge.engine.llm.teacher import TeacherForcing  # torch: loaded with the model

    length = int(opts.teacher_tokens)
    forced = sampling.untransformed().replace(T=length, replicates=1, eos_ids=eos)
    options = ScreenOptions(length=length, seed=opts.seed, split=opts.split, bootstrap=opts.bootstrap,
                            confidence=opts.confidence, model_name=sampling.model_name)  # fmt: skip
    return run_screen(model, documents, sources, forced, TeacherForcing(length=length), options)
