"""The batched engine: many documents per forward, coupling on the model's device, row
removal, the memory planner and non-finite logits."""

from __future__ import annotations

import math

import oracle_engine
import polars as pl
import pytest
import torch
from kvpress import SnapKVPress
from test_coupled_golden import FLOAT32_TOL, mismatches

from kvdiverge.engine.core.coupled import run_batch, run_document
from kvdiverge.engine.core.errors import NonFiniteLogitsError
from kvdiverge.engine.core.pairs import TableKernelPair
from kvdiverge.engine.core.sampling import Decoding, Sampling
from kvdiverge.engine.llm.llm_pair import LLMKernelPair, PairDocument
from kvdiverge.engine.llm.pair_base import stock_kernels
from kvdiverge.engine.llm.planner import kv_bytes_per_token, plan_batch
from kvdiverge.engine.presses.policies import Policy
from kvdiverge.engine.runner import Document, RunOptions, run_documents
from kvdiverge.jobs.params import ShardSettings
from kvdiverge.jobs.shard import generation_options, run_shard
from kvdiverge.models.standins import MINIATURE, random_model


def canonical(records):
    """Records with NaN replaced by a marker, so that == compares them bit for bit."""

    def fix(v):
        if isinstance(v, float) and math.isnan(v):
            return "nan"
        if isinstance(v, list):
            return [fix(x) for x in v]
        return v

    return [{k: fix(v) for k, v in r.items() if k != "seconds"} for r in records]


# --------------------------------------------------------------------------- synthetic, exact


@pytest.mark.parametrize("which", ["history", "eos"])
def test_new_engine_equals_the_old_one_on_synthetic_pairs(which, kernel, eos_kern):
    fn, V, eos = (kernel, 3, ()) if which == "history" else (eos_kern, 2, (1,))
    for seed in range(3):
        oracle = oracle_engine.run_document(TableKernelPair(fn, V, eos), 9, 7, seed, "m", f"d{seed}")
        new = run_document(TableKernelPair(fn, V, eos), 9, 7, seed, "m", f"d{seed}")
        assert canonical(new) == canonical(oracle)
    assert any(r["t_star"] is not None for r in new)  # branches ran, so the comparison covers them


def test_documents_in_one_batch_equal_documents_alone_on_a_synthetic_pair(kernel):
    docs = ["a", "b", "c"]
    together = run_batch(TableKernelPair(kernel, 3), 8, 4, 11, "m", docs)
    alone = [rec for d in docs for rec in run_document(TableKernelPair(kernel, 3), 8, 4, 11, "m", d)]
    assert canonical(together) == canonical(alone)
    assert canonical(together[:4]) != canonical(together[4:8])  # documents get their own uniforms


def test_done_rows_leave_the_batch(kernel):
    class Counting(TableKernelPair):
        rows_seen: list[int] = []

        def advance(self, x, y):
            self.rows_seen.append(x.numel())
            return super().advance(x, y)

    pair = Counting(kernel, 3)
    recs = run_batch(pair, 10, 6, 2, "m", ["a", "b"])
    lags = sorted(10 - r["t_star"] for r in recs if r["t_star"] is not None)
    assert pair.rows_seen[:9] == [12] * 9  # the chain: every row
    # the branch: a row leaves once its lags are done (rows without a branch leave at once)
    assert pair.rows_seen[9:] == [sum(lag > k for lag in lags) for k in range(max(lags))]


# --------------------------------------------------------------------------- planner


def test_planner_formula():
    class Cfg:
        num_hidden_layers, num_attention_heads, num_key_value_heads, hidden_size = 32, 32, 8, 4096

    per_token = kv_bytes_per_token(Cfg, torch.bfloat16)
    assert per_token == 32 * 8 * 128 * 2 * 2 == 131072  # Llama-3.1-8B: 128 KiB per token
    per_doc = 8 * 2 * ((1200 + 2 * 256 - 2) * per_token + 128256 * 52) + 2 * 1200 * per_token
    assert (
        plan_batch(
            kv_bytes_per_token=per_token,
            prompt_len=1200,
            T=256,
            replicates=8,
            vocab_size=128256,
            memory_budget_bytes=10 * per_doc + 1,
            documents=12,
        )
        == 10
    )
    assert (
        plan_batch(
            kv_bytes_per_token=per_token,
            prompt_len=1200,
            T=256,
            replicates=8,
            vocab_size=128256,
            memory_budget_bytes=100 * per_doc,
            documents=12,
        )
        == 12
    )
    assert (
        plan_batch(
            kv_bytes_per_token=per_token,
            prompt_len=1200,
            T=256,
            replicates=8,
            vocab_size=128256,
            memory_budget_bytes=1,
            documents=12,
        )
        == 1
    )
    assert (
        plan_batch(
            kv_bytes_per_token=per_token,
            prompt_len=1,
            T=1,
            replicates=1,
            vocab_size=1,
            memory_budget_bytes=1,
            documents=12,
            override=5,
        )
        == 5
    )
    with pytest.raises(ValueError, match="batch_documents"):
        plan_batch(
            kv_bytes_per_token=1,
            prompt_len=1,
            T=1,
            replicates=1,
            vocab_size=1,
            memory_budget_bytes=1,
            documents=3,
            override=0,
        )


# --------------------------------------------------------------------------- a miniature model

miniature = pytest.mark.miniature


@pytest.fixture(scope="module")
def model():
    """A random-weight miniature with Llama-3.1's structure (grouped keys and values, llama3
    RoPE; :data:`kvdiverge.models.standins.MINIATURE`): the engine's batching, kernels and
    non-finite checks run on it as on the embedded model, in a fraction of the time."""
    return random_model(MINIATURE["llama-3.1-8b"], seed=5)


@pytest.fixture(scope="module")
def docs():
    """Three prompts of different lengths (200, 120 and 280 tokens), random ids of the
    miniature's vocabulary (none of its EOS ids)."""
    gen = torch.Generator().manual_seed(13)
    out = [
        Document(f"doc-{i}", torch.randint(1, 509, (n,), generator=gen).tolist()) for i, n in enumerate((200, 120, 280))
    ]
    assert len({d.prompt_len for d in out}) == 3
    return out


@miniature
def test_new_engine_equals_the_old_one_on_a_miniature_model(model, docs):
    """One document per forward and R = 1 (the batch composition of the oracle engine): on the
    stock kernels (``DynamicCache``, repeated keys and values) the shards agree bit for bit,
    sampled, under SnapKV; on the engine's own kernels (grouped decoding attention, caches
    with capacity) tokens and integers agree exactly and floats within ``FLOAT32_TOL``."""
    policy = Policy.from_config("snapkv-50", {"press": "SnapKVPress", "compression_ratio": 0.5, "window_size": 16})

    def run():
        return run_documents(
            model,
            docs[:2],
            policy,
            Sampling(T=6, replicates=1, decoding=Decoding(temperature=0.8, top_p=0.95), seed=4, model_name="m"),
            RunOptions(batch_documents=1),
        )

    fast = run()
    with stock_kernels():
        new = run()
    oracle = []
    for doc in docs[:2]:
        press = policy.build_press(doc.prompt_len)
        pair = oracle_engine.LLMKernelPair(
            model,
            doc.input_ids,
            press,
            temperature=0.8,
            top_p=0.95,
            expected_kept=policy.expected_kept(doc.prompt_len, press),
        )
        oracle += [
            {"doc_id": doc.doc_id, "prompt_len": doc.prompt_len, "kept_len": pair.kept_len, **r}
            for r in oracle_engine.run_document(pair, 6, 1, 4, "m", doc.doc_id)
        ]
    assert all(
        r.pop("kept_per_layer") == [r["kept_len"] * model.config.num_key_value_heads] * model.config.num_hidden_layers
        for r in new
    )  # a column the oracle engine does not write
    assert canonical(new) == canonical(oracle)
    assert any(r["tv"][1] > 0 for r in new)  # the press changed the kernel, so tv is not trivially 0
    for r in fast:
        r.pop("kept_per_layer")
    assert not mismatches(canonical(fast), canonical(oracle), FLOAT32_TOL)


def greedy_generate(model, ids, T, press=None):
    x = torch.tensor([list(ids)])
    with torch.inference_mode():
        if press is None:
            return model.generate(x, max_new_tokens=T, do_sample=False)[0, len(ids) :].tolist()
        with press(model):
            return model.generate(x, max_new_tokens=T, do_sample=False)[0, len(ids) :].tolist()


GREEDY_T = 8


@pytest.fixture(scope="module")
def greedy_full_cache(model, docs):
    """``model.generate`` (greedy, ``GREEDY_T`` tokens) of each document with the full cache:
    the reference side of both parametrizations below, and the evicted side without a press."""
    return [greedy_generate(model, doc.input_ids, GREEDY_T) for doc in docs]


@miniature
@pytest.mark.parametrize("with_press", [False, True], ids=["no-press", "snapkv"])
def test_greedy_in_a_batch_of_documents_equals_generate_per_document(model, docs, greedy_full_cache, with_press):
    T = GREEDY_T
    presses = [SnapKVPress(compression_ratio=0.5, window_size=16) if with_press else None for _ in docs]
    kept = [int(d.prompt_len * 0.5) if with_press else d.prompt_len for d in docs]
    pair = LLMKernelPair.from_documents(
        model,
        [PairDocument(d.input_ids, p, k) for d, p, k in zip(docs, presses, kept)],
        decoding=Decoding(temperature=0.0),
    )
    recs = run_batch(pair, T, 2, 0, "m", [d.doc_id for d in docs])
    assert pair.kept_lens == kept
    for j, doc in enumerate(docs):
        rec = recs[2 * j]
        ts = rec["t_star"]
        ref = rec["chain_token"] if ts is None else rec["chain_token"][: ts - 1] + [rec["x_star"]] + rec["branch_x"]
        ev = rec["chain_token"] if ts is None else rec["chain_token"][: ts - 1] + [rec["y_star"]] + rec["branch_y"]
        assert ref == greedy_full_cache[j], doc.doc_id
        evicted = greedy_full_cache[j] if presses[j] is None else greedy_generate(model, doc.input_ids, T, presses[j])
        assert ev == evicted, doc.doc_id
    if with_press:  # the eviction matters for some document, so the comparison can fail
        assert any(r["t_star"] is not None for r in recs)


@miniature
def test_ratio_zero_in_a_batch_of_documents_gives_exactly_zero_tv(model, docs):
    policy = Policy.from_config("none", {"press": "SnapKVPress", "compression_ratio": 0.0})
    recs = run_documents(
        model,
        docs,
        policy,
        Sampling(T=6, replicates=2, decoding=Decoding(temperature=0.7, top_p=0.95), seed=1, model_name="m"),
        RunOptions(batch_documents=3),
    )
    assert [r["doc_id"] for r in recs] == [d.doc_id for d in docs for _ in range(2)]  # input order
    assert all(tv == 0.0 for r in recs for tv in r["tv"])
    assert all(r["t_star"] is None for r in recs)


@miniature
def test_batched_shards_are_reproducible_and_close_to_one_document_per_forward(model, docs):
    policy = Policy.from_config("snapkv-50", {"press": "SnapKVPress", "compression_ratio": 0.5, "window_size": 16})
    sampling = Sampling(T=6, replicates=2, decoding=Decoding(temperature=0.8, top_p=0.95), seed=2, model_name="m")
    a = run_documents(model, docs, policy, sampling, RunOptions(batch_documents=3))
    b = run_documents(model, docs, policy, sampling, RunOptions(batch_documents=3))
    one = run_documents(model, docs, policy, sampling, RunOptions(batch_documents=1))
    assert canonical(a) == canonical(b)
    assert [r["kept_len"] for r in a] == [r["kept_len"] for r in one]
    # other batch, other rounding (~1e-6 in the logits): the chain's first steps agree closely
    for x, y in zip(a, one):
        assert x["chain_token"][:2] == y["chain_token"][:2]
        assert x["tv"][1] == pytest.approx(y["tv"][1], abs=1e-4)


# --------------------------------------------------------------------------- non-finite logits


class Inject:
    """Forward hook: write ``value`` into the logits of the first row of ``side`` in the ``call``-th
    decoding forward (one new token per row; prefills are not counted). Each step is one forward
    over both sides' rows, the reference rows first (:class:`kvdiverge.engine.llm.side.JointSides`)."""

    def __init__(self, model, call: int, value: float, side: str = "reference"):
        self.n, self.call, self.value, self.side = 0, call, value, side
        self.handle = model.register_forward_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs, out):
        if kwargs["input_ids"].shape[1] == 1:
            self.n += 1
            if self.n == self.call:
                row = out.logits.shape[0] // 2 if self.side == "evicted" else 0
                out.logits[row, -1, 7] = self.value
        return out


@miniature
def test_nan_logits_stop_the_shard_and_a_rerun_resumes(model, docs, tmp_path):
    prompts = tmp_path / "prompts.parquet"
    pl.DataFrame(
        [
            {"doc_id": d.doc_id, "split": "exploratory", "input_ids": list(d.input_ids), "exclusion_reason": None}
            for d in docs[:2]
        ],
        schema={"doc_id": pl.String, "split": pl.String, "input_ids": pl.List(pl.Int32), "exclusion_reason": pl.String},
    ).write_parquet(prompts)
    config = {
        "seed": 3,
        "shards": 1,
        "replicates": 2,
        "generation": {"batch_documents": 1},
        "decoding": {"temperature": 0.8, "top_p": 0.95, "max_new_tokens": 4},
        "policies": {"snapkv-50": {"press": "SnapKVPress", "compression_ratio": 0.5, "window_size": 16}},
        "runs": {"exploratory": ["snapkv-50"]},
    }
    job = ShardSettings.from_config(config, "smollm2", "snapkv-50", "exploratory", 0)
    options = generation_options(config["generation"])
    out = tmp_path / "shard-0.parquet"
    hook = Inject(model, call=2, value=float("nan"))  # 2nd chain advance, reference side, first document
    try:
        with pytest.raises(NonFiniteLogitsError) as err:
            run_shard(job, prompts, out, model=model, options=options)
    finally:
        hook.handle.remove()
    msg = str(err.value)  # doc-1 is the shorter prompt: documents run shortest first
    assert "NaN" in msg and "'smollm2'" in msg and "'doc-1'" in msg
    assert "replicate 0" in msg and "step 3 (agreement chain)" in msg and "reference side" in msg
    assert (err.value.doc_id, err.value.replicate, err.value.step, err.value.side) == ("doc-1", 0, 3, "reference")
    assert not out.exists() and not list(tmp_path.glob("*.tmp*"))
    frame = run_shard(job, prompts, out, model=model, options=options)
    assert out.exists() and frame.height == 4 and pl.read_parquet(out).height == 4


@miniature
def test_inf_logits_name_the_evicted_side(model, docs):
    policy = Policy.from_config("snapkv-50", {"press": "SnapKVPress", "compression_ratio": 0.5, "window_size": 16})
    hook = Inject(model, call=1, value=float("inf"), side="evicted")  # 1st chain advance
    try:
        with pytest.raises(NonFiniteLogitsError, match=r"\+inf logits from model 'm', document 'doc-1'") as err:
            run_documents(
                model,
                docs[1:3],
                policy,
                Sampling(T=4, replicates=2, decoding=Decoding(temperature=0.8, top_p=0.95), seed=1, model_name="m"),
                RunOptions(batch_documents=2),
            )
    finally:
        hook.handle.remove()
    # doc-1 is the shorter prompt, so it comes first in its batch (row 0)
    assert (err.value.side, err.value.step, err.value.replicate) == ("evicted", 2, 0)
