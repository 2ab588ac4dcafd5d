"""Where a model entry's files are, for each ``source:`` of the config (``docs/configs.md``): a GGUF
file in an installed package, one joined from chunk packages and checked against its SHA-256
(:func:`~kvdiverge.models.sources.assembled_gguf`), a local directory or file, a hub id
(:func:`~kvdiverge.models.sources.resolve`); what is refused when
they are missing (:class:`~kvdiverge.models.sources.ModelNotFoundError`, with
:func:`~kvdiverge.models.sources.location_hint`); the folder where the
machine keeps assembled and converted models (:func:`~kvdiverge.models.sources.conversion_cache`).

No torch, no transformers: the config check reads a model's layers from these files without them.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from kvdiverge.io.files import atomic_path
from kvdiverge.models.embedded import CHUNK_PACKAGES, EMBEDDED_MODELS

__all__ = [
    "CACHE_ENV",
    "ModelNotFoundError",
    "assembled_gguf",
    "gguf_path",
    "chunk_paths",
    "conversion_cache",
    "file_sha256",
    "location_hint",
    "resolve",
]


class ModelNotFoundError(FileNotFoundError):
    """The weights named by a model entry are not where the entry says."""


def location_hint(name: str | None) -> str:
    """How to point the entry ``models.<name>`` at weights already on the machine (the end of every refusal)."""
    key = f"models.{name}" if name else "the model entry"
    return (
        f"To use weights you already have, point {key} at them in the config, e.g.\n"
        f"    source: local\n"
        f"    path: /path/to/model_dir        # a Hugging Face model directory\n"
        f"    # gguf_file: model.gguf         # or a GGUF file inside that directory\n"
        f"or, for a hub id, download it once where there is network "
        f"(`hf download <id>`) and run with HF_HUB_OFFLINE=1."
    )


def resolve(spec: dict[str, Any], name: str | None = None) -> tuple[str, dict[str, Any]]:
    """Where to load from: ``(path_or_id, extra from_pretrained kwargs)``.

    Raises
    ------
    ModelNotFoundError
        If the package, directory or GGUF file does not exist; the message says
        where it looked and how to point the config at local weights.
    ValueError
        If a ``gguf_chunks`` entry's assembled file has another SHA-256 than the entry's
        (:func:`assembled_gguf`).
    """
    source = spec.get("source")
    kwargs: dict[str, Any] = {}
    if source == "gguf_package":
        package = spec["package"]
        found = importlib.util.find_spec(package)
        if found is None or not found.submodule_search_locations:
            raise ModelNotFoundError(
                f"model package {package!r} is not installed in {sys.prefix} "
                f"(looked with importlib.util.find_spec). The embedded default installs with "
                f"{EMBEDDED_MODELS[0].install}.\n" + location_hint(name)
            )
        path = Path(list(found.submodule_search_locations)[0])
    elif source == "gguf_chunks":
        path = assembled_gguf(spec, name).parent
    elif source == "local":
        path = Path(os.path.expanduser(str(spec["path"])))
        if not path.is_dir():
            raise ModelNotFoundError(
                f"model directory {str(path)!r} does not exist (looked at {str(path.resolve())!r}).\n"
                + location_hint(name)
            )
    elif source == "hub":
        if spec.get("revision"):
            kwargs["revision"] = spec["revision"]
        if _in_hub_cache(str(spec["id"]), spec.get("revision")):
            kwargs["local_files_only"] = True  # cached: never touch the network
        return str(spec["id"]), kwargs
    else:
        raise ValueError(f"model source must be gguf_package, gguf_chunks, local or hub, got {source!r}")
    gguf = spec.get("gguf_file")
    if source == "local" and not gguf:
        _check_model_directory(path, name)
    if gguf:
        if not (path / gguf).is_file():
            present = sorted(p.name for p in path.glob("*.gguf"))
            raise ModelNotFoundError(
                f"GGUF file {gguf!r} not found in {str(path)!r} "
                f"(GGUF files there: {present or 'none'}).\n" + location_hint(name)
            )
        kwargs["gguf_file"] = gguf
    return str(path), kwargs


def gguf_path(spec: dict[str, Any], name: str | None = None) -> str:
    """The GGUF file of a model entry (:func:`resolve`'s directory and ``gguf_file``), for llama.cpp.

    Raises
    ------
    ModelNotFoundError
        As :func:`resolve`.
    ValueError
        An entry without a GGUF file (a model directory or a hub id), in one sentence.
    """
    where, kwargs = resolve(spec, name)
    if not kwargs.get("gguf_file"):
        raise ValueError(
            f"model {name or where!r}: the llama_cpp backend reads a GGUF file, and this model has none; "
            "give a .gguf file or an embedded model"
        )
    return os.path.join(where, kwargs["gguf_file"])


def assembled_gguf(spec: dict[str, Any], name: str | None = None) -> Path:
    """The GGUF file of a ``source: gguf_chunks`` entry, joined from its package's chunks once per machine.

    The chunks (``chunk_paths()`` of the module ``package``, in order) are concatenated into
    ``<conversion_cache>/gguf/<sha256>/<gguf_file>`` (a process-wide temporary folder with the cache
    off), atomically and under a file lock, as :func:`~kvdiverge.models.loading.convert_to_directory` keeps
    conversions. Every
    process checks the file against the entry's ``sha256`` before using it (hashed once per process
    and file version).

    Raises
    ------
    ModelNotFoundError
        If the file is not there yet and the package, one of its chunk packages or a chunk is missing
        (the message says how to install them).
    ValueError
        If the file's SHA-256 is not the entry's (the message names both digests).
    """
    from filelock import FileLock

    expected = str(spec["sha256"]).lower()
    target = _gguf_home() / expected / spec["gguf_file"]
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(target) + ".lock"):
            if not target.is_file():
                chunks = chunk_paths(spec, name)
                with atomic_path(target, suffix=".part") as tmp:
                    _concatenate(chunks, tmp)
                try:
                    _check_sha256(target, expected, name)
                except ValueError:
                    target.unlink()  # never kept: a wrong file would fail every later load the same way
                    raise
                return target
    _check_sha256(target, expected, name)
    return target


def _gguf_home() -> Path:
    """Where :func:`assembled_gguf` keeps the assembled GGUF files: ``<conversion_cache>/gguf``, or with
    the cache off a temporary folder of this process (removed when it exits)."""
    cache = conversion_cache()
    if cache is not None:
        return cache / "gguf"
    global _TEMPORARY_HOME
    if _TEMPORARY_HOME is None:
        import atexit
        import shutil
        import tempfile

        _TEMPORARY_HOME = Path(tempfile.mkdtemp(prefix="kvdiverge-gguf-"))
        atexit.register(shutil.rmtree, _TEMPORARY_HOME, ignore_errors=True)
    return _TEMPORARY_HOME


_TEMPORARY_HOME: Path | None = None


def chunk_paths(spec: dict[str, Any], name: str | None = None) -> list[Path]:
    """The chunk files of a ``gguf_chunks`` entry, in order: ``chunk_paths()`` of its package (found with
    ``importlib.util.find_spec``, then imported: it imports its chunk packages). The first holds the
    GGUF file's header.

    Raises
    ------
    ModelNotFoundError
        If the package, one of its chunk packages or a chunk is missing (the message says how to
        install them).
    """
    package = spec["package"]
    install = CHUNK_PACKAGES.get(package, f"`pip install {package.replace('_', '-')}`")
    if importlib.util.find_spec(package) is None:
        raise ModelNotFoundError(
            f"model package {package!r} is not installed in {sys.prefix} (looked with "
            f"importlib.util.find_spec). Install it with {install}.\n" + location_hint(name)
        )
    try:
        paths = [Path(p) for p in importlib.import_module(package).chunk_paths()]
    except ImportError as exc:
        raise ModelNotFoundError(
            f"model package {package!r} cannot list its chunks: {exc}. Install it with {install}.\n"
            + location_hint(name)
        ) from exc
    missing = [str(p) for p in paths if not p.is_file()]
    if missing or not paths:
        raise ModelNotFoundError(
            f"model package {package!r} lacks its chunk files {missing or '(it lists none)'}; reinstall it "
            f"with {install}.\n" + location_hint(name)
        )
    return paths


def _concatenate(chunks: list[Path], out: Path) -> None:
    """Write the files ``chunks`` one after the other into ``out``."""
    import shutil

    with open(out, "wb") as sink:
        for chunk in chunks:
            with open(chunk, "rb") as source:
                shutil.copyfileobj(source, sink, 1 << 22)


def _check_sha256(path: Path, expected: str, name: str | None) -> None:
    """Refuse the file ``path`` unless its SHA-256 is ``expected``.

    Raises
    ------
    ValueError
        Naming the file, the expected and the actual digest.
    """
    stat = path.stat()
    actual = file_sha256(str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if actual != expected:
        key = f"models.{name}.sha256" if name else "the entry's sha256"
        raise ValueError(
            f"GGUF file {str(path)!r} has SHA-256 {actual}, expected {expected} ({key}): it is not the file "
            f"the entry names. Reinstall the chunk packages; a kept file that differs can be deleted to be "
            f"assembled again."
        )


def _check_model_directory(path: Path, name: str | None) -> None:
    """Refuse a local model directory without ``config.json``: it holds no Hugging Face model
    (transformers would blame a missing library instead); a GGUF file there is named."""
    if (path / "config.json").is_file():
        return
    ggufs = sorted(p.name for p in path.glob("*.gguf"))
    found = (
        f"it holds GGUF files ({', '.join(ggufs)}): give one of them as the model"
        if ggufs
        else f"it holds {len(list(path.iterdir()))} files and none of these"
    )
    raise ModelNotFoundError(
        f"model directory {str(path)!r} holds no model: looked for config.json (a Hugging Face model "
        f"directory: config.json, weights *.safetensors or pytorch_model.bin, tokenizer files) and "
        f"*.gguf files; {found}.\n" + location_hint(name)
    )


def _in_hub_cache(repo_id: str, revision: str | None = None) -> bool:
    """True when the hub model's config is in the local Hugging Face cache."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    except Exception:
        return False
    return isinstance(found, str)


#: environment variable naming the directory of converted GGUF models kept across runs
#: (default ``$XDG_CACHE_HOME/kvdiverge``, else ``~/.cache/kvdiverge``; ``off`` keeps none)
CACHE_ENV = "KVDIVERGE_CACHE_DIR"


def conversion_cache() -> Path | None:
    """The directory where converted GGUF models are kept (``$KVDIVERGE_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/kvdiverge``, else ``~/.cache/kvdiverge``), or None when
    ``KVDIVERGE_CACHE_DIR`` is ``off`` or empty."""
    value = os.environ.get(CACHE_ENV)
    if value is not None:
        return None if value.strip() in ("", "off") else Path(os.path.expanduser(value))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvdiverge"


@functools.lru_cache(maxsize=16)
def file_sha256(path: str, size: int, mtime_ns: int) -> str:
    """The SHA-256 of the file ``path`` as it is at ``size`` and ``mtime_ns`` (hashed once per version)."""
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()
