"""The generation settings as frozen objects: checked once, the pairs' part derived."""

import dataclasses

import pytest
import torch

from kvdiverge.engine.core.sampling import Decoding, Sampling, decoding_options


def test_sampling_hands_the_pairs_its_decoding_part():
    s = Sampling(
        T=8, replicates=2, decoding=Decoding(temperature=0.7, top_p=0.95, eos_ids=[2, 7]), seed=3, model_name="m"
    )
    assert s.eos_ids == (2, 7)
    assert s.decoding == Decoding(temperature=0.7, top_p=0.95, eos_ids=(2, 7))
    assert s.decoding.repetition_penalty == 1.0  # none unless asked
    assert s.replace(repetition_penalty=1.3).decoding.repetition_penalty == 1.3
    assert Sampling(T=1, replicates=1, decoding=Decoding(temperature=0.0)).decoding.eos_ids is None  # the model's own
    assert s.replace(T=4).T == 4 and s.T == 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.T = 2


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"T": 0}, r"T \(new tokens\) must be an integer >= 1, got 0"),
        ({"replicates": 2.0}, "replicates must be an integer >= 1, got 2.0"),
        ({"seed": "1"}, "seed must be an integer, got '1'"),
        ({"decoding": {"temperature": 0.7}}, r"decoding must be a Decoding, got \{'temperature': 0.7\}"),
    ],
)
def test_a_sampling_setting_out_of_range_is_named(changes, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        Sampling(**{"T": 4, "replicates": 2, **changes})


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"temperature": float("nan")}, "temperature must be a finite number >= 0, got nan"),
        ({"temperature": True}, "temperature must be a finite number >= 0, got True"),
        ({"top_p": 0}, "top_p must be a finite number > 0 and <= 1, got 0"),
        ({"top_k": 2.5}, "top_k must be an integer >= 0, got 2.5"),
        ({"top_k": -1}, "top_k must be an integer >= 0, got -1"),
        ({"eos_ids": "2"}, "eos_ids must be a sequence of token ids or None, got '2'"),
        ({"repetition_penalty": 0}, "repetition_penalty must be a finite number >= 0.0001 and <= 10000, got 0"),
        ({"min_p": 1.5}, "min_p must be a finite number >= 0 and <= 1, got 1.5"),
    ],
)
def test_a_decoding_setting_out_of_range_is_named(changes, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        Decoding(**changes)


@pytest.mark.parametrize("name", list(decoding_options()))
def test_the_config_schema_takes_each_decoding_range_from_its_field(name):
    """One declaration of each range: the schema entry is the field's, so the config refuses what the object does."""
    from kvdiverge.config.workflow import load_schema
    from kvdiverge.settings.checks import setting_problems

    option = decoding_options()[name]
    entry = load_schema()["properties"]["decoding"]["properties"][name]
    assert {k: entry[k] for k in option["schema"]} == option["schema"]
    outside = {"temperature": -0.5, "top_k": -1, "top_p": 1.5, "repetition_penalty": 0.0, "min_p": 2.0}[name]
    assert setting_problems({name: outside}) != []
    with pytest.raises(ValueError, match=f"^{name} must be"):
        Decoding(**{name: outside})


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
    from kvdiverge.config.workflow import load_schema
    from kvdiverge.doors.arguments import OPTIONS
    from kvdiverge.doors.cli import _parser
    from kvdiverge.doors.measuring import MeasureOptions
    from kvdiverge.settings.checks import SETTINGS, setting_problems

    default, neutral = decoding_options()[name]["default"], decoding_options()[name]["neutral"]
    value = {"top_k": 5, "top_p": 0.5}.get(name, default + 0.25)  # in range for each
    assert SETTINGS[name] == f"decoding.{name}"
    entry = load_schema()["properties"]["decoding"]["properties"][name]
    assert entry.get("default") == (default if decoding_options()[name]["recorded"] else None)  # else: hash kept
    assert setting_problems({name: default}) == []
    flag = "--" + name.replace("_", "-")
    assert OPTIONS[name] == flag
    args = _parser().parse_args(["measure", "embedded", "--sotu", "1", flag, str(value)])
    assert getattr(_parser().parse_args(["measure", "embedded", "--sotu", "1"]), name) is None  # measure()'s
    assert getattr(args, name) == value
    s = Sampling(T=2, replicates=1, decoding=Decoding(**{"temperature": 0.7, name: value}))
    assert getattr(s.decoding, name) == value and getattr(s.untransformed().decoding, name) == neutral
    recorded = MeasureOptions(bootstrap=0).recorded(s, {}, None).record()
    plain = MeasureOptions(bootstrap=0).recorded(s.replace(**{name: default}), {}, None).record()
    if decoding_options()[name]["recorded"]:  # always recorded, at the top level
        assert recorded[name] == value and plain[name] == default and "decoding" not in recorded
    else:  # recorded when set, so records without it stay as they were
        assert recorded["decoding"] == {name: value} and "decoding" not in plain


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
    with pytest.raises(ValueError, match="min_p must be a finite number >= 0 and <= 1"):
        Sampling(T=2, replicates=1, decoding=Decoding(temperature=0.7, min_p=1.5))


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


def test_top_k_keeps_the_k_most_likely_tokens_and_their_ties():
    """By hand: logits (3, 1, 1, 0), top-k 2 keeps the token of 3 and both of 1 (tied with the 2nd)."""
    from kvdiverge.engine.core.decoding import decode_log_probs

    logits = torch.tensor([[3.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    kept = torch.softmax(logits[:, :3], -1)
    assert torch.allclose(decode_log_probs(logits, 1.0, top_k=2).exp()[:, :3], kept, atol=1e-15)
    assert decode_log_probs(logits, 1.0, top_k=2).exp()[0, 3] == 0
    assert torch.equal(decode_log_probs(logits, 1.0, top_k=0), decode_log_probs(logits, 1.0))
    assert torch.equal(decode_log_probs(logits, 1.0, top_k=4), decode_log_probs(logits, 1.0))  # k >= V: all kept


@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p", [(0.7, 20, 0.9, 0.0), (1.3, 5, 1.0, 0.05), (1.0, 50, 0.5, 0.3), (0.9, 1, 1, 0)]
)
def test_top_k_equals_transformers_warpers_in_generates_order(temperature, top_k, top_p, min_p):
    """Temperature, top-k, top-p, then min-p: ``model.generate``'s warper order, on random logits."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(6, 200, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 3
    logits[0, :4] = logits[0, :4].max()  # a tie at the top
    scores = TopKLogitsWarper(top_k)(None, TemperatureLogitsWarper(temperature)(None, logits.clone()))
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    if min_p > 0:
        scores = MinPLogitsWarper(min_p)(None, scores)
    expected = torch.log_softmax(scores, dim=-1)
    got = Decoding(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p).log_probs(logits, torch.float64)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    assert torch.allclose(got[~torch.isinf(got)], expected[~torch.isinf(expected)], atol=1e-12, rtol=0)
    assert int((~torch.isinf(got)).sum(-1).max()) <= max(top_k, 4)  # it truncated to k (the tie: 4)


def test_measure_options_take_the_checked_values_integral_floats_as_counts():
    """``measure(bootstrap=2000.0, seed=3.0)`` is allowed, as the config allows it: every count the door reads
    (the bootstrap's, the horizon, a decoding setting) is the checked ``int``, not the float given."""
    from kvdiverge.doors.measuring import MeasureOptions

    opts = MeasureOptions.checked({"temperature": 0, "top_k": 5.0}, bootstrap=2000.0, seed=3.0, max_new_tokens=16.0)
    assert (opts.bootstrap, opts.seed, opts.max_new_tokens, opts.decoding["top_k"]) == (2000, 3, 16, 5)
    assert all(type(v) is int for v in (opts.bootstrap, opts.seed, opts.max_new_tokens, opts.decoding["top_k"]))
    assert opts.boot.n_boot == 2000 and opts.sampling("m").decoding.top_k == 5
    with pytest.raises(ValueError, match="bootstrap: 2.5 is not an integer"):
        MeasureOptions.checked({}, bootstrap=2.5)
