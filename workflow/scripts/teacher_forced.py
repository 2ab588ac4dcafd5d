"""Snakemake adapter: the teacher-forced pass of one run (rule teacher_forced), or its tables (rule teacher_forced_table).

teacher_forced: kvdiverge.study.teacher.run_teacher_forced on one (model, policy, split), the
per-position table written atomically; teacher_forced_frontier: the same for every frontier point
of one model in one pass, a table per point. teacher_forced_table: every run's positions through
kvdiverge.estimation.teacher_forced (summary_table, document_table).
"""

import polars as pl

from kvdiverge.io.files import save_table, write_parquet_atomic
from kvdiverge.study.rulelog import rule_log


def one_run():
    import torch

    from kvdiverge.study.config import validate
    from kvdiverge.study.devices import bind_device
    from kvdiverge.study.models import local_entry
    from kvdiverge.study.teacher import run_teacher_forced

    torch.set_num_threads(snakemake.threads)
    w = snakemake.wildcards
    # the config as the workflow validated it (defaults filled, the frontier's policies expanded)
    config = validate(snakemake.config)
    spec = config["models"][w.model]
    if snakemake.input.model:
        spec = local_entry(spec, snakemake.input.model)
    paths = {"prompts": snakemake.input.prompts, "corpus": snakemake.input.corpus}
    # one run (rule teacher_forced), or the frontier's points in one pass (rule teacher_forced_frontier)
    policies = list(snakemake.params.policies) if hasattr(snakemake.params, "policies") else [w.policy]
    split = snakemake.params.split if hasattr(snakemake.params, "split") else w.split
    with bind_device(str(spec.get("device", "cpu"))) as device:
        spec = {**spec, "device": device}
        frame = run_teacher_forced(config, w.model, policies, split, paths, model_spec=spec)
    for policy, path in zip(policies, snakemake.output):
        write_parquet_atomic(frame.filter(pl.col("policy") == policy), path)
    return f"wrote {len(policies)} runs: {frame.height} positions"


def tables():
    from kvdiverge.estimation.bootstrap import Bootstrap
    from kvdiverge.estimation.teacher_forced import document_table, summary_table

    out, p = snakemake.output, snakemake.params
    positions = pl.concat([pl.read_parquet(f) for f in snakemake.input])
    summary = summary_table(positions, floor=p.floor, boot=Bootstrap(p.bootstrap, p.confidence, p.seed))
    save_table(summary, out.parquet, out.csv)
    save_table(document_table(positions), out.documents_parquet, out.documents_csv)
    return f"{summary.height} runs, {positions.height} positions\n{summary.select('model', 'policy', 'split', 'kld_mean', 'ppl_ratio', 'same_top_p')}"


with rule_log(snakemake.log[0], snakemake.rule, snakemake.rule) as log:
    log.info("%s", tables() if snakemake.rule == "teacher_forced_table" else one_run())
