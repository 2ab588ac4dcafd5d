"""Snakemake adapter: one trajectory shard (kvdiverge.trajectories.run_shard)."""

import logging
import sys

import torch

from kvdiverge.models import local_entry
from kvdiverge.trajectories import run_shard

logging.basicConfig(filename=snakemake.log[0], level=logging.INFO,  # noqa: F821
                    format="%(asctime)s %(levelname)s %(message)s")
log = logging.getLogger("trajectories")
sys.stderr = open(snakemake.log[0], "a", buffering=1)  # noqa: F821  (tqdm progress into the log)
torch.set_num_threads(snakemake.threads)  # noqa: F821
w = snakemake.wildcards  # noqa: F821
spec = snakemake.config["models"][w.model]  # noqa: F821
if snakemake.input.model:  # noqa: F821  (a GGUF model converted by rule convert_model)
    spec = local_entry(spec, snakemake.input.model)  # noqa: F821
try:
    frame = run_shard(snakemake.config, w.model, w.policy, w.split, snakemake.params.shard,  # noqa: F821
                      snakemake.input.prompts, snakemake.output[0], model_spec=spec)  # noqa: F821
    log.info("wrote %s: %d rows", snakemake.output[0], frame.height)  # noqa: F821
except Exception:
    log.exception("trajectory shard failed")
    raise
