"""Documents the confirmatory split needs: Noether's formula on a finished run's differences.

Reads a run's per-document confirmatory differences (``<results>/analysis/
confirmatory_documents.parquet``, the plan's policy) and the plan (the config's
``confirmatory`` section), and prints, per model: the pilot's documents and differences,
``p' = P(D + D' > 0)``, Noether's number of differences and of documents for the target
power (:func:`kvdiverge.estimation.power.confirmatory_size`), and the power that
resampling the pilot's differences gives at several sizes
(:func:`kvdiverge.estimation.power.simulated_power`).

    .venv/bin/python benchmarks/confirmatory_power.py --config config/config.yaml [--power 0.8]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import polars as pl
import yaml

from kvdiverge.estimation.power import confirmatory_size, simulated_power


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="config/config.yaml")
    ap.add_argument("--power", type=float, default=0.8)
    ap.add_argument("--sizes", type=int, nargs="*", default=[6, 12, 18, 24, 30])
    args = ap.parse_args()
    config = yaml.safe_load(Path(args.config).read_text())
    plan = config["confirmatory"]
    docs = pl.read_parquet(Path(config.get("results_dir", "results")) / "analysis" / "confirmatory_documents.parquet")
    docs = docs.filter(pl.col("policy") == plan["policy"])
    for (model,), g in docs.group_by(["model"], maintain_order=True):
        d = g["d"].drop_nulls().to_numpy()
        out = confirmatory_size(d, g.height, plan["alpha"], args.power, plan["alternative"])
        print(
            f"{model} / {plan['policy']}: pilot of {g.height} documents, {d.size} with a difference "
            f"(mean {d.mean():.4f}, median {float(pl.Series(d).median()):.4f}); p' = {out['p_prime']:.3f}"
        )
        print(
            f"  Noether, one-sided alpha {plan['alpha']}, power {args.power}: {out['n_used']} differences, "
            f"{out['documents']} documents (usable share {out['usable']:.2f}); resampled power there: "
            f"{out['simulated_power']}"
        )
        print(
            "  resampled power by differences: "
            + ", ".join(f"{n}: {simulated_power(d, n, plan['alpha'], plan['alternative']):.2f}" for n in args.sizes)
        )


if __name__ == "__main__":
    main()
