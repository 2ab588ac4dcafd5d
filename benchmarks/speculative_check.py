"""Check the self-speculative reading against a real speculative sampler on the embedded model.

For each press and prompt, the first draft block of ``k`` tokens is run by speculative
sampling (:func:`kvdiverge.testing.speculative.first_block_accepted`: draft = the model's
evicted twin under the press, target = the full cache) with ``--seeds`` independent seeds,
and its mean accepted length is set beside the survival-based estimate
``A_k = S_1 + ... + S_k`` of :func:`kvdiverge.measure` (``Measurement.speculative``, the
agreement chain of the coupling engine, ``--replicates`` per prompt) and Leviathan et al.'s
i.i.d. approximation ``(1 - alpha^{k+1}) / (1 - alpha) - 1`` accepted tokens at the
chain's mean per-step acceptance ``alpha``. Printed per press:

- per prompt: the sampler's mean accepted and its standard error, ``A_k`` and its standard
  error across replicates, and ``z = (sampler - A_k) / sqrt(se_1^2 + se_2^2)``;
- pooled over prompts (equal weight): the sampler's mean, ``A_k`` with its
  document-bootstrap interval and whether the sampler's mean lies inside it, the i.i.d. value.

Usage (short prompts, small k; the README quotes its output)::

    .venv/bin/python benchmarks/speculative_check.py --prompts 3 -k 4 --seeds 512 --replicates 64
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import polars as pl
import torch

import kvdiverge
from kvdiverge.config.inputs import prepare_documents
from kvdiverge.config.prompt_sources import sotu_prompts
from kvdiverge.models.embedded import EMBEDDED_MODEL
from kvdiverge.models.loading import load_model, local_entry
from kvdiverge.testing.speculative import DraftBlocks, first_block_accepted

PRESSES = {  # the default config's prefill presses (config/config.yaml)
    "snapkv-50": {"press": "SnapKVPress", "compression_ratio": 0.5, "window_size": 64, "kernel_size": 5},
    "recent-50": {"press": "StreamingLLMPress", "compression_ratio": 0.5, "n_sink": 4},
}


def build(spec: dict):
    import kvpress

    kw = {k: v for k, v in spec.items() if k != "press"}
    return getattr(kvpress, spec["press"])(**kw)


def per_document_A(m, policy: str, k: int) -> dict[str, tuple[float, float]]:
    """``A_k`` per prompt: replicate mean and its standard error (replicates of ``m``)."""
    out = {}
    for (doc,), g in m.replicates.filter(pl.col("policy") == policy).group_by(["doc_id"]):
        A = np.asarray(g["S"].to_list())[:, :k].sum(axis=1)
        out[doc] = (float(A.mean()), float(A.std(ddof=1) / math.sqrt(len(A))))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=3, help="State of the Union excerpts (embedded corpus)")
    ap.add_argument("--min-words", type=int, default=60)
    ap.add_argument("--max-words", type=int, default=110)
    ap.add_argument("-k", type=int, default=4, help="draft block length (tokens)")
    ap.add_argument("--seeds", type=int, default=512, help="speculative-sampling blocks per prompt")
    ap.add_argument("--replicates", type=int, default=64, help="agreement chains per prompt (measure)")
    ap.add_argument("--model-dir", default=None, help="a converted copy of the embedded model (faster load)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spec = EMBEDDED_MODEL if args.model_dir is None else local_entry(EMBEDDED_MODEL, args.model_dir)
    model, tok = load_model(spec)
    texts = sotu_prompts(args.prompts, args.min_words, args.max_words)
    docs = prepare_documents(texts, tok, instruction="Summarise the text above in two sentences.")
    start = time.perf_counter()
    m = kvdiverge.measure(
        model,
        tok,
        {d.doc_id: d.input_ids for d in docs},
        PRESSES,
        max_new_tokens=args.k,
        replicates=args.replicates,
        seed=0,
        bootstrap=2000,
        progress=False,
    )
    t_measure = time.perf_counter() - start
    spec_t = m.speculative.filter(pl.col("k") == args.k)
    print(
        f"prompts: {[len(d.input_ids) for d in docs]} tokens; k={args.k}; sampler seeds {args.seeds} per "
        f"prompt; chains {args.replicates} per prompt (measure {t_measure:.0f} s); temperature 0.7, top-p 0.95"
    )
    for name, press_spec in PRESSES.items():
        start = time.perf_counter()
        means = []
        A_doc = per_document_A(m, name, args.k)
        for i, d in enumerate(docs):
            acc = first_block_accepted(
                model, d.input_ids, build(press_spec), DraftBlocks(args.k, args.seeds, seed=1000 + i)
            )
            se = acc.std(ddof=1) / math.sqrt(len(acc))
            A, se_A = A_doc[d.doc_id]
            z = (acc.mean() - A) / math.sqrt(se**2 + se_A**2)
            means.append(acc.mean())
            print(
                f"  {name} {d.doc_id}: sampler {acc.mean():.3f} (se {se:.3f}, first token accepted in "
                f"{np.mean(acc >= 1):.0%})  A_k {A:.3f} (se {se_A:.3f})  z {z:+.2f}"
            )
        r = spec_t.filter(pl.col("policy") == name).row(0, named=True)
        pooled = float(np.mean(means))
        inside = r["A_lo"] <= pooled <= r["A_hi"]
        print(
            f"{name}: sampler mean accepted {pooled:.3f} | A_k {r['A']:.3f} [{r['A_lo']:.3f}, {r['A_hi']:.3f}] "
            f"(inside: {'yes' if inside else 'NO'}) | i.i.d. {r['iid_tokens_per_forward'] - 1:.3f} at "
            f"alpha {r['alpha']:.3f} | tokens per forward: sampler {pooled + 1:.3f}, A_k+1 "
            f"{r['tokens_per_forward']:.3f}, i.i.d. {r['iid_tokens_per_forward']:.3f} "
            f"({time.perf_counter() - start:.0f} s)"
        )


if __name__ == "__main__":
    main()
