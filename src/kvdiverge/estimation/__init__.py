"""Estimation: estimators, the §3 decomposition, the document bootstrap, table stages, finite
checks, analyses, the §4 interval, the shard schema, frontiers (numpy, polars, scipy; never torch
or the engine)."""
