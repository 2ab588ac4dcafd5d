"""Estimation: estimators, the §3 decomposition, the document bootstrap, tables, finite
checks, analyses, the §4 interval, the shard schema, atomic writes (numpy, polars, scipy;
never torch or the engine)."""
