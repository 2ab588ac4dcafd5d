"""Measure the numerical noise floor of a config's model in several dtypes.

Runs the noise-floor control (``PermutationPress``: every prompt position kept, only
their order changed) and, optionally, the config's policies, on the config's documents
(both splits, every usable document) through the same runner as the workflow
(:func:`kvdiverge.engine.runner.run_documents`), then prints per dtype, policy and split the
mean TV per chain step, the largest TV, ``p_div`` within T tokens and ``E[N]`` with
95% document-bootstrap intervals, and for each policy whether it lies above the floor
(:func:`kvdiverge.estimation.floor.floor_comparison`). This is how the README's "Numerical
noise floor" table was made::

    .venv/bin/python benchmarks/noise_floor.py --config config/config.yaml \\
        --dtypes float32 bfloat16 --out results-floor [--policies]

Trajectory tables go to ``OUT/{dtype}/{policy}/{split}.parquet`` (shard schema); a
rerun skips those already written. The config's model (the first) is loaded once per
dtype; ``--threads`` sets torch's CPU threads.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import polars as pl
import torch
from tqdm.auto import tqdm

from kvdiverge.config.workflow import SPLITS, floor_policy, load_config
from kvdiverge.data.corpus import build_corpus
from kvdiverge.data.prompts import build_prompts, prompt_settings
from kvdiverge.engine.core.coupled import to_frame
from kvdiverge.engine.core.sampling import Decoding, Sampling
from kvdiverge.engine.presses.policies import Policy
from kvdiverge.engine.runner import Document, RunOptions, run_documents
from kvdiverge.estimation.bootstrap import Bootstrap
from kvdiverge.estimation.estimators import document_estimates, replicate_estimates
from kvdiverge.estimation.floor import floor_comparison
from kvdiverge.estimation.pooling import pooled_estimates
from kvdiverge.io.files import write_parquet_atomic
from kvdiverge.models.loading import context_length, load_model, load_model_config, load_tokenizer

log = logging.getLogger("noise_floor")


def prompts_table(config: dict, model_name: str, out: Path) -> pl.DataFrame:
    """The config's prompts table for its model (built once, cached under ``out``)."""
    path = out / f"prompts-{model_name}.parquet"
    if not path.exists():
        spec = config["models"][model_name]
        docs = build_corpus(config["corpus"])
        table = build_prompts(
            docs,
            load_tokenizer(spec, model_name),
            prompt_settings(config),
            context_length(load_model_config(spec, model_name)),
        )
        write_parquet_atomic(table, path)
    return pl.read_parquet(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="config/config.yaml")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--out", default="results-floor", type=Path)
    ap.add_argument("--policies", action="store_true", help="also run the config's policies")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)

    config = load_config(args.config)
    floor = floor_policy(config)
    if floor is None:
        raise SystemExit(f"{args.config}: no noise-floor control (runs.floor)")
    model_name = next(iter(config["models"]))
    prompts = prompts_table(config, model_name, args.out)
    T, R = int(config["decoding"]["max_new_tokens"]), int(config["replicates"])
    jobs = [(floor, s) for s in SPLITS if config["runs"].get(s)]
    if args.policies:
        jobs += [(p, s) for s in SPLITS for p in config["runs"].get(s, [])]
    for dtype in args.dtypes:
        todo = [(p, s) for p, s in jobs if not (args.out / dtype / p / f"{s}.parquet").exists()]
        model = load_model({**config["models"][model_name], "dtype": dtype}, model_name)[0] if todo else None
        for policy_name, split in todo:
            policy = Policy.from_config(policy_name, config["policies"][policy_name])
            rows = prompts.filter((pl.col("split") == split) & pl.col("exclusion_reason").is_null()).sort("doc_id")
            documents = [Document(r["doc_id"], r["input_ids"]) for r in rows.iter_rows(named=True)]
            start = time.perf_counter()
            with tqdm(total=len(documents) * (2 * T - 1), desc=f"{dtype} {policy_name} {split}", mininterval=30) as bar:
                recs = run_documents(
                    model,
                    documents,
                    policy,
                    Sampling(
                        T=T,
                        replicates=R,
                        decoding=Decoding(
                            temperature=config["decoding"]["temperature"], top_p=config["decoding"]["top_p"]
                        ),
                        seed=config["seed"],
                        model_name=model_name,
                    ),
                    RunOptions(progress=bar),
                )
            meta = {"model": model_name, "policy": policy_name, "split": split}
            write_parquet_atomic(
                to_frame([{**meta, **r} for r in recs]), args.out / dtype / policy_name / f"{split}.parquet"
            )
            log.info(
                "%s %s %s: %d documents in %.0f s",
                dtype,
                policy_name,
                split,
                len(documents),
                time.perf_counter() - start,
            )
        del model

    boot = Bootstrap(config["analysis"]["bootstrap"], config["analysis"]["confidence"], config["seed"])
    for dtype in args.dtypes:
        files = sorted((args.out / dtype).glob("*/*.parquet"))
        if not files:
            continue
        docs = document_estimates(
            replicate_estimates(pl.concat([pl.read_parquet(f) for f in files]), int(config["window"]))
        )
        pooled = pooled_estimates(docs, boot).sort(["split", "policy"])
        print(f"\n{dtype}: T = {T}, R = {R}, {int(boot.confidence * 100)}% document-bootstrap intervals")
        for r in pooled.iter_rows(named=True):
            print(
                f"  {r['policy']:12s} {r['split']:12s} docs {r['n_docs']:3d}  "
                f"mean TV/step {r['tv_mean']:.3g} [{r['tv_mean_lo']:.3g}, {r['tv_mean_hi']:.3g}]  "
                f"max TV {r['tv_max']:.3g}  p_div {r['p_div']:.3g} [{r['p_div_lo']:.3g}, {r['p_div_hi']:.3g}]  "
                f"E[N] {r['E_N']:.3g} [{r['E_N_lo']:.3g}, {r['E_N_hi']:.3g}]"
            )
        for r in floor_comparison(docs, floor, boot).sort(["split", "policy"]).iter_rows(named=True):
            print(
                f"  {r['policy']:12s} {r['split']:12s} minus floor: "
                f"p_div {r['diff_p_div']:.3g} [{r['diff_p_div_lo']:.3g}, {r['diff_p_div_hi']:.3g}]  "
                f"E[N] {r['diff_E_N']:.3g} [{r['diff_E_N_lo']:.3g}, {r['diff_E_N_hi']:.3g}]  "
                f"above floor: p_div {r['above_floor_p_div']}, E[N] {r['above_floor_E_N']}"
            )


if __name__ == "__main__":
    main()
