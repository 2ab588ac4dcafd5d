"""Snakemake adapter: the provenance table of every run, from its shards (kvdiverge.study.provenance)."""

from kvdiverge.io.files import save_table
from kvdiverge.study.provenance import provenance_table, read_provenance, study_hash
from kvdiverge.study.rulelog import rule_log

with rule_log(snakemake.log[0], "provenance", "provenance table") as log:
    table = provenance_table(read_provenance(p) for p in snakemake.input)
    log.info("%d runs from %d shards; study settings hash %s", table.height, len(snakemake.input), study_hash(table))
    log.info("\n%s", table.drop("settings"))
    save_table(table, snakemake.output.parquet, snakemake.output.csv)
