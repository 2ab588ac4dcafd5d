# Stage 4: estimates per (model, policy, split) — kvdiverge.estimation.estimators (estimators.md §3-§6).
# Per document: replicate means with standard errors, the §3 decomposition (checked: a
# failure stops the run), the §4 sharp interval, Var(N_naive)/Var(N_cmc), branch TV by
# lag. The per-replicate estimators are kept next to it. Before anything, the shards'
# recorded settings are checked against the config (kvdiverge.config.provenance.check_shards):
# a shard copied in by hand or made by another version is refused with the command that
# regenerates it. `settings` is that check's reference; it changes only together with
# the shards (whose params are the same settings), so it adds no rerun of its own. Each side of
# every replicate is also read for its length, stop and loops (kvdiverge.estimation.drift, with
# the model's end-of-sequence ids the shards record): the `drift` table, paired per replicate.


rule estimate:
    input:
        expand(SHARD, shard=SHARDS, allow_missing=True),
    output:
        documents=ESTIMATES,
        replicates=f"{RESULTS}/estimates/{{model}}/{{policy}}/{{split}}.replicates.parquet",
        drift=f"{RESULTS}/estimates/{{model}}/{{policy}}/{{split}}.drift.parquet",
    log:
        f"{LOGS}/estimate/{{model}}/{{policy}}/{{split}}.log",
    benchmark:
        benchmark_file("estimate/{model}/{policy}/{split}")
    params:
        window=canonical(CONFIG["window"]),
        windows=canonical({"early": CONFIG["confirmatory"]["early"], "late": CONFIG["confirmatory"]["late"]}),
        settings=shard_settings,
        drift=canonical(DRIFT_LOOP),
    conda:
        CONDA_ENV
    script:
        "../scripts/estimate.py"


# The provenance of every run (settings hash, settings, library versions), read from its
# shards, for the report (summary page) and {results_dir}/analysis/provenance.csv.
rule provenance:
    input:
        all_trajectory_shards(),
    output:
        parquet=f"{ANALYSIS}/provenance.parquet",
        csv=table_report(f"{ANALYSIS}/provenance.csv", "provenance", "provenance"),
    log:
        f"{LOGS}/provenance.log",
    benchmark:
        benchmark_file("provenance/provenance")
    conda:
        CONDA_ENV
    script:
        "../scripts/provenance.py"
