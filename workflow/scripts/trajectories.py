"""Snakemake adapter: one trajectory shard of each of the job's policies (kvdiverge.jobs.shard.run_shard).

The job reads its settings from ``params.settings`` (kvdiverge.jobs.params.ShardSettings, its
rerun key) and, besides them, how to batch: the config's ``generation`` section, which decides no
result; and the teacher-forced settings of its split (kvdiverge.jobs.positions.exported_settings;
none on a llama_cpp model), with which it runs the teacher-forced pass on its documents first. A
CUDA model is bound to a free GPU of its own for the duration of the shard
(kvdiverge.jobs.params.job_model_entry), so that local generation jobs never share a GPU. A model
of backend llama_cpp runs its GGUF file with the job's threads (torch's, set here).
"""

import torch

from kvdiverge.jobs.params import ShardSettings, job_model_entry
from kvdiverge.jobs.positions import ShardPass, exported_settings
from kvdiverge.jobs.rulelog import rule_log
from kvdiverge.jobs.shard import generation_options, run_shard

torch.set_num_threads(snakemake.threads)
settings = ShardSettings.from_params(snakemake.params.settings)
teacher = ShardPass(
    exported_settings(settings.model, settings.split), snakemake.input.corpus, snakemake.output.positions[0]
)
with rule_log(snakemake.log[0], snakemake.rule, "trajectory shard") as log:
    with job_model_entry(settings.model_entry(), snakemake.input.model) as spec:
        frame = run_shard(
            settings,
            snakemake.input.prompts,
            list(snakemake.output.shards),
            model_spec=spec,
            options=generation_options(snakemake.config.get("generation")),
            teacher=teacher,
        )
    log.info("wrote %s: %d rows", ", ".join(snakemake.output.shards), frame.height)
