"""Snakemake adapter: the prespecified confirmatory test (kvdiverge.estimation.confirmatory.confirmatory_analysis)."""

from kvdiverge.estimation.bootstrap import Bootstrap
from kvdiverge.estimation.confirmatory import confirmatory_analysis, plan_hash
from kvdiverge.estimation.estimators import read_estimates
from kvdiverge.io.files import save_table
from kvdiverge.jobs.rulelog import rule_log

p = snakemake.params
out = snakemake.output
with rule_log(snakemake.log[0], "confirmatory", "confirmatory analysis") as log:
    plan = dict(p.plan)
    log.info("plan %s, sha256 %s", plan, plan_hash(plan))
    files = list(snakemake.input)
    if not files:
        raise ValueError(
            f"no confirmatory run of the plan's policy {plan.get('policy')!r}: add it to config runs.confirmatory"
        )
    docs = read_estimates(files)  # refuses non-finite inputs
    boot = Bootstrap(**p.boot)
    result, per_doc = confirmatory_analysis(docs, plan, p.split, boot, floor=p.floor)
    log.info("\n%s", result)
    save_table(result, out.parquet, out.csv)
    save_table(per_doc, out.documents_parquet, out.documents_csv)
