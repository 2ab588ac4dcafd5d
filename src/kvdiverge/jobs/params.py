"""What each generation job of the workflow reads: one typed settings object, handed to it as its rule's params.

The workflow's controller validates the config once, when the workflow starts
(``workflow/rules/common.smk``), and builds for every job the settings object of this
module that holds what the job reads: :class:`ShardSettings` for a trajectory shard job,
:class:`TeacherSettings` for a teacher-forced job. The rule hands it to the job as
``params: settings=...`` in its plain form (:meth:`ParamsForm.to_params`, canonical JSON
values), and the script turns it back with one call (:meth:`ParamsForm.from_params`). The
same object is the job's rerun key: Snakemake's ``params`` rerun trigger compares it with
the one recorded when the output was made, so a changed setting that the job reads reruns
it, and a setting that it does not read reruns nothing.

The one thing a generation job reads besides its settings is how it batches (config
``generation``: :func:`kvdiverge.jobs.shard.generation_options`): results depend on it only through rounding,
so it is no rerun key (:mod:`kvdiverge.config.provenance`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvdiverge.config.provenance import canonical, shard_settings, teacher_settings
from kvdiverge.engine.core.sampling import Sampling
from kvdiverge.jobs.devices import bind_device
from kvdiverge.models.loading import local_entry
from kvdiverge.settings.checks import config_sampling

__all__ = ["JobSettings", "ParamsForm", "ShardRun", "ShardSettings", "TeacherRun", "TeacherSettings", "job_model_entry"]


class ParamsForm:
    """Settings that travel as a rule's ``params`` in their plain form (canonical JSON values): the base of
    :class:`JobSettings` and :class:`TeacherSettings`."""

    def to_params(self) -> dict[str, Any]:
        """The plain form of the settings, for a rule's ``params``: canonical JSON values, outputs in order."""
        return canonical(asdict(self))

    @classmethod
    def from_params(cls, params: Mapping[str, Any]):
        """The settings from their plain form (:meth:`to_params`; what a script finds in ``snakemake.params``)."""
        return cls(**{k: canonical(v) for k, v in dict(params).items()})


@dataclass(frozen=True)
class JobSettings(ParamsForm):
    """The settings one generation job reads: its model, split and policies, and what decides each policy's output.

    Parameters
    ----------
    model : str
        Key of the config's ``models``.
    split : str
        ``"exploratory"`` or ``"confirmatory"``.
    policies : tuple of str
        The job's policies, in the order of its outputs.
    settings : mapping
        Per policy of ``policies``: the settings that decide its output (canonical,
        :func:`kvdiverge.config.provenance.canonical`).
    """

    model: str
    split: str
    policies: tuple[str, ...]
    settings: Mapping[str, Mapping[str, Any]] = field(repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "policies", tuple(self.policies))
        if not self.policies or set(self.policies) != set(self.settings):
            raise ValueError(f"settings for {sorted(self.settings)}, policies {list(self.policies)}: give one each")

    def model_entry(self) -> dict[str, Any] | None:
        """The job's model entry (the config's ``models[model]``; None when the model is given directly)."""
        entry = self.settings[self.policies[0]]["model"]
        return None if entry is None else dict(entry)


@dataclass(frozen=True)
class ShardRun:
    """What one policy of a shard job runs with, typed: read from its settings once (:meth:`ShardSettings.run`).

    Parameters
    ----------
    entry : mapping
        The config's policy entry (a press, a llama.cpp cache), as the shard records it.
    sampling : kvdiverge.engine.core.sampling.Sampling
        Horizon ``T`` (tokens), replicates ``R``, the decoding transform, the master seed and the model's
        name; end-of-sequence ids ``None`` (the model's own).
    shards : int
        Shards of the run (config ``shards``): the job takes every ``shards``-th document.
    documents : int or None
        The first ``documents`` usable documents of the split (the control, the noise floor), or None: all.
    """

    entry: Mapping[str, Any]
    sampling: Sampling
    shards: int
    documents: int | None

    @classmethod
    def of(cls, settings: Mapping[str, Any], model: str) -> ShardRun:
        """The run of one policy's canonical settings (:func:`kvdiverge.config.provenance.shard_settings`)."""
        documents = settings["documents"]
        return cls(
            entry=dict(settings["policy"]),
            sampling=config_sampling(settings, model),
            shards=int(settings["shards"]),
            documents=None if documents is None else int(documents),
        )


@dataclass(frozen=True)
class ShardSettings(JobSettings):
    """The settings of a trajectory shard job (:func:`kvdiverge.jobs.shard.run_shard`).

    Per policy, :func:`kvdiverge.config.provenance.shard_settings` (the model and policy
    entries, decoding, replicates, seed, shards, the control's documents): the settings the
    shard records in its file. ``shard`` is the shard's index in ``[0, shards)``.
    """

    shard: int = 0

    def run(self, policy: str) -> ShardRun:
        """The typed settings of ``policy`` (:class:`ShardRun`), one of the job's ``policies``."""
        return ShardRun.of(self.settings[policy], self.model)

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], model: str, policies: str | Sequence[str], split: str, shard: int
    ) -> ShardSettings:
        """The settings of shard ``shard`` of ``policies`` (one name or several) on ``(model, split)`` of a validated config."""
        names = [policies] if isinstance(policies, str) else list(policies)
        settings = {name: shard_settings(config, model, name, split) for name in names}
        return cls(model=model, split=split, policies=tuple(names), settings=settings, shard=int(shard))


@dataclass(frozen=True)
class TeacherRun:
    """What one run of a teacher-forced job runs with, typed: read from its settings once (:meth:`TeacherSettings.run`).

    Parameters
    ----------
    entry : mapping
        The config's policy entry.
    documents : int or None
        The first ``documents`` usable documents of the split (the control, the noise floor), or None: all.
    seed : int
        The master seed (the prefills' seeds).
    corpus : mapping
        The config's ``corpus`` section: where the text after each excerpt is read from.
    forced : mapping
        The config's ``teacher_forced`` section (length, continuation, target, key tokens; the repeat
        instruction with the reconstruction target).
    """

    entry: Mapping[str, Any]
    documents: int | None
    seed: int
    corpus: Mapping[str, Any]
    forced: Mapping[str, Any]

    @classmethod
    def of(cls, settings: Mapping[str, Any]) -> TeacherRun:
        """The run of one policy's canonical settings (:func:`kvdiverge.config.provenance.teacher_settings`)."""
        documents = settings["documents"]
        return cls(
            entry=dict(settings["policy"]),
            documents=None if documents is None else int(documents),
            seed=int(settings["seed"]),
            corpus=dict(settings["corpus"]),
            forced=dict(settings.get("teacher_forced") or {}),
        )


@dataclass(frozen=True)
class TeacherSettings(ParamsForm):
    """The settings of a teacher-forced job (:func:`kvdiverge.jobs.teacher.run_teacher_forced`): some runs of one model.

    The workflow runs one job per (model, split), for every ``(policy, split)`` run of the split
    (the prediction study's reconstruction pass one per model, for the frontier's runs): one
    model load, and each document prefilled once for every policy that runs on it; or gathers the
    positions the split's shard jobs computed with the same settings (:mod:`kvdiverge.jobs.positions`).
    Its rerun key holds what the teacher-forced positions depend on and nothing else, so a change to
    the ``teacher_forced`` section reruns no trajectory shard, and a change to decoding, replicates or
    shards reruns a teacher-forced job only through its shard jobs' new files, which it gathers.

    Parameters
    ----------
    model : str
        Key of the config's ``models``.
    runs : tuple of (str, str)
        ``(policy, split)`` of every run, in the order of the job's outputs.
    settings : mapping
        Per split, per policy: :func:`kvdiverge.config.provenance.teacher_settings` (the
        model and policy entries, the seed, the control's documents, the ``corpus`` and
        ``teacher_forced`` sections).

    Raises
    ------
    ValueError
        If ``runs`` is empty or ``settings`` does not hold exactly one entry per run.
    """

    model: str
    runs: tuple[tuple[str, str], ...]
    settings: Mapping[str, Mapping[str, Mapping[str, Any]]] = field(repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "runs", tuple((str(policy), str(split)) for policy, split in self.runs))
        given = {(policy, split) for split, named in self.settings.items() for policy in named}
        if not self.runs or given != set(self.runs):
            raise ValueError(f"settings for {sorted(given)}, runs {list(self.runs)}: give one each")

    @classmethod
    def from_config(cls, config: Mapping[str, Any], model: str, runs: Sequence[tuple[str, str]]) -> TeacherSettings:
        """The settings of the teacher-forced pass of ``runs`` (``(policy, split)`` pairs) on ``model`` of a validated config."""
        settings: dict[str, dict[str, Any]] = {}
        for policy, split in runs:
            settings.setdefault(split, {})[policy] = teacher_settings(config, model, policy, split)
        return cls(model=model, runs=tuple(runs), settings=settings)

    def run(self, policy: str, split: str) -> TeacherRun:
        """The typed settings of the run ``(policy, split)`` (:class:`TeacherRun`), one of the job's ``runs``."""
        return TeacherRun.of(self.settings[split][policy])

    def splits(self) -> dict[str, tuple[str, ...]]:
        """Per split, its runs' policies in the order of :attr:`runs`."""
        out: dict[str, list[str]] = {}
        for policy, split in self.runs:
            out.setdefault(split, []).append(policy)
        return {split: tuple(policies) for split, policies in out.items()}

    def model_entry(self) -> dict[str, Any] | None:
        """The job's model entry (the config's ``models[model]``; None when the model is given directly)."""
        policy, split = self.runs[0]
        entry = self.settings[split][policy]["model"]
        return None if entry is None else dict(entry)


@contextlib.contextmanager
def job_model_entry(entry: Mapping[str, Any], converted: str | os.PathLike | None = None) -> Iterator[dict[str, Any]]:
    """The model entry a generation job loads, on a device of its own while the block runs.

    ``entry`` pointed at the converted directory ``converted`` when the model was converted
    (a GGUF file, rule ``convert_model``), its ``device`` a free device bound to this job
    (:func:`kvdiverge.jobs.devices.bind_device`: at most one local generation job per GPU).
    """
    spec = local_entry(dict(entry), converted) if converted else dict(entry)
    with bind_device(str(spec.get("device", "cpu"))) as device:
        yield {**spec, "device": device}
