"""The memory planner: the cache width it plans for, one plan per call, and the B it records."""

from __future__ import annotations

import json

import polars as pl
import pytest
import torch
from kvpress import KnormPress

import kvdiverge.engine.llm.planner as planner
import kvdiverge.engine.refusals as refusals
import kvdiverge.engine.runner as runner
from kvdiverge.config.provenance import read_provenance, settings_hash, shard_settings
from kvdiverge.engine.core.coupled import run_batch
from kvdiverge.engine.core.sampling import Decoding
from kvdiverge.engine.llm.llm_pair import LLMKernelPair, PairDocument
from kvdiverge.engine.llm.planner import LOGIT_BYTES_PER_ENTRY, cache_columns, kv_bytes_per_token, plan_batch
from kvdiverge.jobs.params import ShardSettings
from kvdiverge.jobs.shard import generation_options, run_shard
from kvdiverge.models.standins import MINIATURE, random_model


@pytest.fixture(scope="module")
def mini():
    torch.manual_seed(0)
    return random_model(MINIATURE["llama-3.1-8b"], seed=1)


@pytest.fixture()
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Widths:
    """Forward hook: the cache length (columns) after every forward that passes a cache."""

    def __init__(self, model):
        self.seen: list[int] = []
        self.handle = model.register_forward_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs, out):
        cache = kwargs.get("past_key_values")
        if cache is not None:
            self.seen.append(int(cache.get_seq_length()))


@pytest.mark.miniature
def test_the_planner_covers_the_widest_cache_a_run_reaches(mini, one_thread):
    """Rewound columns stay until rows leave: a run's cache outgrows prompt + T columns, never
    ``cache_columns``, and the planned bytes cover what the run holds."""
    prompt, T, R = 9, 6, 4
    ids = torch.randint(1, 500, (prompt,), generator=torch.Generator().manual_seed(2)).tolist()
    widths = Widths(mini)
    try:
        pair = LLMKernelPair.from_documents(
            mini, [PairDocument(ids, KnormPress(0.5))], decoding=Decoding(temperature=1.0, eos_ids=[])
        )
        recs = run_batch(pair, T, R, 2, "m", ["a"])
    finally:
        widths.handle.remove()
    widest = max(widths.seen)
    assert min(r["t_star"] for r in recs) < T - 1  # a branch starts before the chain's last step
    assert prompt + T < widest <= cache_columns(prompt, T) == prompt + 2 * T - 2
    kv = kv_bytes_per_token(mini.config, torch.float32)
    V = mini.config.vocab_size
    # what one document really holds: both sides' batched caches at their widest, the two
    # prefill caches of the document during the merge, the per-row logits work space
    held = R * 2 * (widest * kv + V * LOGIT_BYTES_PER_ENTRY) + 2 * prompt * kv
    kwargs = dict(kv_bytes_per_token=kv, prompt_len=prompt, T=T, replicates=R, vocab_size=V, documents=2)
    assert plan_batch(memory_budget_bytes=2 * held - 1, **kwargs) == 1
    assert planner.document_bytes(**{k: v for k, v in kwargs.items() if k != "documents"}) >= held


def test_cache_columns_of_a_one_step_horizon_is_the_prompt():
    assert cache_columns(100, 1) == 100 and cache_columns(100, 2) == 102


def _prompts(n_docs, lengths=(12, 15, 18)):
    gen = torch.Generator().manual_seed(5)
    return {
        f"doc-{i}": torch.randint(1, 500, (lengths[i % len(lengths)],), generator=gen).tolist() for i in range(n_docs)
    }


@pytest.mark.miniature
def test_measure_plans_once_for_every_press(mini, monkeypatch, one_thread):
    """The free memory is read once per call: a later press does not get a smaller B."""
    import kvdiverge

    kv = kv_bytes_per_token(mini.config, torch.float32)
    one_doc = planner.document_bytes(
        kv_bytes_per_token=kv, prompt_len=18, T=3, replicates=2, vocab_size=mini.config.vocab_size
    )
    budgets = iter([3 * one_doc, one_doc, one_doc])  # free memory shrinks as blocks stay cached
    calls = []

    def fake_budget(device):
        calls.append(device)
        return next(budgets)

    sizes = []
    real = run_batch

    def counting(pair, T, replicates, seed, model, doc_ids, progress=None):
        sizes.append(len(doc_ids))
        return real(pair, T, replicates, seed, model, doc_ids, progress=progress)

    monkeypatch.setattr(runner, "default_memory_budget", fake_budget)  # the runner's own names
    monkeypatch.setattr(runner, "run_batch", counting)
    presses = {
        "knorm": {"press": "KnormPress", "compression_ratio": 0.5},
        "streaming": {"press": "StreamingLLMPress", "compression_ratio": 0.5},
    }
    m = kvdiverge.measure(
        mini, None, _prompts(3), presses, max_new_tokens=3, replicates=2, seed=1, window=1, bootstrap=10, progress=False
    )
    assert len(calls) == 1
    assert sizes == [3, 3]  # each press: the three documents in one batch
    assert m.batch_documents == 3


@pytest.mark.miniature
def test_measurement_save_records_settings_hash_versions_and_b(mini, tmp_path, one_thread):
    import kvdiverge
    from kvdiverge.config.provenance import library_versions

    m = kvdiverge.measure(
        mini,
        None,
        _prompts(2),
        {"knorm": {"press": "KnormPress", "compression_ratio": 0.5}},
        max_new_tokens=2,
        replicates=1,
        seed=1,
        window=1,
        bootstrap=10,
        progress=False,
        batch_documents=1,
    )
    written = m.save(tmp_path)
    assert tmp_path / "provenance.json" in written
    prov = json.loads((tmp_path / "provenance.json").read_text())
    assert prov == {
        "settings_hash": settings_hash(m.settings.record()),
        "versions": library_versions(),
        "batch_documents": 1,
        "eos_ids": list(m.eos_ids),  # what Measurement.load reads back
        "noise_floor": None,
    }
    assert json.loads((tmp_path / "measure.json").read_text()) == json.loads(
        json.dumps(m.settings.record(), default=str)
    )


@pytest.mark.miniature
def test_a_shard_records_the_b_it_ran_with_outside_its_settings(mini, tmp_path, one_thread):
    prompts = tmp_path / "prompts.parquet"
    pl.DataFrame(
        [
            {"doc_id": d, "split": "exploratory", "input_ids": ids, "exclusion_reason": None}
            for d, ids in _prompts(3).items()
        ],
        schema={"doc_id": pl.String, "split": pl.String, "input_ids": pl.List(pl.Int32), "exclusion_reason": pl.String},
    ).write_parquet(prompts)
    hashes = set()
    for b in (2, "auto"):
        config = {
            "seed": 3,
            "shards": 1,
            "replicates": 2,
            "generation": {"batch_documents": b},
            "decoding": {"temperature": 0.8, "top_p": 1.0, "max_new_tokens": 2},
            "policies": {"knorm": {"press": "KnormPress", "compression_ratio": 0.5}},
            "runs": {"exploratory": ["knorm"]},
        }
        out = tmp_path / f"b{b}" / "shard-0.parquet"
        out.parent.mkdir()
        job = ShardSettings.from_config(config, "mini", "knorm", "exploratory", 0)
        run_shard(job, prompts, out, model=mini, options=generation_options(config["generation"]))
        rec = read_provenance(out)
        assert rec.batch == {"batch_documents": 2 if b == 2 else 3}  # auto: 4 GiB on the CPU holds all three
        assert rec.settings == shard_settings(config, "mini", "knorm", "exploratory")
        hashes.add(rec.settings_hash)
    assert len(hashes) == 1  # B is no setting: shards made with either B are compatible


def _decode_time_plan(mini, prompts, T, R, budget_gb):
    """B the planner gives a decode-time policy (3R rows per document) at ``budget_gb``, and the
    B it would give a prefill policy (2R rows): the test budgets make them differ."""
    kv = kv_bytes_per_token(mini.config, torch.float32)
    kwargs = dict(
        kv_bytes_per_token=kv,
        prompt_len=max(map(len, prompts.values())),
        T=T,
        replicates=R,
        vocab_size=mini.config.vocab_size,
        memory_budget_bytes=int(budget_gb * 2**30),
        documents=len(prompts),
    )
    return plan_batch(decode_time=True, **kwargs), plan_batch(**kwargs)


@pytest.mark.miniature
def test_a_decode_time_policy_under_auto_gets_the_3r_row_plan_at_both_doors(mini, tmp_path, one_thread):
    """``batch_documents: auto`` plans a decode-time policy's rows as 3R per document, in the
    shard job and in ``measure`` alike."""
    import kvdiverge

    T, R, prompts = 2, 2, _prompts(3)
    kv = kv_bytes_per_token(mini.config, torch.float32)
    two_r = planner.document_bytes(
        kv_bytes_per_token=kv, prompt_len=18, T=T, replicates=R, vocab_size=mini.config.vocab_size
    )
    budget_gb = 3 * two_r / 2**30  # three documents at 2R rows each, fewer at 3R
    want, prefill_plan = _decode_time_plan(mini, prompts, T, R, budget_gb)
    assert (want, prefill_plan) == (2, 3)
    window = {"press": "SlidingWindowPress", "compression_ratio": 0.5}
    m = kvdiverge.measure(
        mini,
        None,
        prompts,
        {"window": window},
        max_new_tokens=T,
        replicates=R,
        seed=1,
        window=1,
        bootstrap=10,
        progress=False,
        memory_budget_gb=budget_gb,
    )
    assert m.batch_documents == want
    path = tmp_path / "prompts.parquet"
    pl.DataFrame(
        [
            {"doc_id": d, "split": "exploratory", "input_ids": ids, "exclusion_reason": None}
            for d, ids in prompts.items()
        ],
        schema={"doc_id": pl.String, "split": pl.String, "input_ids": pl.List(pl.Int32), "exclusion_reason": pl.String},
    ).write_parquet(path)
    config = {
        "seed": 1,
        "shards": 1,
        "replicates": R,
        "generation": {"batch_documents": "auto", "memory_budget_gb": budget_gb},
        "decoding": {"temperature": 0.8, "top_p": 1.0, "max_new_tokens": T},
        "policies": {"window": window},
        "runs": {"exploratory": ["window"]},
    }
    job = ShardSettings.from_config(config, "mini", "window", "exploratory", 0)
    run_shard(job, path, tmp_path / "shard-0.parquet", model=mini, options=generation_options(config["generation"]))
    assert read_provenance(tmp_path / "shard-0.parquet").batch == {"batch_documents": want}


@pytest.mark.miniature
def test_measure_checks_each_press_for_refusal_once(mini, monkeypatch, one_thread):
    """One registry check per press per call, with the model, before any forward."""
    import kvdiverge

    seen = []
    real = refusals.refusal

    def counting(press, model=None):
        seen.append((type(press).__name__, model is not None))
        return real(press, model)

    monkeypatch.setattr(refusals, "refusal", counting)  # the name the runner's check calls
    presses = {"knorm": {"press": "KnormPress", "compression_ratio": 0.5}, "snap": KnormPress(0.25)}
    kvdiverge.measure(
        mini,
        None,
        _prompts(3),
        presses,
        max_new_tokens=2,
        replicates=1,
        seed=1,
        window=1,
        bootstrap=10,
        progress=False,
        batch_documents=1,
    )
    assert sorted(seen) == [("KnormPress", True), ("KnormPress", True)]
