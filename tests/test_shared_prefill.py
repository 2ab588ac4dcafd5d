"""Several prefill policies on the same documents: one prefill forward per document for all of them.

:func:`kvdiverge.engine.runner.run_policies` prefills each document once for a group of
policies whose presses share their prefill (:func:`kvdiverge.engine.llm.prefill.prefill_shared`);
each policy's records must equal its run alone bit for bit, and the forwards counted must
show the sharing. The press matrix (``tests/test_press_matrix.py``) checks every press's
shared prefill against its own.
"""

from __future__ import annotations

from collections.abc import Mapping

import polars as pl
import pytest
import torch

from kvdiverge.engine.core.sampling import Decoding, Sampling
from kvdiverge.engine.llm.sharing import PrefillCarry
from kvdiverge.engine.presses import status as press_status
from kvdiverge.engine.presses.policies import Policy, PressPolicy
from kvdiverge.engine.presses.window import SlidingWindowPress
from kvdiverge.engine.runner import Document, RunOptions, _batches, run_policies
from kvdiverge.models.standins import MINIATURE, random_model

pytestmark = [pytest.mark.miniature, pytest.mark.usefixtures("quiet_kvpress")]

SPECS = {
    "snapkv": {"press": "SnapKVPress", "compression_ratio": 0.5, "window_size": 8},
    "knorm": {"press": "KnormPress", "compression_ratio": 0.25},
    "adakv": {
        "press": "AdaKVPress",
        "compression_ratio": 0.5,
        "params": {"press": {"press": "SnapKVPress", "window_size": 8}},
    },
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


def _policies(names) -> dict:
    return names if isinstance(names, Mapping) else {name: Policy.from_config(name, SPECS[name]) for name in names}


def _run(model, docs, names, R=2, memory_budget_gb=None, carry=None):
    """``names``: policies of SPECS by name, or a mapping of name to policy; two documents per batched forward."""
    return run_policies(
        model,
        docs,
        _policies(names),
        Sampling(T=5, replicates=R, decoding=Decoding(temperature=0.7, top_p=0.95), seed=5, model_name="m"),
        split="exploratory",
        options=RunOptions(batch_documents=2, memory_budget_gb=memory_budget_gb),
        carry=carry,
    )


def test_policies_run_together_equal_each_alone_bit_for_bit(model, docs):
    together = _run(model, docs, list(SPECS))
    assert together.trajectories["policy"].unique(maintain_order=True).to_list() == list(SPECS)
    for name in SPECS:
        alone = _run(model, docs, [name]).trajectories.drop("seconds")
        mine = together.trajectories.filter(pl.col("policy") == name).drop("seconds")
        assert mine.equals(alone), f"{name}: records differ when run beside the other policies"
    # one prefill forward per document (3) for the four prefill policies (2R = 4 to a group)
    assert [together.counts[n]["prefill_forwards"] for n in SHARED] == [3, 0, 0, 0]
    assert together.counts["window"]["prefill_forwards"] == 3  # a group of its own (2R = 4 to a group)
    assert _run(model, docs, ["snapkv"]).counts["snapkv"]["prefill_forwards"] == 3
    snap = together.trajectories.filter(pl.col("policy") == "snapkv")
    assert (snap["kept_len"] < snap["prompt_len"]).all()


def test_a_sliding_window_starts_its_lanes_from_the_shared_prefill(model, docs):
    """A decode-time press whose state is fixed at prefill (the sliding window) joins the shared forward."""
    together = _run(model, docs, ["snapkv", "window"])
    assert [together.counts[n]["prefill_forwards"] for n in ("snapkv", "window")] == [3, 0]
    alone = _run(model, docs, ["window"])
    assert alone.counts["window"]["prefill_forwards"] == 3
    # each chain lane restored from the shared prefill, besides what the replay lanes restore either way
    assert together.counts["window"]["prefills_restored"] == alone.counts["window"]["prefills_restored"] + 3
    for name in ("snapkv", "window"):
        mine = together.trajectories.filter(pl.col("policy") == name).drop("seconds")
        assert mine.equals(_run(model, docs, [name]).trajectories.drop("seconds")), f"{name}: records differ"


def test_one_window_press_object_shared_by_the_documents_of_a_batch_gives_each_its_own_window(model, docs):
    """A press object given as it is (PressPolicy: ``kvdiverge.measure(presses=...)``) serves every document;
    a sliding window holds the kept lengths of the prompt it last prefilled, so each document takes a copy."""
    window = {"window": PressPolicy("window", SlidingWindowPress(compression_ratio=0.5))}
    # two documents of different lengths in one batch (_run)
    together = _run(model, docs, {"snapkv": Policy.from_config("snapkv", SPECS["snapkv"]), **window}).trajectories
    mine = together.filter(pl.col("policy") == "window").drop("seconds")
    assert mine.equals(_run(model, docs, window).trajectories.drop("seconds"))
    assert mine.equals(_run(model, docs, ["window"]).trajectories.drop("seconds"))


def test_groups_hold_at_most_2R_policies(model, docs):
    runs = _run(model, docs, SHARED, R=1)  # 2R = 2: two groups of two
    assert [runs.counts[n]["prefill_forwards"] for n in SHARED] == [3, 0, 3, 0]


def test_a_budget_that_leaves_no_room_prefills_each_policy_alone(model, docs):
    runs = _run(model, docs, SHARED, memory_budget_gb=1e-6)
    assert [runs.counts[n]["prefill_forwards"] for n in SHARED] == [3, 3, 3, 3]
    alone = _run(model, docs, SHARED).trajectories.drop("seconds")
    assert runs.trajectories.drop("seconds").equals(alone)


def _carried(model, docs, first, later, memory_budget_gb=None):
    """``first`` on every document, then ``later`` on the first two, with one carry: (runs, runs, carry)."""
    sources = _policies(later)
    carry = PrefillCarry({name: (source, {doc.doc_id for doc in docs[:2]}) for name, source in sources.items()})
    one = _run(model, docs, first, memory_budget_gb=memory_budget_gb, carry=carry)
    return one, _run(model, docs[:2], sources, memory_budget_gb=memory_budget_gb, carry=carry), carry


def test_a_later_call_on_the_first_documents_takes_the_prefills_the_first_call_made(model, docs):
    """The controls' calls (a shard's first documents, batches of their own) prefill nothing of their own."""
    first, later, carry = _carried(model, docs, ["snapkv"], ["knorm", "leverage"])
    assert carry.held == {} and carry.later == {}
    # d0 and d1 in one forward for the three presses (snapkv counts it), d2 alone
    assert first.counts["snapkv"]["prefill_forwards"] == 3
    assert [later.counts[n]["prefill_forwards"] for n in ("knorm", "leverage")] == [0, 0]
    assert first.trajectories.drop("seconds").equals(_run(model, docs, ["snapkv"]).trajectories.drop("seconds"))
    alone = _run(model, docs[:2], ["knorm", "leverage"])
    assert [alone.counts[n]["prefill_forwards"] for n in ("knorm", "leverage")] == [2, 0]
    assert later.trajectories.drop("seconds").equals(alone.trajectories.drop("seconds"))


def test_nothing_is_carried_beyond_the_memory_budget(model, docs):
    first, later, carry = _carried(model, docs, ["snapkv"], ["knorm"], memory_budget_gb=1e-6)
    assert later.counts["knorm"]["prefill_forwards"] == 2 and carry.held == {}
    assert later.trajectories.drop("seconds").equals(_run(model, docs[:2], ["knorm"]).trajectories.drop("seconds"))


def test_a_press_that_evicts_while_decoding_is_carried_with_its_state_after_the_prompt(model, docs):
    """The sliding window's later call starts its lanes from the press and prefill the first call held: each lane
    enters a copy of the press, so the records are those of its call alone."""
    first, later, carry = _carried(model, docs, ["snapkv"], ["window"])
    assert first.counts["snapkv"]["prefill_forwards"] == 3 and carry.held == {}
    assert later.counts["window"]["prefill_forwards"] == 0
    alone = _run(model, docs[:2], ["window"])
    assert alone.counts["window"]["prefill_forwards"] == 2
    assert later.trajectories.drop("seconds").equals(alone.trajectories.drop("seconds"))


def test_held_prefills_go_only_to_their_own_source_and_are_let_go_when_their_call_has_passed(model, docs):
    carry = PrefillCarry({"knorm": (Policy.from_config("knorm", SPECS["knorm"]), {d.doc_id for d in docs[:2]})})
    _run(model, docs, ["snapkv"], carry=carry)
    assert sorted(carry.held) == [("knorm", "d0"), ("knorm", "d1")] and carry.held_bytes() > 0
    other = {"knorm": Policy.from_config("knorm", SPECS["knorm"])}  # the same name, another source
    runs = _run(model, docs[:1], other, carry=carry)
    assert runs.counts["knorm"]["prefill_forwards"] == 1  # prefilled its own
    assert runs.trajectories.drop("seconds").equals(_run(model, docs[:1], other).trajectories.drop("seconds"))
    assert sorted(carry.held) == [("knorm", "d1")]  # d1: its call did not run it
    _run(model, docs[:1], ["snapkv"], carry=carry)
    assert carry.held == {}


def test_a_press_that_scores_with_attention_weights_gets_a_forward_of_its_own(model, docs):
    """The forward that supplies attention weights would hand them to SnapKV, which then scores with
    them instead of its own window attention: presses share a forward only with presses of the same need."""
    from kvdiverge.engine.llm.prefill import prefill, prefill_seed, seeded
    from kvdiverge.engine.llm.sharing import shared_prefills
    from kvdiverge.engine.llm.twin import evicted_twin

    specs = {"observed": {"press": "ObservedAttentionPress", "compression_ratio": 0.5}, **SPECS}
    names = ["observed", "snapkv", "knorm"]
    doc = docs[1]
    presses = {n: [Policy.from_config(n, specs[n]).build_press(doc.context_len)] for n in names}
    sampling = Sampling(T=5, replicates=2, seed=5, model_name="m")
    bank = shared_prefills(evicted_twin(model), [doc], presses, sampling)
    assert bank["observed"] is None and bank["snapkv"][0].forwards == 1
    ids = torch.tensor(doc.input_ids)
    with seeded(prefill_seed(5, "m", doc.doc_id), "cpu"):
        own = prefill(
            model, evicted_twin(model), ids, Policy.from_config("snapkv", SPECS["snapkv"]).build_press(doc.prompt_len)
        )
    for got, want in zip(bank["snapkv"][0].ev.layers, own.ev.layers):
        assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)


def test_a_press_that_fails_in_a_shared_prefill_is_named():
    """The shared forward's failure leaves each pair to prefill alone, where the error names its policy."""
    from kvpress import BasePress, KnormPress

    from kvdiverge.engine.core.errors import PressError
    from kvdiverge.engine.presses.policies import PressPolicy

    class Broken(BasePress):
        def compress(self, module, hidden_states, keys, values, attentions, kwargs):
            raise TypeError("broken on purpose")

    model = random_model(MINIATURE["llama-3.1-8b"], seed=3)
    docs = [Document("a", list(range(1, 41))), Document("b", list(range(2, 50)))]
    policies = {
        "knorm": PressPolicy("knorm", KnormPress(compression_ratio=0.5)),
        "broken": PressPolicy("broken", Broken()),
    }
    with pytest.raises(PressError, match="'broken'.*broken on purpose"):
        run_policies(
            model,
            docs,
            policies,
            Sampling(T=3, replicates=2, decoding=Decoding(temperature=0.7, top_p=0.95), seed=5, model_name="m"),
            split="exploratory",
        )


def _forced(model, docs, sources, carry=None):
    """The teacher-forced pass of ``sources`` on ``docs`` (4 fed tokens each), the prefill seeds of :func:`_run`."""
    from kvdiverge.engine.forced import TeacherPass, teacher_forced_policies
    from kvdiverge.engine.llm.teacher import TeacherForcing

    forcing = TeacherForcing(length=4)
    given = {doc.doc_id: [7 + i, 11, 13 + i, 17] for i, doc in enumerate(docs)}
    settings = TeacherPass(forcing.sampling(5, "m", ()), forcing, "exploratory")
    return teacher_forced_policies(model, docs, sources, settings=settings, continuations=given, carry=carry)


def test_the_teacher_forced_pass_holds_its_prefills_for_the_coupled_run_of_its_documents(model, docs):
    """Run first on the same documents, the teacher-forced pass prefills each document for every press, one press
    included, and the coupled run prefills nothing of its own but the sliding window's; the positions and the
    records are those of each run alone, bit for bit."""
    sources = _policies(["snapkv", "knorm", "window"])
    ids = {doc.doc_id for doc in docs}
    carry = PrefillCarry({name: (source, ids) for name, source in sources.items()})
    assert _forced(model, docs, sources, carry).equals(_forced(model, docs, sources))
    # the window evicts while decoding: its press is held beside its prefill, its state after the prompt
    assert sorted(carry.held) == [(n, d.doc_id) for n in ("knorm", "snapkv", "window") for d in docs]
    runs = _run(model, docs, sources, carry=carry)
    assert carry.held == {}
    assert [runs.counts[n]["prefill_forwards"] for n in ("snapkv", "knorm", "window")] == [0, 0, 0]
    assert runs.trajectories.drop("seconds").equals(_run(model, docs, sources).trajectories.drop("seconds"))

    one = {"snapkv": sources["snapkv"]}  # one press: a forward of one, the same as the pair's own prefill
    carry = PrefillCarry({"snapkv": (one["snapkv"], {d.doc_id for d in docs[:2]})})
    assert _forced(model, docs, one, carry).equals(_forced(model, docs, one))
    assert sorted(carry.held) == [("snapkv", "d0"), ("snapkv", "d1")]  # the documents its coupled run runs
    runs = _run(model, docs, one, carry=carry)
    assert runs.counts["snapkv"]["prefill_forwards"] == 1  # d2
    assert runs.trajectories.drop("seconds").equals(_run(model, docs, one).trajectories.drop("seconds"))


def test_the_teacher_forced_pass_holds_nothing_beyond_the_carrys_room_or_for_another_source(model, docs):
    sources = _policies(["snapkv", "knorm"])
    carry = PrefillCarry({name: (source, {d.doc_id for d in docs}) for name, source in sources.items()}, room=0)
    _forced(model, docs, sources, carry)
    assert carry.held == {}
    carry = PrefillCarry({"snapkv": (Policy.from_config("snapkv", SPECS["snapkv"]), {d.doc_id for d in docs})})
    _forced(model, docs, sources, carry)  # the same name, another source object
    assert carry.held == {}
    # room for one document's full cache and two evicted ones: the first document's, then none
    carry = PrefillCarry({name: (source, {d.doc_id for d in docs}) for name, source in sources.items()})
    _forced(model, docs[:1], sources, carry)
    room = carry.held_bytes()
    carry = PrefillCarry({name: (source, {d.doc_id for d in docs}) for name, source in sources.items()}, room=room)
    _forced(model, docs, sources, carry)
    assert sorted(carry.held) == [("knorm", "d0"), ("snapkv", "d0")]


def test_a_last_batch_of_fewer_documents_runs_first_and_changes_no_record_of_the_full_batch(model, docs):
    """Documents by prompt length (48, 64, 96 tokens), two per forward: ``d2`` alone first, then ``d0`` and ``d1``;
    the full batch's records are those of its documents run without ``d2``, bit for bit."""
    assert _batches(docs, 2) == [[2], [0, 1]]
    assert _batches(docs, 3) == [[0, 1, 2]] and _batches(docs, 1) == [[0], [1], [2]]
    assert _batches(docs[::-1], 2) == [[0], [2, 1]]  # by length, not input order
    three = _run(model, docs, ["snapkv"]).trajectories.drop("seconds")
    two = _run(model, docs[:2], ["snapkv"]).trajectories.drop("seconds")
    assert three.filter(pl.col("doc_id") != "d2").equals(two)


def test_the_prefills_held_for_a_full_batch_wait_beside_the_smaller_batch_run_before_it(model, docs):
    """The teacher-forced pass holds the prefills of ``d0``, ``d1`` and ``d2``; the coupled call runs ``d2`` and then
    ``d0`` and ``d1``. Beside ``d2``'s batch the budget must leave room for ``d0``'s and ``d1``'s (the last held let
    go first), beside the full batch for nothing: what is held for a batch is its own, and ``d2``'s was taken."""
    one = _policies(["snapkv"])

    def held(left_beside_d2: int, order=(["d2"], ["d0", "d1"])) -> list[str]:
        carry = PrefillCarry({"snapkv": (one["snapkv"], {d.doc_id for d in docs})})
        _forced(model, docs, one, carry)
        carry.begin(["snapkv"])
        lefts = {"d2": left_beside_d2, "d0": 0}
        carry.fit(["snapkv"], docs, 1, [(batch, lefts[batch[0]]) for batch in order], ["snapkv"])
        return sorted(doc for _, doc in carry.held)

    carry = PrefillCarry({"snapkv": (one["snapkv"], {d.doc_id for d in docs})})
    _forced(model, docs, one, carry)
    full = carry.held_bytes({("snapkv", "d2")})  # d0's and d1's caches
    assert held(full) == ["d0", "d1", "d2"]
    assert held(full - 1) == ["d0", "d2"]
    assert held(0) == ["d2"]
    # run in the other order, nothing may wait beside the full batch: d2's prefill is let go
    assert held(full, order=(["d0", "d1"], ["d2"])) == ["d0", "d1"]
