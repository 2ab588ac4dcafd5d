"""Snakemake adapter: the teacher-forced tables of every run (kvdiverge.estimation.teacher_forced: summary_table, document_table)."""

import polars as pl

from kvdiverge.estimation.bootstrap import Bootstrap
from kvdiverge.estimation.teacher_forced import document_table, summary_table
from kvdiverge.io.files import save_table
from kvdiverge.study.rulelog import rule_log

out, p = snakemake.output, snakemake.params
with rule_log(snakemake.log[0], "teacher_forced_table") as log:
    positions = pl.concat([pl.read_parquet(f) for f in snakemake.input])
    summary = summary_table(positions, floor=p.floor, boot=Bootstrap(p.bootstrap, p.confidence, p.seed))
    save_table(summary, out.parquet, out.csv)
    save_table(document_table(positions), out.documents_parquet, out.documents_csv)
    log.info(
        "%d runs, %d positions\n%s",
        summary.height,
        positions.height,
        summary.select("model", "policy", "split", "kld_mean", "ppl_ratio", "same_top_p"),
    )
