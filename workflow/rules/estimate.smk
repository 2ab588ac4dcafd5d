# Stage 4: estimates per (model, policy, split) — kvdiverge.estimation.estimators (estimators.md §3-§6).
# Per document: replicate means with standard errors, the §3 decomposition (checked: a
# failure stops the run), the §4 sharp interval, Var(N_naive)/Var(N_cmc), branch TV by
# lag. The per-replicate estimators are kept next to it. Before anything, the shards'
# recorded settings are checked against the config (kvdiverge.study.provenance.check_shards):
# a shard copied in by hand or made by another version is refused with the command that
# regenerates it. `settings` is that check's reference; it changes only together with
# the shards (whose params are the same settings), so it adds no rerun of its own.

ESTIMATE_REPLICATES = f"{RESULTS}/estimates/{{model}}/{{policy}}/{{split}}.replicates.parquet"


rule estimate:
    input:
        expand(SHARD, shard=SHARDS, allow_missing=True),
    output:
        documents=ESTIMATES,
        replicates=ESTIMATE_REPLICATES,
    log:
        f"{LOGS}/estimate/{{model}}/{{policy}}/{{split}}.log",
    params:
        window=canonical(config["window"]),
        windows=canonical({"early": config["confirmatory"]["early"], "late": config["confirmatory"]["late"]}),
        settings=shard_settings,
    threads: 1
    resources:
        mem_mb=4000,
        runtime=30,
    conda:
        CONDA_ENV
    script:
        "../scripts/estimate.py"


# The provenance of every run (settings hash, settings, library versions), read from its
# shards, for the report (summary page) and {results_dir}/analysis/provenance.csv.
PROVENANCE = f"{RESULTS}/analysis/provenance.parquet"


rule provenance:
    input:
        all_trajectory_shards(),
    output:
        parquet=PROVENANCE,
        csv=report(
            f"{RESULTS}/analysis/provenance.csv",
            caption="../report/provenance.rst",
            category="Tables",
            labels={"table": "provenance"},
        ),
    log:
        f"{LOGS}/provenance.log",
    threads: 1
    resources:
        mem_mb=1000,
        runtime=10,
    conda:
        CONDA_ENV
    script:
        "../scripts/provenance.py"


ALL_TARGETS.extend([*estimate_files(), PROVENANCE])
