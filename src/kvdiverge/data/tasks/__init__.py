"""Task scores beside the coupled measures: synthetic tasks built from the workflow's corpus.

A task turns each corpus document into a prompt with a known answer, and scores a greedy
answer against it. Tasks are rows of :data:`TASKS`, each a :class:`Task`: RULER's single
needle (``niah``, :mod:`kvdiverge.data.tasks.niah`), RULER's multi-key needle (``multikey``,
:mod:`kvdiverge.data.tasks.multikey`: the asked needle among distractors) and quote recall (``recall``,
:mod:`kvdiverge.data.tasks.recall`: the document's own next words after a quoted phrase).

The config block ``task`` (``kvdiverge/schemas/config.schema.yaml``) names the task and its
settings; :func:`task_settings` reads it, :func:`build_task_prompts` makes the prompts table
(the prompts stage calls it instead of :func:`kvdiverge.data.prompts.build_prompts`), with
the task's columns (:data:`TASK_COLUMNS`) beside the usual ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import polars as pl

from kvdiverge.data.prompts import SCHEMA, exclusion_reason
from kvdiverge.data.tasks import multikey, niah, recall
from kvdiverge.engine.core.documents import Document
from kvdiverge.settings.checks import check_task

__all__ = ["TASKS", "TASK_COLUMNS", "Task", "TaskError", "build_task_prompts", "task_settings"]

TaskError = niah.TaskError

#: Columns a task adds to the prompts table: trailing question tokens (0 when the question
#: sits inside the compressed prompt), what is asked and the right answer (the needle's key
#: and value; recall's quote and next words), the depth asked for and the depth it went to
#: (percent of the document's words before it).
TASK_COLUMNS = {
    "n_question": pl.Int32,
    "needle_key": pl.String,
    "needle_value": pl.String,
    "needle_depth": pl.Float64,
    "needle_at": pl.Float64,
}


@dataclass(frozen=True)
class Task:
    """One task of the registry.

    Attributes
    ----------
    name : str
        The config's ``task.name``.
    settings : type
        Frozen dataclass of the task's settings, built from the config block.
    needle : callable
        ``(settings, doc_id, index, document) -> needle`` (``.key``, ``.value``, ``.depth``): what
        the ``index``-th document of its split is asked; raises ``TaskError`` for a document
        the task cannot use.
    prompt : callable
        ``(tokenizer, document, needle, settings, **render) -> TaskPrompt``.
    check : callable
        ``(tokenizer, value, max_new_tokens) -> None``; raises when the answer cannot fit.
    score : callable
        ``(answer, value) -> bool``.
    """

    name: str
    settings: type
    needle: Callable
    prompt: Callable
    check: Callable
    score: Callable


#: The tasks by config name (``task.name``): one :class:`Task` each.
TASKS: dict[str, Task] = {
    "niah": Task("niah", niah.NiahSettings, niah.make_needle, niah.task_prompt, niah.check_budget, niah.score_answer),
    "multikey": Task(
        "multikey",
        multikey.MultikeySettings,
        multikey.make_needle,
        multikey.task_prompt,
        multikey.check_budget,
        multikey.score_answer,
    ),
    "recall": Task(
        "recall",
        recall.RecallSettings,
        recall.make_needle,
        recall.task_prompt,
        recall.check_budget,
        recall.score_answer,
    ),
}


def task_settings(block: Any, seed: int = 0, *, name: str = "task") -> tuple[Task, Any] | None:
    """The task and its settings from the config's ``task`` block (``None`` without one).

    Every door's task goes through here: the block is checked against the config schema's
    ``task`` entry (:func:`kvdiverge.settings.checks.check_task`) and the keys of its task, so the
    config (``task`` and each of ``prediction.tasks``), the command line and
    :func:`kvdiverge.measure` refuse the same values with the same sentence.

    Parameters
    ----------
    block : str, mapping or None
        A task name, or ``{"name": ..., **settings}``; a missing ``seed`` takes ``seed``
        (the config's).
    name : str
        How the door spells the block (``task``, ``prediction.tasks[0]``), in the sentences.

    Raises
    ------
    TaskError
        An unknown task name or key, another task's key, or a setting the schema does not allow,
        in one sentence naming it (``task.digits: 2.5 is not an integer; allowed: ...``).
    """
    if block is None or (isinstance(block, Mapping) and not block):
        return None
    try:
        entry = check_task(block, name)
    except ValueError as exc:
        raise TaskError(str(exc)) from None
    task = entry.pop("name", "niah")
    known = {f.name for f in dataclasses.fields(TASKS[task].settings)}
    foreign = sorted(set(entry) - known)
    if foreign:
        raise TaskError(
            f"{name}.{foreign[0]}: not a setting of task {task!r}; its settings: {', '.join(sorted(known))}"
        )
    entry.setdefault("seed", int(seed))
    if "depths" in entry:
        entry["depths"] = tuple(entry["depths"])
    return TASKS[task], TASKS[task].settings(**entry)


def _task_row(task: Task, settings, tokenizer, row: Mapping[str, Any], index: int, render: Mapping) -> dict:
    out = {"doc_id": row["doc_id"], "split": row["split"], "needle_key": None, "needle_value": None}
    out.update(needle_depth=float(settings.depths[index % len(settings.depths)]), exclusion_reason=None)
    try:
        needle = task.needle(settings, row["doc_id"], index, row["text"])
        out.update(needle_key=needle.key, needle_value=needle.value)
        p = task.prompt(tokenizer, row["text"], needle, settings, doc_id=row["doc_id"], **render)
    except TaskError as exc:
        return {
            **out,
            "n_prompt_tokens": 0,
            "input_ids": [],
            "n_question": 0,
            "needle_at": None,
            "exclusion_reason": str(exc),
        }
    n_question = p.n_question if settings.question == "after" else 0
    return {
        **out,
        "n_prompt_tokens": len(p.input_ids),
        "input_ids": p.input_ids,
        "n_question": n_question,
        "needle_at": p.depth,
    }


def build_task_prompts(documents: pl.DataFrame, tokenizer, settings: Mapping[str, Any], context: int) -> pl.DataFrame:
    """The prompts table of one model with the task's prompts and columns.

    Each split's documents, by ``doc_id``, take the task's depths in turn. A document the
    task cannot use (too short for its depth, no paragraph break) is excluded with the
    task's sentence as its reason; the usual exclusions (context, policy minimums) follow
    :func:`kvdiverge.data.prompts.exclusion_reason`.

    Parameters
    ----------
    documents : polars.DataFrame
        The corpus table (``doc_id``, ``split``, ``text``).
    tokenizer
        The model's tokenizer.
    settings : mapping
        :func:`kvdiverge.data.prompts.prompt_settings` of a config with a ``task`` block.
    context : int
        The model's context length, tokens.

    Raises
    ------
    TaskError
        A needle value longer than the answer budget, or a bad ``task`` block.
    """
    task, conf = task_settings(settings["task"], settings.get("seed", 0))
    T = int(settings["max_new_tokens"])
    render = {"system": settings.get("system"), "date": settings.get("date", "2026-01-01")}
    rows = []
    for split, part in documents.sort("doc_id").group_by("split", maintain_order=True):
        for index, row in enumerate(part.iter_rows(named=True)):
            out = _task_row(task, conf, tokenizer, row, index, render)
            if out["needle_value"] is not None:
                task.check(tokenizer, out["needle_value"], T)
            if out["exclusion_reason"] is None:
                minimums = settings["minimums"].get(row["split"], {})
                out["exclusion_reason"] = exclusion_reason(out["n_prompt_tokens"], minimums, context, T)
            rows.append(out)
    return pl.DataFrame(rows, schema={**SCHEMA, **TASK_COLUMNS}).sort("doc_id")


def task_documents(prompts: Mapping[str, str], tokenizer, block: Mapping[str, Any], T: int, render: Mapping) -> tuple:
    """The task's engine documents and prompts table for :func:`kvdiverge.measure` (``task=``).

    Parameters
    ----------
    prompts : mapping of str to str
        Document id -> text (paragraphs separated by blank lines).
    tokenizer
        The model's tokenizer.
    block : mapping
        The task's settings as the config's ``task`` block (``{"name": "niah", ...}``).
    T : int
        The answer budget (``max_new_tokens``).
    render : mapping
        ``system``, ``seed``, ``split``.

    Returns
    -------
    (list of kvdiverge.engine.runner.Document, polars.DataFrame)
        The usable documents (with ``n_question``) and the whole prompts table.

    Raises
    ------
    TaskError
        No document takes its needle (the first reason is given), or a bad setting.
    """
    import warnings

    frame = pl.DataFrame(
        {
            "doc_id": list(prompts),
            "split": [render.get("split", "measure")] * len(prompts),
            "text": list(prompts.values()),
        }
    )
    settings = {"task": dict(block), "seed": int(render.get("seed", 0)), "max_new_tokens": int(T), "minimums": {}}
    settings["system"] = render.get("system")
    table = build_task_prompts(frame, tokenizer, settings, context=10**9)
    bad = table.filter(pl.col("exclusion_reason").is_not_null())
    if bad.height == table.height:
        raise TaskError(f"no prompt takes the task: {bad['exclusion_reason'][0]}")
    for reason in bad["exclusion_reason"]:
        warnings.warn(f"left out of the task: {reason}", stacklevel=3)
    usable = table.filter(pl.col("exclusion_reason").is_null())
    docs = [Document(r["doc_id"], r["input_ids"], int(r["n_question"])) for r in usable.iter_rows(named=True)]
    return docs, table
