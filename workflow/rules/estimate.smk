# Stage 4: estimates per (model, policy, split) — kvdiverge.estimators (estimators.md §3-§6).
# Per document: replicate means with standard errors, the §3 decomposition (checked: a
# failure stops the run), the §4 sharp interval, Var(N_naive)/Var(N_cmc), branch TV by
# lag. The per-replicate estimators are kept next to it.

ESTIMATE_REPLICATES = "results/estimates/{model}/{policy}/{split}.replicates.parquet"


rule estimate:
    input:
        expand(SHARD, shard=SHARDS, allow_missing=True),
    output:
        documents=ESTIMATES,
        replicates=ESTIMATE_REPLICATES,
    log:
        f"{LOGS}/estimate/{{model}}/{{policy}}/{{split}}.log",
    params:
        window=config["window"],
        windows={"early": config["confirmatory"]["early"], "late": config["confirmatory"]["late"]},
    threads: 1
    resources:
        mem_mb=4000,
        runtime=30,
    conda:
        CONDA_ENV
    script:
        "../scripts/estimate.py"


ALL_TARGETS.extend(estimate_files())
