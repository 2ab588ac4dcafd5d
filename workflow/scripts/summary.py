"""Snakemake adapter: headline numbers as an HTML page for the report (kvdiverge.report.pages.summary_html),
the provenance of every run (settings hash, library versions) its last section."""

import polars as pl

from kvdiverge.config.provenance import study_hash
from kvdiverge.io.files import write_text_atomic
from kvdiverge.jobs.rulelog import rule_log
from kvdiverge.report.pages import provenance_html, summary_html

i = snakemake.input
with rule_log(snakemake.log[0], "summary") as log:
    runs = pl.read_parquet(i.provenance)
    html = summary_html(
        pl.read_parquet(i.pooled),
        pl.read_parquet(i.gaps),
        pl.read_parquet(i.confirmatory),
        dict(snakemake.params.plan),
        floor=pl.read_parquet(i.floor),
        provenance=provenance_html(runs, study_hash(runs) if runs.height else None),
        confidence=snakemake.params.confidence,
    )
    write_text_atomic(html, snakemake.output[0])
    log.info("wrote %s", snakemake.output[0])
