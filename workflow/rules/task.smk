# Stage: a task score beside every measurement (config `task`, kvdiverge.study.tasks).
# The prompts stage builds the task's prompts (RULER's single needle in each document);
# the coupled run decodes them greedily, so each trajectory row holds both greedy answers.
# Per model: the answers scored, accuracy per run with document-bootstrap intervals, the
# rank correlations across the frontier's points between the accuracy drop and each
# coupled measure, the per-document ROC AUC, and the figure, under {results_dir}/analysis/task/.

if config.get("task"):

    TASK_DIR = f"{RESULTS}/analysis/task/{{model}}"
    # left out of the correlations and AUC: the noise floor and the `none` control
    TASK_FLOOR = kvdiverge.study.config.floor_policy(config)
    # the frontier's split when there is a frontier (its points are the study's), else every split
    TASK_RUNS = [(m, p, s) for m, p, s in RUNS if FRONTIER_SPLIT is None or s == FRONTIER_SPLIT]
    TASK_CONTROLS = sorted({p for p in (TASK_FLOOR, (config["runs"].get("control") or {}).get("policy")) if p})

    rule task:
        input:
            prompts=PROMPTS,
            model=converted_model,
            shards=lambda wildcards: [
                f for m, p, s in TASK_RUNS if m == wildcards.model for f in trajectory_shards(m, p, s)
            ],
            estimates=lambda wildcards: [
                ESTIMATES.format(model=m, policy=p, split=s) for m, p, s in TASK_RUNS if m == wildcards.model
            ],
        output:
            **{name: f"{TASK_DIR}/{name}.parquet" for name in ("documents", "accuracy", "correlations", "auc")},
            **{f"{name}_csv": f"{TASK_DIR}/{name}.csv" for name in ("documents", "accuracy", "correlations", "auc")},
            png=f"{TASK_DIR}/task.png",
            pdf=f"{TASK_DIR}/task.pdf",
        log:
            f"{LOGS}/task/{{model}}.log",
        params:
            model=lambda wildcards: canonical(config["models"][wildcards.model]),
            task=canonical(config["task"]),
            controls=TASK_CONTROLS,
            floor=TASK_FLOOR,
            bootstrap=canonical(
                {
                    "n_boot": config["analysis"]["bootstrap"],
                    "confidence": config["analysis"]["confidence"],
                    "seed": config["seed"],
                }
            ),
        threads: 1
        resources:
            mem_mb=4000,
            runtime=30,
        conda:
            CONDA_ENV
        script:
            "../scripts/task.py"

    ALL_TARGETS.extend(expand(f"{TASK_DIR}/accuracy.parquet", model=MODELS))
