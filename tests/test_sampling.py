"""The generation settings as frozen objects: checked once, the pairs' part derived."""

import dataclasses

import pytest
import torch

from kvdiverge.engine.core.sampling import Decoding, Sampling, decoding_options


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


@pytest.mark.parametrize("name", list(decoding_options()))
def test_every_decoding_option_reaches_every_door_by_name(name):
    """A decoding setting of ``decoding_options`` needs nothing at the doors: the config key, the
    measure() keyword check, the command-line option, the recorded settings and the neutral transform
    of the teacher-forced pass all come from the field."""
    from kvdiverge.cli import OPTIONS, _parser
    from kvdiverge.study.config import load_schema
    from kvdiverge.study.inputs import measure_settings
    from kvdiverge.study.settings import SETTINGS, setting_problems

    default = decoding_options()[name]["default"]
    value = default + 0.25  # in range for each: a penalty of 1.25, a min-p of 0.25
    assert SETTINGS[name] == f"decoding.{name}"
    entry = load_schema()["properties"]["decoding"]["properties"][name]
    assert "default" not in entry  # an unset setting keeps a config's settings hash
    assert setting_problems({name: default}) == []
    flag = "--" + name.replace("_", "-")
    assert OPTIONS[name] == flag
    args = _parser().parse_args(["measure", "embedded", "--sotu", "1", flag, str(value)])
    assert getattr(args, name) == value
    s = Sampling(T=2, replicates=1, temperature=0.7, **{name: value})
    assert getattr(s.decoding, name) == value and getattr(s.untransformed(), name) == default
    recorded = measure_settings("m", "s", {}, None, sampling=s, window=8, bootstrap=0, confidence=0.95,
                                instruction=None, system=None)  # fmt: skip
    assert recorded["decoding"] == {name: value}
    assert "decoding" not in measure_settings("m", "s", {}, None, sampling=s.replace(**{name: default}), window=8,
                                        bootstrap=0, confidence=0.95, instruction=None, system=None)  # fmt: skip


def test_measure_refuses_an_unknown_decoding_keyword():
    import kvdiverge

    with pytest.raises(TypeError, match="unexpected keyword argument 'min_q'"):
        kvdiverge.measure(None, None, {"a": [1, 2, 3]}, {}, min_q=0.1)


def test_min_p_keeps_tokens_of_at_least_min_p_times_the_top_probability():
    from kvdiverge.engine.core.decoding import decode_log_probs

    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]], dtype=torch.float64)
    out = decode_log_probs(probs.log(), 1.0, min_p=0.2).exp()  # threshold 0.2 * 0.5 = 0.1
    assert torch.allclose(out, torch.tensor([[0.5, 0.3, 0.15, 0.0]], dtype=torch.float64) / 0.95, atol=1e-15)
    assert torch.equal(decode_log_probs(probs.log(), 1.0, min_p=1.0).exp(), torch.tensor([[1.0, 0, 0, 0]]).double())
    assert torch.equal(decode_log_probs(probs.log(), 1.0, min_p=0.0), decode_log_probs(probs.log(), 1.0))
    with pytest.raises(ValueError, match="min_p must lie in"):
        Sampling(T=2, replicates=1, temperature=0.7, min_p=1.5)


@pytest.mark.parametrize("temperature, top_p, min_p", [(0.7, 0.9, 0.1), (1.3, 1.0, 0.05), (1.0, 0.5, 0.3)])
def test_min_p_after_top_p_equals_transformers_warpers(temperature, top_p, min_p):
    """Temperature, top-p, then min-p: ``model.generate``'s warper order, on random logits."""
    from transformers.generation.logits_process import MinPLogitsWarper, TemperatureLogitsWarper, TopPLogitsWarper

    logits = torch.randn(6, 200, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 3
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    expected = torch.log_softmax(MinPLogitsWarper(min_p)(None, scores), dim=-1)
    got = Decoding(temperature=temperature, top_p=top_p, min_p=min_p).log_probs(logits, torch.float64)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    assert torch.allclose(got[~torch.isinf(got)], expected[~torch.isinf(expected)], atol=1e-12, rtol=0)
    assert bool(torch.isinf(got).any())  # it truncated something
