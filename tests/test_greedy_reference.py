"""A greedy run of several policies decodes each document's full cache once and reuses it.

Under greedy decoding the full cache's side of every coupled run is its own greedy
continuation whatever the press (:mod:`kvdiverge.engine.llm.reference`), so
:func:`kvdiverge.engine.runner.run_policies` decodes it once per document and every pair
reads its reference side from it (``RunOptions.share_reference``). The records must equal
those of each pair decoding its own reference side; the full side must equal
``model.generate``; a sampled run must not change.
"""

from __future__ import annotations

import polars as pl
import pytest
import torch
from polars.testing import assert_frame_equal

from kvdiverge.engine.core.sampling import Decoding, Sampling
from kvdiverge.engine.llm.pair_base import GreedyReference, PairDocument
from kvdiverge.engine.llm.reference import greedy_reference
from kvdiverge.engine.presses import status as press_status
from kvdiverge.engine.presses.policies import Policy
from kvdiverge.engine.runner import Document, RunOptions, run_policies
from kvdiverge.models.standins import MINIATURE, random_model
from kvdiverge.testing.generation import greedy_generate, greedy_sides, until_eos

pytestmark = [pytest.mark.miniature, pytest.mark.usefixtures("quiet_kvpress")]

T = 8
SPECS = {
    "snapkv": {"press": "SnapKVPress", "compression_ratio": 0.5, "window_size": 8},
    "knorm": {"press": "KnormPress", "compression_ratio": 0.5},
    "adakv": {
        "press": "AdaKVPress",
        "compression_ratio": 0.5,
        "params": {"press": {"press": "SnapKVPress", "window_size": 8}},
    },
    "window": {"press": "SlidingWindowPress", "compression_ratio": 0.5},  # evicts while decoding
    "decoding": press_status.test_spec("DecodingPress"),  # evicts while decoding, lanes apart
    "none": {"press": "SnapKVPress", "compression_ratio": 0.0},  # the control: the caches are equal
}
GREEDY = Decoding(temperature=0.0)


@pytest.fixture(scope="module")
def model():
    return random_model(MINIATURE["qwen-2.5-7b"], seed=3)


@pytest.fixture(scope="module")
def docs():
    gen = torch.Generator().manual_seed(11)
    return [Document(f"d{i}", torch.randint(1, 500, (n,), generator=gen).tolist()) for i, n in enumerate((48, 64, 96))]


def _run(model, docs, names, share, decoding=GREEDY, R=1):
    policies = {name: Policy.from_config(name, SPECS[name]) for name in names}
    return run_policies(
        model,
        docs,
        policies,
        Sampling(T=T, replicates=R, decoding=decoding, seed=5, model_name="m"),
        split="confirmatory",
        options=RunOptions(batch_documents=2, share_reference=share),
    )


def test_the_shared_reference_gives_the_records_of_each_pair_decoding_its_own(model, docs):
    shared, alone = (_run(model, docs, list(SPECS), share) for share in (True, False))
    assert_frame_equal(shared.trajectories.drop("seconds"), alone.trajectories.drop("seconds"))
    frame = shared.trajectories
    # the presses part from the full cache on some documents, so the branch's full side is read too
    diverged = frame.filter(pl.col("t_star").is_not_null())["policy"].unique().to_list()
    assert {"snapkv", "knorm", "window"} <= set(diverged)
    assert frame.filter(pl.col("policy") == "none")["t_star"].null_count() == len(docs)  # the control never parts
    # the decode-time pair decoded no reference of its own
    assert shared.counts["window"]["reference_forwards"] == 0
    assert alone.counts["window"]["reference_forwards"] > 0


def test_a_question_after_compression_is_prefilled_on_the_shared_reference(model, docs):
    asked = [Document(d.doc_id, d.input_ids, n_question=6) for d in docs]
    names = ["snapkv", "knorm", "none"]
    shared, alone = (_run(model, asked, names, share) for share in (True, False))
    assert_frame_equal(shared.trajectories.drop("seconds"), alone.trajectories.drop("seconds"))
    assert shared.trajectories["t_star"].is_not_null().any()


def test_the_full_side_is_model_generate(model, docs):
    frame = _run(model, docs, ["knorm", "window"], True).trajectories
    eos = model.generation_config.eos_token_id
    for row in frame.iter_rows(named=True):
        doc = next(d for d in docs if d.doc_id == row["doc_id"])
        want = greedy_generate(model, doc.input_ids, max_new_tokens=T)
        assert until_eos(greedy_sides(row)[0], eos) == want, (row["policy"], row["doc_id"])


def test_greedy_reference_decodes_what_generate_decodes(model, docs):
    tokens = greedy_reference(model, [PairDocument(d.input_ids) for d in docs], decoding=GREEDY, horizon=T)
    eos = model.generation_config.eos_token_id
    assert tokens.shape == (len(docs), T)
    for d, row in zip(docs, tokens.tolist()):
        assert until_eos(row, eos) == greedy_generate(model, d.input_ids, max_new_tokens=T)
    with pytest.raises(ValueError, match="temperature 0, got 0.7"):
        greedy_reference(model, [PairDocument(docs[0].input_ids)], decoding=Decoding(temperature=0.7), horizon=T)


def test_a_sampled_run_decodes_each_reference_as_before(model, docs):
    sampled = Decoding(temperature=0.7, top_p=0.95)
    shared, alone = (_run(model, docs, ["knorm", "window"], share, sampled, R=2) for share in (True, False))
    assert_frame_equal(shared.trajectories.drop("seconds"), alone.trajectories.drop("seconds"))
    assert shared.counts["window"]["reference_forwards"] == alone.counts["window"]["reference_forwards"] > 0
    tv = shared.trajectories["tv"].explode().drop_nulls()
    assert ((tv > 0) & (tv < 1)).any()  # sampled: not point masses


def test_greedy_reference_serves_each_rows_next_token():
    # two documents, T = 3: tokens 5 6 7 and 8 9 4, two rows each
    ref = GreedyReference(torch.tensor([[5, 6, 7], [8, 9, 4]]), vocab_size=10, dtype=torch.float64)
    logp = ref.start(4)
    assert logp.argmax(-1).tolist() == [5, 5, 8, 8]
    assert (logp.exp().sum(-1) == 1).all() and (logp.max(-1).values == 0).all()
    assert ref.advance(torch.tensor([5, 5, 8, 8])).argmax(-1).tolist() == [6, 6, 9, 9]
    ref.rewind(torch.tensor([1, 0, 1, 1]))  # row 1 back to the start of its document
    ref.keep_rows(torch.tensor([1, 3]))
    assert ref.advance(torch.tensor([5, 9])).argmax(-1).tolist() == [6, 4]
    assert ref.advance(torch.tensor([6, 4])).argmax(-1).tolist() == [7, 4]  # past the horizon: the last token
    with pytest.raises(RuntimeError, match="not its greedy continuation"):
        ref.advance(torch.tensor([1, 4]))


def test_a_pair_takes_greedy_tokens_for_every_document_or_none(model, docs):
    from kvdiverge.engine.llm.llm_pair import LLMKernelPair  # the pair itself, not the runner

    mixed = [PairDocument(docs[0].input_ids, greedy_tokens=[1] * T), PairDocument(docs[1].input_ids)]
    with pytest.raises(ValueError, match="greedy_tokens: every document of a pair has them"):
        LLMKernelPair.from_documents(model, mixed, decoding=GREEDY, horizon=T)
