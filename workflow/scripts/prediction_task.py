"""Snakemake adapter: one task side of the prediction study on one model (kvdiverge.plan, then its run).

The job reads its settings from ``params.settings`` (kvdiverge.jobs.prediction.PredictionTaskSettings,
its rerun key): every frontier point runs greedily on the task prompts of the prediction split's
documents, planned (and checked) with the tokenizer before the weights load, and the scored answers
per (point, document) are written atomically, with the task, its question placement and the task's
exclusions in the log.
"""

import warnings

import polars as pl
import torch

import kvdiverge
from kvdiverge.io.files import write_parquet_atomic
from kvdiverge.jobs.params import job_model_entry
from kvdiverge.jobs.prediction import PredictionTaskSettings
from kvdiverge.jobs.rulelog import rule_log
from kvdiverge.models.loading import load_model, load_tokenizer

torch.set_num_threads(snakemake.threads)
settings = PredictionTaskSettings.from_params(snakemake.params.settings)
options = settings.measure_options()
with rule_log(snakemake.log[0], snakemake.rule, "prediction task side") as log:
    corpus = pl.read_parquet(snakemake.input.corpus).filter(pl.col("split") == settings.split).sort("doc_id")
    prompts = dict(zip(corpus["doc_id"].to_list(), corpus["text"].to_list()))
    log.info("%s on %s: %d documents of split %s", settings.side, settings.model, len(prompts), settings.split)
    with job_model_entry(settings.entries["model"], snakemake.input.model) as spec:
        tokenizer = load_tokenizer(spec, settings.model)
        presses = {name: dict(entry) for name, entry in settings.entries["frontier"]["presses"].items()}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plan = kvdiverge.plan(prompts, presses, tokenizer=tokenizer, **options)
            model, tokenizer = load_model(spec, settings.model, tokenizer=tokenizer)
            result = plan.run(model)
    for w in caught:
        log.info("%s", w.message)
    task = dict(settings.entries["task"])
    answers = result.task["documents"].with_columns(
        task=pl.lit(task.get("name", "niah")), placement=pl.lit(task.get("question", "inside"))
    )
    write_parquet_atomic(answers, snakemake.output[0])
    log.info(
        "accuracy per point:\n%s",
        result.task["accuracy"].select("policy", "n_docs", "full_accuracy", "accuracy", "drop"),
    )
