"""Snakemake adapter: per-document estimates of one (model, policy, split) (kvdiverge.estimation.tables.estimate),
and each side's length, stop and loops per replicate (kvdiverge.estimation.drift.drift_replicates)."""

from kvdiverge.config.provenance import StaleShardError, check_shards, recorded_eos_ids, regenerate_command
from kvdiverge.estimation.drift import drift_replicates
from kvdiverge.estimation.estimators import read_shards
from kvdiverge.estimation.tables import estimate
from kvdiverge.io.files import write_parquet_atomic
from kvdiverge.jobs.rulelog import rule_log

w = snakemake.wildcards
with rule_log(snakemake.log[0], "estimate", "estimate stage") as log:
    # refuse shards made with other settings than the config's (copied in, older version)
    records = check_shards(
        snakemake.input, dict(snakemake.params.settings), model=w.model, policy=w.policy, split=w.split
    )
    log.info("shards match the config: settings hash %s, versions %s", records[0].settings_hash, records[0].versions)
    shards = read_shards(snakemake.input)
    log.info("%d trajectory rows from %d shards", shards.height, len(snakemake.input))
    reps, docs = estimate(shards, int(snakemake.params.window), dict(snakemake.params.windows), progress=True)
    log.info("%d documents; decomposition identity holds for each", docs.height)
    log.info("\n%s", docs.select("doc_id", "p_div", "tau_mean", "E_N", "E_N_naive", "E_M", "rho", "var_ratio"))
    eos = recorded_eos_ids(records)
    if eos is None and shards.height:
        raise StaleShardError(
            f"the shards of {w.model}/{w.policy}/{w.split} record no end-of-sequence ids (made by an older "
            f"version), which the length drift reads; regenerate them: {regenerate_command(list(snakemake.input))}"
        )
    drift = drift_replicates(shards, eos or [], **dict(snakemake.params.drift))
    log.info("length drift per replicate: EOS ids %s, loop settings %s", eos, dict(snakemake.params.drift))
    write_parquet_atomic(reps, snakemake.output.replicates)
    write_parquet_atomic(drift, snakemake.output.drift)
    write_parquet_atomic(docs, snakemake.output.documents)
    log.info("wrote %s, %s and %s", snakemake.output.documents, snakemake.output.replicates, snakemake.output.drift)
