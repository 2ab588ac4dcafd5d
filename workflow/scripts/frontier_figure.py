"""Snakemake adapter: the frontier figure, PNG and PDF (kvdiverge.report.figures.plot_frontier)."""

import polars as pl

from kvdiverge.report import figures as plots
from kvdiverge.study.rulelog import rule_logger

log = rule_logger(snakemake.log[0], "frontier_figure")
i, o = snakemake.input, snakemake.output
try:
    plots.plot_frontier(pl.read_parquet(i[0]), o.png, o.pdf)
    log.info("wrote %s", list(o))
except Exception:
    log.exception("frontier figure failed")
    raise
