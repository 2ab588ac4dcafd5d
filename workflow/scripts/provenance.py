"""Snakemake adapter: the provenance table of every run, from its shards (kvdiverge.study.provenance)."""

from kvdiverge.estimation.analysis import save_table
from kvdiverge.study.provenance import provenance_table, read_provenance, study_hash
from kvdiverge.study.rulelog import rule_logger

log = rule_logger(snakemake.log[0], "provenance")  # noqa: F821
try:
    table = provenance_table(read_provenance(p) for p in snakemake.input)  # noqa: F821
    log.info("%d runs from %d shards; study settings hash %s", table.height,
             len(snakemake.input), study_hash(table))  # noqa: F821
    log.info("\n%s", table.drop("settings"))
    save_table(table, snakemake.output.parquet, snakemake.output.csv)  # noqa: F821
except Exception:
    log.exception("provenance table failed")
    raise
