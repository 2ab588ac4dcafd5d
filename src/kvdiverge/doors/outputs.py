"""Where the command line writes: output directories checked before any work, and locked while a run writes.

- :func:`output_problem`: why a path cannot be an output directory (a file in the way, a
  location that cannot be written), in one sentence, or None.
- :func:`output_guard`: ``kvdiverge measure``'s output locations checked (``--out``, else the
  working directory where ``--ratios`` writes its figure), then ``--out`` locked for the run
  (``filelock``, as the model conversion cache, :func:`kvdiverge.models.loading.convert_to_directory`).
  A second run on the same ``--out`` is refused at once instead of overwriting the first's files.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["LOCK_NAME", "OutputError", "output_guard", "output_problem"]

#: The lock file a run holds inside its output directory (kept after the run; a lock, never data).
LOCK_NAME = ".kvdiverge.lock"


class OutputError(ValueError):
    """An output location that cannot be used, or one another run is writing."""


def _writable(directory: Path) -> bool:
    """True when a file can be created in ``directory`` (a probe: permissions, read-only mounts, root alike)."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            return True
    except OSError:
        return False


def output_problem(path: str | os.PathLike, option: str = "--out") -> str | None:
    """Why ``path`` cannot be (or become) an output directory, in one sentence; None when it can.

    Parameters
    ----------
    path : path
        The output directory; it need not exist (it is created with its parents).
    option : str
        The argument named in the sentence.

    Returns
    -------
    str or None
        The path, what is in the way (a file where a directory must be) or what cannot be
        written (the directory itself, or the nearest existing directory above it), or None.
    """
    p = Path(path).expanduser()
    shown = f"{option} {str(path)!r}"
    if p.exists():
        if not p.is_dir():
            return f"{shown}: {str(p)!r} is a file, not a directory"
        if not _writable(p):
            return f"{shown}: the directory {str(p)!r} is not writable"
        return None
    for above in p.absolute().parents:
        if not above.exists():
            continue
        if not above.is_dir():
            return f"{shown}: {str(above)!r} is a file, not a directory, so no directory can be made under it"
        if not _writable(above):
            return f"{shown}: the directory {str(above)!r} is not writable, so {str(p)!r} cannot be made in it"
        return None
    return None


@contextlib.contextmanager
def output_guard(out: str | os.PathLike | None, cwd_writes: bool = False) -> Iterator[Path | None]:
    """Check the output locations of a run, then hold ``out`` locked while the block runs.

    Parameters
    ----------
    out : path or None
        ``--out``: created if missing, locked with ``out/.kvdiverge.lock`` (:data:`LOCK_NAME`).
        When the block fails and the directory was made here, it is removed again if it
        holds nothing but the lock.
    cwd_writes : bool
        The run writes into the working directory when ``out`` is None (``--ratios``' figure):
        it is checked too.

    Yields
    ------
    pathlib.Path or None
        ``out`` as a path.

    Raises
    ------
    OutputError
        A location that cannot be used (:func:`output_problem`), or ``out`` locked by another
        run, in one sentence naming the path.
    """
    from filelock import FileLock, Timeout

    problem = output_problem(out) if out is not None else output_problem(".", "the working directory")
    if problem and (out is not None or cwd_writes):
        raise OutputError(problem)
    if out is None:
        yield None
        return
    p = Path(out).expanduser()
    made = not p.exists()
    p.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(p / LOCK_NAME), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise OutputError(
            f"--out {str(out)!r} is being written by another kvdiverge run (it holds {str(p / LOCK_NAME)!r}); "
            f"wait for that run to finish or give another --out"
        ) from None
    ok = False
    try:
        yield p
        ok = True
    finally:
        lock.release()
        if made and not ok and [c.name for c in p.iterdir()] == [LOCK_NAME]:
            (p / LOCK_NAME).unlink(missing_ok=True)
            p.rmdir()
