"""Decode-time eviction: the evicted kernel along chains and branches equals an independent replay."""

from __future__ import annotations

import contextlib

import kvpress
import pytest
import torch
from transformers import DynamicCache

from kvdiverge.engine.core.coupled import run_batch
from kvdiverge.engine.core.decoding import decode_log_probs
from kvdiverge.engine.core.sampling import Decoding, Sampling
from kvdiverge.engine.llm.decode_pair import DecodeTimePair
from kvdiverge.engine.llm.pair_base import PairDocument
from kvdiverge.engine.llm.twin import evicted_twin
from kvdiverge.engine.presses.registry import is_decode_time, refusal
from kvdiverge.engine.presses.window import SlidingWindowPress
from kvdiverge.engine.runner import RunOptions
from kvdiverge.models.standins import MINIATURE, random_model
from kvdiverge.testing.recording import RecordingPair

T, TEMPERATURE = 10, 2.0  # a flat sampling temperature spreads the branch starts t*


@pytest.fixture(scope="module")
def model():
    return random_model(MINIATURE["llama-3.1-8b"], initializer_range=0.2)


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, 500, (n,), generator=gen).tolist() for n in (20, 26, 17)]


def decoding_press():
    return kvpress.DecodingPress(kvpress.KnormPress(), compression_interval=2, target_size=8)


PRESSES = {
    "decoding": decoding_press,
    "ratio-decoding": lambda: kvpress.CompressionRatioDecodingPress(
        kvpress.KnormPress(), compression_interval=3, target_compression_ratio=0.6
    ),
    "prefill-decoding": lambda: kvpress.PrefillDecodingPress(
        prefilling_press=kvpress.SnapKVPress(0.5, window_size=4),
        decoding_press=kvpress.DecodingPress(kvpress.KnormPress(), compression_interval=2, target_size=6),
    ),
    "window": lambda: SlidingWindowPress(0.5, n_sink=2),
    # masks ~half of the prompt at prefill and keeps masking while generating (module state, per row)
    "dms": lambda: kvpress.DMSPress(kvpress.KnormPress(), threshold=-4.0, sliding_window_size=4, decoding=True),
}


@torch.inference_mode()
def replay(model, ids, press, history, temperature=TEMPERATURE, penalty=1.0):
    """Independent replay: fresh twin, fresh press, fresh prefill, then ``history`` one token per forward
    (``press`` None: the plain model, the full cache); with a repetition ``penalty``, each step's raw
    logits penalized on the prompt and the history before it (transformers' rule, by hand)."""

    def decode(logits, context):
        if penalty != 1.0:
            seen = torch.zeros(logits.shape, dtype=torch.bool)
            seen[0, context] = True
            logits = torch.where(seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits)
        return decode_log_probs(logits, temperature, 1.0, dtype=torch.float64)[0]

    twin = evicted_twin(model)
    cache = DynamicCache()
    out = []
    with press(twin) if press is not None else contextlib.nullcontext():
        logits = twin(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True, logits_to_keep=1).logits[
            :, -1
        ]
        out.append(decode(logits, list(ids)))
        for t, tok in enumerate(history):
            logits = twin(
                input_ids=torch.tensor([[tok]]),
                past_key_values=cache,
                use_cache=True,
                position_ids=torch.tensor([[len(ids) + t]]),
            ).logits[:, -1]
            out.append(decode(logits, list(ids) + list(history[: t + 1])))
    return out


def run(model, prompts, make, R):
    rec = RecordingPair(
        DecodeTimePair(
            model, [PairDocument(ids, make()) for ids in prompts], decoding=Decoding(temperature=TEMPERATURE)
        )
    )
    out = run_batch(rec, T, R, 11, "miniature", [f"d{i}" for i in range(len(prompts))])
    return rec, out


def branch_history(r):
    return r["chain_token"][: r["t_star"] - 1] + [r["y_star"]] + r["branch_y"]


def until_eos(tokens, model):
    """``tokens`` up to and including the first end-of-sequence id (the engine feeds nothing after it)."""
    eos = set(model.generation_config.eos_token_id)
    for i, tok in enumerate(tokens):
        if tok in eos:
            return tokens[: i + 1]
    return tokens


def compare(model, prompts, make, R, check):
    """Check every recorded evicted log-distribution of every row against its independent replay."""
    rec, out = run(model, prompts, make, R)
    t_stars = []
    for g, r in enumerate(out):
        ids = prompts[g // R]
        chain = until_eos([tok for tok in r["chain_token"] if tok >= 0], model)
        ref_chain = replay(model, ids, make(), chain[:-1])
        for t in range(len(chain)):
            check(rec.seen[(g, tuple(chain[:t]))], ref_chain[t])
        if r["t_star"] is None or not r["branch_y"]:
            continue
        t_stars.append(r["t_star"])
        h = branch_history(r)
        ref_branch = replay(model, ids, make(), h[:-1])
        fed = [n for n in range(r["t_star"], len(h)) if (g, tuple(h[:n])) in rec.seen]
        assert fed[:1] == [r["t_star"]] and fed == list(range(fed[0], fed[-1] + 1))  # only absorbed EOS tails unfed
        for n in fed:  # the branch's q: after h_<t*, y*, Y_{t*+1}, ...
            check(rec.seen[(g, tuple(h[:n]))], ref_branch[n])
    return t_stars


@pytest.mark.miniature
@pytest.mark.parametrize("name", sorted(PRESSES))
def test_one_row_equals_independent_replay_bit_for_bit(model, prompts, name):
    t_stars = []
    for d in range(3):
        t_stars += compare(
            model, prompts[d : d + 1], PRESSES[name], 1, lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0)
        )
    assert t_stars  # branches happened


@pytest.mark.miniature
def test_a_repetition_penalty_penalizes_each_rows_own_evicted_context(model, prompts):
    """Along chains and branches, the evicted side's distribution equals a replay penalized on the
    prompt and that row's own evicted history, bit for bit."""
    penalty, ids = 1.5, prompts[0]
    decoding = Decoding(temperature=TEMPERATURE, repetition_penalty=penalty)
    rec = RecordingPair(DecodeTimePair(model, [PairDocument(ids, decoding_press())], decoding=decoding))
    out = run_batch(rec, T, 1, 11, "miniature", ["d0"])  # one row: its lane is unbatched, bit for bit
    assert out[0]["t_star"] is not None and out[0]["branch_y"]  # a branch happened
    for (_, history), logq in rec.seen.items():
        want = replay(model, ids, decoding_press(), list(history), penalty=penalty)[-1]
        torch.testing.assert_close(logq, want, rtol=0, atol=0)
    plain = replay(model, ids, decoding_press(), [], penalty=1.0)[0]
    assert not torch.equal(rec.seen[(0, ())], plain)  # the prompt's tokens are penalized from the first step


@pytest.mark.miniature
def test_branches_start_before_and_after_compression_events(model, prompts):
    # interval 2: an event after each even number of generated tokens; t* - 1 tokens are replayed
    t_stars = compare(model, prompts, decoding_press, 4, lambda a, b: None)
    assert {t % 2 for t in t_stars} == {0, 1} and len(set(t_stars)) >= 3


@pytest.mark.miniature
@pytest.mark.parametrize("name", ["decoding", "window", "prefill-decoding", "dms"])
def test_three_documents_equal_replay_within_batch_tolerance(model, prompts, name):
    # rows in one lane: batched forward vs a single-row one, float32 rounding only
    def close(a, b):
        fin = torch.isfinite(b)
        assert torch.equal(fin, torch.isfinite(a))
        assert float((a[fin].exp() - b[fin].exp()).abs().max()) < 1e-5

    assert compare(model, prompts, PRESSES[name], 3, close)


@pytest.mark.miniature
def test_chain_compresses_and_counts_replay(model, prompts):
    pair = DecodeTimePair(
        model, [PairDocument(ids, decoding_press()) for ids in prompts], decoding=Decoding(temperature=TEMPERATURE)
    )
    out = run_batch(pair, T, 3, 11, "miniature", ["d0", "d1", "d2"])
    assert pair.kept_lens == [8, 8, 8]  # target_size, reached along the chain (the prompt is kept at prefill)
    starts = [(r["t_star"], i // 3) for i, r in enumerate(out) if r["t_star"] and r["branch_y"]]
    groups = {(t, d) for t, d in starts if t > 1}
    c = pair.counts
    # one prefill per chain lane; each replay lane restores a copy of it (rows of a document cut back to
    # one length in one call share a lane)
    assert c["prefill_forwards"] == 3
    assert len({(t, d) for t, d in starts}) <= c["prefills_restored"] <= len(starts)
    assert sum(t - 1 for t, _ in groups) <= c["replay_forwards"] <= sum(t - 1 for t, _ in starts)
    assert c["replay_row_steps"] == sum(t - 1 for t, _ in starts)
    twins = [lane.twin for lane in pair._lanes]
    pair.close()
    assert pair._lanes == [] and not any(m._forward_hooks for twin in twins for m in twin.modules())


@pytest.mark.miniature
def test_window_press_holds_the_window_every_step(model, prompts):
    press = SlidingWindowPress(0.5, n_sink=2)
    twin = evicted_twin(model)
    cache = DynamicCache()
    ids = prompts[0]
    with torch.inference_mode(), press(twin):
        twin(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
        first = cache.layers[0].keys.clone()
        assert first.shape[2] == 10 == press.kept_tokens(20)
        for t in range(3):
            twin(
                input_ids=torch.tensor([[7]]),
                past_key_values=cache,
                use_cache=True,
                position_ids=torch.tensor([[20 + t]]),
            )
            keys = cache.layers[0].keys
            assert keys.shape[2] == 10
    # sinks stay, the oldest recent positions left one per step
    assert torch.equal(keys[:, :, :2], first[:, :, :2])
    assert torch.equal(keys[:, :, 2:7], first[:, :, 5:10])


@pytest.mark.miniature
def test_decode_time_detection_and_refusal():
    assert is_decode_time(decoding_press()) and is_decode_time(SlidingWindowPress(0.5))
    assert is_decode_time(PRESSES["prefill-decoding"]())
    assert is_decode_time(kvpress.DMSPress(kvpress.KnormPress(), threshold=-1.0, decoding=True))
    assert not is_decode_time(kvpress.DMSPress(kvpress.KnormPress(), threshold=-1.0))
    assert not is_decode_time(kvpress.SnapKVPress(0.5))
    assert not is_decode_time(kvpress.PrefillDecodingPress(prefilling_press=kvpress.SnapKVPress(0.5)))
    cam = kvpress.CAMPress(kvpress.KnormPress(), compression_interval=2, target_size=8)
    assert is_decode_time(cam) and "random" in refusal(cam)
    assert refusal(decoding_press()) is None
    with pytest.raises(ValueError, match="CAMPress"):
        DecodeTimePair(
            random_model(MINIATURE["qwen-2.5-7b"]), [PairDocument([1, 2, 3], cam)], decoding=Decoding(temperature=1.0)
        )


@pytest.mark.miniature
@torch.inference_mode()
def test_dropped_rows_ride_along_and_kept_rows_stay_exact(model, prompts):
    make = decoding_press
    pair = DecodeTimePair(
        model, [PairDocument(ids, make()) for ids in prompts[:2]], decoding=Decoding(temperature=TEMPERATURE)
    )
    pair.start(4)
    hist = [[5], [6], [7], [8]]
    for step in range(5):  # compression events after steps 2 and 4
        _, logq = pair.advance(torch.zeros(len(hist), dtype=torch.long), torch.tensor([h[-1] for h in hist]))
        if step == 2:
            pair.keep_rows(torch.tensor([3, 0]))  # rows leave, in a new order
            hist, logq = [hist[3], hist[0]], logq[[3, 0]]
        for i, h in enumerate(hist):
            h.append(100 + 10 * i + step)
    for i, (h, d) in enumerate(zip(hist, [1, 0])):
        ref = replay(model, prompts[d], make(), h[:-1])[-1]
        assert float((logq[i].exp() - ref.exp()).abs().max()) < 1e-5
    assert len(pair._lanes) == 2  # both chain lanes still hold a row; the dropped rows ride along


@pytest.mark.miniature
@pytest.mark.parametrize("merge", [True, False], ids=["merged", "apart"])
def test_window_lanes_of_a_document_decode_as_one(model, prompts, monkeypatch, merge):
    # SlidingWindowPress holds K positions per layer whatever the history: a replayed branch
    # joins its document's lane, so the evicted side takes the reference side's forwards and
    # row-steps exactly (one per document per step, no riding rows)
    import kvdiverge.engine.llm.decode_pair as decode_pair

    if not merge:
        monkeypatch.setattr(decode_pair, "_merges_lanes", lambda press: False)
    pair = DecodeTimePair(
        model, [PairDocument(ids, PRESSES["window"]()) for ids in prompts], decoding=Decoding(temperature=TEMPERATURE)
    )
    lanes_per_doc = []
    advance = pair.advance

    def counting_advance(x, y):
        out = advance(x, y)
        lanes_per_doc.append(max(sum(lane.doc == d for lane in pair._lanes) for d in range(3)))
        return out

    pair.advance = counting_advance
    out = run_batch(pair, T, 3, 11, "miniature", ["d0", "d1", "d2"])
    c = pair.counts
    assert sum(1 for r in out if r["t_star"] and r["t_star"] > 1 and r["branch_y"]) >= 3  # branches replayed
    if merge:
        assert max(lanes_per_doc) == 1
        assert c["lane_row_steps"] == c["reference_row_steps"]  # no riding rows
        assert c["lane_forwards"] <= 3 * c["reference_forwards"]  # one lane per document per step
    else:
        assert max(lanes_per_doc) > 1
        assert c["lane_forwards"] > 3 * c["reference_forwards"]
    pair.close()


@pytest.mark.miniature
@pytest.mark.parametrize("name", ["window", "decoding"])
def test_the_reference_side_is_batched_once_every_prefill_evicted(model, prompts, name):
    # SlidingWindowPress evicts at prefill: Q != P from step 1, so every document's reference rows
    # decode in one forward; DecodingPress keeps the prompt at prefill (Q = P exactly until its
    # first compression), so each document keeps an unpadded reference on the lanes' kernels
    pair = DecodeTimePair(
        model, [PairDocument(ids, PRESSES[name]()) for ids in prompts], decoding=Decoding(temperature=TEMPERATURE)
    )
    advances = []
    advance = pair.advance
    pair.advance = lambda x, y: advances.append(x.numel()) or advance(x, y)
    run_batch(pair, T, 3, 11, "miniature", ["d0", "d1", "d2"])
    c = pair.counts
    assert c["reference_row_steps"] == sum(advances)
    if name == "window":
        assert c["reference_forwards"] == len(advances)
    else:
        assert c["reference_forwards"] > len(advances)
    pair.close()


@pytest.mark.miniature
@pytest.mark.parametrize("name", ["window", "decoding", "dms"])
def test_the_chain_lanes_prefill_gives_the_full_cache_and_ratio_0_gives_tv_0(model, prompts, name):
    # one prefill forward per document: the full cache is copied before each layer's compression,
    # and at ratio 0 (nothing evicted, ever) every step's TV is exactly 0
    pair = DecodeTimePair(
        model, [PairDocument(ids, PRESSES[name]()) for ids in prompts], decoding=Decoding(temperature=TEMPERATURE)
    )
    run_batch(pair, T, 3, 11, "miniature", ["d0", "d1", "d2"])
    assert pair.counts["reference_prefills"] == 0 and pair.counts["prefill_forwards"] >= 3
    pair.close()
    zero = DecodeTimePair(
        model,
        [PairDocument(ids, SlidingWindowPress(0.0, n_sink=2)) for ids in prompts],
        decoding=Decoding(temperature=TEMPERATURE),
    )
    out = run_batch(zero, T, 3, 11, "miniature", ["d0", "d1", "d2"])
    assert zero.counts["reference_prefills"] == 0
    assert all(tv == 0.0 for r in out for tv in r["tv"]) and all(r["t_star"] is None for r in out)
    zero.close()


@pytest.mark.miniature
@torch.inference_mode()
def test_the_batched_reference_equals_the_full_cache_model(model, prompts):
    # every reference log-distribution of chains and branches, against one full forward of the
    # prompt and the row's reference history: the float32 rounding of the padded batch only
    class RecordP(RecordingPair):
        def start(self, n):
            self.xh, self.p = [[] for _ in range(n)], {}
            logp, logq = super().start(n)
            self._record_p(logp)
            return logp, logq

        def _record_p(self, logp):
            for i, g in enumerate(self.ids):
                self.p[(g, tuple(self.xh[i]))] = logp[i].clone()

        def advance(self, x, y):
            for i, tok in enumerate(x.tolist()):
                self.xh[i].append(tok)
            logp, logq = super().advance(x, y)
            self._record_p(logp)
            return logp, logq

        def rewind(self, length):
            for i, n in enumerate(length.tolist()):
                del self.xh[i][n:]
            super().rewind(length)

        def keep_rows(self, rows):
            self.xh = [self.xh[i] for i in rows.tolist()]
            super().keep_rows(rows)

    rec = RecordP(
        DecodeTimePair(
            model,
            [PairDocument(ids, PRESSES["window"]()) for ids in prompts],
            decoding=Decoding(temperature=TEMPERATURE),
        )
    )
    run_batch(rec, T, 3, 11, "miniature", ["d0", "d1", "d2"])
    assert len(rec.pair._refs) == 1
    worst = 0.0
    for (g, hist), logp in rec.p.items():
        ids = torch.tensor([prompts[g // 3] + list(hist)])
        ref = decode_log_probs(model(input_ids=ids).logits[:, -1], TEMPERATURE, 1.0, dtype=torch.float64)[0]
        worst = max(worst, float((logp.exp() - ref.exp()).abs().max()))
    assert len(rec.p) > 3 * T and worst < 1e-5


@pytest.mark.miniature
def test_lanes_of_presses_with_step_counters_stay_apart(model, prompts):
    # DecodingPress counts steps per lane: a replayed branch keeps a lane of its own
    pair = DecodeTimePair(
        model, [PairDocument(ids, decoding_press()) for ids in prompts], decoding=Decoding(temperature=TEMPERATURE)
    )
    run_batch(pair, T, 3, 11, "miniature", ["d0", "d1", "d2"])
    assert pair.counts["lane_forwards"] > pair.counts["reference_forwards"]
    pair.close()


def test_config_entries_are_recognised():
    assert is_decode_time({"press": "SlidingWindowPress", "compression_ratio": 0.5, "n_sink": 4})
    assert is_decode_time({"press": "DecodingPress", "params": {"base_press": {"press": "KnormPress"}}})
    assert is_decode_time(
        {
            "press": "PrefillDecodingPress",
            "params": {"decoding_press": {"press": "DecodingPress", "base_press": {"press": "KnormPress"}}},
        }
    )
    assert is_decode_time({"press": "DMSPress", "params": {"decoding": True}})
    assert not is_decode_time({"press": "DMSPress", "params": {"decoding": False}})
    assert not is_decode_time({"press": "StreamingLLMPress", "compression_ratio": 0.5})
    assert not is_decode_time(
        {"press": "PrefillDecodingPress", "params": {"prefilling_press": {"press": "SnapKVPress"}}}
    )


def test_planner_counts_the_replay_lanes():
    from kvdiverge.engine.llm.planner import cache_columns, plan_batch

    # per document: rows x (widest cache x 100 bytes + vocab x 52) + 2 prefill caches of the prompt;
    # R = 2, prompt 90, T 10, vocab 50
    args = dict(kv_bytes_per_token=100, prompt_len=90, T=10, replicates=2, vocab_size=50, documents=100)
    per_row = cache_columns(90, 10) * 100 + 50 * 52
    prefills = 2 * 90 * 100
    assert plan_batch(memory_budget_bytes=12 * (4 * per_row + prefills), **args) == 12  # 2R rows per document
    assert plan_batch(memory_budget_bytes=12 * (6 * per_row + prefills), decode_time=True, **args) == 12  # 3R rows
    assert plan_batch(memory_budget_bytes=12 * (4 * per_row + prefills), decode_time=True, **args) == 8


@pytest.mark.miniature
def test_runner_chooses_the_decode_time_pair(model, prompts):
    from kvdiverge.engine.presses.policies import PressPolicy
    from kvdiverge.engine.runner import Document, run_documents

    docs = [Document(f"d{i}", p) for i, p in enumerate(prompts)]

    def run(press, B):
        return run_documents(
            model,
            docs,
            PressPolicy("p", press),
            Sampling(
                T=8, replicates=2, decoding=Decoding(temperature=TEMPERATURE, top_p=1.0), seed=5, model_name="miniature"
            ),
            RunOptions(batch_documents=B),
        )

    # kept_len: the fewest positions along the chain (the decoding press reaches target_size = 8)
    assert {r["kept_len"] for r in run(decoding_press(), 1)} == {8}
    window = run(SlidingWindowPress(0.5, n_sink=2), 1)
    assert [r["kept_len"] for r in window] == [10, 10, 13, 13, 8, 8]
    # several documents per batch (rows leave as they finish): the same trajectories up to rounding
    batched = run(SlidingWindowPress(0.5, n_sink=2), 3)
    for a, b in zip(window, batched):
        assert a["t_star"] == b["t_star"] and a["branch_y"] == b["branch_y"]
        assert max(abs(x - y) for x, y in zip(a["branch_tv"] + a["tv"], b["branch_tv"] + b["tv"])) < 1e-5


def test_a_batch_of_documents_gives_each_the_records_it_has_alone(model, prompts):
    """Before the first compression Q = P exactly, in any batch: TV 0, so a row branches
    (or not) whatever the number of documents decoded together; the records equal, exactly,
    those of each document run alone."""
    make = lambda: kvpress.DecodingPress(kvpress.KnormPress(), compression_interval=4, target_size=8)  # noqa: E731
    R = 3

    def records(docs, ids):
        pair = DecodeTimePair(
            model, [PairDocument(prompt, make()) for prompt in docs], decoding=Decoding(temperature=TEMPERATURE)
        )
        return run_batch(pair, T, R, 11, "miniature", ids)

    batch = records(prompts, [f"d{i}" for i in range(len(prompts))])
    alone = [r for d in range(len(prompts)) for r in records(prompts[d : d + 1], [f"d{d}"])]
    assert all(r["tv"][:5] == [0.0] * 5 for r in batch)  # steps before the first compression
    assert any(r["tv"][5] > 0 for r in batch)  # the compression after the fourth token changes Q
    assert batch == alone


@pytest.mark.miniature
@pytest.mark.parametrize("name", ["prefill-decoding", "decoding"])
def test_sampled_chain_tv_equals_kvpress_pipeline(model, prompts, name):
    """Sampled at temperature 1, two documents of different lengths (the reference side left-padded,
    on the decoding kernels), R = 2 rows per chain lane: every recorded chain ``tv_t`` is
    ``TV(P, Q)`` of the plain model and of kvpress's own pipeline (fresh prefill under a fresh
    press, then one token per forward) after the same history, within float32 rounding
    (the lane's two rows decode in one forward, the pipeline's one alone)."""
    docs = prompts[:2]
    pair = DecodeTimePair(
        model, [PairDocument(ids, PRESSES[name]()) for ids in docs], decoding=Decoding(temperature=1.0)
    )
    out = run_batch(pair, T, 2, 5, "miniature", ["d0", "d1"])
    steps = 0
    for g, r in enumerate(out):
        chain = until_eos([tok for tok in r["chain_token"] if tok >= 0], model)
        ids = docs[g // 2]
        logp = replay(model, ids, None, chain[:-1], temperature=1.0)
        logq = replay(model, ids, PRESSES[name](), chain[:-1], temperature=1.0)
        for t in range(len(chain)):
            expected = 0.5 * float((logp[t].exp() - logq[t].exp()).abs().sum())
            assert abs(r["tv"][t] - expected) < 1e-5, (g, t, r["tv"][t], expected)
            steps += expected > 1e-3  # compressed steps, not only the prompt-wide prefill eviction
    assert steps >= 8 and len({tuple(r["chain_token"]) for r in out}) == 4  # sampled, distinct chains


@pytest.mark.miniature
def test_the_lanes_do_not_depend_on_the_reference_sides_kernels(model, prompts):
    """The decoding kernels (caches written in place, grouped attention) are the reference side's
    alone: after the same history the evicted side's ``q`` is the same, bit for bit, with the stock
    kernels (:func:`stock_kernels`); only ``p`` moves, by float32 rounding."""
    from kvdiverge.engine.llm.pair_base import stock_kernels

    docs = prompts[:2]

    def records(fast):
        pair = RecordingPair(
            DecodeTimePair(
                model,
                [PairDocument(ids, PRESSES["prefill-decoding"]()) for ids in docs],
                decoding=Decoding(temperature=1.0),
                fast=fast,
            )
        )
        return pair, run_batch(pair, T, 2, 5, "miniature", ["d0", "d1"])

    (fast, out_fast), (stock, out_stock) = records(True), records(False)
    with stock_kernels():
        assert not DecodeTimePair(model, [PairDocument(docs[0])], decoding=Decoding(temperature=1.0)).fast
    shared = fast.seen.keys() & stock.seen.keys()
    assert len(shared) >= 4 * T  # every chain prefix at least
    assert all(torch.equal(fast.seen[k], stock.seen[k]) for k in shared)
    assert [r["chain_token"] for r in out_fast] == [r["chain_token"] for r in out_stock]
    gap = max(abs(a - b) for r, s in zip(out_fast, out_stock) for a, b in zip(r["tv"], s["tv"]))
    assert 0 < gap < 1e-5  # the reference side's rounding
