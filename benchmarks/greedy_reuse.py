"""Benchmark: a greedy task side with each document's full-cache answer decoded once for every point.

Runs :func:`kvdiverge.measure` as the prediction study's task sides do (the needle task,
temperature 0, one replicate, ``T = 16``) on the embedded model: seven frontier points (five
presses at 0.5, the noise floor and the 4-bit cache alone) on ``--documents`` excerpts, for the kvdiverge
package on ``--src`` (e.g. a checkout without the shared reference, to compare). Prints the
wall and CPU seconds of the call, the load average before and after, and with ``--profile``
the cumulative seconds of the engine's phases (cProfile).

    PYTHONPATH=src .venv/bin/python benchmarks/greedy_reuse.py [--src OTHER/src] [--documents 7] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

#: the frontier's presses (without their ratio), as config/fidelity-predicts-task.yaml's
PRESSES = {
    "snapkv": {"press": "SnapKVPress", "window_size": 64, "kernel_size": 5},
    "knorm": {"press": "KnormPress"},
    "streamingllm": {"press": "StreamingLLMPress", "n_sink": 4},
    "tova": {"press": "TOVAPress"},
    "expected-attention": {"press": "ExpectedAttentionPress"},
}
#: the 4-bit cache alone (decoded on lanes: it quantizes while decoding)
CACHES = {"int4": {"backend": "quanto", "nbits": 4, "q_group_size": 64, "residual_length": 32}}
#: (file, function) of the phases the profile reports
PHASES = (
    ("runner.py", "run_policies"),
    ("sharing.py", "shared_prefills"),
    ("reference.py", "greedy_reference"),
    ("llm_pair.py", "start"),
    ("llm_pair.py", "advance"),
    ("decode_pair.py", "start"),
    ("decode_pair.py", "advance"),
    ("tables.py", "task_tables"),
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", default=None, help="kvdiverge source folder to import (default: this checkout's)")
    ap.add_argument("--documents", type=int, default=7, help="excerpts (the needle task may exclude some)")
    ap.add_argument("--question", default="inside", choices=["inside", "after"])
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    if args.src:
        sys.path.insert(0, str(Path(args.src).resolve()))
    import torch

    import kvdiverge
    from kvdiverge.config.prompt_sources import sotu_prompts
    from kvdiverge.models.loading import EMBEDDED_MODEL, EMBEDDED_NAME, load_model

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model, tokenizer = load_model(EMBEDDED_MODEL, EMBEDDED_NAME)
    prompts = sotu_prompts(args.documents, 300, 450)
    options = dict(
        max_new_tokens=16,
        replicates=1,
        temperature=0.0,
        top_p=1.0,
        task={"name": "niah", "question": args.question},
        progress=False,
        model_name=EMBEDDED_NAME,
        bootstrap=200,
    )
    warm = {"knorm": {"press": "KnormPress", "compression_ratio": 0.5}}
    kvdiverge.measure(model, tokenizer, dict(list(prompts.items())[:1]), warm, **options)
    print(f"source {sys.modules['kvdiverge'].__file__}")
    print(f"load before: {os.getloadavg()}")
    prof = cProfile.Profile() if args.profile else None
    wall, cpu = time.perf_counter(), time.process_time()
    if prof:
        prof.enable()
    result = kvdiverge.measure(
        model, tokenizer, prompts, PRESSES, ratios=[0.5], caches=CACHES, cache_ratios=[0], **options
    )
    if prof:
        prof.disable()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(f"load after: {os.getloadavg()}")
    docs = result.trajectories["doc_id"].n_unique()
    points = result.trajectories["policy"].n_unique()
    print(f"{points} points x {docs} documents, T=16, greedy: wall {wall:.1f} s, CPU {cpu:.1f} s")
    if prof:
        stats = pstats.Stats(prof, stream=io.StringIO()).stats
        for file, phase in PHASES:
            spent = sum(v[3] for k, v in stats.items() if k[2] == phase and _ours(k[0], file))
            print(f"  {file}:{phase}: {spent:.1f} s (cumulative)")
    print(result.task["accuracy"].select("policy", "n_docs", "full_accuracy", "accuracy").sort("policy"))


def _ours(path: str, file: str) -> bool:
    """True for ``file`` of the kvdiverge package."""
    return "/kvdiverge/" in path and path.endswith("/" + file)


if __name__ == "__main__":
    main()
