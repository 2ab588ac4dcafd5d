"""Snakemake adapter: one trajectory shard of each of the job's policies (kvdiverge.study.shard.run_shard).

A CUDA model is bound to a free GPU of its own for the duration of the shard
(kvdiverge.study.devices.bind_device: one lock per device), so that local generation jobs
never share a GPU.
"""

import torch

from kvdiverge.study.config import validate
from kvdiverge.study.devices import bind_device
from kvdiverge.study.models import local_entry
from kvdiverge.study.rulelog import rule_log
from kvdiverge.study.shard import run_shard

torch.set_num_threads(snakemake.threads)
w = snakemake.wildcards
with rule_log(snakemake.log[0], "trajectories", "trajectory shard") as log:
    # Snakemake hands the job its config as read from the files: the workflow's validation
    # (common.smk: defaults filled, the frontier's policies expanded) is made again here
    config = validate(snakemake.config)
    spec = config["models"][w.model]
    if snakemake.input.model:
        spec = local_entry(spec, snakemake.input.model)
    with bind_device(str(spec.get("device", "cpu"))) as device:
        frame = run_shard(
            config,
            w.model,
            list(snakemake.params.policies),
            snakemake.params.split,
            snakemake.params.shard,
            snakemake.input.prompts,
            list(snakemake.output),
            model_spec={**spec, "device": device},
        )
    log.info("wrote %s: %d rows", ", ".join(snakemake.output), frame.height)
