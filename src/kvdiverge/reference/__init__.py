"""Reference constructions for tests and benchmarks: exact enumeration, the §4
constructions, miniature random-weight architectures."""
