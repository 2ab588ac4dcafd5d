"""Snakemake adapter: the provenance table of every run, from its shards (kvdiverge.config.provenance)."""

from kvdiverge.config.provenance import provenance_table, read_provenance, study_hash
from kvdiverge.io.files import save_table
from kvdiverge.jobs.rulelog import rule_log

with rule_log(snakemake.log[0], "provenance", "provenance table") as log:
    table = provenance_table(read_provenance(p) for p in snakemake.input)
    log.info("%d runs from %d shards; study settings hash %s", table.height, len(snakemake.input), study_hash(table))
    log.info("\n%s", table.drop("settings"))
    save_table(table, snakemake.output.parquet, snakemake.output.csv)
