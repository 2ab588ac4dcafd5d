"""The config check of the task blocks: ``task`` and the prediction study's sides, by the rules of every door.

:func:`kvdiverge.config.workflow.check` calls these two, so that ``snakemake -n`` refuses what a task job
or :func:`kvdiverge.measure` would refuse, with the same sentences, named by the config's keys:

- a task block as every door reads it (:func:`kvdiverge.data.tasks.task_settings`: the schema's values
  and only its own task's keys);
- a question prefilled after compression beside a policy that cannot take it (the check of every door,
  :func:`kvdiverge.engine.refusals.question_after_problems`, asked of the press catalogue);
- the reconstruction target beside a task (:func:`reconstruction_problem`), greedy decoding for ``task``; for ``prediction``, a frontier, plain prompts on the fidelity side, task
  documents of another split, sides named apart, and fidelity measures the horizon gives
  (:func:`kvdiverge.estimation.prediction_inputs.measure_problems`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvdiverge.config.frontier import frontier_points
from kvdiverge.data.tasks import TaskError, task_settings
from kvdiverge.engine.presses import catalogue
from kvdiverge.estimation.prediction_inputs import RECONSTRUCTION_PREFIX, measure_problems

__all__ = [
    "block_problems",
    "prediction_block_problems",
    "question_after_problems",
    "reconstruction_problem",
    "side_problems",
    "task_block_problems",
]


def task_block_problems(config: Mapping[str, Any], scheduled: Sequence[str]) -> list[str]:
    """What refuses the config's ``task``: the block as every door reads it (:func:`block_problems`),
    decoding other than greedy (the answers are the coupled run's own), and with ``question: after``
    each of the ``scheduled`` policies that cannot take it (:func:`question_after_problems`); empty
    without a ``task``."""
    task = config.get("task")
    if not task:
        return []
    out = block_problems("task", task, config.get("seed", 0))
    target = (config.get("teacher_forced") or {}).get("target")
    out += [p for p in [reconstruction_problem(target, task, "teacher_forced.target")] if p]
    temperature = config.get("decoding", {}).get("temperature")
    if temperature is not None and temperature != 0:
        out.append(f"task: the task scores greedy answers, so decoding.temperature must be 0, got {temperature}")
    if task.get("question") == "after":
        policies = config.get("policies", {})
        out += question_after_problems("task.question", {n: policies[n] for n in scheduled if n in policies})
    return out


def reconstruction_problem(target: str | None, task: Any, name: str) -> str | None:
    """The sentence refusing the reconstruction target beside a task (its prompts are the task's, not the
    text it repeats), spelled ``name`` as the door spells the target setting; None when they may go together."""
    if target != "reconstruction" or not task:
        return None
    return (
        f"{name}: 'reconstruction' repeats each prompt's own text, and a task's prompts are built from it "
        "(a needle inserted, a question): measure the reconstruction without the task"
    )


def block_problems(key: str, block: Mapping[str, Any], seed: int) -> list[str]:
    """The sentence refusing a task block as :func:`kvdiverge.measure` reads it
    (:func:`kvdiverge.data.tasks.task_settings`: another task's keys, values the schema refuses), named
    by its config ``key``; empty when the block is a task."""
    try:
        task_settings(block, seed, name=key)
    except TaskError as exc:
        return [str(exc)]
    return []


def question_after_problems(key: str, policies: Mapping[str, Any]) -> list[str]:
    """``<key>: 'after' cannot run policy ...`` for each policy (name: config entry) that cannot take a
    question prefilled after compression, by the press catalogue
    (:func:`kvdiverge.engine.presses.catalogue.question_after_problem`, the sentence of every door's
    :func:`kvdiverge.engine.refusals.question_after_problems`); a policy that does not build is left to the
    check of the policies."""
    out = []
    for name, entry in policies.items():
        try:
            problem = None if catalogue.build_problem(entry) else catalogue.question_after_problem(entry)
        except LookupError:  # a press of a user's module the catalogue was not given: the job asks the engine
            problem = None
        if problem:
            out.append(f"{key}: 'after' cannot run policy {name!r}: {problem}")
    return out


def prediction_block_problems(config: Mapping[str, Any]) -> list[str]:
    """What refuses the config's ``prediction``: no frontier (its points are what is predicted), a
    top-level ``task`` (the fidelity side's prompts stay plain), task documents on the frontier's
    split, two task sides alike (``<name>-<question>``, :func:`kvdiverge.jobs.prediction.side_name`), a side's block
    (:func:`side_problems`), a measure the fidelity side's horizon cannot give, and a measure of the
    reconstruction pass when the teacher-forced pass already reconstructs; empty without a ``prediction``."""
    block = config.get("prediction")
    if not block:
        return []
    if not config.get("frontier"):
        return ["prediction: needs a frontier (its points are what the fidelity measures rank)"]
    out = []
    if config.get("task"):
        out.append(
            "prediction: the fidelity side's prompts must stay plain: remove the top-level task "
            "(the task sides are prediction.tasks)"
        )
    split = config["frontier"].get("split", "exploratory")
    if block.get("split", "confirmatory") == split:
        out.append(
            f"prediction.split: {split!r} is the frontier's split: the task documents must be others "
            "than the fidelity documents"
        )
    names = [f"{t.get('name', 'niah')}-{t.get('question', 'inside')}" for t in block.get("tasks", [])]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        out.append(f"prediction.tasks: task side {twice[0]!r} is given twice")
    out += side_problems(config)
    horizon = config.get("decoding", {}).get("max_new_tokens")
    if horizon is not None:
        out += measure_problems(block.get("measures", []), horizon)
    target = (config.get("teacher_forced") or {}).get("target", "continuation")
    twice = [m for m in block.get("measures", []) if m.startswith(RECONSTRUCTION_PREFIX)]
    if twice and target == "reconstruction":
        out.append(
            f"prediction.measures: {twice[0]!r} reads a second pass with the reconstruction target, and "
            f"teacher_forced.target is already 'reconstruction': name it {twice[0].removeprefix(RECONSTRUCTION_PREFIX)!r}"
        )
    return out


def side_problems(config: Mapping[str, Any]) -> list[str]:
    """What refuses a task side of ``prediction.tasks``: its block (:func:`block_problems`) and, with
    ``question: after``, a frontier press that cannot take it (:func:`question_after_problems`, each
    press once at its first point; such a side runs the presses without the caches,
    :class:`kvdiverge.jobs.prediction.PredictionTaskSettings`)."""
    policies = config.get("policies", {})
    presses: dict[str, str] = {}
    for point in frontier_points(dict(config)):
        if point.cache is None and point.policy in policies:
            presses.setdefault(point.press, point.policy)
    out: list[str] = []
    for i, task in enumerate(config["prediction"].get("tasks", [])):
        key = f"prediction.tasks[{i}]"
        out += block_problems(key, task, config.get("seed", 0))
        if task.get("question") == "after":
            out += question_after_problems(f"{key}.question", {p: policies[p] for p in presses.values()})
    return out
