"""The engine (torch, transformers, kvpress), in three parts under the runner:

- :mod:`kvdiverge.engine.core`: the coupling core (coupling math, decoding transform, kernel
  pairs, uniform streams, the batched coupled run);
- :mod:`kvdiverge.engine.presses`: what the engine knows of each press (adapters, registry,
  status table, promises, policies, the project's presses);
- :mod:`kvdiverge.engine.llm`: the LLM cache machinery (evicted twin, head masks, prefill,
  the two LLM pairs, the planner).

:mod:`kvdiverge.engine.runner` runs documents through them.
"""
