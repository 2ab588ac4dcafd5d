"""Output files and folders written atomically, so an interrupted run never leaves a half one.

- :func:`atomic_path`: a temporary path that replaces the destination when the ``with`` block ends normally;
- :func:`write_parquet_atomic`, :func:`write_text_atomic`: one parquet or text file;
- :func:`save_table`: a table as parquet and/or CSV (:func:`scalar_columns`: the CSV's columns).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import polars as pl

__all__ = ["atomic_path", "save_table", "scalar_columns", "write_parquet_atomic", "write_text_atomic"]


def _default_mode() -> int:
    """Permissions a plain ``open(path, "w")`` would give (0o666 less the umask)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = ".tmp", directory: bool = False) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success it replaces ``path``.

    Write the file (or, with ``directory``, fill the folder) at the yielded path inside the
    ``with`` block. When the block ends normally a file gets ordinary permissions, a folder
    already at ``path`` is removed, and the new one is renamed onto ``path`` (``os.replace``,
    atomic on POSIX for a file); when it raises, the temporary one is removed and ``path`` is
    left as it was. Parent folders are created.

    Parameters
    ----------
    path : str or os.PathLike
        Destination file or folder.
    suffix : str
        Suffix of the temporary file (some writers choose the format from it,
        e.g. ``".png"``).
    directory : bool
        Yield an empty temporary folder instead of a file (a converted model).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if directory:
        tmp = tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent)
    else:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
        os.close(fd)
    try:
        yield Path(tmp)
        if directory:
            if path.exists():
                shutil.rmtree(path)
        else:
            os.chmod(tmp, _default_mode())
        os.replace(tmp, path)
    except BaseException:
        if directory:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            Path(tmp).unlink(missing_ok=True)
        raise


def write_parquet_atomic(frame: pl.DataFrame, path: str | os.PathLike, metadata: dict[str, str] | None = None) -> Path:
    """Write ``frame`` to the parquet file ``path`` atomically (see :func:`atomic_path`).

    ``metadata`` is stored as the file's key-value metadata (read it back with
    ``polars.read_parquet_metadata``).
    """
    with atomic_path(path) as tmp:
        frame.write_parquet(tmp, metadata=metadata)
    return Path(path)


def write_text_atomic(text: str, path: str | os.PathLike) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically (see :func:`atomic_path`)."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def scalar_columns(frame: pl.DataFrame) -> pl.DataFrame:
    """``frame`` without its list columns (for CSV)."""
    return frame.select([c for c, t in frame.schema.items() if not isinstance(t, (pl.List, pl.Array))])


def save_table(frame: pl.DataFrame, parquet: str | None = None, csv: str | None = None) -> None:
    """Write a table as parquet and/or CSV, each atomically (temporary file, then rename).

    The CSV gets the scalar columns only (list columns stay in the parquet file).
    """
    if parquet is not None:
        write_parquet_atomic(frame, parquet)
    if csv is not None:
        with atomic_path(csv) as tmp:
            scalar_columns(frame).write_csv(tmp, float_precision=6)
