"""Snakemake adapter: the prediction study's tables and figure for one model
(kvdiverge.estimation.prediction.prediction_study, kvdiverge.report.prediction).

The fidelity side is the frontier's points on its split: the coupled estimates, the teacher-forced
documents and positions. The CPU time per point of the coupled measures comes from the frontier
split's shard jobs' benchmark files (Snakemake's ``cpu_time``, seconds), shared by the (run, document)
pairs they served, that of the
teacher-forced ones (the teacher-forced table's float columns and ``kld_p99``) from the split's
teacher-forced job, shared by the (run, document) pairs it served, and that of the measures
prefixed ``reconstruction_`` from the reconstruction pass's job, the same way. Beside the study: the
prediction table without each press in turn (point estimates and permutation p-values, no
bootstrap), each task's chance level in the accuracy table, and the analysis's inputs (``fidelity``,
``task``, ``points``), from which the point estimates and p-values rebuild.
"""

import dataclasses
from pathlib import Path

import polars as pl

from kvdiverge.data.tasks import task_settings
from kvdiverge.estimation.bootstrap import Bootstrap
from kvdiverge.estimation.prediction import PredictionSettings, prediction_study
from kvdiverge.estimation.prediction_inputs import RECONSTRUCTION_PREFIX, fidelity_documents, frontier_points_table
from kvdiverge.estimation.prediction_review import chance_accuracy, cpu_per_point, prediction_without
from kvdiverge.io.files import save_table
from kvdiverge.jobs.rulelog import rule_log
from kvdiverge.report.prediction import plot_prediction

i, o, p = snakemake.input, snakemake.output, snakemake.params
model = pl.col("model") == snakemake.wildcards.model
with rule_log(snakemake.log[0], "prediction", "prediction analysis") as log:
    points = frontier_points_table(pl.read_parquet(i.frontier).filter(model))
    positions = pl.concat([pl.read_parquet(f, columns=["model", "policy", "doc_id", "kld"]) for f in i.positions])
    documents, teacher = (pl.read_parquet(f).filter(model) for f in (i.documents, i.teacher))
    reconstruction = (
        pl.concat([pl.read_parquet(f) for f in i.reconstruction]).filter(model) if i.reconstruction else None
    )
    fidelity = fidelity_documents(documents, teacher, positions.filter(model), reconstruction=reconstruction)
    fidelity = fidelity.filter(pl.col("point").is_in(list(p.points)))
    task = pl.concat([pl.read_parquet(f).filter(model) for f in i.answers], how="diagonal_relaxed")
    task = task.rename({"policy": "point"})
    settings = PredictionSettings(boot=Bootstrap(**p.boot), n_perm=p.n_perm, min_full_accuracy=p.min_full_accuracy)
    chance = {}
    for block in dict(p.tasks).values():
        found, values = task_settings(dict(block))
        chance[found.name] = chance_accuracy(found.name, dataclasses.asdict(values))
    measures = list(p.measures)
    study = prediction_study(fidelity, task, points, measures, settings=settings, chance=chance)
    cpu = {
        family: sum(pl.read_csv(f, separator="\t")["cpu_time"].sum() for f in files)
        for family, files in dict(p.costs).items()
        if files and all(Path(f).exists() for f in files)  # none where a benchmark file is missing
    }
    # the split's shard and teacher-forced jobs served every run of the split (the points, the controls, any other policy)
    of_split = pl.col("split") == p.split
    served = {"coupled": documents.filter(of_split), "teacher": teacher.filter(of_split)}
    if reconstruction is not None:
        served["reconstruction"] = reconstruction.unique(["policy", "doc_id"])
    cost = {family: cpu_per_point(seconds, served[family], list(p.points)) for family, seconds in cpu.items()}
    teacher_measures = [c for c, dtype in teacher.schema.items() if dtype.is_float()] + ["kld_p99"]
    family = (
        pl.when(pl.col("measure").str.starts_with(RECONSTRUCTION_PREFIX))
        .then(pl.lit("reconstruction"))
        .when(pl.col("measure").is_in(teacher_measures))
        .then(pl.lit("teacher"))
        .otherwise(pl.lit("coupled"))
    )
    tables = study.tables()
    tables["prediction"] = tables["prediction"].with_columns(
        cpu_s_per_point=family.replace_strict(cost, default=None, return_dtype=pl.Float64)
    )
    no_boot = dataclasses.replace(settings, boot=dataclasses.replace(settings.boot, n_boot=0))
    tables["without"] = pl.concat(
        [
            prediction_without(fidelity, task, points, measures, leave_out=[press], settings=no_boot)
            for press in points["press"].unique(maintain_order=True).to_list()
        ],
        how="diagonal_relaxed",
    )
    # the inputs beside the results: the point estimates and p-values rebuild from them alone (docs/task.md)
    tables |= {"fidelity": fidelity, "task": task, "points": points}
    for name, table in tables.items():
        save_table(table, o[f"{name}_parquet"], o[f"{name}_csv"])
    sides = study.accuracy.group_by("task", "placement", "refused").agg(pl.col("full_accuracy").first())
    log.info("full-cache accuracy per task side (refused below %g):\n%s", p.min_full_accuracy, sides)
    log.info("CPU seconds per point: %s", cost)
    log.info("\n%s", tables["prediction"].select("measure", "task", "placement", "kendall_within_ratio",
                                                 "p_kendall_within_ratio_holm", "mae_gain", "p_mae_gain_holm",
                                                 "spearman_given_ratio"))  # fmt: skip
    plot_prediction(study.prediction, study.predictions, o.png, o.pdf)
