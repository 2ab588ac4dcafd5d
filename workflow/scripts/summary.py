"""Snakemake adapter: headline numbers as an HTML page for the report (kvdiverge.estimation.analysis)."""

import polars as pl

from kvdiverge.report.pages import summary_html
from kvdiverge.estimation.io import write_text_atomic
from kvdiverge.study.provenance import provenance_html
from kvdiverge.study.rulelog import rule_logger

log = rule_logger(snakemake.log[0], "summary")  # noqa: F821
i = snakemake.input  # noqa: F821
try:
    html = summary_html(pl.read_parquet(i.pooled), pl.read_parquet(i.gaps), pl.read_parquet(i.confirmatory),
                        dict(snakemake.params.plan), floor=pl.read_parquet(i.floor))  # noqa: F821
    # settings hash and library versions of every run, at the end of the page
    html = html.replace("</body>", provenance_html(pl.read_parquet(i.provenance)) + "</body>", 1)
    write_text_atomic(html, snakemake.output[0])  # noqa: F821
    log.info("wrote %s", snakemake.output[0])  # noqa: F821
except Exception:
    log.exception("summary failed")
    raise
