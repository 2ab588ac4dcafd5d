"""Snakemake adapter: the teacher-forced tables of every run (kvdiverge.estimation.teacher_forced: summary_table,
document_table); the documents without a key position (kvdiverge.estimation.key_tokens) counted in the log."""

import polars as pl

from kvdiverge.estimation.bootstrap import Bootstrap
from kvdiverge.estimation.key_tokens import missing_key_lines
from kvdiverge.estimation.teacher_forced import document_table, summary_table
from kvdiverge.io.files import save_table
from kvdiverge.jobs.rulelog import rule_log

out, p = snakemake.output, snakemake.params
with rule_log(snakemake.log[0], "teacher_forced_table") as log:
    positions = pl.concat([pl.read_parquet(f) for f in snakemake.input])
    summary = summary_table(positions, floor=p.floor, boot=Bootstrap(**p.boot))
    save_table(summary, out.parquet, out.csv)
    save_table(document_table(positions), out.documents_parquet, out.documents_csv)
    log.info(
        "%d runs, %d positions\n%s",
        summary.height,
        positions.height,
        summary.select("model", "policy", "split", "kld_mean", "ppl_ratio", "same_top_p"),
    )
    for line in missing_key_lines(summary):
        log.warning("%s", line)
