"""The batched run's state machine: rows leave the pair, its state moves to a device and dtype,
non-finite logits are named, and a pair must implement the whole interface."""

from __future__ import annotations

import pytest
import torch

from kvdiverge.engine.core.batch_state import BatchState
from kvdiverge.engine.core.coupled import run_batch
from kvdiverge.engine.core.errors import NonFiniteLogitsError
from kvdiverge.engine.core.pairs import TableKernelPair
from kvdiverge.testing.constructions import ConstructedPair


class Counting(TableKernelPair):
    """Records the rows of every ``advance``; raises NaN logits on row 0 at advance ``fail``."""

    def __init__(self, *args, fail=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.rows_seen, self.fail = [], fail

    def advance(self, x, y):
        self.rows_seen.append(x.numel())
        if len(self.rows_seen) == self.fail:
            raise NonFiniteLogitsError("evicted", [0], "NaN")
        return super().advance(x, y)


def test_rows_of_a_construction_leave_the_pair_as_table_rows_do(kernel):
    """A §4 construction keeps rows like its inner pair, so done rows never ride along."""
    T, R = 8, 5
    plain = Counting(kernel, 3)
    inner = Counting(kernel, 3)
    recs = run_batch(ConstructedPair(inner, 2, "lower"), T, R, 4, "m", ["a", "b"])
    run_batch(plain, T, R, 4, "m", ["a", "b"])
    lags = sorted(T - r["t_star"] for r in recs if r["t_star"] is not None)
    assert inner.rows_seen[: T - 1] == [2 * R] * (T - 1)  # the chain: every row
    assert inner.rows_seen[T - 1 :] == [sum(lag > k for lag in lags) for k in range(max(lags))]
    assert plain.rows_seen[: T - 1] == [2 * R] * (T - 1)


def test_a_pair_without_keep_rows_is_refused_by_name(kernel):
    class NoKeep:
        vocab_size, eos_ids = 3, ()

        def start(self, n):
            raise AssertionError("never reached")

        advance = rewind = start

    with pytest.raises(TypeError, match=r"NoKeep is not a kernel pair: it lacks keep_rows"):
        run_batch(NoKeep(), 4, 2, 0, "m", ["a"])


def test_state_moves_floats_to_the_dtype_and_keeps_indices_int64():
    state = BatchState.new(3, 2, 0, "m", ["a", "b"], (5,))
    assert state.act.tolist() == [0, 1, 2, 3] and state.tau_naive.tolist() == [4] * 4
    moved = state.to(torch.device("cpu"), torch.float32)
    assert moved.tv.dtype == moved.S.dtype == moved.uniforms["chain"].dtype == torch.float32
    assert moved.chain.dtype == moved.residuals[0].dtype == moved.eos.dtype == torch.long
    assert torch.equal(moved.uniforms["chain"], state.uniforms["chain"].float())
    assert moved.uniforms["chain"].shape == (4, 3)


def test_non_finite_logits_name_document_replicate_step_and_phase(kernel):
    T = 6
    first = run_batch(TableKernelPair(kernel, 3), T, 2, 1, "m", ["a", "b"])[0]
    assert first["t_star"] is not None and first["t_star"] < T  # row 0 starts a branch with lags left
    # advance 2 appends the chain's 2nd token (logits of step 3); advance T appends (x*, y*) after the
    # chain's T - 1 advances, for the branch's first lag (step t* + 1)
    for fail, phase, step in [(2, "agreement chain", 3), (T, "residual branch", first["t_star"] + 1)]:
        with pytest.raises(NonFiniteLogitsError) as err:
            run_batch(Counting(kernel, 3, fail=fail), T, 2, 1, "m", ["a", "b"])
        e = err.value
        assert (e.model, e.doc_id, e.replicate, e.step, e.phase, e.side) == ("m", "a", 0, step, phase, "evicted")
        assert f"document 'a', replicate 0, step {step} ({phase}), evicted side" in str(e)
