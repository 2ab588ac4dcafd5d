"""Snakemake adapter: the self-speculative reading (kvdiverge.estimation.speculative.speculative_table)."""

from kvdiverge.estimation.bootstrap import Bootstrap
from kvdiverge.estimation.estimators import read_estimates
from kvdiverge.estimation.speculative import speculative_table
from kvdiverge.io.files import save_table
from kvdiverge.jobs.rulelog import rule_log

p = snakemake.params
out = snakemake.output
with rule_log(snakemake.log[0], "speculative", "speculative reading") as log:
    docs = read_estimates(list(snakemake.input))
    table = speculative_table(docs, Bootstrap(**p.boot))
    log.info(
        "\n%s",
        table.select(
            "model",
            "policy",
            "split",
            "k",
            "A",
            "A_lo",
            "A_hi",
            "tokens_per_forward",
            "alpha",
            "iid_tokens_per_forward",
        ),
    )
    save_table(table, out.parquet, out.csv)
