"""The task sides of the prediction study: what each task job reads, and the job itself.

A config's ``prediction`` block (``kvdiverge/schemas/config.schema.yaml``) asks whether the
frontier's task-agnostic fidelity measures predict a task's accuracy drop
(:mod:`kvdiverge.estimation.prediction`). The fidelity side is the frontier as the workflow
runs it; each *task side* (a task and its question placement, ``niah-inside``, ``niah-after``,
``recall-inside``) runs every frontier point greedily on the documents of another split, one
job per (model, side) through :func:`kvdiverge.measure`, with the task's prompts in place of
the plain ones. :class:`PredictionTaskSettings` is what such a job reads, and its rerun key;
:func:`prediction_sides` names the sides of a config. A measure named ``reconstruction_<measure>``
reads a second teacher-forced pass of the frontier's runs, with the reconstruction target
(KVzip's context reconstruction): :func:`reconstruction_config` is the config that pass runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from kvdiverge.config.provenance import canonical
from kvdiverge.estimation.prediction_inputs import RECONSTRUCTION_PREFIX

__all__ = ["PredictionTaskSettings", "prediction_sides", "reconstruction_config", "side_name"]


def side_name(task: Mapping[str, Any]) -> str:
    """A task side's name, ``<task name>-<question placement>`` (``niah-after``)."""
    return f"{task.get('name', 'niah')}-{task.get('question', 'inside')}"


def prediction_sides(config: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The task sides of a validated config by name (:func:`side_name`), each its task block; empty
    without a ``prediction`` block."""
    block = config.get("prediction") or {}
    return {side_name(t): dict(t) for t in block.get("tasks", [])}


def reconstruction_config(config: Mapping[str, Any]) -> dict[str, Any] | None:
    """The validated ``config`` as the prediction study's reconstruction pass runs it; None when no
    measure of ``prediction.measures`` starts with
    :data:`kvdiverge.estimation.prediction_inputs.RECONSTRUCTION_PREFIX`.

    The pass is the teacher-forced pass (:func:`kvdiverge.jobs.teacher.run_teacher_forced`) with
    ``teacher_forced.target: reconstruction`` and ``prediction.reconstruction``'s settings
    (``length``: the repeated text's tokens scored, the whole excerpt when it is longer) over the
    ``teacher_forced`` section's others (the repeat instruction, the key tokens). Its measures are the
    continuation pass's, on every position of the excerpt (Kim et al. 2025, "KVzip: Query-Agnostic
    KV Cache Compression with Context Reconstruction").
    """
    block = config.get("prediction") or {}
    if not any(str(m).startswith(RECONSTRUCTION_PREFIX) for m in block.get("measures", [])):
        return None
    section = {**dict(config.get("teacher_forced") or {}), **dict(block.get("reconstruction") or {})}
    return {**config, "teacher_forced": {**section, "target": "reconstruction"}}


@dataclass(frozen=True)
class PredictionTaskSettings:
    """What one task-side job of the prediction study reads: its rule's ``params: settings``.

    Parameters
    ----------
    model : str
        Key of the config's ``models``; the ``model`` column and the seeds' model name.
    side : str
        The task side (:func:`side_name`).
    split : str
        The task documents' split (``prediction.split``).
    entries : mapping
        ``model`` (the config's model entry), ``task`` (the side's task block), ``frontier``
        (presses, ratios, budgets, and with the question inside the compressed prompt the caches
        and their ratios: a quantized cache quantizes while decoding, so it cannot take a
        question prefilled after compression), ``seed``, ``max_new_tokens`` (tokens) and
        ``system`` (the prompt's system message), canonical. The chat template's date is
        :func:`kvdiverge.measure`'s (the config's default ``prompt.date``).
    """

    model: str
    side: str
    split: str
    entries: Mapping[str, Any] = field(repr=False)

    @classmethod
    def from_config(cls, config: Mapping[str, Any], model: str, side: str) -> PredictionTaskSettings:
        """The settings of side ``side`` on ``model`` of a validated config with a ``prediction`` block.

        Raises
        ------
        KeyError
            ``side`` is not one of :func:`prediction_sides`.
        """
        task = prediction_sides(config)[side]
        block, frontier = config["prediction"], dict(config["frontier"])
        keep = ["presses", "ratios", "budgets"]
        if task.get("question", "inside") == "inside":
            keep += ["caches", "cache_ratios"]
        prompt = config.get("prompt", {})
        entries = {
            "model": config["models"][model],
            "task": task,
            "frontier": {k: frontier[k] for k in keep if frontier.get(k) is not None},
            "seed": config["seed"],
            "max_new_tokens": block.get("max_new_tokens", 16),
            "system": prompt.get("system"),
        }
        return cls(model=model, side=side, split=block.get("split", "confirmatory"), entries=canonical(entries))

    def to_params(self) -> dict[str, Any]:
        """The plain form of the settings, for a rule's ``params`` (canonical JSON values)."""
        return canonical(asdict(self))

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> PredictionTaskSettings:
        """The settings from their plain form (:meth:`to_params`)."""
        return cls(**{k: canonical(v) for k, v in dict(params).items()})

    def measure_options(self) -> dict[str, Any]:
        """The keywords of :func:`kvdiverge.measure` for this side: the frontier's grid, the task,
        greedy decoding (temperature 0, top-p 1), one replicate, the seed and the names."""
        e, f = self.entries, self.entries["frontier"]
        return {
            "ratios": f["ratios"],
            "budgets": f.get("budgets") or None,
            "caches": f.get("caches"),
            "cache_ratios": f.get("cache_ratios"),
            "task": dict(e["task"]),
            "max_new_tokens": int(e["max_new_tokens"]),
            "replicates": 1,
            "seed": int(e["seed"]),
            "system": e.get("system"),
            "model_name": self.model,
            "split": self.split,
            "temperature": 0.0,
            "top_p": 1.0,
        }
