"""Snakemake adapter: the self-speculative figure, PNG and PDF (kvdiverge.report.figures.plot_speculative)."""

import polars as pl

from kvdiverge.report import figures as plots
from kvdiverge.study.rulelog import rule_logger

log = rule_logger(snakemake.log[0], "speculative_figure")
i, o, p = snakemake.input, snakemake.output, snakemake.params
try:
    plots.plot_speculative(pl.read_parquet(i[0]), o.png, o.pdf, floor=p.floor)
    log.info("wrote %s", list(o))
except Exception:
    log.exception("speculative figure failed")
    raise
