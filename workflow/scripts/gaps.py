"""Snakemake adapter: exploratory gap decomposition (kvdiverge.analysis.gap_decomposition)."""

import polars as pl
from tqdm import tqdm

from kvdiverge.analysis import GAP_SCHEMA, gap_decomposition, save_table
from kvdiverge.estimators import read_estimates
from kvdiverge.rulelog import rule_logger

log = rule_logger(snakemake.log[0], "gaps")  # noqa: F821
p = snakemake.params  # noqa: F821
try:
    files = list(snakemake.input)  # noqa: F821
    docs = read_estimates(files) if files else None  # refuses non-finite inputs
    frames = []
    jobs = [(m, a, b) for m in p.models for a, b in p.gaps]
    for model, a, b in tqdm(jobs, desc="gaps"):
        have = set() if docs is None else set(
            docs.filter(pl.col("model") == model)["policy"].unique().to_list())
        if not {a, b} <= have:
            log.warning("gap %s - %s skipped for %s: policy not run on the exploratory split", a, b, model)
            continue
        g = gap_decomposition(docs, model, a, b, "exploratory", p.bootstrap, p.confidence, p.seed)
        log.info("%s: %s - %s\n%s", model, a, b, g.select("term", "value", "value_lo", "value_hi", "share"))
        frames.append(g)
    gaps = pl.concat(frames) if frames else pl.DataFrame(schema=GAP_SCHEMA)
    save_table(gaps, snakemake.output.parquet, snakemake.output.csv)  # noqa: F821
except Exception:
    log.exception("gap decomposition failed")
    raise
