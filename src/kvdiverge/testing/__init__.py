"""Oracles and fixtures for tests and benchmarks (as ``numpy.testing``): exact enumeration of
the coupled process, the §4 constructions, a real speculative sampler, a recording kernel pair,
greedy generation by transformers and kvpress alone.
Only the tests and benchmarks import this package; no module of the package outside it does."""
