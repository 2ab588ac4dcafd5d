# Teacher-forced fidelity per (model, policy, split) — kvdiverge.engine.forced, kvdiverge.estimation.teacher_forced
# (docs/teacher-forced.md). Each run's documents get a continuation (the corpus text after the
# excerpt, else the full-cache model's greedy continuation) fed to both sides after the
# coupled run's prefill; per position KL(P||Q), Δp, top-1 agreement, both log-likelihoods.
# The `teacher_forced` table beside `pool`: llama.cpp's --kl-divergence statistics per
# (model, policy, split) with document-bootstrap intervals and the noise floor beside each
# policy; `teacher_forced_documents` holds the headline means per document (joins on doc_id).

import kvdiverge.study.teacher

TEACHER_POSITIONS = f"{RESULTS}/teacher_forced/{{model}}/{{policy}}/{{split}}.parquet"


# Teacher-forced positions of every run (the control and the noise floor included).
TEACHER_FILES = [TEACHER_POSITIONS.format(model=m, policy=p, split=s) for m, p, s in RUNS]


rule teacher_forced:
    input:
        prompts=PROMPTS,
        corpus=CORPUS,
        model=converted_model,
    output:
        TEACHER_POSITIONS,
    log:
        f"{LOGS}/teacher_forced/{{model}}/{{policy}}/{{split}}.log",
    params:
        # model and policy entries, seed, control documents, the teacher_forced section
        # (no decoding setting, replicates or shards)
        settings=lambda wildcards: kvdiverge.study.teacher.teacher_settings(
            config, wildcards.model, wildcards.policy, wildcards.split
        ),
    threads: 1
    resources:
        gpu=lambda wildcards: 1 if model_on_gpu(wildcards.model) else 0,
        mem_mb=lambda wildcards: 64000 if model_on_gpu(wildcards.model) else 6000,
        runtime=lambda wildcards: 240 if model_on_gpu(wildcards.model) else 60,
    conda:
        CONDA_ENV
    script:
        "../scripts/teacher_forced.py"


rule teacher_forced_table:
    input:
        TEACHER_FILES,
    output:
        parquet=f"{ANALYSIS}/teacher_forced.parquet",
        csv=f"{ANALYSIS}/teacher_forced.csv",
        documents_parquet=f"{ANALYSIS}/teacher_forced_documents.parquet",
        documents_csv=f"{ANALYSIS}/teacher_forced_documents.csv",
    log:
        f"{LOGS}/analysis/teacher_forced.log",
    params:
        seed=canonical(config["seed"]),
        bootstrap=canonical(config["analysis"]["bootstrap"]),
        confidence=canonical(config["analysis"]["confidence"]),
        floor=(config["runs"].get("floor") or {}).get("policy"),
    threads: 1
    resources:
        mem_mb=4000,
        runtime=30,
    conda:
        CONDA_ENV
    script:
        "../scripts/teacher_forced.py"


ALL_TARGETS.extend([f"{ANALYSIS}/teacher_forced.parquet", f"{ANALYSIS}/teacher_forced_documents.parquet"])
