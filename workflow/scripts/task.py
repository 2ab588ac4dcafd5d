"""Snakemake adapter: the task's tables and figure (kvdiverge.data.tasks.tables, kvdiverge.report.task)."""

import polars as pl

from kvdiverge.data.tasks import task_settings
from kvdiverge.data.tasks.tables import TASK_TABLES, TaskTableOptions, task_tables
from kvdiverge.estimation.bootstrap import Bootstrap
from kvdiverge.io.files import save_table
from kvdiverge.jobs.rulelog import rule_log
from kvdiverge.models.loading import load_tokenizer, local_entry
from kvdiverge.report.task import plot_task

i, o, p = snakemake.input, snakemake.output, snakemake.params
with rule_log(snakemake.log[0], "task", "task stage") as log:
    spec = dict(p.model)
    if i.model:
        spec = local_entry(spec, i.model)
    tokenizer = load_tokenizer(spec, snakemake.wildcards.model)
    task, _ = task_settings(p.task)
    tables = task_tables(
        pl.concat([pl.read_parquet(f) for f in i.shards], how="diagonal_relaxed"),
        pl.concat([pl.read_parquet(f) for f in i.estimates], how="diagonal_relaxed"),
        pl.read_parquet(i.prompts),
        tokenizer,
        task.score,
        options=TaskTableOptions(controls=p.controls, floor=p.floor, boot=Bootstrap(**p.boot)),
    )
    for name in TASK_TABLES:
        save_table(tables[name], o[name], o[f"{name}_csv"])
    acc = tables["accuracy"]
    log.info("accuracy:\n%s", acc.select("policy", "n_docs", "full_accuracy", "accuracy", "drop", "drop_lo", "drop_hi"))
    log.info("correlations:\n%s", tables["correlations"])
    log.info("auc:\n%s", tables["auc"])
    plot_task(acc, tables["correlations"], o.png, o.pdf, controls=p.controls)
    log.info("wrote %s", list(o))
