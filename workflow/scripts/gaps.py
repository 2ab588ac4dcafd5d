"""Snakemake adapter: exploratory gap decomposition (kvdiverge.estimation.tables.gaps)."""

from kvdiverge.estimation.bootstrap import Bootstrap
from kvdiverge.estimation.estimators import read_estimates
from kvdiverge.estimation.tables import gaps
from kvdiverge.io.files import save_table
from kvdiverge.jobs.rulelog import rule_log

p = snakemake.params
with rule_log(snakemake.log[0], "gaps", "gap decomposition") as log:
    files = list(snakemake.input)
    docs = read_estimates(files) if files else None  # refuses non-finite inputs
    boot = Bootstrap(**p.boot)
    table = gaps(docs, p.gaps, boot, split="exploratory", models=p.models, progress=True)
    save_table(table, snakemake.output.parquet, snakemake.output.csv)
