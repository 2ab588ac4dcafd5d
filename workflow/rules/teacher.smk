# Teacher-forced fidelity per (model, policy, split) — kvdiverge.engine.forced, kvdiverge.estimation.teacher_forced
# (docs/teacher-forced.md). Each run's documents get a continuation (the corpus text after the
# excerpt, else the full-cache model's greedy continuation) fed to both sides after the
# coupled run's prefill; per position KL(P||Q), Δp, top-1 agreement, both log-likelihoods.
# The `teacher_forced` table beside `pool`: llama.cpp's --kl-divergence statistics per
# (model, policy, split) with document-bootstrap intervals and the noise floor beside each
# policy; `teacher_forced_documents` holds the headline means per document (joins on doc_id).


rule teacher_forced:
    input:
        prompts=rules.prompts.output[0],
        corpus=rules.corpus.output[0],
        model=converted_model,
    output:
        f"{RESULTS}/teacher_forced/{{model}}/{{policy}}/{{split}}.parquet",
    log:
        f"{LOGS}/teacher_forced/{{model}}/{{policy}}/{{split}}.log",
    benchmark:
        benchmark_file("teacher_forced/{model}/{policy}/{split}")
    params:
        # what the job reads, its rerun key: model and policy entries, seed, control documents,
        # the corpus and teacher_forced sections (no decoding setting, replicates or shards)
        settings=teacher_job,
    resources:
        **generation_resources(),
    conda:
        CONDA_ENV
    script:
        "../scripts/teacher_forced.py"


# The frontier's points of one model in one job (as rule frontier_trajectories): one model load,
# each document prefilled once for every point and its reference side run once.
if FRONTIER_POINTS:

    ruleorder: teacher_forced_frontier > teacher_forced

    rule teacher_forced_frontier:
        input:
            prompts=rules.prompts.output[0],
            corpus=rules.corpus.output[0],
            model=converted_model,
        output:
            expand(
                rules.teacher_forced.output[0], policy=FRONTIER_POLICIES, split=FRONTIER_SPLIT, allow_missing=True
            ),
        log:
            f"{LOGS}/teacher_forced/{{model}}/{FRONTIER_SPLIT}/frontier.log",
        benchmark:
            benchmark_file(f"teacher_forced_frontier/{{model}}/{FRONTIER_SPLIT}")
        params:
            # what the job reads, its rerun key: as rule teacher_forced's, for every frontier point
            settings=teacher_job,
        resources:
            **generation_resources(),
        conda:
            CONDA_ENV
        script:
            "../scripts/teacher_forced.py"


rule teacher_forced_table:
    input:
        # the positions of every run (the control and the noise floor included)
        run_files(rules.teacher_forced.output[0]),
    output:
        parquet=f"{ANALYSIS}/teacher_forced.parquet",
        csv=table_report(f"{ANALYSIS}/teacher_forced.csv", "teacher_forced", "teacher-forced fidelity"),
        documents_parquet=f"{ANALYSIS}/teacher_forced_documents.parquet",
        documents_csv=f"{ANALYSIS}/teacher_forced_documents.csv",
    log:
        f"{LOGS}/analysis/teacher_forced.log",
    benchmark:
        benchmark_file("teacher_forced_table/teacher_forced_table")
    params:
        floor=FLOOR,
        **ANALYSIS_PARAMS,
    conda:
        CONDA_ENV
    script:
        "../scripts/teacher_forced_table.py"
