"""Estimation: estimators, tables, finite checks, analyses, the §4 interval, the shard schema
(numpy, polars, scipy; never torch or the engine)."""
