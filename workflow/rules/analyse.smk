# Stage 5: exploratory and confirmatory analyses — kvdiverge.analysis (estimators.md §7-§8).
# Tables go to {results_dir}/analysis/ as parquet (full) and csv (scalar columns).

ANALYSIS = f"{RESULTS}/analysis"
CONFIRMATORY_PLAN = config["confirmatory"]
# estimate tables the analyses read
GAP_ESTIMATES = sorted(
    {
        ESTIMATES.format(model=m, policy=p, split="exploratory")
        for m in MODELS
        for pair in config["analysis"]["gaps"]
        for p in pair
        if (m, p, "exploratory") in RUNS
    }
)
CONFIRMATORY_ESTIMATES = [
    ESTIMATES.format(model=m, policy=CONFIRMATORY_PLAN["policy"], split="confirmatory")
    for m in MODELS
    if (m, CONFIRMATORY_PLAN["policy"], "confirmatory") in RUNS
]
ANALYSIS_TABLES = ["documents", "pooled", "timing", "survival", "branch_tv", "variance"]


rule pool:
    input:
        estimate_files(),
    output:
        **{f"{t}_parquet": f"{ANALYSIS}/{t}.parquet" for t in ANALYSIS_TABLES},
        documents_csv=f"{ANALYSIS}/documents.csv",
        pooled_csv=report(
            f"{ANALYSIS}/pooled.csv",
            caption="../report/pooled.rst",
            category="Tables",
            labels={"table": "pooled estimates"},
        ),
        timing_csv=report(
            f"{ANALYSIS}/timing.csv",
            caption="../report/timing.rst",
            category="Tables",
            labels={"table": "divergence timing"},
        ),
        survival_csv=f"{ANALYSIS}/survival.csv",
        branch_tv_csv=f"{ANALYSIS}/branch_tv.csv",
        variance_csv=report(
            f"{ANALYSIS}/variance.csv",
            caption="../report/variance_table.rst",
            category="Tables",
            labels={"table": "naive vs CMC variance"},
        ),
    log:
        f"{LOGS}/analysis/pool.log",
    params:
        seed=canonical(config["seed"]),
        bootstrap=canonical(config["analysis"]["bootstrap"]),
        confidence=canonical(config["analysis"]["confidence"]),
    threads: 1
    resources:
        mem_mb=4000,
        runtime=30,
    conda:
        CONDA_ENV
    script:
        "../scripts/pool.py"


rule gaps:
    input:
        GAP_ESTIMATES,
    output:
        parquet=f"{ANALYSIS}/gaps.parquet",
        csv=report(
            f"{ANALYSIS}/gaps.csv",
            caption="../report/gaps_table.rst",
            category="Tables",
            labels={"table": "gap decomposition"},
        ),
    log:
        f"{LOGS}/analysis/gaps.log",
    params:
        gaps=canonical(config["analysis"]["gaps"]),
        models=MODELS,
        seed=canonical(config["seed"]),
        bootstrap=canonical(config["analysis"]["bootstrap"]),
        confidence=canonical(config["analysis"]["confidence"]),
    threads: 1
    resources:
        mem_mb=4000,
        runtime=30,
    conda:
        CONDA_ENV
    script:
        "../scripts/gaps.py"


rule confirmatory:
    input:
        CONFIRMATORY_ESTIMATES,
    output:
        parquet=f"{ANALYSIS}/confirmatory.parquet",
        csv=f"{ANALYSIS}/confirmatory.csv",
        documents_parquet=f"{ANALYSIS}/confirmatory_documents.parquet",
        documents_csv=f"{ANALYSIS}/confirmatory_documents.csv",
        html=report(
            f"{ANALYSIS}/confirmatory.html",
            caption="../report/confirmatory.rst",
            category="Confirmatory",
            labels={"table": "confirmatory test"},
        ),
    log:
        f"{LOGS}/analysis/confirmatory.log",
    params:
        plan=canonical(CONFIRMATORY_PLAN),
        split="confirmatory",
        seed=canonical(config["seed"]),
        bootstrap=canonical(config["analysis"]["bootstrap"]),
        confidence=canonical(config["analysis"]["confidence"]),
    threads: 1
    resources:
        mem_mb=2000,
        runtime=20,
    conda:
        CONDA_ENV
    script:
        "../scripts/confirmatory.py"


ALL_TARGETS.extend(
    [
        *(f"{ANALYSIS}/{t}.parquet" for t in ANALYSIS_TABLES),
        f"{ANALYSIS}/gaps.parquet",
        f"{ANALYSIS}/confirmatory.parquet",
    ]
)
