"""Snakemake adapter: one trajectory shard of each of the job's policies (kvdiverge.study.shard.run_shard).

A CUDA model is bound to a free GPU of its own for the duration of the shard
(kvdiverge.study.devices.bind_device: one lock per device), so that local generation jobs
never share a GPU.
"""

import torch

from kvdiverge.study.devices import bind_device
from kvdiverge.study.models import local_entry
from kvdiverge.study.rulelog import rule_logger
from kvdiverge.study.shard import run_shard

log = rule_logger(snakemake.log[0], "trajectories")
torch.set_num_threads(snakemake.threads)
w = snakemake.wildcards
spec = snakemake.config["models"][w.model]
if snakemake.input.model:
    spec = local_entry(spec, snakemake.input.model)
try:
    with bind_device(str(spec.get("device", "cpu"))) as device:
        spec = {**spec, "device": device}
        frame = run_shard(
            snakemake.config,
            w.model,
            list(snakemake.params.policies),
            snakemake.params.split,
            snakemake.params.shard,
            snakemake.input.prompts,
            list(snakemake.output),
            model_spec=spec,
        )
    log.info("wrote %s: %d rows", ", ".join(snakemake.output), frame.height)
except Exception:
    log.exception("trajectory shard failed")
    raise
