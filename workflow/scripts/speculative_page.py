"""Snakemake adapter: the self-speculative reading's page (kvdiverge.report.pages.speculative_html) from its table."""

import polars as pl

from kvdiverge.io.files import write_text_atomic
from kvdiverge.jobs.rulelog import rule_log
from kvdiverge.report.pages import speculative_html

with rule_log(snakemake.log[0], "speculative_page"):
    table = pl.read_parquet(snakemake.input[0])
    write_text_atomic(speculative_html(table, snakemake.params.confidence), snakemake.output[0])
