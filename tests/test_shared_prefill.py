"""Several prefill policies on the same documents: one prefill forward per document for all of them.

:func:`kvdiverge.engine.runner.run_policies` prefills each document once for a group of
policies whose presses share their prefill (:func:`kvdiverge.engine.llm.prefill.prefill_shared`);
the group then decodes as one kernel pair. Each policy's records must equal its run alone
within the rounding of a batched forward, and the forwards counted must show the sharing. The press matrix (``tests/test_press_matrix.py``) checks every press's
shared prefill against its own.
"""

from __future__ import annotations

import logging
import warnings

import polars as pl
import pytest
import torch

from kvdiverge.engine.presses import status as press_status
from kvdiverge.engine.presses.policies import Policy
from kvdiverge.engine.runner import Document, run_policies
from kvdiverge.reference.miniatures import MINIATURE, random_model

pytestmark = pytest.mark.miniature

SPECS = {
    "snapkv": {"press": "SnapKVPress", "compression_ratio": 0.5, "window_size": 8},
    "knorm": {"press": "KnormPress", "compression_ratio": 0.25},
    "adakv": {"press": "AdaKVPress", "compression_ratio": 0.5,
              "params": {"press": {"press": "SnapKVPress", "window_size": 8}}},
    "leverage": press_status.test_spec("LeverageScorePress"),  # draws from torch's generator
    "window": {"press": "SlidingWindowPress", "compression_ratio": 0.5},  # evicts while decoding
}
SHARED = ["snapkv", "knorm", "adakv", "leverage"]


@pytest.fixture(scope="module")
def model():
    return random_model(MINIATURE["qwen-2.5-7b"], seed=3)


@pytest.fixture(scope="module")
def docs():
    gen = torch.Generator().manual_seed(11)
    return [Document(f"d{i}", torch.randint(1, 500, (n,), generator=gen).tolist()) for i, n in enumerate((48, 64, 96))]


@pytest.fixture(autouse=True)
def _quiet():
    logging.disable(logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    logging.disable(logging.NOTSET)


def _run(model, docs, names, R=2, policies=None, **kw):
    policies = policies or {name: Policy.from_config(name, SPECS[name]) for name in names}
    return run_policies(model, docs, policies, T=5, replicates=R, temperature=0.7, top_p=0.95, seed=5,
                        model_name="m", split="exploratory", batch_documents=2, **kw)


#: Largest difference of a float column (TV, survival) between a policy run in a group and alone:
#: the rounding of a batched forward (documents batched together differ as much).
FLOAT_TOL = 1e-6
FLOATS = ["tv", "survival", "branch_tv"]


def _same(a: pl.DataFrame, b: pl.DataFrame) -> None:
    """Every column equal, the float lists within FLOAT_TOL."""
    assert a.drop(FLOATS + ["seconds"]).equals(b.drop(FLOATS + ["seconds"]))
    for col in FLOATS:
        for x, y in zip(a[col].to_list(), b[col].to_list()):
            assert len(x) == len(y) and all(abs(u - v) <= FLOAT_TOL for u, v in zip(x, y)), col


def _per_batch(model, docs, R=2):
    from kvdiverge.engine.llm.planner import document_bytes, kv_bytes_per_token

    return 2 * document_bytes(kv_bytes_per_token=kv_bytes_per_token(model.config, torch.float32),
                              prompt_len=max(d.prompt_len for d in docs), T=5, replicates=R,
                              vocab_size=model.config.vocab_size) / 2**30


def test_policies_run_together_equal_each_alone(model, docs):
    together = _run(model, docs, list(SPECS))
    assert together.trajectories["policy"].unique(maintain_order=True).to_list() == list(SPECS)
    for name in SPECS:
        alone = _run(model, docs, [name]).trajectories
        _same(together.trajectories.filter(pl.col("policy") == name), alone)
    # one prefill forward per document (3) for the four prefill policies, decoded as one pair
    assert [together.counts[n]["prefill_forwards"] for n in SHARED] == [3, 0, 0, 0]
    assert [together.counts[n]["batches"] for n in SHARED] == [2, 2, 2, 2]
    assert together.counts["window"]["prefill_forwards"] == 3  # its own: it evicts while decoding
    assert _run(model, docs, ["snapkv"]).counts["snapkv"]["prefill_forwards"] == 3
    snap = together.trajectories.filter(pl.col("policy") == "snapkv")
    assert (snap["kept_len"] < snap["prompt_len"]).all()
    assert (together.trajectories.filter(pl.col("policy") == "knorm")["kept_len"] > snap["kept_len"]).all()


def test_groups_hold_what_the_memory_budget_holds(model, docs):
    runs = _run(model, docs, SHARED, memory_budget_gb=2.5 * _per_batch(model, docs))  # two batches' worth
    assert [runs.counts[n]["prefill_forwards"] for n in SHARED] == [3, 0, 3, 0]


def test_a_budget_for_one_batch_runs_each_policy_alone_bit_for_bit(model, docs):
    runs = _run(model, docs, SHARED, memory_budget_gb=1.5 * _per_batch(model, docs))
    assert [runs.counts[n]["prefill_forwards"] for n in SHARED] == [3, 3, 3, 3]
    for name in SHARED:
        alone = _run(model, docs, [name]).trajectories.drop("seconds")
        assert runs.trajectories.filter(pl.col("policy") == name).drop("seconds").equals(alone)


def test_a_press_that_fails_in_a_group_is_named():
    """The group reruns each policy alone, so the error names the failing policy."""
    pytest.importorskip("kvpress")
    from kvpress import BasePress, KnormPress

    from kvdiverge.engine.core.errors import PressError
    from kvdiverge.engine.presses.policies import PressPolicy

    class Broken(BasePress):
        def compress(self, module, hidden_states, keys, values, attentions, kwargs):
            raise TypeError("broken on purpose")

    model = random_model(MINIATURE["llama-3.1-8b"], seed=3)
    docs = [Document("a", list(range(1, 41))), Document("b", list(range(2, 50)))]
    policies = {"knorm": PressPolicy("knorm", KnormPress(compression_ratio=0.5)), "broken": PressPolicy("broken", Broken())}
    with pytest.raises(PressError, match="'broken'.*broken on purpose"):
        _run(model, docs, None, policies=policies)
