"""Snakemake adapter: per-document estimates of one (model, policy, split) (kvdiverge.estimators)."""

from kvdiverge.estimators import document_estimates, read_shards, replicate_estimates
from kvdiverge.io import write_parquet_atomic
from kvdiverge.provenance import check_shards
from kvdiverge.rulelog import rule_logger

log = rule_logger(snakemake.log[0], "estimate")  # noqa: F821
w = snakemake.wildcards  # noqa: F821
try:
    # refuse shards made with other settings than the config's (copied in, older version)
    records = check_shards(snakemake.input, dict(snakemake.params.settings),  # noqa: F821
                           model=w.model, policy=w.policy, split=w.split)
    log.info("shards match the config: settings hash %s, versions %s", records[0].settings_hash,
             records[0].versions)
    shards = read_shards(snakemake.input)  # noqa: F821
    log.info("%d trajectory rows from %d shards", shards.height, len(snakemake.input))  # noqa: F821
    reps = replicate_estimates(shards, int(snakemake.params.window), progress=True)  # noqa: F821
    docs = document_estimates(reps, dict(snakemake.params.windows))  # noqa: F821
    log.info("%d documents; decomposition identity holds for each", docs.height)
    log.info("\n%s", docs.select("doc_id", "p_div", "tau_mean", "E_N", "E_N_naive", "E_M", "rho",
                                 "var_ratio"))
    write_parquet_atomic(reps, snakemake.output.replicates)  # noqa: F821
    write_parquet_atomic(docs, snakemake.output.documents)  # noqa: F821
    log.info("wrote %s and %s", snakemake.output.documents, snakemake.output.replicates)  # noqa: F821
except Exception:
    log.exception("estimate stage failed")
    raise
