"""kvdiverge: how KV-cache eviction changes LLM generation.

A Snakemake workflow (``Snakefile``) over a document corpus; this package holds all
of its logic. Stages: ``corpus`` -> ``prompts`` -> ``trajectories`` -> ``estimators``
-> ``analysis`` -> ``plots``. See ``docs/internals.md`` for the contracts between them.

The front door for one model and a few presses: :func:`kvdiverge.measure`
(:mod:`kvdiverge.measurement`; the command ``kvdiverge measure``, :mod:`kvdiverge.cli`).
It is imported on first use, so ``import kvdiverge`` stays light (no torch).
"""

__version__ = "0.1.0"
__all__ = ["Measurement", "measure"]


def __getattr__(name):
    if name in __all__:
        from kvdiverge import measurement

        return getattr(measurement, name)
    raise AttributeError(f"module 'kvdiverge' has no attribute {name!r}")
