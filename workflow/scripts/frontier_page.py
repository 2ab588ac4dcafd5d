"""Snakemake adapter: the frontier's page (kvdiverge.report.pages.frontier_html) from its two tables."""

import polars as pl

from kvdiverge.io.files import write_text_atomic
from kvdiverge.jobs.rulelog import rule_log
from kvdiverge.report.pages import frontier_html

i = snakemake.input
with rule_log(snakemake.log[0], "frontier_page"):
    points, areas = pl.read_parquet(i.points), pl.read_parquet(i.areas)
    write_text_atomic(frontier_html(points, areas, snakemake.params.confidence), snakemake.output[0])
