"""Snakemake adapter: per-document estimates of one (model, policy, split) (kvdiverge.tables.estimate)."""

from kvdiverge.estimators import read_shards
from kvdiverge.io import write_parquet_atomic
from kvdiverge.rulelog import rule_logger
from kvdiverge.tables import estimate

log = rule_logger(snakemake.log[0], "estimate")  # noqa: F821
try:
    shards = read_shards(snakemake.input)  # noqa: F821
    log.info("%d trajectory rows from %d shards", shards.height, len(snakemake.input))  # noqa: F821
    reps, docs = estimate(shards, int(snakemake.params.window), dict(snakemake.params.windows),  # noqa: F821
                          progress=True)
    log.info("%d documents; decomposition identity holds for each", docs.height)
    log.info("\n%s", docs.select("doc_id", "p_div", "tau_mean", "E_N", "E_N_naive", "E_M", "rho",
                                 "var_ratio"))
    write_parquet_atomic(reps, snakemake.output.replicates)  # noqa: F821
    write_parquet_atomic(docs, snakemake.output.documents)  # noqa: F821
    log.info("wrote %s and %s", snakemake.output.documents, snakemake.output.replicates)  # noqa: F821
except Exception:
    log.exception("estimate stage failed")
    raise
