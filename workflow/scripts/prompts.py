"""Snakemake adapter: build results/prompts/{model}.parquet (kvdiverge.data.prompts)."""

import polars as pl

from kvdiverge.data.prompts import build_prompts, check_usable, summary
from kvdiverge.data.tasks import build_task_prompts
from kvdiverge.io.files import write_parquet_atomic
from kvdiverge.jobs.rulelog import rule_log
from kvdiverge.models.loading import context_length, load_model_config, load_tokenizer

with rule_log(snakemake.log[0], "prompts", "prompts stage") as log:
    name = snakemake.wildcards.model
    spec = dict(snakemake.params.model)
    log.info("model %s: %s", name, spec)
    tokenizer = load_tokenizer(spec, name)
    context = context_length(load_model_config(spec, name))
    log.info("context length: %d tokens", context)
    documents = pl.read_parquet(snakemake.input[0])
    settings = dict(snakemake.params.settings)
    build = build_task_prompts if settings.get("task") else build_prompts
    prompts = build(documents, tokenizer, settings, context)
    log.info("\n%s", summary(prompts))
    check_usable(prompts, dict(snakemake.params.settings))
    write_parquet_atomic(prompts, snakemake.output[0])
    log.info("wrote %s", snakemake.output[0])
