"""kvdiverge.planning.cost: a config's generation cost, checked against hand-computed values."""

import re
from pathlib import Path

import pytest

from kvdiverge.config.workflow import load_config
from kvdiverge.doors.cli import main
from kvdiverge.planning.cost import projected_hours, stage_costs, study_cost, task_cost, teacher_cost, totals


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


def test_the_prediction_study_counts_its_task_sides_and_the_teacher_forced_pass():
    config = load_config("config/fidelity-predicts-task.yaml")
    # the teacher-forced pass: every coupled run's documents (250), 128 continuation tokens on 2 sides;
    # a block forward per side, but int4 (a quantized cache, 8 documents) steps: 2 x 127 per document
    teacher = teacher_cost(config)
    assert [(c.policy, c.split, c.documents) for c in teacher] == [
        (c.policy, c.split, c.documents) for c in study_cost(config)
    ]
    assert totals(teacher)["token_steps"] == 250 * 2 * 128 == 64_000
    assert totals(teacher)["forwards"] == (250 + 8) + 242 * 2 + 8 * 2 * 127 == 2_774
    # each task side: 30 confirmatory documents, T = 16, R = 1: 2 x (2T - 1) = 62 token-steps a document;
    # 6 presses x 4 ratios and the noise floor, and with the question inside the int4 cache alone
    sides = task_cost(config)
    points = {side: [c.policy for c in sides if c.stage == f"task {side}"] for side in ("niah-after", "niah-inside")}
    assert len(points["niah-after"]) == 25 and points["niah-after"][-1] == "noise-floor"
    assert points["niah-inside"] == [*points["niah-after"][:-1], "int4", "noise-floor"]
    assert {(c.documents, c.replicates, c.T, c.token_steps) for c in sides} == {(30, 1, 16, 30 * 62)}
    stages = stage_costs(config)
    assert [(s.stage, s.jobs, s.documents, s.token_steps) for s in stages] == [
        # the workflow's jobs: one per (model, split, shard) and one teacher-forced job per (model, split)
        ("coupled runs", 2 * 2, 250, 126_000),
        ("teacher-forced pass", 2, 250, 64_000),
        # the reconstruction pass: the frontier's 25 points on its 8 documents, at most 1,024 tokens on 2 sides
        ("reconstruction pass", 1, 25 * 8, 25 * 8 * 2 * 1024),
        ("task side niah-after", 1, 25 * 30, 25 * 30 * 62),
        ("task side niah-inside", 1, 26 * 30, 26 * 30 * 62),
        ("task side recall-inside", 1, 26 * 30, 26 * 30 * 62),
    ]
    # a block forward per side and a prefill per document, int4 token by token: 2 x 1,023 forwards a document
    assert stages[2].forwards == (200 + 8) + 192 * 2 + 8 * 2 * 1023
    # one document per forward: 2T - 2 = 30 decode forwards and a prefill (int4: two) per document
    assert stages[3].forwards == 25 * 30 * (1 + 30) and stages[4].forwards == 26 * 30 * 31 + 30
    assert sum(s.token_steps for s in stages) == 333_220 + 409_600


def test_a_greedy_continuation_is_generated_once_per_split(smoke):
    # smoke: 16 continuation tokens; 2 documents on each split; the full-cache greedy continuation of each
    # document once per (model, split): a prefill and 15 more forwards, one row, 16 token-steps
    greedy = {**smoke, "teacher_forced": {**smoke["teacher_forced"], "continuation": "greedy"}}
    extra = [c for c in teacher_cost(greedy) if c.policy == "greedy continuation"]
    assert [(c.split, c.documents, c.prefill_forwards, c.forwards, c.token_steps) for c in extra] == [
        ("exploratory", 2, 2, 32, 32),
        ("confirmatory", 2, 2, 32, 32),
    ]
    assert len(teacher_cost(greedy)) == len(teacher_cost(smoke)) + 2


def test_command_line(capsys):
    assert main(["cost", "config/smoke.yaml", "--rate", "660"]) == 0
    out = capsys.readouterr().out
    # smoke: 780 token-steps and 24 of the decode-time replays; the teacher-forced pass's 13 documents x 2 x 16
    assert "coupled runs (T = 8, R = 2): 13 document-policy runs in 4 job(s), 265 forwards (13 prefill), " in out
    assert "teacher-forced pass (16 continuation tokens): 13 document-policy runs in 2 job(s)" in out
    assert "all stages: 6 jobs, 360 forwards, 1,220 token-steps" in out
    assert out.splitlines()[-1] == (
        "at 660 token-steps/s on 1 device(s): coupled runs 0.00 h (1 s), teacher-forced pass 0.00 h (1 s); "
        "all stages 0.00 h (2 s)"
    )
    assert main(["cost", "config/fidelity-predicts-task.yaml"]) == 0
    out = capsys.readouterr().out
    assert "task side niah-after (T = 16, R = 1, greedy): 750 document-policy runs in 1 job(s), " in out
    assert "reconstruction pass (1024 excerpt tokens at most): 200 document-policy runs in 1 job(s)" in out
    assert "all stages: 10 jobs, 107,162 forwards, 742,820 token-steps" in out
    assert main(["cost", "config/smoke.yaml", "--rate", "1e-300"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("all stages 3.39e+299 h (1.22e+303 s)")


def test_command_line_bad_config_is_one_line(tmp_path, capsys):
    assert main(["cost", str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvdiverge cost: error: ")
    assert "missing.yaml" in err[0]
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")
    assert main(["cost", str(binary)]) == 2
    assert capsys.readouterr().err == (
        f"kvdiverge cost: error: {binary}: not a text file: byte 0x89 at offset 0 is not UTF-8; a config is a "
        f"YAML text file\n"
    )


@pytest.mark.parametrize(
    "options, message",
    [
        (["--rate", "0"], "--rate: 0.0 is not allowed; allowed: a number > 0"),
        (["--rate", "-5"], "--rate: -5.0 is not allowed; allowed: a number > 0"),
        (["--rate", "inf"], "--rate: inf is not a finite number; allowed: a number > 0"),
        (["--rate", "nan"], "--rate: nan is not a finite number; allowed: a number > 0"),
        (["--batch-documents", "0"], "--batch-documents: 0 is not allowed; allowed: an integer >= 1"),
        (["--rate", "660", "--gpus", "0"], "--gpus: 0 is not allowed; allowed: an integer >= 1"),
    ],
)
def test_command_line_names_an_option_out_of_range_as_spelled(options, message, capsys):
    assert main(["cost", "config/smoke.yaml", *options]) == 2
    assert capsys.readouterr().err == f"kvdiverge cost: error: {message}\n"


def test_command_line_prints_every_reason_an_invalid_config_gives(tmp_path, capsys):
    text = (Path("config/smoke.yaml")).read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(re.sub(r"(?m)^shards: .*$", "shards: -1", re.sub(r"(?m)^replicates: .*$", "replicates: 0", text)))
    assert main(["cost", str(bad)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"kvdiverge cost: error: {bad}: invalid config:",
        "  replicates: 0 is out of range; allowed: >= 1",
        "  shards: -1 is out of range; allowed: >= 1",
    ]
