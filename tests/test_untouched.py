"""``untouched`` means the evicted side's kernel equals the reference side's, not equal kept counts.

A press can keep every prompt position and still change the cache (ThinK prunes key
channels), or keep the whole prefill cache and evict while decoding (DMS with
``decoding=True``): neither is untouched. A press that changes nothing is.
"""

from __future__ import annotations

import logging
import warnings

import kvpress
import pytest
import torch

from kvdiverge.study.standins import MINIATURE, random_model


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
    assert (
        "left the cache untouched (TV 0 at every step: the same kernel as the full cache): knorm-0"
        in m.format_summary()
    )
