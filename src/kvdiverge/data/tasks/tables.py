"""The task's tables from a coupled run: one path for the workflow's ``task`` rule and :func:`kvdiverge.measure`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import polars as pl

from kvdiverge.data.tasks.answers import score_answers
from kvdiverge.estimation.bootstrap import Bootstrap
from kvdiverge.estimation.task import MEASURES, accuracy_table, auc_table, correlation_table, task_documents

__all__ = ["TASK_TABLES", "TaskTableOptions", "task_tables"]

#: Tables :func:`task_tables` returns, by name (``results/analysis/task/{name}.parquet``).
TASK_TABLES = ("documents", "accuracy", "correlations", "auc")


@dataclass(frozen=True)
class TaskTableOptions:
    """Settings of :func:`task_tables`.

    Attributes
    ----------
    controls : sequence of str
        Policy names left out of the correlations and AUC (the ``none`` control, the noise floor).
    floor : str or None
        The noise floor's policy name (the figure's band); None: no band.
    boot : kvdiverge.estimation.bootstrap.Bootstrap
        Document-bootstrap resamples, interval coverage and master seed of the resamples.
    """

    controls: Sequence[str] = ()
    floor: str | None = None
    boot: Bootstrap = Bootstrap()


def task_tables(
    trajectories: pl.DataFrame,
    estimates: pl.DataFrame,
    prompts: pl.DataFrame,
    tokenizer,
    score,
    *,
    options: TaskTableOptions | None = None,
    extra: pl.DataFrame | None = None,
) -> dict[str, pl.DataFrame]:
    """Answers, accuracy, correlations and AUC of a greedy coupled run on the task's prompts.

    Parameters
    ----------
    trajectories, estimates : polars.DataFrame
        Shard rows and document estimates of every run (greedy decoding).
    prompts : polars.DataFrame
        The task's prompts table (:func:`kvdiverge.data.tasks.build_task_prompts`).
    tokenizer
        The model's tokenizer.
    score : callable
        The task's scoring function (:attr:`kvdiverge.data.tasks.Task.score`).
    options : TaskTableOptions, optional
        Controls, noise floor and bootstrap settings; None: the defaults (:class:`TaskTableOptions`).
    extra : polars.DataFrame, optional
        More per-document measures on (model, policy, split, doc_id), e.g. teacher-forced
        ones; every numeric column but the keys becomes a measure.

    Returns
    -------
    dict of polars.DataFrame
        ``documents`` (:func:`kvdiverge.estimation.task.task_documents`), ``accuracy``,
        ``correlations``, ``auc`` (:mod:`kvdiverge.estimation.task`).
    """
    o = TaskTableOptions() if options is None else options
    answers = score_answers(trajectories, prompts, tokenizer, score)
    docs = task_documents(answers, estimates, extra)
    measures = list(MEASURES)
    if extra is not None:
        keys = {"model", "policy", "split", "doc_id"}
        measures += [c for c, t in extra.schema.items() if c not in keys and t.is_numeric()]
    return {
        "documents": docs,
        "accuracy": accuracy_table(docs, measures, o.boot),
        "correlations": correlation_table(docs, measures, o.controls, o.floor, o.boot),
        "auc": auc_table(docs, measures, o.controls, o.boot),
    }
