"""Snakemake adapter: the teacher-forced pass of every run of one model (kvdiverge.jobs.teacher).

Rule teacher_forced reads its settings from ``params.settings`` (kvdiverge.jobs.params.TeacherSettings,
its rerun key) and writes one per-position table per run, atomically, in the order of its runs.
"""

import polars as pl
import torch

from kvdiverge.io.files import write_parquet_atomic
from kvdiverge.jobs.params import TeacherSettings, job_model_entry
from kvdiverge.jobs.rulelog import rule_log
from kvdiverge.jobs.teacher import run_teacher_forced

torch.set_num_threads(snakemake.threads)
settings = TeacherSettings.from_params(snakemake.params.settings)
paths = {"prompts": snakemake.input.prompts, "corpus": snakemake.input.corpus}
with rule_log(snakemake.log[0], snakemake.rule) as log:
    with job_model_entry(settings.model_entry(), snakemake.input.model) as spec:
        frame = run_teacher_forced(settings, paths, model_spec=spec)
    for (policy, split), path in zip(settings.runs, snakemake.output):
        write_parquet_atomic(frame.filter((pl.col("policy") == policy) & (pl.col("split") == split)), path)
    log.info("wrote %d runs: %d positions", len(settings.runs), frame.height)
