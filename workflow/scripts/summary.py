"""Snakemake adapter: headline numbers as an HTML page for the report (kvdiverge.analysis)."""

import logging

import polars as pl

from kvdiverge.analysis import summary_html
from kvdiverge.io import write_text_atomic

logging.basicConfig(filename=snakemake.log[0], level=logging.INFO,  # noqa: F821
                    format="%(asctime)s %(levelname)s %(message)s")
log = logging.getLogger("summary")
i = snakemake.input  # noqa: F821
try:
    html = summary_html(pl.read_parquet(i.pooled), pl.read_parquet(i.gaps), pl.read_parquet(i.confirmatory),
                        dict(snakemake.params.plan))  # noqa: F821
    write_text_atomic(html, snakemake.output[0])  # noqa: F821
    log.info("wrote %s", snakemake.output[0])  # noqa: F821
except Exception:
    log.exception("summary failed")
    raise
