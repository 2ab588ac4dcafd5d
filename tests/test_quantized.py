"""Quantized KV caches as decode-time policies: exact against transformers' QuantizedCache, lanes, refusals."""

from __future__ import annotations

import importlib.util

import kvpress
import pytest
import torch
from transformers import DynamicCache, QuantizedCache

from kvdiverge.engine.core.coupled import run_batch
from kvdiverge.engine.core.decoding import decode_log_probs
from kvdiverge.engine.core.sampling import Decoding, Sampling
from kvdiverge.engine.llm.decode_pair import DecodeTimePair
from kvdiverge.engine.llm.pair_base import PairDocument
from kvdiverge.engine.llm.twin import evicted_twin
from kvdiverge.engine.presses.quantized import (
    QuantizedCachePress,
    QuantizedCacheSpec,
    kv_bits_per_element,
    quantize_cache_layers,
    refusal,
)
from kvdiverge.engine.presses.registry import is_decode_time
from kvdiverge.engine.presses.registry import refusal as registry_refusal
from kvdiverge.engine.runner import RunOptions
from kvdiverge.models.standins import MINIATURE, random_model

quanto = pytest.mark.skipif(
    importlib.util.find_spec("optimum") is None or importlib.util.find_spec("optimum.quanto") is None,
    reason="optimum-quanto missing",
)
T, TEMPERATURE = 9, 2.0


@pytest.fixture(scope="module")
def model():
    return random_model(MINIATURE["llama-3.1-8b"], initializer_range=0.2)  # head_dim 8, 2 layers


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, 500, (n,), generator=gen).tolist() for n in (20, 26, 17)]


def spec(**kw):
    return QuantizedCacheSpec(**{"backend": "quanto", "nbits": 2, "q_group_size": 8, "residual_length": 3, **kw})


def test_spec_checks_and_bits():
    with pytest.raises(ValueError, match=r"nbits must be one of \[2, 4\] for backend 'quanto', got 3"):
        QuantizedCacheSpec(nbits=3)
    with pytest.raises(ValueError, match=r"backend must be one of \['hqq', 'quanto'\], got 'gptq'"):
        QuantizedCacheSpec(backend="gptq")
    with pytest.raises(ValueError, match="residual_length must be an integer >= 1, got 0"):
        QuantizedCacheSpec(residual_length=0)
    assert QuantizedCacheSpec(backend="hqq", nbits=3).axis == 1 and QuantizedCacheSpec().axis == 0
    assert kv_bits_per_element(QuantizedCacheSpec(nbits=4, q_group_size=64)) == 4.5  # 4 + 2 * 16 / 64
    assert kv_bits_per_element(QuantizedCacheSpec(nbits=2, q_group_size=32)) == 3.0
    assert kv_bits_per_element(None) == 16.0 and kv_bits_per_element(None, 32) == 32.0


@pytest.mark.miniature
def test_refusals_are_one_sentence(model, monkeypatch):
    wide = QuantizedCacheSpec(q_group_size=64)
    assert refusal(wide, model) == (
        "the quantized cache's q_group_size 64 does not divide the model's head "
        "dimension 8, so a group would span two tokens"
    )
    assert registry_refusal(QuantizedCachePress(wide, kvpress.SnapKVPress(0.5)), model) == refusal(wide, model)
    inner = kvpress.DecodingPress(kvpress.KnormPress(), compression_interval=2, target_size=8)
    assert registry_refusal(QuantizedCachePress(spec(), inner)).startswith(
        "a quantized cache after the decode-time press DecodingPress is not supported"
    )
    assert is_decode_time(QuantizedCachePress(spec())) and registry_refusal(QuantizedCachePress(spec())) is None
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name.startswith("optimum") else real(name, *a)
    )
    assert refusal(spec()) == (
        "the quantized cache's backend 'quanto' needs the package 'optimum-quanto', which "
        "is not installed (pip install -c constraints.txt optimum-quanto)"
    )


@quanto
def test_layers_quantize_row_by_row():
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 2, 12, 8, generator=gen), torch.randn(2, 2, 12, 8, generator=gen)
    both, alone = DynamicCache(), DynamicCache()
    both.update(k, v, 0)
    alone.update(k[1:], v[1:], 0)
    assert quantize_cache_layers(both, spec()) == 1 and quantize_cache_layers(both, spec()) == 0
    quantize_cache_layers(alone, spec())
    new = torch.randn(2, 2, 1, 8, generator=gen)
    kb, _ = both.update(new, new, 0)
    ka, _ = alone.update(new[1:], new[1:], 0)
    assert torch.equal(kb[1:], ka) and both.get_seq_length() == 13
    assert 0.05 < float((kb[:, :, :12] - k).abs().mean()) < 1.0  # 2 bits: visibly lossy


@torch.inference_mode()
def transformers_replay(model, ids, history, sp):
    """transformers' own QuantizedCache from a fresh prefill, then ``history`` one token per forward."""
    cache = QuantizedCache(
        backend=sp.backend,
        config=model.config,
        nbits=sp.nbits,
        axis_key=sp.axis,
        axis_value=sp.axis,
        q_group_size=sp.q_group_size,
        residual_length=sp.residual_length,
    )
    logits = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    out = [decode_log_probs(logits, TEMPERATURE, 1.0)[0]]
    for t, tok in enumerate(history):
        logits = model(
            input_ids=torch.tensor([[tok]]),
            past_key_values=cache,
            use_cache=True,
            position_ids=torch.tensor([[len(ids) + t]]),
        ).logits[:, -1]
        out.append(decode_log_probs(logits, TEMPERATURE, 1.0)[0])
    return out


@torch.inference_mode()
def press_replay(model, ids, history, press):
    """A fresh twin under a fresh press, a fresh prefill, then ``history`` one token per forward."""
    twin, cache = evicted_twin(model), DynamicCache()
    with press(twin):
        logits = twin(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True, logits_to_keep=1).logits[
            :, -1
        ]
        out = [decode_log_probs(logits, TEMPERATURE, 1.0)[0]]
        for t, tok in enumerate(history):
            logits = twin(
                input_ids=torch.tensor([[tok]]),
                past_key_values=cache,
                use_cache=True,
                position_ids=torch.tensor([[len(ids) + t]]),
            ).logits[:, -1]
            out.append(decode_log_probs(logits, TEMPERATURE, 1.0)[0])
    return out


class Recorder:
    """Records every evicted log-distribution by (row, evicted history)."""

    def __init__(self, pair):
        self.pair, self.vocab_size, self.eos_ids, self.seen = pair, pair.vocab_size, pair.eos_ids, {}

    def _record(self, logq):
        for i, g in enumerate(self.ids):
            self.seen[(g, tuple(self.hist[i]))] = logq[i].clone()

    def start(self, n):
        self.ids, self.hist = list(range(n)), [[] for _ in range(n)]
        logp, logq = self.pair.start(n)
        self.first = (logp.clone(), logq.clone())
        self._record(logq)
        return logp, logq

    def advance(self, x, y):
        for i, tok in enumerate(y.tolist()):
            self.hist[i].append(tok)
        logp, logq = self.pair.advance(x, y)
        self._record(logq)
        return logp, logq

    def rewind(self, length):
        for i, n in enumerate(length.tolist()):
            del self.hist[i][n:]
        self.pair.rewind(length)

    def keep_rows(self, rows):
        self.ids = [self.ids[i] for i in rows.tolist()]
        self.hist = [self.hist[i] for i in rows.tolist()]
        self.pair.keep_rows(rows)


def check_rows(model, prompts, make, R, replay, tol, kept=None):
    """Every recorded q of every row (chain and branch) against ``replay`` of the row's own history."""
    kept = [len(p) for p in prompts] if kept is None else kept
    rec = Recorder(
        DecodeTimePair(
            model,
            [PairDocument(ids, make(), k) for ids, k in zip(prompts, kept)],
            decoding=Decoding(temperature=TEMPERATURE),
        )
    )
    out = run_batch(rec, T, R, 11, "miniature", [f"d{i}" for i in range(len(prompts))])
    n_branch = 0
    for g, r in enumerate(out):
        ids = prompts[g // R]
        histories = [[tok for tok in r["chain_token"] if tok >= 0]]
        if r["t_star"] is not None and r["branch_y"]:
            histories.append(r["chain_token"][: r["t_star"] - 1] + [r["y_star"]] + r["branch_y"])
            n_branch += 1
        for h in histories:
            ref = replay(model, ids, h[:-1])
            for n in range(len(h)):
                if (g, tuple(h[:n])) in rec.seen:
                    got, want = rec.seen[(g, tuple(h[:n]))], ref[n]
                    assert float((got.exp() - want.exp()).abs().max()) <= tol, (g, n)
    return rec, out, n_branch


@quanto
@pytest.mark.miniature
def test_quantized_cache_alone_equals_transformers_quantized_cache(model, prompts):
    # residual 3 over T = 9: flushes at several steps; chains and replayed branches, bit for bit
    sp = spec()
    branches, tv_max = 0, 0.0
    for d in range(3):  # one row per document: the lane's forward is the replay's, bit for bit
        rec, out, n_branch = check_rows(
            model,
            prompts[d : d + 1],
            lambda: QuantizedCachePress(sp),
            1,
            lambda m, ids, h: transformers_replay(m, ids, h, sp),
            tol=0.0,
        )
        branches += n_branch
        tv_max = max(tv_max, max(v for v in out[0]["tv"] if v == v))
        logp, logq = rec.first
        assert torch.equal(logp, logq)  # the prefill's logits are full precision: q_1 = p_1
        assert out[0]["tv"][0] == 0.0
        assert rec.pair.kept_lens == [len(prompts[d])]  # nothing evicted; the fewest positions a layer held
    assert branches >= 2 and tv_max > 0.01  # 2 bits change q after the prefill
    # four rows of one document in one lane: as the replay, up to float32 batch rounding
    check_rows(
        model,
        prompts[:1],
        lambda: QuantizedCachePress(sp),
        4,
        lambda m, ids, h: transformers_replay(m, ids, h, sp),
        tol=1e-5,
    )


@quanto
@pytest.mark.parametrize("nbits", [2, 4])
@pytest.mark.miniature
def test_press_then_quantize_one_document_alone_and_in_a_batch(model, prompts, nbits):
    sp = spec(nbits=nbits)

    def make():
        return QuantizedCachePress(sp, kvpress.SnapKVPress(0.5, window_size=4))

    # one document, one row: every q equals a fresh prefill + replay exactly
    for d in range(2):
        check_rows(
            model,
            prompts[d : d + 1],
            make,
            1,
            lambda m, ids, h: press_replay(m, ids, h, make()),
            tol=0.0,
            kept=[len(prompts[d]) // 2],
        )
    # three documents, three rows each, in one pair: each row as its document alone (float32 batch rounding)
    rec, out, n_branch = check_rows(
        model, prompts, make, 3, lambda m, ids, h: press_replay(m, ids, h, make()), tol=1e-5, kept=[10, 13, 8]
    )
    assert n_branch >= 3 and rec.pair.kept_lens == [10, 13, 8]  # SnapKV 50% kept, then quantized


def test_policy_entries_alone_and_after_a_press():
    from kvdiverge.engine.core.errors import PressError
    from kvdiverge.engine.presses.policies import Policy

    alone = Policy.from_config("int2", {"cache": "quantized", "nbits": 2, "q_group_size": 8, "residual_length": 3})
    press = alone.build_press(20)
    assert isinstance(press, QuantizedCachePress) and press.spec == spec()
    assert type(press.press).__name__ == "SnapKVPress" and press.press.compression_ratio == 0.0  # no eviction
    assert alone.expected_kept(20, press) == 20 and alone.min_prompt_tokens == 1 and not alone.is_control
    assert is_decode_time(press)
    both = Policy.from_config(
        "snap-int4",
        {
            "press": "SnapKVPress",
            "compression_ratio": 0.5,
            "window_size": 4,
            "cache": "quantized",
            "nbits": 4,
            "q_group_size": 8,
        },
    )
    p = both.build_press(20)
    assert p.spec == QuantizedCacheSpec(nbits=4, q_group_size=8) and p.press.compression_ratio == 0.5
    assert both.expected_kept(20, p) == 10
    from kvdiverge.config.inputs import describe_press

    assert describe_press(both) == {
        "press": "SnapKVPress",
        "compression_ratio": 0.5,
        "window_size": 4,
        "cache": "quantized",
        "backend": "quanto",
        "nbits": 4,
        "q_group_size": 8,
        "residual_length": 128,
    }
    with pytest.raises(PressError, match=r"policy 'x'.*'cache' must be 'quantized'.*got 'int8'"):
        Policy.from_config("x", {"press": "SnapKVPress", "compression_ratio": 0.5, "cache": "int8"})
    with pytest.raises(PressError, match=r"policy 'x'.*nbits must be one of \[2, 4\] for backend 'quanto', got 8"):
        Policy.from_config("x", {"cache": "quantized", "nbits": 8})
    with pytest.raises(PressError, match=r"policy 'x'.*'cache' must be 'quantized'.*got None"):
        Policy.from_config("x", {"press": "SnapKVPress", "compression_ratio": 0.5, "nbits": 4})


@quanto
@pytest.mark.miniature
def test_runner_runs_a_quantized_policy(model, prompts):
    from kvdiverge.engine.presses.policies import Policy
    from kvdiverge.engine.runner import Document, run_documents

    policy = Policy.from_config("int2", {"cache": "quantized", "nbits": 2, "q_group_size": 8, "residual_length": 3})
    docs = [Document(f"d{i}", p) for i, p in enumerate(prompts[:2])]
    recs = run_documents(
        model,
        docs,
        policy,
        Sampling(
            T=6, replicates=2, decoding=Decoding(temperature=TEMPERATURE, top_p=1.0), seed=3, model_name="miniature"
        ),
        RunOptions(batch_documents=2),
    )
    assert [r["kept_len"] for r in recs] == [20, 20, 26, 26]
    assert all(r["tv"][0] == 0.0 for r in recs) and max(max(r["tv"]) for r in recs) > 0.01


@pytest.mark.skipif(importlib.util.find_spec("hqq") is None, reason="hqq missing")
def test_hqq_layers_quantize_each_row_alone():
    # HQQ's optimiser stops on the whole tensor's error: run row by row, a row's cache is its own
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(3, 2, 16, 8, generator=gen)
    sp = QuantizedCacheSpec(backend="hqq", nbits=4, q_group_size=8, residual_length=4)
    both, alone = DynamicCache(), DynamicCache()
    both.update(k, k, 0)
    alone.update(k[2:], k[2:], 0)
    quantize_cache_layers(both, sp)
    quantize_cache_layers(alone, sp)
    new = torch.randn(3, 2, 1, 8, generator=gen)
    kb, _ = both.update(new, new, 0)
    ka, _ = alone.update(new[2:], new[2:], 0)
    assert torch.equal(kb[2:], ka)
    assert 0.01 < float((kb[:, :, :16] - k).abs().mean()) < 0.3  # 4 bits: lossy, not garbage
