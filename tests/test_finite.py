"""The estimate and analysis stages refuse non-finite inputs, naming the file and the column."""

import math

import numpy as np
import polars as pl
import pytest

from kvdiverge.engine.core.coupled import simulate
from kvdiverge.engine.core.pairs import TableKernelPair
from kvdiverge.estimation.estimators import document_estimates, read_estimates, read_shards, replicate_estimates
from kvdiverge.estimation.finite import NonFiniteError

T = 4


def stopping_kernel(hx, hy):
    """Equal coins on the first step, disjoint supports after: the chain stops at step 2."""
    if not hx:
        return np.array([0.5, 0.5, 0.0]), np.array([0.5, 0.5, 0.0])
    return np.array([1.0, 0.0, 0.0]), np.array([0.0, 1.0, 0.0])


def equal_kernel(hx, hy):
    """``p = q`` everywhere: never diverges (the undefined estimates of the none control)."""
    return np.array([0.6, 0.3, 0.1]), np.array([0.6, 0.3, 0.1])


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    """A shard file whose chain stopped at step 2 (``tv`` NaN at steps 3 and 4)."""
    frame = simulate(TableKernelPair(stopping_kernel, 3), T, 2, seed=3, doc_id="stop")
    assert math.isnan(frame["tv"][0][2]) and frame["chain_token"][0][2] == -1  # the setting
    path = tmp_path_factory.mktemp("shards") / "shard-0.parquet"
    frame.write_parquet(path)
    return path, frame


@pytest.fixture(scope="module")
def estimates(tmp_path_factory):
    """A per-document estimate file with a diverging and a never-diverging document."""
    parts = [
        simulate(TableKernelPair(stopping_kernel, 3), T, 2, seed=3, doc_id="stop"),
        simulate(TableKernelPair(equal_kernel, 3), T, 2, seed=3, doc_id="equal"),
    ]
    docs = document_estimates(replicate_estimates(pl.concat(parts), 1), {"early": (1, 1), "late": (2, 3)})
    equal = docs.filter(pl.col("doc_id") == "equal")
    assert math.isnan(equal["tau_mean"][0]) and math.isnan(equal["rho"][0])  # undefined by definition
    path = tmp_path_factory.mktemp("estimates") / "exploratory.parquet"
    docs.write_parquet(path)
    return path, docs


def test_valid_shard_with_a_stopped_chain_is_read(shard):
    path, frame = shard
    assert read_shards([str(path)]).height == frame.height


def _set_list(frame, column, row, element, value):
    values = frame[column].to_list()
    values[row] = list(values[row])
    values[row][element] = value
    return frame.with_columns(pl.Series(column, values, dtype=frame.schema[column]))


@pytest.mark.parametrize(
    "column,element,value",
    [
        ("survival", 1, float("nan")),
        ("tv", 0, float("inf")),  # before the stop: a number belongs there
        ("tv", 3, float("inf")),  # after the stop only NaN is undefined
        ("branch_tv", 0, float("-inf")),
    ],
)
def test_non_finite_shard_is_refused_naming_file_and_column(shard, tmp_path, column, element, value):
    _, frame = shard
    bad = _set_list(frame, column, 1, element, value)
    path = tmp_path / "shard-1.parquet"
    bad.write_parquet(path)
    with pytest.raises(NonFiniteError) as err:
        read_shards([str(shard[0]), str(path)])
    msg = str(err.value)
    assert str(path) in msg and f"column {column!r}" in msg
    assert f"element {element}" in msg and "replicate 1" in msg and "'stop'" in msg


def test_nan_tv_before_the_stop_is_refused(shard, tmp_path):
    _, frame = shard
    bad = _set_list(frame, "tv", 0, 0, float("nan"))  # chain_token[0] is a real token
    assert bad["chain_token"][0][0] != -1
    path = tmp_path / "shard-0.parquet"
    bad.write_parquet(path)
    with pytest.raises(NonFiniteError, match=r"column 'tv'.*row 0 .*element 0"):
        read_shards([str(path)])


def test_non_finite_seconds_are_refused(shard, tmp_path):
    _, frame = shard
    path = tmp_path / "shard-0.parquet"
    frame.with_columns(pl.lit(float("nan")).alias("seconds")).write_parquet(path)
    with pytest.raises(NonFiniteError, match=r"column 'seconds'.* 2 non-finite"):
        read_shards([str(path)])


def test_estimates_with_undefined_values_are_read(estimates):
    path, docs = estimates
    assert read_estimates([str(path)]).equals(docs)


@pytest.mark.parametrize(
    "doc,column,value",
    [
        ("stop", "p_div", float("nan")),
        ("equal", "E_N", float("inf")),
        ("stop", "tau_mean", float("nan")),  # p_div > 0 here: tau_mean is defined
        ("stop", "rho", float("nan")),  # E_L > 0 here
        ("stop", "btv_late", float("nan")),  # the window has weight
        ("equal", "p_div_se", float("nan")),  # R = 2: the standard error is defined
    ],
)
def test_non_finite_estimates_are_refused_naming_file_and_column(estimates, tmp_path, doc, column, value):
    _, docs = estimates
    bad = docs.with_columns(
        pl.when(pl.col("doc_id") == doc).then(pl.lit(value)).otherwise(pl.col(column)).alias(column)
    )
    path = tmp_path / "exploratory.parquet"
    bad.write_parquet(path)
    with pytest.raises(NonFiniteError) as err:
        read_estimates([str(path)])
    msg = str(err.value)
    assert str(path) in msg and f"column {column!r}" in msg and repr(doc) in msg


def test_non_finite_branch_tv_lag_with_weight_is_refused(estimates, tmp_path):
    _, docs = estimates
    row = docs["doc_id"].to_list().index("stop")
    assert docs["btv_den"][row][0] > 0
    bad = _set_list(docs, "btv_lag", row, 0, float("nan"))
    path = tmp_path / "exploratory.parquet"
    bad.write_parquet(path)
    with pytest.raises(NonFiniteError, match=r"column 'btv_lag'.*element 0"):
        read_estimates([str(path)])


def test_infinite_variance_ratio_only_where_its_denominator_is_zero(estimates, tmp_path):
    _, docs = estimates
    assert docs.filter(pl.col("doc_id") == "equal")["var_N_cmc"][0] == 0
    path = tmp_path / "exploratory.parquet"
    stop = pl.col("doc_id") == "stop"  # give the other document a defined ratio 0 / 0.5
    docs = docs.with_columns(
        pl.when(stop).then(0.5).otherwise(pl.col("var_N_cmc")).alias("var_N_cmc"),
        *(pl.when(stop).then(0.0).otherwise(pl.col(c)).alias(c) for c in ("var_ratio", "var_ratio_tv")),
    )
    for doc, value, refused in (
        ("equal", float("inf"), False),
        ("equal", float("-inf"), True),
        ("stop", float("inf"), True),
    ):
        docs.with_columns(
            pl.when(pl.col("doc_id") == doc).then(pl.lit(value)).otherwise(pl.col("var_ratio")).alias("var_ratio")
        ).write_parquet(path)
        if refused:
            with pytest.raises(NonFiniteError, match="column 'var_ratio'"):
                read_estimates([str(path)])
        else:
            assert read_estimates([str(path)]).height == 2
