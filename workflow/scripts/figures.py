"""Snakemake adapter: the study's figures, PNG and PDF (kvdiverge.report.figures)."""

import polars as pl

from kvdiverge.report import figures as plots
from kvdiverge.study.rulelog import rule_logger

log = rule_logger(snakemake.log[0], "figures")
i, o, p = snakemake.input, snakemake.output, snakemake.params
try:
    plots.plot_survival(pl.read_parquet(i.survival), o.survival_png, o.survival_pdf, floor=p.floor)
    plots.plot_gaps(pl.read_parquet(i.gaps), o.gap_decomposition_png, o.gap_decomposition_pdf)
    plots.plot_branch_tv(pl.read_parquet(i.branch_tv), o.branch_tv_png, o.branch_tv_pdf, early=p.early, late=p.late)
    plots.plot_confirmatory(
        pl.read_parquet(i.confirmatory_documents),
        pl.read_parquet(i.confirmatory),
        o.confirmatory_differences_png,
        o.confirmatory_differences_pdf,
    )
    plots.plot_variance(pl.read_parquet(i.variance), o.variance_png, o.variance_pdf)
    log.info("wrote %s", list(o))
except Exception:
    log.exception("figures failed")
    raise
