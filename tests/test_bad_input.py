"""Bad input at every door: one sentence naming the key or argument, the value and what is allowed.

The command line exits 2 with one line on stderr for every error (``--debug`` shows the
traceback), and refuses what the input alone decides before any model is loaded; the API
(:func:`kvdiverge.measure`) refuses the same values with the same sentences.
"""

from __future__ import annotations

import pytest

from kvdiverge import cli


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model's weights or tokenizer fails the test: the refusal must come first."""
    from kvdiverge.study import models

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(models, "load_model", refuse)
    monkeypatch.setattr(models, "load_tokenizer", refuse)


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("Describe the water cycle.\n")
    return path


def error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("kvdiverge measure: error: "), err
    return lines[0].removeprefix("kvdiverge measure: error: ")


def run(argv) -> int:
    try:
        return cli.main(argv)
    except SystemExit as exc:  # argparse's own errors
        return exc.code


@pytest.mark.parametrize("extra, message", [
    (["--temperature", "nan"], "--temperature: nan is not a finite number; allowed: a number >= 0"),
    (["--temperature", "-1"], "--temperature: -1.0 is not allowed; allowed: a number >= 0"),
    (["--top-p", "0"], "--top-p: 0.0 is not allowed; allowed: a number > 0 and <= 1"),
    (["--bootstrap", "0"], "--bootstrap: 0 is not allowed; allowed: an integer >= 1"),
    (["--confidence", "1"], "--confidence: 1.0 is not allowed; allowed: a number > 0 and < 1"),
    (["-W", "0"], "-W/--window: 0 is not allowed; allowed: an integer >= 1"),
    (["--seed", "-3"], "--seed: -3 is not allowed; allowed: an integer >= 0"),
    (["--device", "cuda"], "--device: 'cuda' asks for a CUDA device, but this torch"),
    (["--device", "gpu0"], "--device: 'gpu0' is not a device; allowed: cpu, cuda, cuda:N or mps"),
])
def test_the_command_line_refuses_a_setting_before_loading_the_model(extra, message, prompts, no_model, capsys):
    import torch

    if extra[:2] == ["--device", "cuda"] and torch.cuda.is_available():
        pytest.skip("this torch has CUDA")
    rc = run(["measure", "embedded", "--prompts", str(prompts), "--press", "KnormPress", *extra])
    assert rc == 2
    assert error_line(capsys).startswith(message)


def test_every_error_is_one_line_and_debug_shows_the_traceback(prompts, monkeypatch, capsys):
    from kvdiverge import measurement

    def broken(*args, **kwargs):
        raise RuntimeError("something inside broke")

    monkeypatch.setattr(measurement, "prepare_presses", broken)
    argv = ["measure", "embedded", "--prompts", str(prompts), "--press", "KnormPress"]
    assert run(argv) == 2
    assert error_line(capsys) == "RuntimeError: something inside broke (rerun with --debug for the traceback)"
    with pytest.raises(RuntimeError, match="something inside broke"):
        cli.main(argv + ["--debug"])
