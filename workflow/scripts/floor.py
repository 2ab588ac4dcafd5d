"""Snakemake adapter: every policy beside the noise floor (kvdiverge.estimation.floor.floor_comparison)."""

import polars as pl

from kvdiverge.estimation.bootstrap import Bootstrap
from kvdiverge.estimation.estimators import read_estimates
from kvdiverge.estimation.floor import FLOOR_SCHEMA, floor_comparison
from kvdiverge.io.files import save_table
from kvdiverge.jobs.rulelog import rule_log

p = snakemake.params
out = snakemake.output
with rule_log(snakemake.log[0], "floor", "floor comparison") as log:
    if p.floor is None:
        log.info("no noise-floor control configured (runs.floor): empty table")
        table = pl.DataFrame(schema=FLOOR_SCHEMA)
    else:
        docs = read_estimates(list(snakemake.input))
        table = floor_comparison(docs, p.floor, Bootstrap(**p.boot))
        log.info(
            "floor %s:\n%s",
            p.floor,
            table.select(
                [
                    "model",
                    "split",
                    "policy",
                    "n_docs",
                    "p_div",
                    "floor_p_div",
                    "E_N",
                    "floor_E_N",
                    "tv_mean",
                    "floor_tv_mean",
                    "above_floor_p_div",
                    "above_floor_E_N",
                ]
            ),
        )
    save_table(table, out.parquet, out.csv)
