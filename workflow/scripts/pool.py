"""Snakemake adapter: pooled estimates, timing, survival, branch TV, variance (kvdiverge.estimation.tables.pool)."""

from tqdm import tqdm

from kvdiverge.estimation.bootstrap import Bootstrap
from kvdiverge.estimation.estimators import read_estimates
from kvdiverge.estimation.tables import pool
from kvdiverge.io.files import save_table
from kvdiverge.jobs.rulelog import rule_log

out = snakemake.output
p = snakemake.params
with rule_log(snakemake.log[0], "pool", "pooling") as log:
    docs = read_estimates(tqdm(snakemake.input, desc="estimates"))
    log.info("%d per-document rows from %d runs", docs.height, len(snakemake.input))
    tables = pool(docs, Bootstrap(**p.boot))
    log.info("pooled decomposition identity holds for every run")
    log.info("\n%s", tables["timing"])
    log.info("\n%s", tables["variance"])
    save_table(docs, out.documents_parquet, out.documents_csv)
    for name, frame in tables.items():
        save_table(frame, getattr(out, f"{name}_parquet"), getattr(out, f"{name}_csv"))
