"""Does the FLOPs formula scale with the measured cost? Decode forwards at several widths and vocabularies, on the CPU.

``kvdiverge.planning.roofline.flops_per_token`` (Kaplan et al. 2020, Table 1, with the
attention-times-values product) predicts the GPU time of the study from the architecture. This
benchmark checks its scaling where it can be checked, on this machine's CPU: random Llama-3.1
stand-ins (``kvdiverge.models.standins.MINIATURE``'s structure: 4:1 grouped-query attention,
Llama-3.1 RoPE) at widths and vocabularies chosen so that the formula's three terms (weights,
logits, attention) each dominate somewhere. Per size it times decode forwards of ``rows`` rows
on a ``context``-token cache (transformers' ``DynamicCache``, torch on one thread) and prints the
FLOPs per token-step, the seconds per token-step and the achieved GFLOP/s. Where the formula
holds, the achieved rate is the same at every size large enough to keep the CPU's matmuls busy;
a term the formula misses would show as a rate that falls with that term's size::

    python benchmarks/flops_scaling.py                 # about 2 minutes on one core
    python benchmarks/flops_scaling.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from kvdiverge.models.standins import MINIATURE, random_model
from kvdiverge.planning.roofline import flops_per_token, parameter_counts

#: (hidden size, layers, vocabulary): the weights term grows 16x from the first to the third;
#: the third and fourth differ only in the logits' term; the last is the largest width.
SIZES = ((256, 4, 4096), (512, 4, 4096), (1024, 4, 4096), (1024, 4, 32768), (2048, 4, 4096))


def values_at(hidden: int, layers: int, vocab: int) -> dict:
    heads = hidden // 64  # head dim 64, 4 query heads per KV head as Llama-3.1
    return {
        **MINIATURE["llama-3.1-8b"],
        "hidden_size": hidden,
        "intermediate_size": int(hidden * 3.5),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 4),
        "vocab_size": vocab,
        "eos_token_id": [vocab - 1],
    }


@torch.inference_mode()
def seconds_per_token_step(model, rows: int, context: int, steps: int) -> float:
    """Mean seconds of one row's decode forward, over ``steps`` forwards of ``rows`` rows."""
    from transformers import DynamicCache

    vocab = model.config.vocab_size
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.randint(0, vocab, (1, context)), past_key_values=cache, use_cache=True)
    cache.batch_repeat_interleave(rows)  # one prefill, copied to every row: only the decode is timed
    token = torch.randint(0, vocab, (rows, 1))
    model(input_ids=token, past_key_values=cache, use_cache=True)  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        model(input_ids=token, past_key_values=cache, use_cache=True)
    return (time.perf_counter() - start) / steps / rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = []
    print(f"rows {args.rows}, context {args.context}, {args.steps} forwards, {args.threads} thread(s)")
    print(f"{'hidden':>6} {'layers':>6} {'vocab':>6} {'params':>10} {'GFLOP/token':>11} {'ms/token':>9} {'GFLOP/s':>8}")
    for hidden, layers, vocab in SIZES:
        values = values_at(hidden, layers, vocab)
        model = random_model(values)
        flops = flops_per_token(values, args.context)
        s = seconds_per_token_step(model, args.rows, args.context, args.steps)
        row = {
            "hidden": hidden,
            "layers": layers,
            "vocab": vocab,
            "parameters": parameter_counts(values)["total"],
            "flops_per_token": flops,
            "seconds_per_token": s,
            "gflops_per_s": flops / s / 1e9,
        }
        out.append(row)
        print(
            f"{hidden:>6} {layers:>6} {vocab:>6} {row['parameters']:>10,} {flops / 1e9:>11.3f} "
            f"{s * 1e3:>9.3f} {row['gflops_per_s']:>8.1f}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "sizes": out}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
