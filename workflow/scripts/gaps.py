"""Snakemake adapter: exploratory gap decomposition (kvdiverge.estimation.tables.gaps)."""

from kvdiverge.estimation.analysis import save_table
from kvdiverge.estimation.estimators import read_estimates
from kvdiverge.estimation.tables import gaps
from kvdiverge.study.rulelog import rule_log

p = snakemake.params
with rule_log(snakemake.log[0], "gaps", "gap decomposition") as log:
    files = list(snakemake.input)
    docs = read_estimates(files) if files else None  # refuses non-finite inputs
    table = gaps(docs, p.gaps, p.bootstrap, p.confidence, p.seed, split="exploratory", models=p.models, progress=True)
    save_table(table, snakemake.output.parquet, snakemake.output.csv)
