# Stage: whether the frontier's task-agnostic fidelity predicts a task's accuracy drop (config
# `prediction`, kvdiverge.jobs.prediction, kvdiverge.estimation.prediction). The fidelity side is
# the frontier as the other stages run it (plain prompts, the config's decoding, the teacher-forced
# pass). Each task side (niah-inside, ...) runs every frontier point greedily on the documents of
# `prediction.split`, one job per (model, side) through kvdiverge.measure, and scores the answers;
# rule prediction joins both sides per model under {results_dir}/analysis/prediction/{model}/.
# A measure named reconstruction_<measure> reads the reconstruction pass (rule
# teacher_forced_reconstruction): the teacher-forced pass of the frontier's runs with the
# reconstruction target (kvdiverge.jobs.prediction.reconstruction_config), one job per model.

if PREDICTION_SIDES and RECONSTRUCTION_CONFIG:

    rule teacher_forced_reconstruction:
        input:
            prompts=rules.prompts.output[0],
            corpus=rules.corpus.output[0],
            model=converted_model,
        output:
            expand(RECONSTRUCTION, policy=FRONTIER_POLICIES, split=FRONTIER_SPLIT, allow_missing=True),
        log:
            f"{LOGS}/teacher_forced_reconstruction/{{model}}.log",
        benchmark:
            benchmark_file("teacher_forced_reconstruction/{model}")
        params:
            # its rerun key: the teacher-forced job's, with the reconstruction's target and length
            settings=reconstruction_job,
        resources:
            **generation_resources(rule="teacher_forced"),
        conda:
            CONDA_ENV
        script:
            "../scripts/teacher_forced.py"


if PREDICTION_SIDES:

    rule prediction_task:
        input:
            corpus=rules.corpus.output[0],
            model=converted_model,
        output:
            f"{PREDICTION_DIR}/answers-{{side}}.parquet",
        log:
            f"{LOGS}/prediction/{{model}}/{{side}}.log",
        benchmark:
            benchmark_file("prediction_task/{model}/{side}")
        params:
            # what the job reads, its rerun key (kvdiverge.jobs.prediction.PredictionTaskSettings)
            settings=prediction_task_job,
        resources:
            **generation_resources(),
        conda:
            CONDA_ENV
        script:
            "../scripts/prediction_task.py"

    rule prediction:
        input:
            answers=expand(rules.prediction_task.output[0], side=PREDICTION_SIDES, allow_missing=True),
            documents=rules.pool.output.documents_parquet,
            teacher=rules.teacher_forced_table.output.documents_parquet,
            positions=expand(TEACHER, policy=FRONTIER_POLICIES, split=FRONTIER_SPLIT, allow_missing=True),
            # the reconstruction pass's positions, where a measure reads them
            reconstruction=expand(RECONSTRUCTION, policy=FRONTIER_POLICIES, split=FRONTIER_SPLIT, allow_missing=True)
            if RECONSTRUCTION_CONFIG
            else [],
            frontier=rules.frontier.output.parquet,
        output:
            prediction_parquet=f"{PREDICTION_DIR}/prediction.parquet",
            prediction_csv=report(
                f"{PREDICTION_DIR}/prediction.csv",
                caption="../report/prediction.rst",
                category="Prediction",
                labels={"model": "{model}", "table": "prediction"},
            ),
            predictions_parquet=f"{PREDICTION_DIR}/predictions.parquet",
            predictions_csv=f"{PREDICTION_DIR}/predictions.csv",
            pairwise_parquet=f"{PREDICTION_DIR}/pairwise.parquet",
            pairwise_csv=f"{PREDICTION_DIR}/pairwise.csv",
            presses_parquet=f"{PREDICTION_DIR}/presses.parquet",
            presses_csv=f"{PREDICTION_DIR}/presses.csv",
            accuracy_parquet=f"{PREDICTION_DIR}/accuracy.parquet",
            accuracy_csv=f"{PREDICTION_DIR}/accuracy.csv",
            without_parquet=f"{PREDICTION_DIR}/without.parquet",
            without_csv=f"{PREDICTION_DIR}/without.csv",
            # the analysis's inputs: the fidelity measures per (point, document), the task answers, the points
            fidelity_parquet=f"{PREDICTION_DIR}/fidelity.parquet",
            fidelity_csv=f"{PREDICTION_DIR}/fidelity.csv",
            task_parquet=f"{PREDICTION_DIR}/task.parquet",
            task_csv=f"{PREDICTION_DIR}/task.csv",
            points_parquet=f"{PREDICTION_DIR}/points.parquet",
            points_csv=f"{PREDICTION_DIR}/points.csv",
            png=report(
                f"{PREDICTION_DIR}/prediction.png",
                caption="../report/prediction.rst",
                category="Prediction",
                labels={"model": "{model}", "table": "figure"},
            ),
            pdf=f"{PREDICTION_DIR}/prediction.pdf",
        log:
            f"{LOGS}/prediction/{{model}}/prediction.log",
        benchmark:
            benchmark_file("prediction/{model}")
        params:
            # the task blocks by side (each task's chance level)
            tasks=kvdiverge.jobs.prediction.prediction_sides(CONFIG),
            measures=CONFIG.get("prediction", {}).get("measures"),
            min_full_accuracy=CONFIG.get("prediction", {}).get("min_full_accuracy"),
            # the within-ratio permutations of each test (kvdiverge.estimation.prediction.PredictionSettings)
            n_perm=999,
            points=FRONTIER_POLICIES,
            split=FRONTIER_SPLIT,
            costs=prediction_costs,
            **ANALYSIS_PARAMS,
        conda:
            CONDA_ENV
        script:
            "../scripts/prediction.py"
