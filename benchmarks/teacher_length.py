"""How long the teacher-forced continuation must be: the mean KLD's interval at several lengths.

Reads the per-position tables of a workflow run's teacher-forced pass
(``<results>/teacher_forced/<model>/<policy>/<split>.parquet``), cuts every document's
continuation to each length (its first ``L`` fed tokens), and prints per (policy, split, L):
the documents, the positions, the mean over documents of each document's mean KLD (nats)
with its document-bootstrap interval (:class:`kvdiverge.estimation.bootstrap.Bootstrap`), the
interval's half-width, and that half-width relative to the mean. The pass's cost grows with
``L`` (one block forward per document, or ``L`` steps for a decode-time press), so the
shortest length whose interval is about as narrow as the longest one's is the default to take::

    snakemake --cores 2 --configfile config/config.yaml results/analysis/teacher_forced.parquet
    python benchmarks/teacher_length.py results --lengths 32 64 128
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import polars as pl

from kvdiverge.estimation.bootstrap import Bootstrap


def length_table(positions: pl.DataFrame, lengths, boot: Bootstrap) -> pl.DataFrame:
    """Per (model, policy, split, length): ``n_docs``, ``n_positions``, ``kld_mean`` with ``_lo``/``_hi``,
    ``half_width`` and ``relative_half_width`` (nats; the interval resamples documents)."""
    rows = []
    for (model, policy, split), part in positions.group_by(["model", "policy", "split"], maintain_order=True):
        for length in lengths:
            cut = part.filter(pl.col("position") < length)
            docs = cut.group_by("doc_id").agg(pl.col("kld").mean()).sort("doc_id")["kld"].to_numpy()
            idx = boot.indices(len(docs), "teacher-length", model, policy, split, length)
            lo, hi = boot.interval(docs[idx].mean(axis=1))
            mean = float(docs.mean())
            half = (float(hi) - float(lo)) / 2
            rows.append(
                {"model": model, "policy": policy, "split": split, "length": int(length), "n_docs": len(docs),
                 "n_positions": cut.height, "kld_mean": mean, "kld_mean_lo": float(lo), "kld_mean_hi": float(hi),
                 "half_width": half, "relative_half_width": half / mean if mean > 0 else np.nan}
            )  # fmt: skip
    return pl.DataFrame(rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path, help="the run's results directory (config results_dir)")
    p.add_argument("--lengths", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--bootstrap", type=int, default=2000)
    args = p.parse_args(argv)
    files = sorted((args.results / "teacher_forced").glob("*/*/*.parquet"))
    if not files:
        raise SystemExit(f"no teacher-forced positions under {args.results / 'teacher_forced'}")
    table = length_table(pl.concat([pl.read_parquet(f) for f in files]), args.lengths, Bootstrap(args.bootstrap))
    with pl.Config(tbl_rows=-1, tbl_cols=-1, tbl_width_chars=200, float_precision=4):
        print(table.drop("model"))


if __name__ == "__main__":
    main()
