"""Snakemake adapter: the frontier table and ranking (kvdiverge.estimation.frontier.frontier_tables),
the KV bytes counted with each model's sizes, read from its config (kvdiverge.models.loading.entry_kv_sizes),
each point's teacher-forced headline (kvdiverge.estimation.teacher_forced.with_teacher_columns) and its length
ratio, compressed over full (kvdiverge.estimation.drift.with_drift_columns)."""

import polars as pl

from kvdiverge.estimation.bootstrap import Bootstrap
from kvdiverge.estimation.drift import length_ratios, with_drift_columns
from kvdiverge.estimation.estimators import read_estimates
from kvdiverge.estimation.frontier import FrontierPoint, frontier_tables
from kvdiverge.estimation.teacher_forced import with_teacher_columns
from kvdiverge.io.files import save_table
from kvdiverge.jobs.rulelog import rule_log
from kvdiverge.models.loading import entry_kv_sizes
from kvdiverge.report.formatting import frontier_text

p = snakemake.params
out = snakemake.output
with rule_log(snakemake.log[0], "frontier", "frontier analysis") as log:
    docs = read_estimates(list(snakemake.input.documents))
    grid = [FrontierPoint.of(point) for point in p.grid]
    sizes = {name: entry_kv_sizes(dict(entry), name) for name, entry in p.models.items()}
    log.info("KV sizes per model: %s", sizes)
    boot = Bootstrap(**p.boot)
    points, areas = frontier_tables(docs, grid, p.floor, boot, split=p.split, kv_sizes=sizes)
    points = with_teacher_columns(points, pl.read_parquet(snakemake.input.teacher))
    drift = pl.concat([pl.read_parquet(f) for f in snakemake.input.drift], how="vertical")
    points = with_drift_columns(points, length_ratios(drift, boot))
    log.info("\n%s", frontier_text(points, areas, boot.confidence))
    save_table(points, out.parquet, out.csv)
    save_table(areas, out.areas_parquet, out.areas_csv)
