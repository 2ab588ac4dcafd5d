"""Logging of a Snakemake rule's script into the rule's ``log:`` file."""

from __future__ import annotations

import logging
import sys

__all__ = ["rule_logger"]


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
