"""Snakemake adapter: the confirmatory test's page (kvdiverge.report.pages.confirmatory_html) from its table."""

import polars as pl

from kvdiverge.io.files import write_text_atomic
from kvdiverge.jobs.rulelog import rule_log
from kvdiverge.report.pages import confirmatory_html

p = snakemake.params
with rule_log(snakemake.log[0], "confirmatory_page"):
    result = pl.read_parquet(snakemake.input[0])
    write_text_atomic(confirmatory_html(dict(p.plan), result, confidence=p.confidence), snakemake.output[0])
