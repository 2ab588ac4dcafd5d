"""Snakemake adapter: convert a GGUF model entry to a safetensors directory (kvdiverge.models.loading)."""

from kvdiverge.jobs.rulelog import rule_log
from kvdiverge.models.loading import convert_to_directory

with rule_log(snakemake.log[0], "convert_model", "model conversion") as log:
    entry = convert_to_directory(dict(snakemake.params.model), snakemake.output[0], snakemake.wildcards.model)
    log.info("converted %s -> %s", snakemake.wildcards.model, entry["path"])
