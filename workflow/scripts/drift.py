"""Snakemake adapter: length and loop drift per policy (kvdiverge.estimation.drift.drift_table, length_survival)."""

import polars as pl

from kvdiverge.estimation.bootstrap import Bootstrap
from kvdiverge.estimation.drift import drift_table, length_survival, no_stop_note
from kvdiverge.io.files import save_table
from kvdiverge.jobs.rulelog import rule_log

p = snakemake.params
out = snakemake.output
with rule_log(snakemake.log[0], "drift", "length and loop drift") as log:
    reps = pl.concat([pl.read_parquet(f) for f in snakemake.input], how="vertical")
    table = drift_table(reps, Bootstrap(**p.boot))
    for note in no_stop_note(table):
        log.warning(note)
    log.info(
        "\n%s", table.select("model", "policy", "split", "measure", "full", "compressed", "diff", "diff_lo", "diff_hi")
    )
    save_table(table, out.parquet, out.csv)
    save_table(length_survival(reps), out.survival_parquet, out.survival_csv)
