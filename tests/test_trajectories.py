"""The trajectory engine on synthetic kernel pairs, against exhaustive enumeration."""

import numpy as np
import polars as pl
import pytest

from kvdiverge.engine.core.coupled import simulate
from kvdiverge.engine.core.pairs import TableKernelPair
from kvdiverge.engine.core.streams import uniform_streams
from kvdiverge.estimation.schema import TRAJECTORY_SCHEMA
from kvdiverge.testing.exact import enumerate_coupled

V = 3


def markov_pair(a, b):
    """Reference and evicted kernels that depend on their own last token; the evicted
    kernel also remembers whether its first token was 2 (a long-range effect)."""
    la = a[-1] if a else 0
    lb = b[-1] if b else 0
    p = np.array([0.5, 0.3, 0.2]) if la == 0 else np.array([0.2, 0.5, 0.3])
    q = np.array([0.4, 0.4, 0.2]) if lb == 0 else np.array([0.1, 0.3, 0.6])
    if b and b[0] == 2:
        q = np.array([0.3, 0.3, 0.4])
    return p, q


def eos_pair(a, b):
    """Token 2 is EOS; the evicted kernel ends sooner."""
    p = np.array([0.6, 0.3, 0.1]) if len(a) % 2 == 0 else np.array([0.3, 0.6, 0.1])
    q = np.array([0.5, 0.2, 0.3]) if len(b) % 2 == 0 else np.array([0.3, 0.5, 0.2])
    return p, q


def estimates(df: pl.DataFrame, T: int, W: int) -> dict[str, np.ndarray]:
    """Per-replicate estimators of estimators.md §5, straight from the shard columns."""
    S = np.array(df["survival"].to_list())
    S_T = S[:, -1]
    f_hat = np.hstack([np.ones((len(S), 1)), S[:, :-1]]) - S
    mism = df["branch_mismatch"].to_list()
    btv = df["branch_tv"].to_list()
    naive = df["tau_naive"].to_list()
    return {
        "p_div": 1 - S_T,
        "E_L": (f_hat * (T - np.arange(1, T + 1))).sum(1),
        "N_cmc": (1 - S_T) + (1 - S_T) * np.array([sum(m) for m in mism]),
        "N_naive": np.array([0.0 if t is None else 1 + sum(m) for t, m in zip(naive, mism)]),
        "N_tv": (1 - S_T) + (1 - S_T) * np.array([sum(b) for b in btv]),
        "N_win": (1 - S_T) * np.array([sum(m[:W]) for m in mism]),
    }


@pytest.mark.parametrize("fn, eos", [(markov_pair, ()), (eos_pair, (2,))], ids=["markov", "eos"])
def test_engine_is_unbiased_against_exact_enumeration(fn, eos):
    T, W = 4, 1
    exact = enumerate_coupled(fn, V, T, W, eos_ids=eos)
    pair = TableKernelPair(fn, V, eos_ids=eos)
    df = pl.concat([simulate(pair, T, 8, seed=s) for s in range(250)])
    est = estimates(df, T, W)
    targets = {
        "p_div": exact.p_div,
        "E_L": exact.E_L,
        "N_cmc": exact.E_N,
        "N_naive": exact.E_N,
        "N_tv": exact.E_N,
        "N_win": exact.E_N_win,
    }
    for name, target in targets.items():
        x = est[name]
        se = x.std(ddof=1) / np.sqrt(len(x))
        assert abs(x.mean() - target) < 4 * se + 1e-12, (name, x.mean(), target, se)
    # Rao-Blackwellisation: the CMC estimator has no more variance than the naive one.
    assert est["N_cmc"].var() <= est["N_naive"].var()


def test_shard_columns_follow_the_schema_and_invariants():
    T = 5
    df = simulate(TableKernelPair(markov_pair, V), T, 6, seed=3)
    assert df.schema == pl.Schema(TRAJECTORY_SCHEMA)
    assert df.height == 6 and df["replicate"].to_list() == list(range(6))
    for row in df.iter_rows(named=True):
        S = np.array(row["survival"])
        tv = np.array(row["tv"])
        # S_t = prod (1 - tv_s) while the chain runs
        ran = ~np.isnan(tv)
        assert np.allclose(S[ran], np.cumprod(1 - tv[ran]))
        assert np.all(np.diff(S) <= 0)
        if row["t_star"] is None:
            assert row["branch_tv"] == [] and S[-1] == 1.0
        else:
            L = T - row["t_star"]
            assert len(row["branch_x"]) == len(row["branch_y"]) == len(row["branch_tv"]) == L
            assert row["x_star"] != row["y_star"]
            assert row["branch_mismatch"] == [int(x != y) for x, y in zip(row["branch_x"], row["branch_y"])]
            if row["tau_naive"] is not None:
                assert row["t_star"] == row["tau_naive"]


def test_identical_kernels_never_diverge():
    same = lambda a, b: (np.array([0.2, 0.3, 0.5]),) * 2  # noqa: E731
    df = simulate(TableKernelPair(same, V), 6, 4, seed=0)
    assert all(v == 0.0 for tv in df["tv"].to_list() for v in tv)
    assert df["t_star"].null_count() == 4 and df["tau_naive"].null_count() == 4
    assert all(s == [1.0] * 6 for s in df["survival"].to_list())


def test_disjoint_kernels_diverge_at_step_one_and_stop_the_chain():
    split = lambda a, b: (np.array([1.0, 0, 0]), np.array([0, 1.0, 0]))  # noqa: E731
    df = simulate(TableKernelPair(split, V), 3, 2, seed=0)
    assert df["tau_naive"].to_list() == [1, 1] and df["t_star"].to_list() == [1, 1]
    assert df["chain_token"].to_list() == [[-1, -1, -1]] * 2
    assert df["survival"].to_list() == [[0.0, 0.0, 0.0]] * 2
    assert df["x_star"].to_list() == [0, 0] and df["y_star"].to_list() == [1, 1]
    assert df["branch_mismatch"].to_list() == [[1, 1]] * 2


def test_eos_is_absorbing_on_both_sides():
    # Both sides emit EOS (2) first; afterwards only EOS is possible.
    fn = lambda a, b: (np.array([0.0, 0.0, 1.0]), np.array([0.0, 0.0, 1.0]))  # noqa: E731
    df = simulate(TableKernelPair(fn, V, eos_ids=(2,)), 4, 2, seed=0)
    assert df["chain_token"].to_list() == [[2, 2, 2, 2]] * 2


def test_runs_are_reproducible_and_streams_do_not_depend_on_policy():
    pair = TableKernelPair(markov_pair, V)
    a = simulate(pair, 5, 4, seed=11).drop("seconds")
    b = simulate(pair, 5, 4, seed=11).drop("seconds")
    assert a.equals(b)
    c = simulate(pair, 5, 4, seed=11, doc_id="other").drop("seconds", "doc_id")
    assert not a.drop("doc_id").equals(c)
    s1 = uniform_streams(1, "m", "d", 0, 4)
    s2 = uniform_streams(1, "m", "d", 0, 4)
    assert all(np.array_equal(s1[k], s2[k]) for k in s1)
    assert not np.array_equal(s1["chain"], s1["divergence"])
    # pinned: the derivation of streams must not drift between versions
    assert s1["chain"][0] == 0.6926057933023988
    assert not np.array_equal(uniform_streams(1, "m", "d", 1, 4)["chain"], s1["chain"])


def test_the_floor_runs_on_all_documents_of_a_split_or_its_first_n():
    from kvdiverge.jobs.documents import shard_documents

    prompts = pl.DataFrame(
        {
            "doc_id": [f"d{i}" for i in range(6)],
            "split": ["exploratory"] * 5 + ["confirmatory"],
            "input_ids": [[1, 2, 3]] * 6,
            "exclusion_reason": [None, "too short", None, None, None, None],
        }
    )
    config = {"shards": 2, "runs": {"exploratory": ["a"], "confirmatory": ["b"], "floor": {"policy": "noise-floor"}}}

    def docs(cfg, split="exploratory"):
        return sorted(d for s in range(2) for d in shard_documents(prompts, cfg, "noise-floor", split, s)["doc_id"])

    assert docs(config) == ["d0", "d2", "d3", "d4"]  # every usable document, like policy "a"
    assert docs(config, "confirmatory") == ["d5"]
    subset = {**config, "runs": {**config["runs"], "floor": {"policy": "noise-floor", "documents": 2}}}
    assert docs(subset) == ["d0", "d2"]  # the first usable ones
    assert sorted(d for s in range(2) for d in shard_documents(prompts, subset, "a", "exploratory", s)["doc_id"]) == [
        "d0",
        "d2",
        "d3",
        "d4",
    ]  # the policies keep all
