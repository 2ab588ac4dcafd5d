"""Table input/output: atomic parquet writes, so an interrupted run leaves no half file."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import polars as pl

__all__ = ["write_parquet_atomic"]


def write_parquet_atomic(frame: pl.DataFrame, path: str | os.PathLike) -> Path:
    """Write ``frame`` to ``path`` atomically (temporary file in the same folder, then rename).

    Parameters
    ----------
    frame : polars.DataFrame
        The table to write.
    path : str or os.PathLike
        Destination ``.parquet`` file; parent folders are created.

    Returns
    -------
    pathlib.Path
        The written path.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        frame.write_parquet(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
