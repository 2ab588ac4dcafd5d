"""Estimation: estimators, the document bootstrap, tables, finite checks, analyses, the §4
interval, the shard schema, atomic writes (numpy, polars, scipy; never torch or the engine)."""
