"""Logging of a Snakemake rule's script into the rule's ``log:`` file."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

__all__ = ["rule_log", "rule_logger"]


def rule_logger(log_path: str, name: str) -> logging.Logger:
    """Send log records and everything written to stderr (tqdm progress bars, library
    warnings, tracebacks) to ``log_path``, and return the logger called ``name``.

    Parameters
    ----------
    log_path : str
        The rule's ``log:`` file (``snakemake.log[0]``), appended to.
    name : str
        Logger name, usually the rule's.
    """
    logging.basicConfig(filename=log_path, level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    sys.stderr = open(log_path, "a", buffering=1)
    return logging.getLogger(name)


@contextlib.contextmanager
def rule_log(log_path: str, name: str, task: str | None = None) -> Iterator[logging.Logger]:
    """The frame of a rule's script: its logger (:func:`rule_logger`) for the body, and any
    exception the body raises written to the log with its traceback, then raised again, so
    that Snakemake marks the job failed and shows the log.

    Parameters
    ----------
    log_path : str
        The rule's ``log:`` file (``snakemake.log[0]``), appended to.
    name : str
        Logger name, usually the rule's.
    task : str, optional
        What the script does, for the failure line ``"<task> failed"``; default ``name``.

    Yields
    ------
    logging.Logger
        The logger called ``name``.

    Examples
    --------
    >>> with rule_log(snakemake.log[0], "pool", "pooling") as log:  # doctest: +SKIP
    ...     log.info("%d rows", table.height)
    """
    log = rule_logger(log_path, name)
    try:
        yield log
    except Exception:
        log.exception("%s failed", task or name)
        raise
