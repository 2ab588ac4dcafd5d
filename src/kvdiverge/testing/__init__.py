"""Oracles and fixtures for tests, benchmarks and rehearsals (as ``numpy.testing``): exact
enumeration of the coupled process, the §4 constructions, miniature random-weight
architectures, a real speculative sampler, a recording kernel pair."""
