"""Snakemake adapter: exploratory gap decomposition (kvdiverge.estimation.tables.gaps)."""

from kvdiverge.estimation.analysis import save_table
from kvdiverge.estimation.estimators import read_estimates
from kvdiverge.estimation.tables import gaps
from kvdiverge.study.rulelog import rule_logger

log = rule_logger(snakemake.log[0], "gaps")
p = snakemake.params
try:
    files = list(snakemake.input)
    docs = read_estimates(files) if files else None  # refuses non-finite inputs
    table = gaps(docs, p.gaps, p.bootstrap, p.confidence, p.seed, split="exploratory", models=p.models, progress=True)
    save_table(table, snakemake.output.parquet, snakemake.output.csv)
except Exception:
    log.exception("gap decomposition failed")
    raise
