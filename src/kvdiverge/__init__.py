"""kvdiverge: how KV-cache eviction changes LLM generation.

A Snakemake workflow (``Snakefile``) over a document corpus; this package holds all
of its logic. Stages: ``corpus`` -> ``prompts`` -> ``trajectories`` -> ``estimators``
-> ``analysis`` -> ``plots``. See ``docs/internals.md`` for the contracts between them.
"""

__version__ = "0.1.0"
