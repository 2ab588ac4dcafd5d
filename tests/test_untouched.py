"""``untouched`` means the evicted side's kernel equals the reference side's, not equal kept counts.

A press can keep every prompt position and still change the cache (ThinK prunes key
channels), or keep the whole prefill cache and evict while decoding (DMS with
``decoding=True``): neither is untouched. A press that changes nothing is. Chains that never
part are not enough: a press that compressed, or any press under greedy decoding (TV 0 when
the answers agree), is ``no_divergence``, with no warning.
"""

from __future__ import annotations

import logging
import warnings

import kvpress
import pytest
import torch

from kvdiverge.models.standins import MINIATURE, random_model


@pytest.fixture(scope="module")
def measured():
    import kvdiverge

    model = random_model(MINIATURE["llama-3.1-8b"], seed=3)
    gen = torch.Generator().manual_seed(5)
    prompts = {f"p{i}": torch.randint(1, 500, (n,), generator=gen).tolist() for i, n in enumerate((40, 56))}
    presses = {
        "think": kvpress.ThinKPress(key_channel_compression_ratio=0.5, window_size=8),
        "dms-decoding": kvpress.DMSPress(kvpress.KnormPress(), threshold=-0.45, sliding_window_size=8, decoding=True),
        "knorm-0": kvpress.KnormPress(compression_ratio=0.0),
    }
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            m = kvdiverge.measure(
                model,
                None,
                prompts,
                presses,
                max_new_tokens=12,
                replicates=2,
                temperature=1.0,
                top_p=1.0,
                seed=1,
                window=2,
                bootstrap=20,
                progress=False,
            )
    finally:
        logging.disable(logging.NOTSET)
    return m, [str(w.message) for w in caught if "untouched" in str(w.message)]


def test_a_press_that_keeps_every_position_but_changes_the_kernel_is_not_untouched(measured):
    m, messages = measured
    s = {r["policy"]: r for r in m.summary.iter_rows(named=True)}
    for name in ("think", "dms-decoding"):
        assert s[name]["kept_fraction"] == 1.0  # every prompt position kept after the prefill ...
        assert s[name]["p_div"] > 0  # ... and yet the chains part
        assert not s[name]["untouched"], name
    tv = {p: max(v for row in m.trajectories.filter(policy=p)["tv"].to_list() for v in row) for p in s}
    assert tv["think"] > 0 and tv["dms-decoding"] > 0 and tv["knorm-0"] == 0.0


def test_a_press_that_changes_nothing_is_untouched_and_warned_about(measured):
    m, messages = measured
    s = {r["policy"]: r for r in m.summary.iter_rows(named=True)}
    assert s["knorm-0"]["untouched"] and s["knorm-0"]["p_div"] == 0.0
    assert messages == [
        "press 'knorm-0' left the cache untouched (TV 0 at every step on every prompt: the same "
        "kernel as the full cache)"
    ]
    assert m.compression.filter(policy="knorm-0")["untouched"].to_list() == [True, True]
    assert [s[p]["no_divergence"] for p in ("think", "dms-decoding", "knorm-0")] == [False, False, False]
    text = m.format_summary()
    assert "left the cache untouched (TV 0 at every step: the same kernel as the full cache): knorm-0" in text
    assert "100%*" in text and "%~" not in text


def test_untouched_needs_every_position_kept_and_a_decoding_whose_tv_can_show_the_kernels():
    import polars as pl

    from kvdiverge.estimation.tables import compression_table

    # per policy: (prompt_len, kept_len, tv of the one replicate)
    cases = {
        "kept-all-same": (96, 96, [0.0, 0.0, 0.0]),
        "compressed-same": (96, 72, [0.0]),  # a chain that drew EOS at step 1, the kernels equal there
        "kept-all-parted": (96, 96, [0.0, 0.25, 0.0]),
        "compressed-parted": (96, 72, [0.0, 1.0]),
    }
    documents = pl.DataFrame(
        {"policy": list(cases), "doc_id": ["d"] * 4, "prompt_len": [c[0] for c in cases.values()]}
        | {"kept_len": [c[1] for c in cases.values()]}
    )
    trajectories = pl.DataFrame({"policy": list(cases), "doc_id": ["d"] * 4, "tv": [c[2] for c in cases.values()]})

    def flags(point_masses):
        table = compression_table(documents, trajectories, point_masses)
        return {r["policy"]: (r["untouched"], r["no_divergence"]) for r in table.iter_rows(named=True)}

    assert flags(False) == {
        "kept-all-same": (True, False),
        "compressed-same": (False, True),
        "kept-all-parted": (False, False),
        "compressed-parted": (False, False),
    }
    # greedy: TV 0 shows only that the arg-maxes agreed, so nothing is called untouched
    assert flags(True) == {
        "kept-all-same": (False, True),
        "compressed-same": (False, True),
        "kept-all-parted": (False, False),
        "compressed-parted": (False, False),
    }


def test_greedy_answers_that_agree_are_no_divergence_not_an_untouched_cache():
    import kvdiverge

    model = random_model(MINIATURE["llama-3.1-8b"], seed=3)
    prompt = torch.randint(1, 500, (96,), generator=torch.Generator().manual_seed(5)).tolist()
    presses = {
        "snap": kvpress.SnapKVPress(compression_ratio=0.25, window_size=4),
        "knorm-0": kvpress.KnormPress(compression_ratio=0.0),
    }
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            m = kvdiverge.measure(model, None, {"p": prompt}, presses, temperature=0, max_new_tokens=4, replicates=1,
                                  bootstrap=20, progress=False)  # fmt: skip
    finally:
        logging.disable(logging.NOTSET)
    assert not [str(w.message) for w in caught if "untouched" in str(w.message)]
    comp = {r["policy"]: r for r in m.compression.iter_rows(named=True)}
    assert (comp["snap"]["prompt_len"], comp["snap"]["kept_len"]) == (96, 72)  # it compressed ...
    s = {r["policy"]: r for r in m.summary.iter_rows(named=True)}
    assert s["snap"]["p_div"] == 0.0 and s["knorm-0"]["p_div"] == 0.0  # ... and the greedy answers agreed
    assert [(s[p]["untouched"], s[p]["no_divergence"]) for p in presses] == [(False, True), (False, True)]
    text = m.format_summary()
    assert "75%~" in text and "100%~" in text and "%*" not in text and "left the cache untouched" not in text
    assert (
        "~ no divergence observed under this decoding (TV 0 at every step on every prompt), which does not show "
        "the cache untouched: the press compressed it, or greedy answers agreed: snap, knorm-0"
    ) in text
