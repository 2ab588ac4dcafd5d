"""What a trajectory shard was made with: its settings, their hash, the library versions.

A cached file is only as good as its key. The workflow keys every rule on the settings
that decide its output (rule ``params``, which Snakemake's default ``params`` rerun
trigger compares with the ones recorded when the file was made). A file can still be
copied in by hand, made by an older version, or made with ``--rerun-triggers mtime``;
so each shard also carries its settings inside the file, as parquet key-value metadata:

``kvdiverge.settings``
    :func:`shard_settings` as canonical JSON (sorted keys, no spaces).
``kvdiverge.settings_hash``
    :func:`settings_hash` of those settings (SHA-256, 16 hex digits).
``kvdiverge.versions``
    :func:`library_versions` of the process that wrote the shard, as JSON.
``kvdiverge.shard``
    ``{"model", "policy", "split", "shard"}`` of the shard, as JSON.
``kvdiverge.batch``
    ``{"batch_documents": B}``: the documents per batched forward the shard ran with, as
    JSON. Not a setting: results depend on ``B`` only through rounding, so shards made
    with different ``B`` stay compatible (it enters neither the settings nor their hash).
``kvdiverge.eos``
    ``{"eos_ids": [...]}``: the end-of-sequence ids the model stopped at (its generation
    config's; null when no document ran), as JSON: what the length drift reads stops with
    (:mod:`kvdiverge.estimation.drift`). The model's, not a setting.
``kvdiverge.backend``
    A shard of a llama_cpp model only (:func:`backend_metadata`): the llama.cpp build, the policy's cache
    types, rotation and flash attention, and the threads
    (:func:`kvdiverge.engine.llamacpp.run.provenance`), as JSON. Not settings: the threads come from the
    job, and the build from the machine; both can change the numbers, so they are recorded.

The estimate stage calls :func:`check_shards`, which refuses shards whose settings differ
from the current config or from each other, naming the setting, both values and the
command that regenerates them.

Sources: Snakemake's rerun triggers (``snakemake --help``, ``--rerun-triggers``; default
``code input mtime params software-env``); Apache Parquet file metadata
(``key_value_metadata`` of ``FileMetaData``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

import polars as pl

from kvdiverge.config.workflow import control_documents
from kvdiverge.io.files import save_table, write_text_atomic

__all__ = [
    "KEY_SETTINGS",
    "KEY_HASH",
    "KEY_VERSIONS",
    "KEY_SHARD",
    "KEY_BATCH",
    "LIBRARIES",
    "CONFIGFILES_ENV",
    "StaleShardError",
    "ShardProvenance",
    "canonical",
    "shard_settings",
    "teacher_settings",
    "settings_hash",
    "library_versions",
    "shard_metadata",
    "read_provenance",
    "differences",
    "check_shards",
    "save_measurement",
    "recorded_eos_ids",
    "regenerate_command",
    "provenance_table",
    "study_hash",
    "compressed_layers",
    "layers_metadata",
    "KEY_LAYERS",
    "KEY_BACKEND",
    "backend_metadata",
]

log = logging.getLogger(__name__)

KEY_SETTINGS = "kvdiverge.settings"
KEY_HASH = "kvdiverge.settings_hash"
KEY_VERSIONS = "kvdiverge.versions"
KEY_SHARD = "kvdiverge.shard"
KEY_BATCH = "kvdiverge.batch"
KEY_EOS = "kvdiverge.eos"
KEY_LAYERS = "kvdiverge.layers"
KEY_BACKEND = "kvdiverge.backend"
#: Libraries whose versions a shard records (besides Python); numbers may change with them.
LIBRARIES = ("torch", "transformers", "kvpress", "kvdiverge")
#: Environment variable through which the workflow tells its scripts its config files
#: (``workflow/rules/common.smk``), for the regenerate command of error messages. Not a
#: rule parameter: running the same settings from another file must not rerun anything.
CONFIGFILES_ENV = "KVDIVERGE_CONFIGFILES"


class StaleShardError(ValueError):
    """Shards were made with settings other than the config's (or each other's)."""


def canonical(value: Any) -> Any:
    """``value`` in canonical form: mapping keys sorted, tuples as lists, whole floats as ints.

    Two configs that differ only in key order, or in writing ``1.0`` for ``1``, decide the
    same outputs, so their canonical forms (and Snakemake params, and hashes) are equal.

    Parameters
    ----------
    value : Any
        Nested dicts / lists / tuples of YAML scalars.

    Returns
    -------
    Any
        The same structure; dicts are new objects with sorted keys.
    """
    if isinstance(value, Mapping):
        return {k: canonical(value[k]) for k in sorted(value)}
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def shard_settings(config: Mapping[str, Any], model: str, policy: str, split: str) -> dict[str, Any]:
    """Every config setting that decides the rows of a shard of ``(model, policy, split)``.

    Besides these, a shard's rows depend only on its prompts table (a rule input) and its
    index (in its path). Left out on purpose: anything that must not change results
    (where it runs, batch sizes), and ``runs`` lists beyond the control's document count.

    Parameters
    ----------
    config : mapping
        Validated workflow config (defaults filled).
    model, policy, split : str
        Keys of ``config['models']``, ``config['policies']``; ``"exploratory"`` or
        ``"confirmatory"``.

    Returns
    -------
    dict
        Canonical (:func:`canonical`) ``{"model", "policy", "decoding", "replicates",
        "seed", "shards", "documents"}``; ``documents`` is the control's document count
        where the control limits this run (``runs.control``), else ``None`` (all usable
        documents of the split). ``model`` is None when ``config`` has no entry for the
        model (a loaded model passed directly to ``run_shard``).
    """
    return canonical(
        {
            "model": config.get("models", {}).get(model),  # None: a model given directly (tests)
            "policy": config["policies"][policy],
            "decoding": config["decoding"],
            "replicates": config["replicates"],
            "seed": config["seed"],
            "shards": config["shards"],
            "documents": control_documents(config, policy, split),
        }
    )


def teacher_settings(config: dict[str, Any], model: str, policy: str, split: str) -> dict[str, Any]:
    """What decides a run's teacher-forced positions besides its inputs (prompts, corpus, model).

    Canonical (:func:`canonical`) ``{"model", "policy", "seed",
    "documents", "corpus", "teacher_forced"}``: the model and policy entries, the master seed (prefill
    seeds), the control's document count (:func:`kvdiverge.config.workflow.control_documents`),
    the ``corpus`` section (where the text after each excerpt is read from) and the
    ``teacher_forced`` section, its ``repeat_instruction`` only with ``target: reconstruction`` (the
    one target that reads it). Decoding settings, replicates and shards do not enter.
    """
    section = dict(config.get("teacher_forced") or {})
    if section.get("target", "continuation") != "reconstruction":
        section.pop("repeat_instruction", None)
    return canonical(
        {
            "model": config["models"][model],
            "policy": config["policies"][policy],
            "seed": config["seed"],
            "documents": control_documents(config, policy, split),
            "corpus": config["corpus"],
            "teacher_forced": section,
        }
    )


def _json(value: Any) -> str:
    return json.dumps(canonical(value), sort_keys=True, separators=(",", ":"), default=str)


def settings_hash(settings: Mapping[str, Any]) -> str:
    """SHA-256 of the canonical JSON of ``settings``, first 16 hex digits."""
    return hashlib.sha256(_json(settings).encode()).hexdigest()[:16]


def library_versions() -> dict[str, str]:
    """Versions of Python and of :data:`LIBRARIES` in this process ("not installed" if absent)."""
    out = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            out[name] = importlib_metadata.version(name)
        except importlib_metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def shard_metadata(
    settings: Mapping[str, Any],
    *,
    model: str,
    policy: str,
    split: str,
    shard: int,
    batch_documents: int | None = None,
    eos_ids: Sequence[int] | None = None,
) -> dict[str, str]:
    """Parquet key-value metadata for a shard (module docstring lists the keys).

    ``batch_documents`` is the ``B`` the shard ran with and ``eos_ids`` the model's end-of-sequence
    ids (None: no document ran).
    """
    return {
        KEY_SETTINGS: _json(settings),
        KEY_HASH: settings_hash(settings),
        KEY_VERSIONS: _json(library_versions()),
        KEY_SHARD: _json({"model": model, "policy": policy, "split": split, "shard": int(shard)}),
        KEY_BATCH: _json({"batch_documents": None if batch_documents is None else int(batch_documents)}),
        KEY_EOS: _json({"eos_ids": None if eos_ids is None else sorted(int(e) for e in eos_ids)}),
    }


def layers_metadata(layers: Mapping[str, Any] | None) -> dict[str, str]:
    """Parquet key-value metadata of the layers a shard's presses compress: ``layers`` is
    ``{"compressed": [...], "layers": n, "sliding_window": W or None}`` (:func:`compressed_layers`),
    None when no document ran (no entry)."""
    return {} if layers is None else {KEY_LAYERS: _json(dict(layers))}


def backend_metadata(record: Mapping[str, Any] | None) -> dict[str, str]:
    """Parquet key-value metadata of the engine a shard ran on besides transformers: ``record`` is
    :func:`kvdiverge.engine.llamacpp.run.provenance` of the shard's policy (None: transformers, no entry)."""
    return {} if record is None else {KEY_BACKEND: _json(dict(record))}


def compressed_layers(layers: Mapping[str, Any]) -> str:
    """The layers a press compresses, in words: ``"all 30"``, or for a model with sliding-window
    layers ``"3 of 18 (5, 11, 17); 15 sliding-window layers of 512 tokens kept whole"``; ``""``
    when a shard recorded none."""
    if not layers:
        return ""
    compressed, n = list(layers["compressed"]), int(layers["layers"])
    if len(compressed) == n:
        return f"all {n}"
    window = layers.get("sliding_window")
    return (
        f"{len(compressed)} of {n} ({', '.join(str(i) for i in compressed)}); "
        f"{n - len(compressed)} sliding-window layers of {window} tokens kept whole"
    )


@dataclass(frozen=True)
class ShardProvenance:
    """The recorded provenance of one shard file (``settings`` is None when none was recorded;
    ``batch`` is ``{"batch_documents": B}`` and ``eos`` ``{"eos_ids": [...]}``, empty when not recorded;
    ``backend`` the llama.cpp build, cache and threads of a llama_cpp model's shard, empty for transformers)."""

    path: str
    settings: dict[str, Any] | None
    settings_hash: str | None
    versions: dict[str, str] = field(default_factory=dict)
    shard: dict[str, Any] = field(default_factory=dict)
    batch: dict[str, Any] = field(default_factory=dict)
    eos: dict[str, Any] = field(default_factory=dict)
    layers: dict[str, Any] = field(default_factory=dict)
    backend: dict[str, Any] = field(default_factory=dict)


def read_provenance(path: str | os.PathLike) -> ShardProvenance:
    """Read the provenance a shard file records (only its footer is read).

    Raises
    ------
    FileNotFoundError
        If ``path`` does not exist.
    """
    meta = pl.read_parquet_metadata(path)
    if KEY_SETTINGS not in meta:
        return ShardProvenance(str(path), None, None)
    return ShardProvenance(
        str(path),
        json.loads(meta[KEY_SETTINGS]),
        meta.get(KEY_HASH),
        json.loads(meta.get(KEY_VERSIONS, "{}")),
        json.loads(meta.get(KEY_SHARD, "{}")),
        json.loads(meta.get(KEY_BATCH, "{}")),
        json.loads(meta.get(KEY_EOS, "{}")),
        json.loads(meta.get(KEY_LAYERS, "{}")),
        json.loads(meta.get(KEY_BACKEND, "{}")),
    )


def differences(recorded: Any, expected: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """Settings that differ, as ``(dotted key, recorded value, expected value)``.

    A key present on one side only differs with ``"<absent>"`` on the other.
    """
    if isinstance(recorded, Mapping) and isinstance(expected, Mapping):
        out = []
        for key in sorted(set(recorded) | set(expected), key=str):
            name = f"{prefix}.{key}" if prefix else str(key)
            if key not in recorded:
                out.append((name, "<absent>", expected[key]))
            elif key not in expected:
                out.append((name, recorded[key], "<absent>"))
            else:
                out.extend(differences(recorded[key], expected[key], name))
        return out
    if canonical(recorded) != canonical(expected):
        return [(prefix or "<settings>", recorded, expected)]
    return []


def recorded_eos_ids(records: Sequence[ShardProvenance]) -> list[int] | None:
    """The end-of-sequence ids the shards record (the union over those that ran a document); None when
    none records any (shards of an older version, or no document ran)."""
    found = [r.eos.get("eos_ids") for r in records if r.eos.get("eos_ids") is not None]
    return sorted({int(e) for ids in found for e in ids}) if found else None


def regenerate_command(paths: Sequence[str], configfiles: Sequence[str] | None = None) -> str:
    """The command that remakes ``paths`` (and everything downstream) with the current config.

    ``--forcerun`` with file names reruns exactly the jobs that make those files, and
    Snakemake then reruns whatever reads them. ``configfiles`` defaults to the
    :data:`CONFIGFILES_ENV` environment variable (set by the workflow).
    """
    if configfiles is None:
        env = os.environ.get(CONFIGFILES_ENV)
        configfiles = env.split(os.pathsep) if env else ["<your config>"]
    conf = "".join(f" --configfile {c}" for c in configfiles)
    return f"snakemake --cores all{conf} --forcerun {' '.join(paths)}"


def _show(value: Any) -> str:
    return value if value == "<absent>" else json.dumps(value, default=str)


def check_shards(
    paths: Iterable[str | os.PathLike],
    expected: Mapping[str, Any] | None = None,
    *,
    model: str | None = None,
    policy: str | None = None,
    split: str | None = None,
    configfiles: Sequence[str] | None = None,
) -> list[ShardProvenance]:
    """Refuse shards whose recorded settings differ from ``expected`` or from each other.

    Parameters
    ----------
    paths : iterable of path
        Shard files of one ``(model, policy, split)``, named ``shard-{i}.parquet``.
    expected : mapping, optional
        :func:`shard_settings` of the current config; when None the shards are compared
        with the first one.
    model, policy, split : str, optional
        The run the shards must record (checked when given); each shard must also record
        the index of its file name.
    configfiles : sequence of str, optional
        For the regenerate command (:func:`regenerate_command`).

    Returns
    -------
    list of ShardProvenance
        One per path, in order. Shards made with different library versions are
        accepted with a logged warning (a cluster's nodes may differ).

    Raises
    ------
    StaleShardError
        Naming, per offending shard, each differing setting with the recorded and the
        expected value, and the command that regenerates the offending shards.
    """
    records = [read_provenance(p) for p in paths]
    if not records:
        return records
    missing = [r.path for r in records if r.settings is None]
    if missing:
        raise StaleShardError(
            f"{len(missing)} trajectory shard(s) record no settings (made by an older kvdiverge, "
            f"or copied in by hand), so they cannot be checked against the config: "
            f"{', '.join(missing)}. Regenerate them with:\n  {regenerate_command(missing, configfiles)}"
        )
    reference, against = (
        (expected, "the config") if expected is not None else (records[0].settings, f"{records[0].path}")
    )
    problems, stale = [], []
    for rec in records:
        diff = differences(rec.settings, reference)
        want = {"model": model, "policy": policy, "split": split}
        index = re.search(r"shard-(\d+)\.parquet$", str(rec.path))
        if index:
            want["shard"] = int(index.group(1))
        diff += [
            (f"shard.{k}", rec.shard.get(k, "<absent>"), v)
            for k, v in want.items()
            if v is not None and rec.shard.get(k) != v
        ]
        if diff:
            stale.append(rec.path)
            problems += [
                f"{rec.path}: {key} = {_show(got)} in the shard, {_show(want_)} in {against}"
                for key, got, want_ in diff
            ]
    if problems:
        raise StaleShardError(
            "trajectory shards were made with other settings than "
            f"{against} (Snakemake did not know: copied in by hand, made by another version, "
            "or run with --rerun-triggers mtime):\n  "
            + "\n  ".join(problems)
            + f"\nRegenerate them with:\n  {regenerate_command(stale, configfiles)}"
        )
    versions = {json.dumps(r.versions, sort_keys=True) for r in records}
    if len(versions) > 1:
        log.warning(
            "shards were made with different library versions: %s",
            "; ".join(f"{r.path}: {r.versions}" for r in records),
        )
    return records


def provenance_table(records: Iterable[ShardProvenance]) -> pl.DataFrame:
    """One row per run (``model``, ``policy``, ``split``) from the records of its shards.

    Returns
    -------
    polars.DataFrame
        ``model``, ``policy``, ``split`` (str), ``shards`` (int64, files), ``settings_hash``
        (str), ``settings`` (str, canonical JSON), ``compressed_layers`` (str, :func:`compressed_layers`
        of the first shard), then one str column per entry of
        :func:`library_versions` (several versions joined by ``" | "``), sorted by run.

    Raises
    ------
    StaleShardError
        If a shard records no settings, or the shards of one run record different ones.
    """
    runs: dict[tuple[str, str, str], list[ShardProvenance]] = {}
    for rec in records:
        if rec.settings is None:
            raise StaleShardError(
                f"{rec.path} records no settings: regenerate it with\n  {regenerate_command([rec.path])}"
            )
        key = (rec.shard.get("model"), rec.shard.get("policy"), rec.shard.get("split"))
        runs.setdefault(key, []).append(rec)
    rows = []
    for (model, policy, split), recs in sorted(runs.items()):
        check_shards([r.path for r in recs])
        row = {
            "model": model,
            "policy": policy,
            "split": split,
            "shards": len(recs),
            "settings_hash": recs[0].settings_hash,
            "settings": _json(recs[0].settings),
            "compressed_layers": compressed_layers(recs[0].layers),
        }
        for lib in ("python", *LIBRARIES):
            row[lib] = " | ".join(sorted({r.versions.get(lib, "unknown") for r in recs}))
        rows.append(row)
    schema = {
        "model": pl.String,
        "policy": pl.String,
        "split": pl.String,
        "shards": pl.Int64,
        "settings_hash": pl.String,
        "settings": pl.String,
        "compressed_layers": pl.String,
        **{lib: pl.String for lib in ("python", *LIBRARIES)},
    }
    return pl.DataFrame(rows, schema=schema)


def study_hash(table: pl.DataFrame) -> str:
    """One hash for the whole study: SHA-256 (16 hex digits) over every run's settings hash."""
    items = [
        f"{m}/{p}/{s}={h}"
        for m, p, s, h in table.select("model", "policy", "split", "settings_hash")
        .sort("model", "policy", "split")
        .rows()
    ]
    return hashlib.sha256("\n".join(items).encode()).hexdigest()[:16]


def save_measurement(
    directory: str | os.PathLike,
    tables: Mapping[str, Any],
    settings: Mapping[str, Any],
    batch_documents: int | None,
    run: Mapping[str, Any] | None = None,
) -> list[Path]:
    """Write a measurement's tables, settings and provenance under ``directory``, atomically.

    Each table as ``<name>.parquet``, and its scalar columns as ``<name>.csv`` except for
    ``trajectories`` and ``replicates``; ``measure.json`` (the settings) and
    ``provenance.json``: ``settings_hash`` (:func:`settings_hash` of the settings),
    ``versions`` (:func:`library_versions`), ``batch_documents`` (the ``B`` used) and the items of
    ``run`` (what the run stopped at and compared against, e.g. ``eos_ids`` and ``noise_floor``:
    read back by :meth:`kvdiverge.doors.results.Measurement.load`).

    Parameters
    ----------
    directory : path
        Created when missing.
    tables : mapping of str to polars.DataFrame
        Name -> table (:meth:`kvdiverge.doors.results.Measurement.save`).
    settings : mapping
        The measurement's settings.
    batch_documents : int or None
        Documents per batched forward the measurement ran with.
    run : mapping, optional
        More of what the run used that is not a setting (JSON values), written beside ``batch_documents``.

    Returns
    -------
    list of pathlib.Path
        The files written.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, frame in tables.items():
        csv = None if name in ("trajectories", "replicates") else out / f"{name}.csv"
        save_table(frame, out / f"{name}.parquet", csv)
        written += [out / f"{name}.parquet"] + ([csv] if csv else [])
    write_text_atomic(json.dumps(settings, indent=2, default=str) + "\n", out / "measure.json")
    provenance = {
        "settings_hash": settings_hash(settings),
        "versions": library_versions(),
        "batch_documents": batch_documents,
        **(run or {}),
    }
    write_text_atomic(json.dumps(provenance, indent=2) + "\n", out / "provenance.json")
    return written + [out / "measure.json", out / "provenance.json"]
