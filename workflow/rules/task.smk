# Stage: a task score beside every measurement (config `task`, kvdiverge.data.tasks).
# The prompts stage builds the task's prompts (RULER's single needle in each document);
# the coupled run decodes them greedily, so each trajectory row holds both greedy answers.
# Per model: the answers scored, accuracy per run with document-bootstrap intervals, the
# rank correlations across the frontier's points between the accuracy drop and each
# coupled measure, the per-document ROC AUC, and the figure, under {results_dir}/analysis/task/.
# These measures come from the generation that writes the answer: the answer's own divergence,
# not a prediction (workflow/rules/prediction.smk asks for one, on other documents).

if TASK_RUNS:

    rule task:
        input:
            prompts=rules.prompts.output[0],
            model=converted_model,
            shards=task_shards,
            estimates=task_estimates,
        output:
            **{name: f"{TASK_DIR}/{name}.parquet" for name in TASK_TABLES},
            **{f"{name}_csv": f"{TASK_DIR}/{name}.csv" for name in TASK_TABLES if name != "accuracy"},
            accuracy_csv=report(
                f"{TASK_DIR}/accuracy.csv",
                caption="../report/task.rst",
                category="Task",
                labels={"model": "{model}", "table": "accuracy"},
            ),
            png=report(
                f"{TASK_DIR}/task.png",
                caption="../report/task.rst",
                category="Task",
                labels={"model": "{model}", "table": "figure"},
            ),
            pdf=f"{TASK_DIR}/task.pdf",
        log:
            f"{LOGS}/task/{{model}}.log",
        benchmark:
            benchmark_file("task/{model}")
        params:
            model=lambda wildcards: canonical(CONFIG["models"][wildcards.model]),
            task=canonical(CONFIG["task"]),
            controls=TASK_CONTROLS,
            floor=FLOOR,
            **ANALYSIS_PARAMS,
        conda:
            CONDA_ENV
        script:
            "../scripts/task.py"
