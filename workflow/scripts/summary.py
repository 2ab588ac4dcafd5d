"""Snakemake adapter: headline numbers as an HTML page for the report (kvdiverge.estimation.analysis)."""

import polars as pl

from kvdiverge.estimation.io import write_text_atomic
from kvdiverge.report.pages import summary_html
from kvdiverge.study.provenance import provenance_html
from kvdiverge.study.rulelog import rule_log

i = snakemake.input
with rule_log(snakemake.log[0], "summary") as log:
    html = summary_html(
        pl.read_parquet(i.pooled),
        pl.read_parquet(i.gaps),
        pl.read_parquet(i.confirmatory),
        dict(snakemake.params.plan),
        floor=pl.read_parquet(i.floor),
    )
    # settings hash and library versions of every run, at the end of the page
    html = html.replace("</body>", provenance_html(pl.read_parquet(i.provenance)) + "</body>", 1)
    write_text_atomic(html, snakemake.output[0])
    log.info("wrote %s", snakemake.output[0])
