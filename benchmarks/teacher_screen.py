"""The teacher-forced screen of a frontier against its coupled run: cost, and whether they rank alike.

Runs every point of a config's frontier (and its noise floor) on the first ``--documents``
usable documents of the frontier's split twice, on the same loaded model:

1. the teacher-forced pass only (:func:`kvdiverge.engine.forced.teacher_forced_policies`:
   the corpus text after each excerpt, ``--length`` tokens, one forward per point for
   prefill-only presses), and
2. the coupled run (:func:`kvdiverge.engine.runner.run_policies`, the config's T, R,
   temperature and top-p), then its pooled ``E[M]``;

and prints the wall and CPU (process) time of each and their ratios (on a shared machine the
CPU time is the one to quote: with ``--threads 1`` it is the compute the pass needs), per point the teacher-forced mean KLD,
PPL ratio and Same top p beside ``E[M]``, the Spearman rank correlation of mean KLD and
``E[M]`` across the frontier's points (the floor left out), and the points whose two ranks
differ by more than ``--rank-gap``. The noise floor's mean KLD is the float32 floor quoted in
``docs/teacher-forced.md``::

    .venv/bin/python benchmarks/teacher_screen.py --config config/frontier.yaml --documents 3 \\
        --threads 1 --out results-screen

Tables go to ``OUT/teacher_forced_positions.parquet``, ``OUT/teacher_forced.csv`` and
``OUT/screen_vs_coupled.csv``.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import polars as pl
import torch
from scipy.stats import spearmanr

from kvdiverge.config.frontier import frontier_split
from kvdiverge.config.workflow import floor_policy, load_config
from kvdiverge.data.corpus import build_corpus
from kvdiverge.data.prompts import build_prompts, prompt_settings
from kvdiverge.engine.core.sampling import Decoding, Sampling
from kvdiverge.engine.forced import TeacherPass, teacher_forced_policies
from kvdiverge.engine.llm.pair_base import model_eos_ids
from kvdiverge.engine.llm.teacher import TeacherForcing
from kvdiverge.engine.presses.policies import Policy
from kvdiverge.engine.runner import Document, run_policies
from kvdiverge.estimation import tables
from kvdiverge.estimation.bootstrap import Bootstrap
from kvdiverge.estimation.teacher_forced import summary_table
from kvdiverge.io.files import save_table
from kvdiverge.jobs.teacher import corpus_continuations
from kvdiverge.models.loading import context_length, load_model
from kvdiverge.settings.checks import config_sampling

log = logging.getLogger("teacher_screen")


def inputs(config: dict, n_docs: int):
    """``(model_name, model, tokenizer, corpus, documents, policies)`` of the frontier's split."""
    name = next(iter(config["models"]))
    model, tok = load_model(config["models"][name], name)
    corpus = build_corpus(config["corpus"])
    prompts = build_prompts(corpus, tok, prompt_settings(config), context_length(model))
    split = frontier_split(config)
    usable = prompts.filter((pl.col("split") == split) & pl.col("exclusion_reason").is_null()).sort("doc_id")
    docs = [Document(r["doc_id"], r["input_ids"]) for r in usable.head(n_docs).iter_rows(named=True)]
    names = [floor_policy(config)] + list(config["runs"][split])
    policies = {n: Policy.from_config(n, config["policies"][n]) for n in names if n}
    return name, model, tok, corpus, docs, policies


def screen(config, loaded, length: int) -> tuple[pl.DataFrame, tuple[float, float]]:
    """The teacher-forced positions of every point, and the (wall, CPU) seconds they took."""
    name, model, tok, corpus, docs, policies = loaded
    forcing = TeacherForcing(length=length)
    conts = corpus_continuations(config["corpus"], corpus, tok, [d.doc_id for d in docs], length)
    sampling = Sampling(
        T=length, replicates=1, decoding=Decoding(temperature=1.0), seed=int(config["seed"]), model_name=name
    )
    sampling = sampling.replace(eos_ids=tuple(model_eos_ids(model)))
    t0, c0 = time.perf_counter(), time.process_time()
    positions = teacher_forced_policies(
        model, docs, policies, settings=TeacherPass(sampling, forcing, "screen"), continuations=conts
    )
    return positions, (time.perf_counter() - t0, time.process_time() - c0)


def coupled(config, loaded) -> tuple[pl.DataFrame, tuple[float, float]]:
    """The coupled run's pooled table of every point, and the (wall, CPU) seconds its generation took."""
    name, model, _, _, docs, policies = loaded
    sampling = config_sampling(config, name).replace(eos_ids=tuple(model_eos_ids(model)))
    t0, c0 = time.perf_counter(), time.process_time()
    runs = run_policies(model, docs, policies, sampling, split="screen")
    seconds = (time.perf_counter() - t0, time.process_time() - c0)
    _, per_doc = tables.estimate(runs.trajectories, int(config["window"]))
    return tables.pool(per_doc, Bootstrap(200, 0.95, int(config["seed"])))["pooled"], seconds


def compare(teacher: pl.DataFrame, pooled: pl.DataFrame, floor: str | None, gap: int) -> tuple[pl.DataFrame, str]:
    """Per point: teacher-forced headline beside E[M], both ranks; the rank correlation and the outliers."""
    both = teacher.select("policy", "kld_mean", "ppl_ratio", "same_top_p", "delta_p_rms").join(
        pooled.select("policy", "E_M", "p_div"), on="policy"
    )
    points = both.filter(pl.col("policy") != floor).with_columns(
        pl.col("kld_mean").rank().alias("rank_kld"), pl.col("E_M").rank().alias("rank_E_M")
    )
    rho, p = spearmanr(points["kld_mean"].to_numpy(), points["E_M"].to_numpy())
    odd = points.filter((pl.col("rank_kld") - pl.col("rank_E_M")).abs() > gap).sort("policy")
    text = f"Spearman rho(mean KLD, E[M]) over {points.height} points = {rho:.3f} (p = {p:.2g})"
    if odd.height:
        text += "; ranked more than %d apart: %s" % (
            gap,
            ", ".join(
                f"{r['policy']} (KLD rank {r['rank_kld']:g}, E[M] rank {r['rank_E_M']:g})"
                for r in odd.iter_rows(named=True)
            ),
        )
    return points.sort("rank_E_M"), text


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="config/frontier.yaml")
    ap.add_argument("--documents", type=int, default=3)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--rank-gap", type=int, default=4)
    ap.add_argument("--out", default="results-screen")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    config = load_config(args.config)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    loaded = inputs(config, args.documents)
    floor = floor_policy(config)
    positions, t_screen = screen(config, loaded, args.length)
    positions.write_parquet(out / "teacher_forced_positions.parquet")
    teacher = summary_table(positions, floor=floor, boot=Bootstrap(200, seed=int(config["seed"])))
    save_table(teacher, str(out / "teacher_forced.parquet"), str(out / "teacher_forced.csv"))
    log.info("screen: %.1f s wall, %.1f s CPU, %d points x %d documents", *t_screen, len(loaded[5]), len(loaded[4]))
    pooled, t_coupled = coupled(config, loaded)
    points, text = compare(teacher, pooled, floor, args.rank_gap)
    save_table(points, str(out / "screen_vs_coupled.parquet"), str(out / "screen_vs_coupled.csv"))
    with pl.Config(tbl_rows=100, tbl_cols=20, tbl_width_chars=200):
        print(points)
    row = teacher.filter(pl.col("policy") == floor).row(0, named=True) if floor else None
    if row:
        print(
            f"noise floor ({floor}): mean KLD {row['kld_mean']:.3g} ± {row['kld_se']:.2g}, RMS Δp {100 * row['delta_p_rms']:.3g} %"
        )
    print(
        f"screen {t_screen[0]:.1f} s wall, {t_screen[1]:.1f} s CPU; coupled {t_coupled[0]:.1f} s wall, "
        f"{t_coupled[1]:.1f} s CPU: screen / coupled = {t_screen[1] / t_coupled[1]:.3f} (CPU), "
        f"{t_screen[0] / t_coupled[0]:.3f} (wall)"
    )
    print(text)


if __name__ == "__main__":
    main()
