"""The generation settings as frozen objects: checked once, the pairs' part derived."""

import dataclasses

import pytest

from kvdiverge.engine.core.sampling import Decoding, Sampling


def test_sampling_hands_the_pairs_its_decoding_part():
    s = Sampling(T=8, replicates=2, temperature=0.7, top_p=0.95, seed=3, model_name="m", eos_ids=[2, 7])
    assert s.eos_ids == (2, 7)
    assert s.decoding == Decoding(temperature=0.7, top_p=0.95, eos_ids=(2, 7))
    assert s.decoding.repetition_penalty == 1.0  # none unless asked
    assert s.replace(repetition_penalty=1.3).decoding.repetition_penalty == 1.3
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
        ({"repetition_penalty": 0}, "repetition_penalty must be a finite number > 0, got 0"),
    ],
)
def test_a_setting_out_of_range_is_named(changes, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        Sampling(**{"T": 4, "replicates": 2, "temperature": 1.0, **changes})


def test_the_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    """transformers' RepetitionPenaltyLogitsProcessor, by hand: seen tokens 0 (logit 2) and 1
    (logit -1) become 2 / 2 = 1 and -1 * 2 = -2; unseen tokens 2 and 3 stay."""
    import torch

    from kvdiverge.engine.core.decoding import penalize_repeats

    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0]])
    seen = torch.tensor([[True, True, False, False]])
    assert penalize_repeats(logits, seen, 2.0).tolist() == [[1.0, -2.0, 0.5, -3.0]]
    assert penalize_repeats(logits, seen, 1.0).tolist() == logits.tolist()


def test_the_repeat_history_follows_each_sides_rows_through_rewinds_and_dropped_rows():
    """Two documents (prompts {0} and {1}) with 2 rows each, vocabulary 6: each side's context is
    its document's prompt and the tokens that side generated, as the coupled run rewinds and drops rows."""
    import torch

    from kvdiverge.engine.core.decoding import RepeatHistory

    def rows(mask):
        return [sorted(torch.nonzero(r).flatten().tolist()) for r in mask]

    h = RepeatHistory([torch.tensor([0]), torch.tensor([1, 1])], 6, 1.5)
    assert rows(h.seen("reference")) == [[0], [1]]  # before begin: one row per document
    h.begin(2)
    h.append(torch.tensor([2, 2, 3, 3]), torch.tensor([2, 4, 3, 5]))
    assert rows(h.seen("reference")) == [[0, 2], [0, 2], [1, 3], [1, 3]]
    assert rows(h.seen("evicted")) == [[0, 2], [0, 4], [1, 3], [1, 5]]
    h.rewind(torch.tensor([1, 0, 1, 1]))  # row 1 goes back to its prompt
    h.append(torch.tensor([5, 4, 0, 0]), torch.tensor([5, 3, 0, 0]))
    assert rows(h.seen("evicted")) == [[0, 2, 5], [0, 3], [0, 1, 3], [0, 1, 5]]
    h.keep_rows(torch.tensor([3, 1]))
    assert rows(h.seen("reference")) == [[0, 1, 3], [0, 4]]
    assert rows(h.seen("evicted")) == [[0, 1, 5], [0, 3]]
