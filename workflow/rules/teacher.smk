# Teacher-forced fidelity per (model, policy, split) — kvdiverge.engine.forced, kvdiverge.estimation.teacher_forced
# (docs/teacher-forced.md). Each run's documents get a continuation (the corpus text after the
# excerpt, else the full-cache model's greedy continuation) fed to both sides after the
# coupled run's prefill; per position KL(P||Q), Δp, top-1 agreement, both log-likelihoods.
# teacher_forced.target: reconstruction feeds instead a repeat instruction in the model's chat
# template, then the excerpt's own text (KVzip); on either target LongPPL's key tokens are marked
# from one short-context forward per document (teacher_forced.key_tokens).
# One job per (model, split) writes the positions of every run of the split. The split's shard jobs
# compute them on their documents before their coupled runs, on the prefills those runs then take
# (kvdiverge.jobs.positions), with the job's settings (an environment variable: common.smk's
# export_teacher_settings); the job gathers their files when they were made with its own settings (no
# model load), and otherwise runs the pass itself: one model load, and each document prefilled once and
# its reference side run once for every policy that runs on it. One rule per split
# (teacher_forced_<split>), as the shard jobs. Its rerun key is its own (teacher_job): the
# teacher_forced section reruns no trajectory shard, and a rerun shard job (decoding, replicates,
# shards, a changed policy) reruns the split's job, which gathers the new files.
# A llama_cpp model has no teacher-forced pass (TEACHER_RUNS, common.smk).
# The `teacher_forced` table beside `pool`: llama.cpp's --kl-divergence statistics per
# (model, policy, split) with document-bootstrap intervals and the noise floor beside each
# policy; `teacher_forced_documents` holds the headline means per document (joins on doc_id).


for _split, _policies in SPLIT_POLICIES.items():

    rule:
        name:
            f"teacher_forced_{_split}"
        input:
            prompts=rules.prompts.output[0],
            corpus=rules.corpus.output[0],
            model=converted_model,
            # the shard jobs' positions (gathered when made with this job's settings)
            shards=expand(SHARD_POSITIONS, split=_split, shard=SHARDS, allow_missing=True),
        output:
            expand(TEACHER, policy=_policies, split=_split, allow_missing=True),
        log:
            f"{LOGS}/teacher_forced/{{model}}/{_split}.log",
        benchmark:
            benchmark_file(f"teacher_forced/{{model}}/{_split}")
        params:
            # what the job reads, its rerun key: per run the model and policy entries, seed, control
            # documents, the corpus and teacher_forced sections (no decoding setting, replicates or shards)
            settings=teacher_job(_split),
        # after the shard jobs, which take longer; the longest first (TEACHER_PRIORITY, common.smk)
        priority: TEACHER_PRIORITY[_split]
        resources:
            # every run of the split in one job: its requests are the pass's own (GPU_REQUESTS)
            **generation_resources(rule="teacher_forced"),
        conda:
            CONDA_ENV
        script:
            "../scripts/teacher_forced.py"


rule teacher_forced_table:
    input:
        # the positions of every run (the control and the noise floor included) of a transformers model
        run_files(TEACHER, TEACHER_RUNS),
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
