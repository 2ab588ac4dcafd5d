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

A row of the CSV already there is replaced by the same model's, backend's and policy's from the
directories given, and kept otherwise, so cache types measured apart add up to one table. quanto's int4
on the transformers backend goes beside them (``--transformers DIR``: what
``kvdiverge measure embedded --sotu 8 --cache quanto:nbits=4 -T 16 -R 2 --threads 1 --seed 20261205 --out DIR``
wrote), with no KLD: the weights differ (llama.cpp reads the GGUF file's Q4_1 blocks, transformers their
de-quantized float32 copy), so each backend's pair is compared, not the references. ``--figure`` draws
``docs/images/llamacpp_caches.png`` from the CSV alone: p_div, E[M] and the mean KLD against the bits each
cache stores per K or V element (``bits``: ggml's block sizes, scales included; quanto's 4 bits plus a
float32 scale and zero point per group of 64).
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
from kvdiverge.estimation.kv_bytes import kv_bytes_per_element
from kvdiverge.io.render import markdown_table
from kvdiverge.models.sources import gguf_path
from kvdiverge.report.formatting import with_interval

#: Prompt and forced tokens of each excerpt in the teacher-forced pass.
PROMPT, FORCED = 96, 64
#: The command line's ``--words`` default: the same excerpts as ``--sotu N``.
WORDS = (150, 250)
N_BOOT, CONFIDENCE, SEED = 2000, 0.95, 20261205
DOCS = Path(__file__).resolve().parents[1] / "docs"
OUT = DOCS / "data" / "llamacpp" / "caches.csv"
FIGURE = DOCS / "images" / "llamacpp_caches.png"
#: quanto's int4 cache as the command line's ``--cache quanto:nbits=4`` builds it (groups of 64, float32 scales)
INT4 = {"backend": "quanto", "nbits": 4, "q_group_size": 64}


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


def bits(policy: str, backend: str) -> float:
    """Bits a cache stores per K or V element: a llama.cpp type's (mean of K and V), or quanto's int4 in float32."""
    if backend == "transformers":
        return kv_bytes_per_element(INT4, 4) * 8
    return parse_cache(policy).bits


def transformers_rows(out: Path) -> list[dict]:
    """The summary rows of a transformers measurement beside the caches, without their references (no f16 there)."""
    record = json.loads((out / "measure.json").read_text())
    summary = pl.read_csv(out / "summary.csv")
    return [
        {"model": record["model"], **r, "kld_mean": None, "kld_mean_lo": None, "kld_mean_hi": None}
        for r in summary.iter_rows(named=True)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="*", help="--out directories of kvdiverge measure --backend llama_cpp")
    parser.add_argument("--transformers", nargs="*", default=[], help="--out directories of transformers caches")
    parser.add_argument("--figure", action="store_true", help="draw the figure from the committed CSV and stop")
    args = parser.parse_args()
    if args.figure:
        draw(pl.read_csv(OUT), FIGURE)
        print(f"wrote {FIGURE}")
        return
    start = time.process_time()
    rows = [{**row, "backend": "llama_cpp"} for out in map(Path, args.out) for row in llama_rows(out)]
    rows += [
        {**row, "backend": "transformers"} for out in map(Path, args.transformers) for row in transformers_rows(out)
    ]
    new = pl.DataFrame(rows).with_columns(bits=pl.Series([bits(r["policy"], r["backend"]) for r in rows]))
    table = merged(pl.read_csv(OUT) if OUT.is_file() else None, new)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    table.write_csv(OUT, float_precision=6)
    print(f"{time.process_time() - start:.0f} CPU s for the teacher-forced pass; wrote {OUT}")
    print(caches_markdown(table))


#: The columns a row of the table is known by.
KEY = ["model", "backend", "policy"]


def merged(kept: pl.DataFrame | None, new: pl.DataFrame) -> pl.DataFrame:
    """The committed rows with ``new``'s in place of those of the same model, backend and policy, and the rest of
    ``new`` after them; by model (in order of first appearance), llama.cpp first, then by bits per element (most
    first) and rotation (on first)."""
    table = (
        new
        if kept is None
        else pl.concat([kept.join(new.select(KEY), on=KEY, how="anti"), new], how="diagonal_relaxed")
    )
    order = {m: i for i, m in enumerate(table["model"].unique(maintain_order=True))}
    return table.sort(
        pl.col("model").replace_strict(order, return_dtype=pl.Int64),
        pl.col("backend") != "llama_cpp",
        pl.col("bits"),
        pl.col("policy").str.ends_with(":norot"),
        descending=[False, False, True, False],
        maintain_order=True,
    )


def llama_rows(out: Path) -> list[dict]:
    """The summary rows of a llama.cpp measurement with each cache's teacher-forced mean KLD and its interval."""
    record = json.loads((out / "measure.json").read_text())
    summary = pl.read_csv(out / "summary.csv")
    n = int(summary["n_docs"].max())
    model_arg = "embedded" if record["model"] == "smollm2-135m" else record["model"]
    kld = teacher_kld(model_arg, summary["policy"].to_list(), n)
    draws = resample_indices(n, N_BOOT, SEED, "llamacpp-kld", record["model"])
    rows = []
    for r in summary.iter_rows(named=True):
        per = kld[r["policy"]]
        lo, hi = percentile_interval(per[draws].mean(axis=1)[:, None], CONFIDENCE)
        rows.append({"model": record["model"], **r, "kld_mean": per.mean(), "kld_mean_lo": lo[0], "kld_mean_hi": hi[0]})
    return rows


def caches_markdown(table: pl.DataFrame) -> str:
    """docs/results.md's table of the caches: one row per model and cache."""
    rows = [
        [f"{r['model']}", f"`{r['policy']}`", r["backend"].replace("_", "."), f"{r['bits']:g}",
         with_interval(r, "p_div", 2), with_interval(r, "tau_mean", 3), with_interval(r, "E_M", 2),
         "–" if r["kld_mean"] is None else with_interval(r, "kld_mean", 2)]
        for r in table.iter_rows(named=True)
    ]  # fmt: skip
    header = [
        "model",
        "cache",
        "backend",
        "bits per element",
        "p_div [95% CI]",
        "first-divergence step [95% CI]",
        "E[M] [95% CI]",
        "mean KLD [95% CI]",
    ]
    return "\n".join(markdown_table(header, rows))


#: The figure's panels: column and axis label.
PANELS = (("p_div", "p_div (parted within T = 16)"), ("E_M", "E[M] (mismatched fraction of T)"),
          ("kld_mean", "mean KLD (nats per token)"))  # fmt: skip


#: Where a (model, rotation) pair sits within its column.
DODGE = {("smollm2-135m", True): -0.27, ("smollm2-135m", False): -0.09, ("gemma3-270m", True): 0.09,
         ("gemma3-270m", False): 0.27}  # fmt: skip


def draw(table: pl.DataFrame, path: Path) -> None:
    """p_div, E[M] and the mean KLD of each cache, a panel each (one above the other), the caches in
    columns by their bits per element (fewest right, int4 beside the llama.cpp type of its bits); one
    colour per model, rotation off an open marker beside the same type, int4 a square. The KLD panel is
    logarithmic: the f16 control (exactly 0) is not drawn there."""
    import matplotlib.pyplot as plt

    from kvdiverge.report.drawing import save_figure

    bases = table.with_columns(cache=pl.col("policy").str.strip_suffix(":norot"))
    columns = bases.unique(["cache", "backend"], maintain_order=True).sort(
        "bits", pl.col("backend") != "llama_cpp", descending=[True, False], maintain_order=True
    )
    column = {cache: i for i, cache in enumerate(columns["cache"])}
    fig, axes = plt.subplots(len(PANELS), 1, figsize=(0.9 * len(column) + 2, 2.6 * len(PANELS)), sharex=True)
    colours = dict(zip(table["model"].unique(maintain_order=True), ("tab:blue", "tab:orange", "tab:green")))
    for ax, (metric, label) in zip(axes, PANELS):
        for r in table.filter(pl.col(metric).is_not_null() & pl.col(metric).is_not_nan()).iter_rows(named=True):
            off = r["policy"].endswith(":norot")
            x = column[r["policy"].removesuffix(":norot")] + DODGE[(r["model"], not off)]
            if metric == "kld_mean" and r[metric] == 0:
                continue
            err = [[r[metric] - r[f"{metric}_lo"]], [r[f"{metric}_hi"] - r[metric]]]
            ax.errorbar(x, r[metric], yerr=err, fmt="s" if r["backend"] == "transformers" else "o",
                        color=colours[r["model"]], capsize=2, markerfacecolor="white" if off else colours[r["model"]])  # fmt: skip
        labels = [f"{c.replace('quanto:nbits=4', 'int4')}\n{b:g}" for c, b in zip(columns["cache"], columns["bits"])]
        ax.set_xticks(range(len(column)), labels, fontsize=8)
        ax.set_xlim(-0.5, len(column) - 0.5)
        ax.set_xlabel("cache type, bits per K or V element" if metric == PANELS[-1][0] else "")
        ax.set_ylabel(label)
        if metric == "kld_mean":
            ax.set_yscale("log")
    handles = [plt.Line2D([], [], color=c, marker="o", linestyle="", label=m) for m, c in colours.items()]
    handles += [
        plt.Line2D([], [], color="grey", marker="o", markerfacecolor="white", linestyle="", label="rotation off"),
        plt.Line2D([], [], color="grey", marker="s", linestyle="", label="transformers backend (no KLD)"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False, bbox_to_anchor=(0.5, -0.03))
    fig.suptitle("KV cache types against the full cache: 8 excerpts, T = 16, R = 2, 95 % intervals")
    fig.tight_layout()
    save_figure(fig, path)


if __name__ == "__main__":
    main()
