"""The teacher-forced positions a trajectory shard job computes on its documents, and their gathering.

A shard job runs the teacher-forced pass on its own documents before its coupled run, with the
prefills that run then takes (:class:`kvdiverge.engine.llm.sharing.PrefillCarry`), and writes the
positions of every run of its split to one file, stamped with the hash of the teacher-forced settings
it ran with (:class:`kvdiverge.jobs.params.TeacherSettings`). It reads those settings from an
environment variable the workflow sets when it starts (:func:`export_settings`), not from its rerun
key, so that a changed ``teacher_forced`` section reruns no shard. The teacher-forced job gathers the
files when every shard was made with its own settings, and runs the pass itself otherwise (a shard made
before the change, or a job that did not get the variable). This module reads and writes no model: the
gathering job starts without torch.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import polars as pl

from kvdiverge.config.provenance import settings_hash
from kvdiverge.jobs.params import TeacherSettings

__all__ = [
    "POSITIONS_KEY",
    "SETTINGS_ENV",
    "ShardPass",
    "export_settings",
    "exported_settings",
    "gather_positions",
    "positions_metadata",
]

log = logging.getLogger(__name__)

#: the parquet key-value metadata key of a shard's positions: ``{"settings", "shards", "shard"}`` as JSON
POSITIONS_KEY = "kvdiverge_teacher_forced"
#: the environment variable of the teacher-forced settings, ``{model: {split: plain form}}`` as JSON
SETTINGS_ENV = "KVDIVERGE_TEACHER_SETTINGS"
#: the longest value exported (the kernel's limit on one environment string is 128 KiB)
_MAX_ENV = 100_000


def export_settings(settings: dict[str, dict[str, dict]]) -> bool:
    """Set :data:`SETTINGS_ENV` to ``settings`` (per model, per split, a
    :class:`~kvdiverge.jobs.params.TeacherSettings`' :meth:`~kvdiverge.jobs.params.ParamsForm.to_params`) for the
    jobs this process starts; True if set. Too long a value is not set (and an older one removed): the
    teacher-forced jobs then run the pass themselves."""
    value = json.dumps(settings, sort_keys=True, separators=(",", ":"))
    if len(value) > _MAX_ENV:
        os.environ.pop(SETTINGS_ENV, None)
        return False
    os.environ[SETTINGS_ENV] = value
    return True


def exported_settings(model: str, split: str) -> TeacherSettings | None:
    """The teacher-forced settings of ``(model, split)`` from :data:`SETTINGS_ENV`; None where it has none."""
    value = os.environ.get(SETTINGS_ENV)
    params = json.loads(value).get(model, {}).get(split) if value else None
    return None if params is None else TeacherSettings.from_params(params)


@dataclass(frozen=True)
class ShardPass:
    """The teacher-forced pass a shard job runs on its documents (:func:`kvdiverge.jobs.shard.run_shard`).

    Parameters
    ----------
    settings : kvdiverge.jobs.params.TeacherSettings or None
        The teacher-forced job's settings for the shard's split (every run of the split); None: no pass (none
        exported, or a model of ``backend: llama_cpp``), an empty file.
    corpus : str
        ``results/corpus/documents.parquet``: the texts after the excerpts, the reconstruction's texts.
    output : str
        The file of the positions (:func:`positions_metadata`).
    """

    settings: TeacherSettings | None
    corpus: str | os.PathLike
    output: str | os.PathLike


def positions_metadata(settings: TeacherSettings | None, shards: int, shard: int) -> dict[str, str]:
    """The metadata of shard ``shard`` of ``shards``'s positions: the hash of ``settings``
    (:func:`kvdiverge.config.provenance.settings_hash` of its plain form), ``None`` when it ran no pass."""
    digest = None if settings is None else settings_hash(settings.to_params())
    return {POSITIONS_KEY: json.dumps({"settings": digest, "shards": int(shards), "shard": int(shard)})}


def gather_positions(paths: Sequence[str | os.PathLike], settings: TeacherSettings) -> pl.DataFrame | None:
    """The positions of the job's runs gathered from its split's shard files, or None when they cannot be.

    Parameters
    ----------
    paths : sequence of str
        The shard jobs' position files (:func:`positions_metadata`), one per shard.
    settings : kvdiverge.jobs.params.TeacherSettings
        The teacher-forced job's settings.

    Returns
    -------
    polars.DataFrame or None
        :data:`kvdiverge.estimation.teacher_forced.POSITION_SCHEMA` in the order the job's own pass gives
        (split by split, run by run, document by ``doc_id``, position by position); None when a file is
        missing, was made with other settings or without the pass, or the files are not shards ``0`` to
        ``n - 1`` of ``n`` (the reason is logged).
    """
    if not paths:
        return None
    digest = settings_hash(settings.to_params())
    made = []
    for path in paths:
        meta = pl.read_parquet_metadata(path).get(POSITIONS_KEY) if os.path.exists(path) else None
        made.append(None if meta is None else json.loads(meta))
    shards = sorted((m["shards"], m["shard"]) for m in made if m is not None and m["settings"] == digest)
    if shards != [(len(paths), i) for i in range(len(paths))]:
        log.info("the shard jobs' positions were made with other settings: the pass runs here")
        return None
    runs = [(policy, split) for split, names in settings.splits().items() for policy in names]
    order = pl.DataFrame(
        {"policy": [p for p, _ in runs], "split": [s for _, s in runs], "_run": list(range(len(runs)))}
    )
    frame = pl.concat([pl.read_parquet(path) for path in paths])
    log.info("gathered the positions of %d shard jobs: %d rows", len(paths), frame.height)
    return frame.join(order, on=["policy", "split"]).sort("_run", "doc_id", "position").drop("_run")
