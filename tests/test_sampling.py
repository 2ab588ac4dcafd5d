"""The generation settings as frozen objects: checked once, the pairs' part derived."""

import dataclasses

import pytest

from kvdiverge.engine.core.sampling import Decoding, Sampling


def test_sampling_hands_the_pairs_its_decoding_part():
    s = Sampling(T=8, replicates=2, temperature=0.7, top_p=0.95, seed=3, model_name="m", eos_ids=[2, 7])
    assert s.eos_ids == (2, 7)
    assert s.decoding == Decoding(temperature=0.7, top_p=0.95, eos_ids=(2, 7))
    assert Sampling(T=1, replicates=1, temperature=0.0).decoding.eos_ids is None  # the model's own
    assert s.replace(T=4).T == 4 and s.T == 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.T = 2


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"T": 0}, r"T \(new tokens\) must be an integer >= 1, got 0"),
        ({"replicates": 2.0}, "replicates must be an integer >= 1, got 2.0"),
        ({"temperature": float("nan")}, "temperature must be a finite number >= 0, got nan"),
        ({"top_p": 0}, r"top_p must lie in \(0, 1\], got 0"),
        ({"seed": "1"}, "seed must be an integer, got '1'"),
        ({"eos_ids": "2"}, "eos_ids must be a sequence of token ids or None, got '2'"),
    ],
)
def test_a_setting_out_of_range_is_named(changes, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        Sampling(**{"T": 4, "replicates": 2, "temperature": 1.0, **changes})
