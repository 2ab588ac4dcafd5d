"""Snakemake adapter: pooled estimates, timing, survival, branch TV, variance (kvdiverge.estimators)."""

from tqdm import tqdm

from kvdiverge.analysis import save_table, timing_table, variance_table
from kvdiverge.estimators import branch_tv_curve, pooled_estimates, read_estimates, survival_curve
from kvdiverge.rulelog import rule_logger

log = rule_logger(snakemake.log[0], "pool")  # noqa: F821
out = snakemake.output  # noqa: F821
p = snakemake.params  # noqa: F821
try:
    docs = read_estimates(tqdm(snakemake.input, desc="estimates"))  # noqa: F821  (refuses non-finite)
    log.info("%d per-document rows from %d runs", docs.height, len(snakemake.input))  # noqa: F821
    pooled = pooled_estimates(docs, p.bootstrap, p.confidence, p.seed)
    survival = survival_curve(docs, p.bootstrap, p.confidence, p.seed)
    branch = branch_tv_curve(docs, p.bootstrap, p.confidence, p.seed)
    timing = timing_table(pooled, survival)
    variance = variance_table(pooled)
    log.info("pooled decomposition identity holds for every run")
    log.info("\n%s", timing)
    log.info("\n%s", variance)
    save_table(docs, out.documents_parquet, out.documents_csv)
    save_table(pooled, out.pooled_parquet, out.pooled_csv)
    save_table(timing, out.timing_parquet, out.timing_csv)
    save_table(survival, out.survival_parquet, out.survival_csv)
    save_table(branch, out.branch_tv_parquet, out.branch_tv_csv)
    save_table(variance, out.variance_parquet, out.variance_csv)
except Exception:
    log.exception("pooling failed")
    raise
