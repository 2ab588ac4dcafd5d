# Stage 5: exploratory and confirmatory analyses — kvdiverge.estimation.timing, gap, floor, confirmatory (estimators.md §7-§8).
# Tables go to {results_dir}/analysis/ as parquet (full) and csv (scalar columns). The
# noise floor (config runs.floor) is compared with every policy of its splits
# (floor.parquet) and reported beside the confirmatory test. Every analysis with a
# document bootstrap takes ANALYSIS_PARAMS (seed, bootstrap, confidence; common.smk).

CONFIRMATORY_PLAN = CONFIG["confirmatory"]
# estimate tables the analyses read
GAP_RUNS = list(
    {
        (m, p, "exploratory")
        for m in MODELS
        for pair in CONFIG["analysis"]["gaps"]
        for p in pair
        if (m, p, "exploratory") in RUNS
    }
)
CONFIRMATORY_RUNS = [
    (m, p, "confirmatory")
    for m in MODELS
    for p in (CONFIRMATORY_PLAN["policy"], FLOOR)
    if p and (m, p, "confirmatory") in RUNS
]
ANALYSIS_TABLES = ["documents", "pooled", "timing", "survival", "branch_tv", "variance"]


rule pool:
    input:
        estimate_files(),
    output:
        **{f"{t}_parquet": f"{ANALYSIS}/{t}.parquet" for t in ANALYSIS_TABLES},
        documents_csv=f"{ANALYSIS}/documents.csv",
        pooled_csv=table_report(f"{ANALYSIS}/pooled.csv", "pooled", "pooled estimates"),
        timing_csv=table_report(f"{ANALYSIS}/timing.csv", "timing", "divergence timing"),
        survival_csv=f"{ANALYSIS}/survival.csv",
        branch_tv_csv=f"{ANALYSIS}/branch_tv.csv",
        variance_csv=table_report(f"{ANALYSIS}/variance.csv", "variance_table", "naive vs CMC variance"),
    log:
        f"{LOGS}/analysis/pool.log",
    benchmark:
        benchmark_file("pool/pool")
    params:
        **ANALYSIS_PARAMS,
    conda:
        CONDA_ENV
    script:
        "../scripts/pool.py"


rule gaps:
    input:
        sorted(run_files(rules.estimate.output.documents, GAP_RUNS)),
    output:
        parquet=f"{ANALYSIS}/gaps.parquet",
        csv=table_report(f"{ANALYSIS}/gaps.csv", "gaps_table", "gap decomposition"),
    log:
        f"{LOGS}/analysis/gaps.log",
    benchmark:
        benchmark_file("gaps/gaps")
    params:
        gaps=canonical(CONFIG["analysis"]["gaps"]),
        models=MODELS,
        **ANALYSIS_PARAMS,
    conda:
        CONDA_ENV
    script:
        "../scripts/gaps.py"


rule floor:
    input:
        estimate_files(),
    output:
        parquet=f"{ANALYSIS}/floor.parquet",
        csv=table_report(f"{ANALYSIS}/floor.csv", "floor", "noise floor beside each policy"),
    log:
        f"{LOGS}/analysis/floor.log",
    benchmark:
        benchmark_file("floor/floor")
    params:
        floor=FLOOR,
        **ANALYSIS_PARAMS,
    conda:
        CONDA_ENV
    script:
        "../scripts/floor.py"


rule confirmatory:
    input:
        run_files(rules.estimate.output.documents, CONFIRMATORY_RUNS),
    output:
        parquet=f"{ANALYSIS}/confirmatory.parquet",
        csv=f"{ANALYSIS}/confirmatory.csv",
        documents_parquet=f"{ANALYSIS}/confirmatory_documents.parquet",
        documents_csv=f"{ANALYSIS}/confirmatory_documents.csv",
    log:
        f"{LOGS}/analysis/confirmatory.log",
    benchmark:
        benchmark_file("confirmatory/confirmatory")
    params:
        plan=canonical(CONFIRMATORY_PLAN),
        floor=FLOOR,
        split="confirmatory",
        **ANALYSIS_PARAMS,
    conda:
        CONDA_ENV
    script:
        "../scripts/confirmatory.py"


# The self-speculative reading (kvdiverge.estimation.speculative): each policy's cache as
# the draft, the full cache as the target; expected accepted tokens of a first draft block
# A_k = S_1 + ... + S_k, k = 1..min(8, T), with document-bootstrap intervals.
rule speculative:
    input:
        estimate_files(),
    output:
        parquet=f"{ANALYSIS}/speculative.parquet",
        csv=table_report(f"{ANALYSIS}/speculative.csv", "speculative_table", "self-speculative reading"),
    log:
        f"{LOGS}/analysis/speculative.log",
    benchmark:
        benchmark_file("speculative/speculative")
    params:
        **ANALYSIS_PARAMS,
    conda:
        CONDA_ENV
    script:
        "../scripts/speculative.py"


# Length and loop drift (kvdiverge.estimation.drift): per policy, each side's mean and median
# length to EOS, stop rate, loop rate, seq-rep-4 and distinct-2, and the paired difference
# (compressed minus full) with document-bootstrap intervals; the EOS time's survival per side.
rule drift:
    input:
        drift_files(),
    output:
        parquet=f"{ANALYSIS}/drift.parquet",
        csv=table_report(f"{ANALYSIS}/drift.csv", "drift", "length and loop drift"),
        survival_parquet=f"{ANALYSIS}/length_survival.parquet",
        survival_csv=f"{ANALYSIS}/length_survival.csv",
    log:
        f"{LOGS}/analysis/drift.log",
    benchmark:
        benchmark_file("drift/drift")
    params:
        **ANALYSIS_PARAMS,
    conda:
        CONDA_ENV
    script:
        "../scripts/drift.py"


# The frontier (config `frontier`): every press against compression ratio and every curve
# against KV bytes per prompt token, beside the noise floor (kvdiverge.estimation.frontier).
# Its policies are ordinary policies (<press>@<ratio>, <cache>, <press>@<ratio>+<cache>,
# expanded by kvdiverge.config.workflow.validate, generated by their split's trajectories rule); only
# this table and its figure are new. The model entries are params: the byte count reads each
# model's config. The teacher-forced table's headline columns join each point.
if FRONTIER_POINTS:

    rule frontier:
        input:
            documents=run_files(
                rules.estimate.output.documents,
                [
                    (m, p, FRONTIER_SPLIT)
                    for m in MODELS
                    for p in FRONTIER_POLICIES + [FLOOR]
                    if (m, p, FRONTIER_SPLIT) in RUNS
                ],
            ),
            # the teacher-forced headline of every point joins its row (and the figure's fourth panel)
            teacher=rules.teacher_forced_table.output.parquet,
            # and its length ratio, compressed over full (the figure's length panel)
            drift=run_files(
                rules.estimate.output.drift,
                [(m, p, FRONTIER_SPLIT) for m in MODELS for p in FRONTIER_POLICIES if (m, p, FRONTIER_SPLIT) in RUNS],
            ),
        output:
            parquet=f"{ANALYSIS}/frontier.parquet",
            csv=table_report(f"{ANALYSIS}/frontier.csv", "frontier_table", "frontier points", category="Frontier"),
            areas_parquet=f"{ANALYSIS}/frontier_areas.parquet",
            areas_csv=table_report(
                f"{ANALYSIS}/frontier_areas.csv",
                "frontier_areas",
                "frontier ranking",
                category="Frontier",
            ),
        log:
            f"{LOGS}/analysis/frontier.log",
        benchmark:
            benchmark_file("frontier/frontier")
        params:
            grid=canonical([pt.as_dict() for pt in FRONTIER_POINTS]),
            models=canonical({m: CONFIG["models"][m] for m in MODELS}),
            split=FRONTIER_SPLIT,
            floor=FLOOR,
            **ANALYSIS_PARAMS,
        conda:
            CONDA_ENV
        script:
            "../scripts/frontier.py"
