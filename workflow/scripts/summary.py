"""Snakemake adapter: headline numbers as an HTML page for the report (kvdiverge.analysis)."""

import polars as pl

from kvdiverge.analysis import summary_html
from kvdiverge.io import write_text_atomic
from kvdiverge.provenance import provenance_html
from kvdiverge.rulelog import rule_logger

log = rule_logger(snakemake.log[0], "summary")  # noqa: F821
i = snakemake.input  # noqa: F821
try:
    html = summary_html(pl.read_parquet(i.pooled), pl.read_parquet(i.gaps), pl.read_parquet(i.confirmatory),
                        dict(snakemake.params.plan))  # noqa: F821
    # settings hash and library versions of every run, at the end of the page
    html = html.replace("</body>", provenance_html(pl.read_parquet(i.provenance)) + "</body>", 1)
    write_text_atomic(html, snakemake.output[0])  # noqa: F821
    log.info("wrote %s", snakemake.output[0])  # noqa: F821
except Exception:
    log.exception("summary failed")
    raise
