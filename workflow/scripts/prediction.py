"""Snakemake adapter: the prediction study's tables and figure for one model
(kvdiverge.estimation.prediction.prediction_study, kvdiverge.report.prediction).

The fidelity side is the frontier's points on its split: the coupled estimates, the teacher-forced
documents and positions. The CPU time per point of the coupled measures comes from the frontier
shard jobs' benchmark files (Snakemake's ``cpu_time``, seconds) over the points, that of the
teacher-forced ones from the model's teacher-forced job over every run it served.
"""

from pathlib import Path

import polars as pl

from kvdiverge.estimation.bootstrap import Bootstrap
from kvdiverge.estimation.prediction import fidelity_documents, frontier_points_table, prediction_study
from kvdiverge.estimation.teacher_forced import HEADLINE
from kvdiverge.io.files import save_table
from kvdiverge.report.prediction import plot_prediction
from kvdiverge.study.rulelog import rule_log

i, o, p = snakemake.input, snakemake.output, snakemake.params
model = pl.col("model") == snakemake.wildcards.model
with rule_log(snakemake.log[0], "prediction", "prediction analysis") as log:
    points = frontier_points_table(pl.read_parquet(i.frontier).filter(model))
    positions = pl.concat([pl.read_parquet(f, columns=["model", "policy", "doc_id", "kld"]) for f in i.positions])
    tables = [pl.read_parquet(f).filter(model) for f in (i.documents, i.teacher)]
    fidelity = fidelity_documents(*tables, positions.filter(model)).filter(pl.col("point").is_in(list(p.points)))
    task = pl.concat([pl.read_parquet(f).filter(model) for f in i.answers], how="diagonal_relaxed")
    boot = Bootstrap(p.bootstrap, p.confidence, p.seed)
    study = prediction_study(fidelity, task.rename({"policy": "point"}), points, list(p.measures), boot=boot,
                             min_full_accuracy=p.min_full_accuracy)  # fmt: skip
    found = {family: [f for f in files if Path(f).exists()] for family, files in dict(p.costs).items()}
    cost = {  # None where a job's benchmark file is missing (its outputs came from elsewhere)
        family: sum(pl.read_csv(f, separator="\t")["cpu_time"].sum() for f in files) / p.cost_runs[family]
        if files
        else None
        for family, files in found.items()
    }
    teacher = pl.col("measure").is_in([*HEADLINE, "kld_p99", "kld_max"])
    study["prediction"] = study["prediction"].with_columns(
        cpu_s_per_point=pl.when(teacher)
        .then(pl.lit(cost["teacher"]))
        .otherwise(pl.lit(cost["coupled"]))
        .cast(pl.Float64)
    )
    for name in ("prediction", "predictions", "accuracy"):
        save_table(study[name], o[f"{name}_parquet"], o[f"{name}_csv"])
    sides = study["accuracy"].group_by("task", "placement", "refused").agg(pl.col("full_accuracy").first())
    log.info("full-cache accuracy per task side (refused below %g):\n%s", p.min_full_accuracy, sides)
    log.info("CPU seconds per point: %s", cost)
    log.info("\n%s", study["prediction"].select("measure", "task", "placement", "spearman", "spearman_given_ratio",
                                                 "mae_held_out", "mae_ratio_only", "mae_gain"))  # fmt: skip
    plot_prediction(study["prediction"], study["predictions"], o.png, o.pdf)
