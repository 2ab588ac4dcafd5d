"""Snakemake adapter: the teacher-forced pass of every run of one model (kvdiverge.jobs.teacher).

Rule teacher_forced reads its settings from ``params.settings`` (kvdiverge.jobs.params.TeacherSettings,
its rerun key) and writes one per-position table per run, atomically, in the order of its runs. It
gathers the shard jobs' positions when they were made with its settings (kvdiverge.jobs.positions:
no torch, no model), and runs the pass itself otherwise.
"""

import polars as pl

from kvdiverge.io.files import write_parquet_atomic
from kvdiverge.jobs.params import TeacherSettings, job_model_entry
from kvdiverge.jobs.positions import gather_positions
from kvdiverge.jobs.rulelog import rule_log

settings = TeacherSettings.from_params(snakemake.params.settings)
paths = {"prompts": snakemake.input.prompts, "corpus": snakemake.input.corpus}
with rule_log(snakemake.log[0], snakemake.rule) as log:
    # the shard jobs' positions: none for the prediction study's reconstruction pass (its own settings)
    frame = gather_positions(getattr(snakemake.input, "shards", []), settings)
    if frame is None:  # the pass itself; torch and the model only then
        import torch

        from kvdiverge.jobs.teacher import run_teacher_forced

        torch.set_num_threads(snakemake.threads)
        with job_model_entry(settings.model_entry(), snakemake.input.model) as spec:
            frame = run_teacher_forced(settings, paths, model_spec=spec)
    for (policy, split), path in zip(settings.runs, snakemake.output):
        write_parquet_atomic(frame.filter((pl.col("policy") == policy) & (pl.col("split") == split)), path)
    log.info("wrote %d runs: %d positions", len(settings.runs), frame.height)
