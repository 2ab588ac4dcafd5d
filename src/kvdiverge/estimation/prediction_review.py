"""What a reviewer asks beside the prediction study (:mod:`kvdiverge.estimation.prediction`).

- :func:`prediction_without`: the prediction table without some presses or points (a press that
  decides the result alone, a quantized cache at a ratio no press has);
- :func:`chance_accuracy`: the accuracy a guess gets on a task, beside the full cache's bar;
- :func:`cpu_per_point`: a job's CPU time per frontier point, shared by the (run, document) pairs it served.

Each press's held-out error is :func:`kvdiverge.estimation.prediction.press_errors`, and the drop
among the documents the full cache answers right the study's accuracy table (``drop_full_right``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import polars as pl

from kvdiverge.estimation.prediction import PredictionSettings, prediction_study
from kvdiverge.estimation.prediction_inputs import PredictionInputError

__all__ = ["chance_accuracy", "cpu_per_point", "prediction_without"]


def prediction_without(
    fidelity: pl.DataFrame,
    task: pl.DataFrame,
    points: pl.DataFrame,
    measures: Sequence[str],
    *,
    leave_out: Sequence[str],
    settings: PredictionSettings = PredictionSettings(),
    directions: Mapping[str, int] | None = None,
) -> pl.DataFrame:
    """The prediction table of :func:`~kvdiverge.estimation.prediction.prediction_study` without some presses or points.

    Parameters
    ----------
    fidelity, task, points, measures, settings, directions
        As :func:`kvdiverge.estimation.prediction.prediction_study`.
    leave_out : sequence of str
        Presses (the ``press`` column of ``points``: a quantized cache alone is its own) or points
        to leave out of both sides, e.g. ``["ExpectedAttentionPress", "int4"]``.

    Returns
    -------
    polars.DataFrame
        The ``prediction`` table of :class:`kvdiverge.estimation.prediction.PredictionStudy` on the
        remaining points, with ``without`` (the names left out, joined by ", ") first.

    Raises
    ------
    PredictionInputError
        A name that is neither a press nor a point of ``points``; or as
        :func:`~kvdiverge.estimation.prediction.prediction_study` on what remains (e.g. fewer than 3 presses).
    """
    known = set(points["press"].to_list()) | set(points["point"].to_list())
    unknown = [n for n in leave_out if n not in known]
    if unknown:
        presses = ", ".join(sorted(map(str, set(points["press"].to_list()))))
        raise PredictionInputError(f"leave_out: {unknown[0]!r} is neither a press nor a point; the presses: {presses}")
    gone = pl.col("press").is_in(list(leave_out)) | pl.col("point").is_in(list(leave_out))
    study = prediction_study(fidelity, task, points.filter(~gone), measures, settings=settings, directions=directions)
    return study.prediction.select(pl.lit(", ".join(leave_out)).alias("without"), pl.all())


def chance_accuracy(task: str, settings: Mapping[str, Any]) -> float:
    """The accuracy of a guess on a task (its chance level), beside the full cache's bar.

    Parameters
    ----------
    task : str
        The task's name (``niah``, ``multikey``, ``recall``: :data:`kvdiverge.data.tasks.TASKS`).
    settings : mapping
        The task's settings: ``digits`` for the needles, ``distractors`` for the multi-key needle.

    Returns
    -------
    float
        ``niah``: ``1 / (9 10^(digits - 1))``, one guessed value of ``digits`` digits (RULER's values
        run from ``10^(digits-1)``). ``multikey``: ``1 / (1 + distractors)``, one of the prompt's
        needle values copied at random (the key confused). ``recall``: NaN, free text with no set of
        answers to guess among (a word guessed from the quote itself can be right far more often:
        the harshest points' accuracy, ``lowest_accuracy`` of the study, shows how often).

    Raises
    ------
    ValueError
        An unknown task, or a setting it needs missing.
    """
    needs = {"niah": ("digits",), "multikey": ("digits", "distractors"), "recall": ()}
    if task not in needs:
        raise ValueError(f"task {task!r}: no chance level known; the tasks: {', '.join(needs)}")
    missing = [k for k in needs[task] if k not in settings]
    if missing:
        raise ValueError(f"task {task!r}: its chance level needs the setting {missing[0]!r}")
    if task == "niah":
        return 1 / (9 * 10 ** (int(settings["digits"]) - 1))
    if task == "multikey":
        return 1 / (1 + int(settings["distractors"]))
    return float("nan")


def cpu_per_point(cpu_s: float, served: pl.DataFrame, points: Sequence[str]) -> float:
    """A job's CPU seconds per point: its CPU time shared by the (run, document) pairs it served.

    Parameters
    ----------
    cpu_s : float
        The job's CPU time, seconds (Snakemake's benchmark ``cpu_time``).
    served : polars.DataFrame
        One row per (run, document) the job served: ``policy``, ``doc_id`` and, where runs differ by
        split, ``split`` (e.g. the teacher-forced documents of every run of the model: the frontier's
        points, the controls and the confirmatory run, each on its own documents).
    points : sequence of str
        The points (policies) to cost.

    Returns
    -------
    float
        ``cpu_s`` times the points' share of the pairs, over the number of points; NaN when the job
        served nothing.

    Raises
    ------
    ValueError
        ``points`` empty.
    """
    if not len(points):
        raise ValueError("points must name at least one point to share the CPU time among")
    pairs = served.select(*[c for c in ("policy", "split", "doc_id") if c in served.columns]).unique()
    if pairs.is_empty():
        return float("nan")
    share = pairs.filter(pl.col("policy").is_in(list(points))).height / pairs.height
    return float(cpu_s) * share / len(points)
