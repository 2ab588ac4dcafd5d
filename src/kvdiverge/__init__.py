"""kvdiverge: how KV-cache eviction changes LLM generation.

A Snakemake workflow (``Snakefile``) over a document corpus; this package holds all
of its logic, in layers that import one way (``docs/internals.md``, "Layers"):
``io`` (atomic writes, tables saved and rendered) <- ``estimation`` (estimators, bootstrap,
analyses; no torch) <- ``engine`` (coupling, kernel pairs, the batched coupled run) <-
``testing`` (exact enumeration, §4 constructions; for the tests) <- ``study`` (config, corpus,
prompts, models, the shard job) and ``report`` (figures, pages) <- the doors ``screening``,
``measurement`` (with its result, ``results``) and ``cli``.
Workflow stages: corpus -> prompts -> trajectories -> estimate -> pool, gaps, floor,
confirmatory -> figures, summary.

The front door for one model and a few presses: :func:`kvdiverge.measure`
(:mod:`kvdiverge.measurement`; the command ``kvdiverge measure``, :mod:`kvdiverge.cli`).
:func:`kvdiverge.screen` (:mod:`kvdiverge.screening`; ``kvdiverge measure --screen``) runs only
the teacher-forced pass (``docs/teacher-forced.md``). Both are imported on first use, so
``import kvdiverge`` stays light (no torch).
``kvdiverge.__version__`` is the installed distribution's version (:mod:`importlib.metadata`).
"""

from importlib.metadata import PackageNotFoundError, version

try:  # the one version literal is pyproject.toml's, read from the installed metadata
    __version__ = version("kvdiverge")
except PackageNotFoundError:  # sources on the path without an install (PYTHONPATH=src)
    __version__ = "0+unknown"
__all__ = ["Measurement", "Screen", "__version__", "measure", "screen"]


def __getattr__(name):
    if name in ("Screen", "screen"):
        from kvdiverge import screening

        return getattr(screening, name)
    if name in __all__:  # the doors import torch and polars: on first use only
        from kvdiverge import measurement

        return getattr(measurement, name)
    raise AttributeError(f"module 'kvdiverge' has no attribute {name!r}")
