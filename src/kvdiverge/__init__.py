"""kvdiverge: how KV-cache eviction changes LLM generation.

A Snakemake workflow (``Snakefile``) over a document corpus; this package holds all
of its logic, in layers that import one way (``docs/internals.md``, "Layers"):
``io`` (atomic writes, tables saved and rendered) <- ``estimation`` (estimators, bootstrap,
analyses; no torch) <- ``engine`` (coupling, kernel pairs, the batched coupled run) <-
``testing`` (exact enumeration, §4 constructions; for the tests) <- ``settings`` (one setting's
rules) <- ``data`` (corpus, prompts, tasks) and ``models`` <- ``config`` (checks before work) <-
``jobs`` (the workflow's jobs) <- ``planning`` (cost, roofline) <- ``doors`` (``screening``,
``measurement`` with its result ``results``, ``cli``); ``report`` (figures, pages) beside them.
Workflow stages: corpus -> prompts -> trajectories -> estimate -> pool, gaps, floor,
confirmatory -> figures, summary.

The front door for one model and a few presses: :func:`kvdiverge.measure`
(:mod:`kvdiverge.doors.measurement`; the command ``kvdiverge measure``, :mod:`kvdiverge.doors.cli`).
:func:`kvdiverge.screen` (:mod:`kvdiverge.doors.screening`; ``kvdiverge measure --screen``) runs only
the teacher-forced pass (``docs/teacher-forced.md``). :func:`kvdiverge.plan` checks a measurement
before any model loads (:mod:`kvdiverge.doors.plan`; ``measure`` is ``plan(...).run(model)``).
These are imported on first use, so
``import kvdiverge`` stays light (no torch).
``kvdiverge.__version__`` is the installed distribution's version (:mod:`importlib.metadata`).
"""

from importlib.metadata import PackageNotFoundError, version

try:  # the one version literal is pyproject.toml's, read from the installed metadata
    __version__ = version("kvdiverge")
except PackageNotFoundError:  # sources on the path without an install (PYTHONPATH=src)
    __version__ = "0+unknown"
__all__ = ["Measurement", "Plan", "Screen", "__version__", "measure", "plan", "screen"]


def __getattr__(name):
    if name in ("Screen", "screen"):
        from kvdiverge.doors import screening

        return getattr(screening, name)
    if name in __all__:  # the doors import torch and polars: on first use only
        from kvdiverge.doors import measurement

        return getattr(measurement, name)
    raise AttributeError(f"module 'kvdiverge' has no attribute {name!r}")
