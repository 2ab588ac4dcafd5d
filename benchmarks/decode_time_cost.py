"""Engine cost per token-step with and without decode-time eviction, on a config's model.

Runs config policies on the first ``--documents`` exploratory documents through the
workflow's runner (:func:`kvdiverge.engine.runner.run_documents`, one document per
forward) and prints per policy the wall and CPU seconds, the engine's token-steps (one
next-token distribution of one row on one side; chain steps plus branch lags, both
sides) and CPU milliseconds per token-step; for a decode-time policy also the evicted
side's lane, replay and prefill counts (:attr:`kvdiverge.engine.llm.decode_pair.DecodeTimePair.counts`)::

    .venv/bin/python benchmarks/decode_time_cost.py --config config/config.yaml \\
        --policies recent-50 window-50 --documents 2

``--apart`` runs each policy a second time with every replay lane kept apart (no lane
merging, as for a press with step counters), right after the first run, so the merging of
a document's lanes (``SlidingWindowPress``) shows as a ratio; ``--batch-documents`` sets the
documents per batched forward (1 by default; the workflow's ``auto`` puts a shard's
documents in one batch).

CPU seconds (``time.process_time``, one torch thread) are the figure to compare on a
shared machine: wall time there includes the waits for other processes.
"""

from __future__ import annotations

import argparse
import time

import polars as pl
import torch

import kvdiverge.engine.llm.decode_pair as decode_pair
from kvdiverge.config.workflow import load_config
from kvdiverge.data.corpus import build_corpus
from kvdiverge.data.prompts import render_ids
from kvdiverge.engine.core.sampling import Decoding, Sampling
from kvdiverge.engine.presses.policies import policies_from_config
from kvdiverge.engine.runner import Document, RunOptions, run_documents
from kvdiverge.models.loading import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="config/config.yaml")
    ap.add_argument("--policies", nargs="+", default=["recent-50", "window-50"])
    ap.add_argument("--documents", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch-documents", type=int, default=1)
    ap.add_argument("--apart", action="store_true", help="also run with every replay lane kept apart")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    docs = build_corpus(cfg["corpus"]).filter(pl.col("split") == "exploratory").head(args.documents)
    name = next(iter(cfg["models"]))
    model, tokenizer = load_model(cfg["models"][name], name)
    documents = [
        Document(d, render_ids(tokenizer, text, cfg["prompt"]["instruction"]))
        for d, text in zip(docs["doc_id"], docs["text"])
    ]
    T, R = int(cfg["decoding"]["max_new_tokens"]), int(cfg["replicates"])
    print(f"{name}: {len(documents)} documents, prompts {[d.prompt_len for d in documents]} tokens, T = {T}, R = {R}")
    counts: list[dict[str, int]] = []
    close = decode_pair.DecodeTimePair.close

    def recording_close(pair):
        counts.append(dict(pair.counts))
        close(pair)

    decode_pair.DecodeTimePair.close = recording_close
    policies = policies_from_config(cfg)
    merges = decode_pair._merges_lanes
    variants = [("", merges)] + ([(" (lanes apart)", lambda press: False)] if args.apart else [])
    for policy in args.policies:
        for label, merging in variants:
            decode_pair._merges_lanes = merging
            counts.clear()
            wall, cpu = time.perf_counter(), time.process_time()
            recs = run_documents(
                model,
                documents,
                policies[policy],
                Sampling(
                    T=T,
                    replicates=R,
                    decoding=Decoding(
                        temperature=float(cfg["decoding"]["temperature"]), top_p=float(cfg["decoding"]["top_p"])
                    ),
                    seed=int(cfg["seed"]),
                    model_name=name,
                ),
                RunOptions(batch_documents=args.batch_documents),
            )
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            steps = sum(2 * (sum(1 for v in r["tv"] if v == v) + len(r["branch_x"])) for r in recs)
            total = {k: sum(c[k] for c in counts) for k in counts[0]} if counts else {}
            print(
                f"{policy}{label}: wall {wall:.1f} s, CPU {cpu:.1f} s, {steps} token-steps, "
                f"{1000 * cpu / steps:.1f} CPU ms per token-step" + (f"; {total}" if total else ""),
                flush=True,
            )
    decode_pair._merges_lanes = merges


if __name__ == "__main__":
    main()
