"""Snakemake adapter: one figure of the study, PNG and PDF (kvdiverge.report's survival, analyses, frontier, speculative), by its name
(the `figure` wildcard; workflow/rules/common.smk FIGURE_TABLE names its tables and settings)."""

import polars as pl

from kvdiverge.jobs.rulelog import rule_log
from kvdiverge.report import analyses, frontier, speculative, survival


def read(name):
    return pl.read_parquet(snakemake.input[name])


# each figure's drawing, from its tables (by name) and settings, to (png, pdf)
DRAW = {
    "survival": lambda s, out: survival.plot_survival(read("survival"), *out, floor=s["floor"]),
    "gap_decomposition": lambda s, out: analyses.plot_gaps(read("gaps"), *out),
    "branch_tv": lambda s, out: analyses.plot_branch_tv(read("branch_tv"), *out, early=s["early"], late=s["late"]),
    "confirmatory_differences": lambda s, out: analyses.plot_confirmatory(
        read("confirmatory_documents"), read("confirmatory"), *out
    ),
    "variance": lambda s, out: analyses.plot_variance(read("variance"), *out),
    "speculative": lambda s, out: speculative.plot_speculative(read("speculative"), *out, floor=s["floor"]),
    "frontier": lambda s, out: frontier.plot_frontier(read("frontier"), *out),
    "length": lambda s, out: survival.plot_length(read("length_survival"), *out, floor=s["floor"]),
}

name = snakemake.wildcards.figure
with rule_log(snakemake.log[0], "figure", f"figure {name}") as log:
    DRAW[name](dict(snakemake.params.settings), (snakemake.output.png, snakemake.output.pdf))
    log.info("wrote %s", list(snakemake.output))
