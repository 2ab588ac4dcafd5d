"""The self-speculative reading: A_k = sum_{j<=k} S_j against speculative sampling enumerated exactly."""

import math

import numpy as np
import polars as pl
import pytest

from kvdiverge.engine.core.coupled import simulate
from kvdiverge.engine.core.pairs import TableKernelPair
from kvdiverge.estimation.bootstrap import Bootstrap
from kvdiverge.estimation.estimators import document_estimates, replicate_estimates
from kvdiverge.estimation.speculative import (
    accepted_distribution,
    accepted_tokens,
    format_speculative_line,
    iid_tokens_per_forward,
    speculative_table,
)
from kvdiverge.testing.exact import enumerate_coupled


def hand_kernel(hx, hy):
    """Two tokens. Step 1: p = (.5, .5), q = (.8, .2), TV .3. After a shared 0: p = (1, 0),
    q = (.5, .5), TV .5. Everywhere else p = q = (.5, .5)."""
    h = hy
    if len(h) == 0:
        return np.array([0.5, 0.5]), np.array([0.8, 0.2])
    if h == (0,):
        return np.array([1.0, 0.0]), np.array([0.5, 0.5])
    return np.array([0.5, 0.5]), np.array([0.5, 0.5])


def constant_kernel(hx, hy):
    """p = (.6, .4), q = (.3, .7) on every history: TV .3, i.i.d. acceptance .7."""
    return np.array([0.6, 0.4]), np.array([0.3, 0.7])


def speculative_accepted(fn, vocab, k, h=()):
    """E[accepted tokens] of one block of k under speculative sampling, enumerated.

    The draft proposes y ~ q(. | h); the target accepts it with probability
    min(1, p(y | h) / q(y | h)); the block stops at the first rejection. Written from the
    sampler's definition, independent of the coupling code.
    """
    if k == 0:
        return 0.0
    p, q = fn(h, h)
    total = 0.0
    for y in range(vocab):
        if q[y] <= 0:
            continue
        accept = q[y] * min(1.0, p[y] / q[y])
        total += accept * (1.0 + speculative_accepted(fn, vocab, k - 1, h + (y,)))
    return total


def speculative_lengths(fn, vocab, k, h=()):
    """P(accepted = j), j = 0..k, of one block of k under speculative sampling, enumerated from the
    sampler's definition (as :func:`speculative_accepted`)."""
    out = np.zeros(k + 1)
    if k == 0:
        out[0] = 1.0
        return out
    p, q = fn(h, h)
    for y in range(vocab):
        if q[y] <= 0:
            continue
        accept = q[y] * min(1.0, p[y] / q[y])
        out[0] += q[y] - accept  # rejected: the block stops with 0 accepted
        out[1:] += accept * speculative_lengths(fn, vocab, k - 1, h + (y,))
    return out


def test_serving_terms_are_the_sampler_s(kernel):
    """vLLM's acceptance length and histogram, the conditional acceptance, against the real sampler."""
    exact = enumerate_coupled(kernel, 3, T=4, W=1)
    for k in range(1, 5):
        lengths = speculative_lengths(kernel, 3, k)
        np.testing.assert_allclose(accepted_distribution(exact.S, k), lengths, atol=1e-12)
        # vLLM: 1 + accepted / steps, one step per block
        assert 1 + accepted_tokens(exact.S, k)[-1] == pytest.approx(1 + lengths @ np.arange(k + 1), abs=1e-12)
        # NeMo-Skills: P(position k accepted | the k - 1 before accepted)
        reached = lengths[k - 1 :].sum()  # P(accepted >= k - 1)
        cond = lengths[k:].sum() / reached
        assert cond == pytest.approx(exact.S[k - 1] / (exact.S[k - 2] if k > 1 else 1.0), abs=1e-12)
    # hand kernel: S = (.7, .45, .45) -> accepted of a block of 3 is 0 w.p. .3, 1 w.p. .25, 3 w.p. .45
    np.testing.assert_allclose(speculative_lengths(hand_kernel, 2, 3), [0.3, 0.25, 0.0, 0.45], atol=1e-12)
    np.testing.assert_allclose(accepted_distribution([0.7, 0.45, 0.45], 3), [0.3, 0.25, 0.0, 0.45], atol=1e-12)
    with pytest.raises(ValueError, match=r"block length k must be in \[1, T=3\], got 0"):
        accepted_distribution([0.7, 0.45, 0.45], 0)


def test_hand_kernel_by_hand():
    # S_1 = .7; S_2 = .5 * .5 (draft 0 accepted, then TV .5) + .2 (draft 1 accepted, then TV 0)
    exact = enumerate_coupled(hand_kernel, 2, T=3, W=1)
    np.testing.assert_allclose(exact.S, [0.7, 0.45, 0.45], atol=1e-12)
    np.testing.assert_allclose(accepted_tokens(exact.S, 3), [0.7, 1.15, 1.6], atol=1e-12)
    for k, a in ((1, 0.7), (2, 1.15), (3, 1.6)):
        assert speculative_accepted(hand_kernel, 2, k) == pytest.approx(a, abs=1e-12)


def test_sum_of_survival_is_the_speculative_sampler_on_a_history_kernel(kernel):
    exact = enumerate_coupled(kernel, 3, T=4, W=1)
    A = accepted_tokens(exact.S, 4)
    for k in range(1, 5):
        assert A[k - 1] == pytest.approx(speculative_accepted(kernel, 3, k), abs=1e-12)
    assert A[-1] < 4 and np.all(np.diff(A) > 0)


def test_constant_kernel_equals_the_iid_formula():
    # per replicate the chain survival is .7^t exactly, so the table is exact
    docs = document_estimates(replicate_estimates(simulate(TableKernelPair(constant_kernel, 2), 5, 8, seed=1), 1))
    t = speculative_table(docs, Bootstrap(50, 0.9, 0))
    assert t["k"].to_list() == [1, 2, 3, 4, 5]
    A = np.cumsum(0.7 ** np.arange(1, 6))
    np.testing.assert_allclose(t["A"].to_numpy(), A, atol=1e-12)
    np.testing.assert_allclose(t["tokens_per_forward"].to_numpy(), A + 1, atol=1e-12)
    np.testing.assert_allclose(t["alpha"].to_numpy(), 0.7, atol=1e-12)
    np.testing.assert_allclose(t["iid_tokens_per_forward"].to_numpy(), (1 - 0.7 ** np.arange(2, 7)) / 0.3, atol=1e-12)
    np.testing.assert_allclose(t["accepted_fraction"].to_numpy(), A / np.arange(1, 6), atol=1e-12)
    np.testing.assert_allclose(t["A_lo"].to_numpy(), A, atol=1e-12)  # one document: no spread
    # i.i.d. acceptance: the curve's own terms are MagicDec's predictions
    np.testing.assert_allclose(t["conditional_acceptance"].to_numpy(), 0.7, atol=1e-12)
    np.testing.assert_allclose(t["iid_S_k"].to_numpy(), t["S_k"].to_numpy(), atol=1e-12)
    np.testing.assert_allclose(t["acceptance_length"].to_numpy(), t["iid_tokens_per_forward"].to_numpy(), atol=1e-12)
    hist = t["accepted_hist"].to_list()
    np.testing.assert_allclose(hist[1], [0.3, 0.7 * 0.3, 0.49], atol=1e-12)
    assert [len(h) for h in hist] == [2, 3, 4, 5, 6] and all(sum(h) == pytest.approx(1.0) for h in hist)


def test_engine_estimate_is_unbiased_for_the_sampler():
    T, R = 3, 3000
    reps = replicate_estimates(simulate(TableKernelPair(hand_kernel, 2), T, R, seed=5), 1)
    S = np.asarray(reps["S"].to_list())
    A = accepted_tokens(S, T)  # per replicate
    assert np.all(A[:, 0] == pytest.approx(0.7))  # the first step is the prompt's: no noise
    for k in (2, 3):
        se = A[:, k - 1].std(ddof=1) / math.sqrt(R)
        truth = speculative_accepted(hand_kernel, 2, k)
        assert abs(A[:, k - 1].mean() - truth) <= 4 * se, (k, A[:, k - 1].mean(), truth, se)


def doc(policy, doc_id, S, tv_mean, T=3):
    return {
        "model": "m",
        "policy": policy,
        "split": "exploratory",
        "doc_id": doc_id,
        "T": T,
        "S": S,
        "tv_mean": tv_mean,
    }


def test_pooled_table_by_hand():
    docs = pl.DataFrame(
        [
            doc("a", "d0", [0.7, 0.45, 0.45], 0.4),
            doc("a", "d1", [1.0, 1.0, 1.0], 0.0),
            doc("b", "d0", [0.5, 0.25, 0.0], 0.75),
            doc("b", "d1", [0.5, 0.25, 0.0], 0.75),
        ]
    )
    t = speculative_table(docs, Bootstrap(400, 0.9, 3), max_block=2)
    a = t.filter(pl.col("policy") == "a")
    assert a["k"].to_list() == [1, 2] and a["n_docs"].to_list() == [2, 2]
    np.testing.assert_allclose(a["A"].to_numpy(), [0.85, 1.575])
    np.testing.assert_allclose(a["S_k"].to_numpy(), [0.85, 0.725])
    np.testing.assert_allclose(a["alpha"].to_numpy(), [0.8, 0.8])
    np.testing.assert_allclose(a["iid_tokens_per_forward"].to_numpy(), [1.8, 1 + 0.8 + 0.64])
    # resampled means of two documents lie between them, and both ends are reached
    np.testing.assert_allclose(a["A_lo"].to_numpy(), [0.7, 1.15])
    np.testing.assert_allclose(a["A_hi"].to_numpy(), [1.0, 2.0])
    np.testing.assert_allclose(a["tokens_per_forward_hi"].to_numpy(), [2.0, 3.0])
    np.testing.assert_allclose(a["iid_tokens_per_forward_lo"].to_numpy(), [1.6, 1.96])  # alpha .6
    # pooled survival (.85, .725): conditional .725 / .85; MagicDec's alpha .8 predicts .8, .64
    np.testing.assert_allclose(a["conditional_acceptance"].to_numpy(), [0.85, 0.725 / 0.85])
    np.testing.assert_allclose(a["iid_S_k"].to_numpy(), [0.8, 0.64])
    np.testing.assert_allclose(a["acceptance_length"].to_numpy(), [1.85, 2.575])
    np.testing.assert_allclose(a["accepted_hist"].to_list()[1], [0.15, 0.125, 0.725])
    # resampled conditionals of d0 (.45/.7) and d1 (1) bound the interval
    np.testing.assert_allclose(a["conditional_acceptance_lo"].to_numpy()[1], 0.45 / 0.7)
    np.testing.assert_allclose(a["conditional_acceptance_hi"].to_numpy()[1], 1.0)
    b = t.filter(pl.col("policy") == "b")
    np.testing.assert_allclose(b["A"].to_numpy(), [0.5, 0.75])
    np.testing.assert_allclose(b["A_hi"].to_numpy(), b["A_lo"].to_numpy())
    assert speculative_table(docs, Bootstrap(400, 0.9, 3), max_block=2).equals(t)
    assert speculative_table(docs, Bootstrap(400, 0.9, 3))["k"].max() == 3  # capped at T
    line = format_speculative_line(t, ["b", "a", "absent"], k=4)
    assert "k=2" in line and line.index(" b 1.75 [1.75, 1.75] (iid 1.31)") < line.index(" a 2.58 [2.15, 3.00]")
    assert "absent" not in line


def test_iid_formula_and_bad_block():
    np.testing.assert_allclose(iid_tokens_per_forward([0.0, 0.5, 1.0], 3), [1.0, 1.875, 4.0])
    np.testing.assert_allclose(iid_tokens_per_forward(0.9, [1, 4]), [(1 - 0.81) / 0.1, (1 - 0.9**5) / 0.1])
    with pytest.raises(ValueError, match=r"block length K must be in \[1, T=3\], got 4"):
        accepted_tokens(np.ones(3), 4)
    with pytest.raises(ValueError, match="max_block must be >= 1, got 0"):
        speculative_table(pl.DataFrame([doc("a", "d0", [1.0, 1.0, 1.0], 0.0)]), Bootstrap(10, 0.9, 0), max_block=0)
    assert (
        speculative_table(
            pl.DataFrame(
                schema={
                    "model": pl.String,
                    "policy": pl.String,
                    "split": pl.String,
                    "T": pl.Int64,
                    "S": pl.List(pl.Float64),
                    "tv_mean": pl.Float64,
                }
            ),
            Bootstrap(10, 0.9, 0),
        ).height
        == 0
    )


# --------------------------------------------------------------------------- a real sampler on the embedded model

PROMPT = (
    "The bridge over the river was built in 1932 by a company from Glasgow. It has three spans of steel "
    "and carries a railway and a road. In winter the steel contracts and in summer it expands, which is "
    "why the engineers left joints between the spans."
)


@pytest.mark.llm
def test_speculative_sampler_on_the_embedded_model_matches_the_survival_sum(embedded):
    import torch
    from kvpress import SnapKVPress

    import kvdiverge
    from kvdiverge.config.inputs import prepare_documents
    from kvdiverge.testing.speculative import DraftBlocks, first_block_accepted

    torch.set_num_threads(1)
    model, tok = embedded
    ids = prepare_documents({"bridge": PROMPT}, tok, instruction="Summarise the text in two sentences.")[0].input_ids
    k, press = 3, {"press": "SnapKVPress", "compression_ratio": 0.5, "window_size": 8}
    m = kvdiverge.measure(
        model, tok, {"bridge": ids}, {"snapkv": press}, max_new_tokens=k, replicates=32, bootstrap=50, progress=False
    )
    A = np.asarray(m.replicates["S"].to_list()).sum(axis=1)  # A_k per replicate (T = k)
    acc = first_block_accepted(
        model, ids, SnapKVPress(compression_ratio=0.5, window_size=8), DraftBlocks(k, 128, seed=4)
    )
    assert acc.min() >= 1  # a prefill press: q_1 = p_1, the first drafted token is always accepted
    assert m.speculative["S_k"][0] == 1.0
    assert A.mean() == pytest.approx(m.speculative.filter(pl.col("k") == k)["A"][0])
    se = math.sqrt(acc.var(ddof=1) / len(acc) + A.var(ddof=1) / len(A))
    assert abs(acc.mean() - A.mean()) <= 4 * se, (acc.mean(), A.mean(), se)
    assert acc.mean() < k - 0.05  # the press does change the kernel: not every block is accepted whole
    # vLLM's histogram of accepted lengths and the conditional acceptance, against the sampler's blocks
    row = m.speculative.filter(pl.col("k") == k).row(0, named=True)
    seen = np.bincount(acc, minlength=k + 1) / len(acc)
    for j, (p_hat, p_est) in enumerate(zip(seen, row["accepted_hist"])):
        assert abs(p_hat - p_est) <= 4 * math.sqrt(max(p_est * (1 - p_est), 1e-4) / len(acc)) + 0.03, (j, seen)
    assert row["acceptance_length"] == pytest.approx(1 + row["A"])
    reached = (acc >= k - 1).mean()
    assert (acc >= k).mean() / reached == pytest.approx(row["conditional_acceptance"], abs=0.2)
    with pytest.raises(ValueError, match="speculative sampling needs temperature > 0, got 0"):
        first_block_accepted(
            model, ids, SnapKVPress(compression_ratio=0.5, window_size=8), DraftBlocks(k, 4, temperature=0)
        )
