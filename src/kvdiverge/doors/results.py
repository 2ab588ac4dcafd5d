"""What :func:`kvdiverge.measure` returns: :class:`kvdiverge.doors.results.Measurement`, the workflow's tables for one model.

It holds the coupled run's trajectories and the estimates and pooled tables computed from them
(:mod:`kvdiverge.estimation.tables`), computes the rest on first use (gaps, the self-speculative
reading, length drift, the frontier), prints them (:mod:`kvdiverge.report.formatting`), draws them
(:mod:`kvdiverge.report.survival`, :mod:`kvdiverge.report.frontier`, imported on first drawing) and saves them
(:func:`kvdiverge.config.provenance.save_measurement`).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import polars as pl

from kvdiverge.config.inputs import NOISE_FLOOR_PRESS
from kvdiverge.config.provenance import save_measurement
from kvdiverge.doors import measuring
from kvdiverge.doors.measuring import MeasureSettings
from kvdiverge.doors.screening import Screen
from kvdiverge.estimation import tables
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

__all__ = ["Measurement"]

#: The tables a :class:`Measurement` is made of, as :meth:`Measurement.save` names their files.
_SAVED = ("trajectories", "replicates", "documents", "pooled", "timing", "survival", "branch_tv", "variance")


def _read(where: Path, name: str) -> pl.DataFrame | None:
    """The table ``<name>.parquet`` under ``where``, or None where there is none."""
    path = where / f"{name}.parquet"
    return pl.read_parquet(path) if path.is_file() else None


def _report():
    """The report's figure modules, imported when a figure is drawn: they load matplotlib and seaborn, which a
    measurement does not need."""
    from kvdiverge.report import frontier, survival

    return SimpleNamespace(frontier=frontier, survival=survival)


@dataclass
class Measurement:
    """Everything :func:`kvdiverge.doors.measurement.measure` measured: the workflow's tables, for one model.

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
    settings : kvdiverge.doors.measuring.MeasureSettings
        What it was measured with: sampling, bootstrap, split, window, presses (name -> description),
        frontier; :meth:`~kvdiverge.doors.measuring.MeasureSettings.record` is the dict saved and hashed.
    noise_floor : str or None
        Name of the noise-floor press among the presses, if any.
    batch_documents : int or None
        Documents per batched forward ``B`` every press ran with (planned once per
        :func:`kvdiverge.doors.measurement.measure` call); not a setting, since results depend on it only by rounding.
    teacher_forced : kvdiverge.doors.screening.Screen or None
        The teacher-forced pass (``measure(..., teacher_tokens=N)``): llama.cpp's KLD, PPL
        ratio, Same top p and RMS Δp per press (``docs/teacher-forced.md``); None when not run.
    task : dict of polars.DataFrame or None
        With :func:`kvdiverge.doors.measurement.measure`'s ``task``: the task's ``documents``, ``accuracy``,
        ``correlations`` and ``auc`` tables (:func:`kvdiverge.data.tasks.tables.task_tables`).
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
    settings: MeasureSettings
    noise_floor: str | None = None
    batch_documents: int | None = None
    teacher_forced: Any = None
    task: dict[str, pl.DataFrame] | None = None
    eos_ids: tuple[int, ...] | None = None
    _gaps: dict[tuple[str, str], pl.DataFrame] = field(default_factory=dict, repr=False)
    _cache: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def of_run(cls, runs, settings: MeasureSettings, sources: Mapping[str, Any], eos_ids) -> Measurement:
        """The measurement of a coupled run (:func:`kvdiverge.engine.runner.run_policies`'s result):
        its estimates (the settings' ``window`` and named lag ``windows``) and pooled tables
        (:func:`kvdiverge.estimation.tables.pool`, the settings' bootstrap); the noise
        floor is the first of ``sources`` that keeps every position."""
        reps, docs = tables.estimate(runs.trajectories, settings.window, settings.windows)
        pooled = tables.pool(docs, settings.bootstrap)
        floors = measuring.floors(sources)
        return cls(
            trajectories=runs.trajectories,
            replicates=reps,
            documents=docs,
            settings=settings,
            noise_floor=floors[0] if floors else None,
            batch_documents=runs.batch_documents,
            eos_ids=eos_ids,
            **pooled,
        )

    def warn_untouched(self, floors: Sequence[str] = (), stacklevel: int = 2) -> None:
        """Warn (``UserWarning``) of each press but the noise ``floors`` that left the cache untouched:
        every prompt position kept and TV 0 at every step on every prompt, under sampling
        (``summary['untouched']``). A press whose chains never parted but that compressed, or any
        under greedy decoding (``summary['no_divergence']``), is no cause for a warning."""
        untouched = self.summary.filter(pl.col("untouched"))["policy"].to_list()
        for name in (n for n in untouched if n not in floors):  # the floor keeps every position by design
            warnings.warn(
                f"press {name!r} left the cache untouched (TV 0 at every step on every prompt: the same "
                f"kernel as the full cache)",
                stacklevel=stacklevel + 1,
            )

    @property
    def presses(self) -> list[str]:
        """Press names, in the order given."""
        return list(self.settings.presses)

    def gap(self, a: str, b: str) -> pl.DataFrame:
        """Gap decomposition ``A - B`` of the expected token loss of presses ``a`` and ``b``, paired
        by prompt (§7): four rows (``term``: ``delta``, ``first_mismatch``, ``exposure``, ``rate``),
        ``value`` in tokens with its paired-bootstrap interval, ``share`` of the gap and
        ``value_M = value / T`` (:func:`kvdiverge.estimation.tables.press_gap`). Raises
        ``ValueError`` if ``a`` or ``b`` is not a measured press, or ``a == b``."""
        if (a, b) not in self._gaps:  # a refused pair is never stored
            s = self.settings
            self._gaps[(a, b)] = press_gap(
                self.documents, self.presses, a, b, s.bootstrap, s.split, s.sampling.model_name
            )
        return self._gaps[(a, b)]

    @property
    def gaps(self) -> pl.DataFrame:
        """Gap decompositions of every pair ``(A, B)`` of presses, A before B in the given order."""
        return self._memo("gaps", lambda: pairwise_gaps(self.gap, self.presses))

    @property
    def speculative(self) -> pl.DataFrame:
        """The self-speculative reading, per press (the press's cache drafts, the full cache is the
        target): rows ``k = 1..min(8, T)`` with document-bootstrap intervals of the accepted tokens
        ``A = sum_{j<=k} S_j`` of a first draft block of ``k``, ``tokens_per_forward = A + 1``, the
        per-step acceptance ``alpha`` and the i.i.d. formula
        (:func:`kvdiverge.estimation.speculative.speculative_table`)."""
        return self._memo("speculative", lambda: speculative_table(self.documents, self.settings.bootstrap))

    @property
    def drift_replicates(self) -> pl.DataFrame:
        """Per press, prompt and replicate: each side's length to EOS, stop, loop and repetition, paired
        (:func:`kvdiverge.estimation.drift.drift_replicates`)."""
        loops = loop_settings(None, self.settings.sampling.T)
        return self._memo("drift_replicates", lambda: drift_replicates(self.trajectories, self.eos_ids or (), **loops))

    @property
    def drift(self) -> pl.DataFrame:
        """Length and loop drift per press: ``length_mean``, ``length_median`` (tokens), ``stop_rate``,
        ``loop_rate``, ``rep4``, ``distinct2`` on the full-cache and the compressed side and their paired
        difference, with document-bootstrap intervals (:func:`kvdiverge.estimation.drift.drift_table`)."""
        return self._memo("drift", lambda: drift_table(self.drift_replicates, self.settings.bootstrap))

    @property
    def length_survival(self) -> pl.DataFrame:
        """Per press and side, ``P(EOS step > t)`` for ``t = 0..T``: the Kaplan–Meier curve of the EOS time
        censored at ``T`` (:func:`kvdiverge.estimation.drift.length_survival`)."""
        return self._memo("length_survival", lambda: length_survival(self.drift_replicates))

    @property
    def point_masses(self) -> bool:
        """Whether the decoding's kernels are point masses (greedy:
        :attr:`kvdiverge.engine.core.sampling.Decoding.point_masses`), where TV 0 shows only that the
        answers agreed."""
        return self.settings.sampling.decoding.point_masses

    @property
    def compression(self) -> pl.DataFrame:
        """Per press and prompt: ``prompt_len``, ``kept_len`` (tokens), ``kept_fraction``, ``untouched``
        (every position kept and the evicted side's kernel equal to the reference side's: TV exactly 0
        at every step of every replicate, under sampling) and ``no_divergence`` (TV 0 at every step,
        yet not untouched: the press compressed, or the decoding is greedy;
        :func:`kvdiverge.estimation.tables.compression_table`)."""
        return self._memo(
            "compression", lambda: compression_table(self.documents, self.trajectories, self.point_masses)
        )

    @property
    def summary(self) -> pl.DataFrame:
        """One row per press: ``policy``, ``n_docs``, ``T``, ``R``, ``kept_fraction``, ``untouched``
        and ``no_divergence`` (:attr:`compression`, on every prompt), ``p_div``, ``tau_mean`` and ``E_L`` (steps),
        ``E_M`` (mismatch fraction), each with ``_lo``/``_hi`` bootstrap bounds, ``rho``,
        ``first_mismatch_term + exposure_rate_term = E_M``, ``exposure_share``; with a noise floor,
        ``E_M_minus_floor`` and ``p_div_minus_floor`` (:func:`kvdiverge.estimation.tables.summary_table`)."""
        return self._memo("summary", self._summary)

    def _summary(self) -> pl.DataFrame:
        """:attr:`summary`, computed."""
        args = (self.pooled, self.documents, self.presses, self.trajectories, self.noise_floor, self.gap)
        out = summary_table(*args, point_masses=self.point_masses)
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
            summary_text(self.summary, self.settings.record(), self.noise_floor, NOISE_FLOOR_PRESS)
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
        (:func:`kvdiverge.config.provenance.settings_hash` of the settings), ``versions``
        (:func:`kvdiverge.config.provenance.library_versions`) and ``batch_documents`` (the ``B`` used).
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
        if self.settings.frontier:
            tables["frontier"], tables["frontier_areas"] = self._frontier()
        if self.teacher_forced is not None:
            tables["teacher_forced"] = self.teacher_forced.table
            tables["teacher_forced_documents"] = self.teacher_forced.documents
        run = {"eos_ids": None if self.eos_ids is None else list(self.eos_ids), "noise_floor": self.noise_floor}
        if self.teacher_forced is not None:
            run["teacher_forced"] = self.teacher_forced.settings
        return save_measurement(directory, tables, self.settings.record(), self.batch_documents, run)

    @classmethod
    def load(cls, directory: str | os.PathLike) -> Measurement:
        """The measurement :meth:`save` wrote under ``directory``: its tables, settings, ``B``, end-of-sequence
        ids and noise floor, the task's tables and the teacher-forced pass's (a
        :class:`~kvdiverge.doors.screening.Screen` without its per-position table, which is not saved).
        Every table and number it prints equals the saved measurement's.

        Raises
        ------
        FileNotFoundError
            Naming the first file of a saved measurement that ``directory`` lacks.
        """
        where = Path(directory)
        needed = ["measure.json", "provenance.json", *(f"{name}.parquet" for name in _SAVED)]
        missing = [name for name in needed if not (where / name).is_file()]
        if missing:
            raise FileNotFoundError(f"{where}: {missing[0]} is missing: not a directory Measurement.save wrote")
        run = json.loads((where / "provenance.json").read_text())
        task = {path.stem.removeprefix("task_"): pl.read_parquet(path) for path in sorted(where.glob("task_*.parquet"))}
        teacher = None
        if (where / "teacher_forced.parquet").is_file():
            tables = (_read(where, "teacher_forced_documents"), _read(where, "teacher_forced"))
            teacher = Screen(None, *tables, run.get("teacher_forced", {}))
        eos_ids = None if run.get("eos_ids") is None else tuple(run["eos_ids"])
        return cls(
            **{name: _read(where, name) for name in _SAVED},
            settings=MeasureSettings.of_record(json.loads((where / "measure.json").read_text()), eos_ids),
            noise_floor=run.get("noise_floor"),
            batch_documents=run.get("batch_documents"),
            teacher_forced=teacher,
            task=task or None,
            eos_ids=eos_ids,
        )

    def plot_survival(self, target=None):
        """Draw the survival figure ``S_t`` per press: into ``target`` Axes (returned), to a path
        (``.png``, ``.pdf``, ``.svg``; the path returned) or, with None, as a new figure
        (:func:`kvdiverge.report.survival.render_survival`)."""
        return _report().survival.render_survival(self.survival, target, title=self.settings.sampling.model_name)

    def _memo(self, key: str, compute):
        """``compute()``, computed once and kept (a failure is not kept)."""
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]

    def _frontier(self) -> tuple[pl.DataFrame, pl.DataFrame]:
        def compute():
            s = self.settings
            sizes = {s.sampling.model_name: dict(s.kv_sizes)} if s.kv_sizes else None
            points, areas = measured_frontier(self.documents, s.frontier, self.noise_floor, s.bootstrap, s.split, sizes)
            teacher = None if self.teacher_forced is None else self.teacher_forced.table
            ratios = length_ratios(self.drift_replicates, self.settings.bootstrap)
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
        return frontier_text(points, areas, self.settings.bootstrap.confidence)

    def plot_frontier(self, target=None):
        """Draw the frontier figure: into ``target``, a sequence of 3 Axes (returned), to a path
        (format from the suffix; the path returned) or, with None, as a new figure
        (:func:`kvdiverge.report.frontier.render_frontier`)."""
        return _report().frontier.render_frontier(self.frontier(), target, title=self.settings.sampling.model_name)
