"""kvdiverge.study.cost: a config's generation cost, checked against hand-computed values."""

import pytest

from kvdiverge.cli import main
from kvdiverge.study.config import load_config
from kvdiverge.study.cost import projected_hours, study_cost, totals


@pytest.fixture(scope="module")
def smoke():
    return load_config("config/smoke.yaml")


@pytest.fixture(scope="module")
def paper():
    return load_config("config/paper.yaml")


def test_smoke_cost_by_hand(smoke):
    # smoke: T = 8, R = 2, 2 shards; exploratory snapkv-50, snapkv-b128 and the decode-time window-50 on 2
    # documents, confirmatory snapkv-90 on 2, the noise floor on both splits' 2 documents, the control
    # `none` on the first 1 exploratory document.
    costs = study_cost(smoke)
    assert [(c.policy, c.split, c.documents) for c in costs] == [
        ("snapkv-50", "exploratory", 2),
        ("snapkv-b128", "exploratory", 2),
        ("window-50", "exploratory", 2),
        ("noise-floor", "exploratory", 2),
        ("snapkv-90", "confirmatory", 2),
        ("noise-floor", "confirmatory", 2),
        ("none", "exploratory", 1),
    ]
    assert [c.decode_time for c in costs] == [False, False, True, False, False, False, False]
    # per document: token-steps R x 2 sides x (2T - 1) = 2 * 2 * 15 = 60;
    # forwards: 1 prefill (both caches) + 2T - 2 steps of one forward over both sides = 1 + 14 = 15;
    # window-50 prefills once per document (its chain lane's prefill forward gives the full cache too)
    assert [c.token_steps for c in costs] == [120] * 6 + [60]
    assert [c.forwards for c in costs] == [30, 30, 100, 30, 30, 30, 15]
    # window-50, per document: reference 2T - 2 = 14, evicted lanes (R + 1)(T - 1) = 21,
    # replays R = 2 prefills and R (T - 2) = 12 forwards (and token-steps)
    window = costs[2]
    assert (
        window.prefill_forwards,
        window.decode_forwards,
        window.replay_prefills,
        window.replay_forwards,
        window.replay_token_steps,
    ) == (2, 70, 4, 24, 24)
    assert totals(costs) == {
        "runs": 7,
        "documents": 13,
        "shards": 14,
        "prefill_forwards": 13,
        "decode_forwards": 224,
        "forwards": 265,
        "token_steps": 780,
        "replay_forwards": 28,
        "replay_token_steps": 24,
    }
    floor = {**smoke, "runs": {**smoke["runs"], "floor": {"policy": "noise-floor", "documents": 1}}}
    assert [c.documents for c in study_cost(floor) if c.policy == "noise-floor"] == [1, 1]


def test_paper_cost_and_batching(paper):
    # 2 models x (3 x 288 + 288 + 2 x 288 noise floor + 24) = 3504 document runs, R = 8, T = 256
    tot = totals(study_cost(paper))
    assert tot["documents"] == 3504
    assert tot["token_steps"] == 3504 * 8 * 2 * 511 == 28_648_704
    assert tot["decode_forwards"] == 3504 * 510 and tot["prefill_forwards"] == 3504
    # B = 12: a shard of 12 documents decodes as one group; the control's 24 documents
    # over 24 shards stay one per group
    batched = study_cost(paper, batch_documents=12)
    full = next(c for c in batched if c.policy == "snapkv-50")
    assert full.decode_forwards == 24 * 510
    control = next(c for c in batched if c.policy == "none")
    assert control.decode_forwards == 24 * 510
    assert totals(batched)["token_steps"] == tot["token_steps"]  # rows, not forwards, set the work
    # 28,648,704 token-steps at 3,979 token-steps/s on 1 device: 2.0 h; on 4 devices: 0.5 h
    assert projected_hours(paper, 28_648_704 / 7200) == pytest.approx(2.0)
    assert projected_hours(paper, 28_648_704 / 7200, gpus=4) == pytest.approx(0.5)


def test_bad_input_is_named(paper):
    with pytest.raises(ValueError, match="batch_documents"):
        study_cost(paper, batch_documents=0)
    with pytest.raises(ValueError, match="token_steps_per_s"):
        projected_hours(paper, 0)


def test_command_line(capsys):
    assert main(["cost", "config/smoke.yaml", "--rate", "660"]) == 0
    out = capsys.readouterr().out
    assert "660 token-steps" in out
    assert "0.00 h (1 s)" in out


def test_command_line_bad_config_is_one_line(tmp_path, capsys):
    assert main(["cost", str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvdiverge cost: error: ")
    assert "missing.yaml" in err[0]
    (tmp_path / "binary.yaml").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    assert main(["cost", str(tmp_path / "binary.yaml")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"kvdiverge cost: error: {tmp_path / 'binary.yaml'}: not a text file (byte 0 is not UTF-8); a config is YAML text"
    )


def exit_code(argv) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's own errors
        return exc.code


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("--rate", "0", "argument --rate: 0 is not allowed; allowed: a finite number > 0"),
        ("--rate", "-5", "argument --rate: -5 is not allowed; allowed: a finite number > 0"),
        ("--rate", "inf", "argument --rate: inf is not allowed; allowed: a finite number > 0"),
        ("--rate", "nan", "argument --rate: nan is not allowed; allowed: a finite number > 0"),
        ("--rate", "fast", "argument --rate: 'fast' is not a number; allowed: a finite number > 0"),
        ("--batch-documents", "0", "argument --batch-documents: 0 is not allowed; allowed: an integer >= 1"),
        ("--gpus", "0", "argument --gpus: 0 is not allowed; allowed: an integer >= 1"),
        ("--gpus", "1.5", "argument --gpus: '1.5' is not an integer; allowed: an integer >= 1"),
    ],
)
def test_cost_options_are_refused_by_their_names(option, value, message, capsys):
    assert exit_code(["cost", "config/smoke.yaml", option, value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"kvdiverge cost: error: {message} (see --help)"


def test_a_tiny_rate_prints_hours_in_three_digits(capsys):
    assert main(["cost", "config/smoke.yaml", "--rate", "1e-300"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("at 1e-300 token-steps/s on 1 device(s): ") and line.endswith(" s)")
    assert len(line) < 100 and "e+" in line


def test_an_invalid_config_prints_every_reason_on_one_line(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text("seed: -1\ncorpus: {min_words: 0}\n")
    assert main(["cost", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"kvdiverge cost: error: {config}: invalid config: missing config key models, policies, runs, confirmatory; "
        "corpus.min_words: 0 is out of range; allowed: >= 1; seed: -1 is out of range; allowed: >= 0"
    ]
