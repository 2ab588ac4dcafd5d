"""Snakemake adapter: the teacher-forced pass of the job's policies on one (model, split) (kvdiverge.study.teacher).

Rule teacher_forced runs one policy, rule teacher_forced_frontier every frontier point of one
model in one pass; both read their settings from ``params.settings``
(kvdiverge.study.jobs.TeacherSettings, their rerun key) and write one per-position table per
policy, atomically.
"""

import polars as pl
import torch

from kvdiverge.io.files import write_parquet_atomic
from kvdiverge.study.jobs import TeacherSettings, job_model_entry
from kvdiverge.study.rulelog import rule_log
from kvdiverge.study.teacher import run_teacher_forced

torch.set_num_threads(snakemake.threads)
settings = TeacherSettings.from_params(snakemake.params.settings)
paths = {"prompts": snakemake.input.prompts, "corpus": snakemake.input.corpus}
with rule_log(snakemake.log[0], snakemake.rule) as log:
    with job_model_entry(settings.model_entry(), snakemake.input.model) as spec:
        frame = run_teacher_forced(settings, paths, model_spec=spec)
    for policy, path in zip(settings.policies, snakemake.output):
        write_parquet_atomic(frame.filter(pl.col("policy") == policy), path)
    log.info("wrote %d runs: %d positions", len(settings.policies), frame.height)
