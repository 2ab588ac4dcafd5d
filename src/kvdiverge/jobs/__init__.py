"""The workflow's jobs: what each Snakemake job reads, and the job itself.

One typed settings object per job, handed to it as its rule's params
(:mod:`~kvdiverge.jobs.params`); the shard job (:mod:`~kvdiverge.jobs.shard`), the
teacher-forced job (:mod:`~kvdiverge.jobs.teacher`) and the prediction study's task job
(:mod:`~kvdiverge.jobs.prediction`); a job's GPU (:mod:`~kvdiverge.jobs.devices`) and its
rule's ``log:`` file (:mod:`~kvdiverge.jobs.rulelog`).
"""
