"""The command line's conventions: ``--version``, ``python -m kvdiverge``, and its exit status.

0 on success, 2 for a usage error (bad arguments or input), 1 for a failure at run time; each
stated in ``--help``. A whole successful measurement (exit 0) runs in ``tests/test_measure.py``
and, from an installed wheel, in ``tests/test_wheel.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

import polars as pl
import pytest
from conftest import run_main

import kvdiverge
from kvdiverge.doors import arguments, cli

REPO = Path(__file__).resolve().parents[1]
PYPROJECT_VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def python_m(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``python -m kvdiverge *args`` with this tree's sources first on the path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, "-m", "kvdiverge", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_the_version_is_the_installed_distributions():
    assert kvdiverge.__version__ == version("kvdiverge") == PYPROJECT_VERSION


def test_version_prints_the_version_and_exits_0(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == cli.EXIT_OK == 0
    assert capsys.readouterr().out == f"kvdiverge {kvdiverge.__version__}\n"


def test_python_m_kvdiverge_is_the_command_line(tmp_path):
    res = python_m(["--version"], tmp_path)
    assert (res.returncode, res.stdout, res.stderr) == (0, f"kvdiverge {kvdiverge.__version__}\n", "")
    res = python_m(["measure", "embedded"], tmp_path)  # no prompts: argparse's usage error
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.splitlines()[-1] == (
        "kvdiverge measure: error: one of the arguments --prompts --sotu is required (see --help)"
    )


def test_help_states_the_exit_status(capsys):
    for argv in (["--help"], ["measure", "--help"]):
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 0
        text = " ".join(capsys.readouterr().out.split())
        assert "exit status: 0 on success; 2 for a usage error" in text
        assert "1 for a failure at run time" in text
    from kvdiverge.engine.llm.teacher import DEFAULT_LENGTH

    assert f"(default {DEFAULT_LENGTH} with --screen)" in text  # the pass's default length, stated without torch


@pytest.mark.parametrize(
    "argv",
    [
        ["measure"],  # no model
        ["measure", "embedded", "--sotu", "1", "--bogus"],  # an unknown option
        ["measure", "embedded", "--sotu", "1", "-T", "four"],  # not an integer
    ],
)
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == cli.EXIT_USAGE == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(("kvdiverge: error: ", "kvdiverge measure: error: ")), err


def test_bad_input_exits_2_and_a_run_time_failure_exits_1(tmp_path, monkeypatch, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("Describe the water cycle.\n")
    argv = ["measure", "embedded", "--prompts", str(prompts), "--press", "KnormPress", "-T", "2", "-R", "1"]
    assert cli.main([*argv[:3], str(tmp_path / "missing.txt"), *argv[4:]]) == cli.EXIT_USAGE == 2
    assert "prompts file not found" in capsys.readouterr().err

    def out_of_memory(*args, **kwargs):
        raise MemoryError("cannot allocate 64 GiB")

    monkeypatch.setattr(arguments, "load_tokenizer", out_of_memory)
    assert cli.main(argv) == cli.EXIT_FAILURE == 1
    err = capsys.readouterr().err
    assert err == (
        "kvdiverge measure: error: MemoryError: cannot allocate 64 GiB (rerun with --debug for the traceback)\n"
    )


#: A third embedded model: one record (a miniature with Qwen2.5's structure and the embedded tokenizer's
#: first 4,096 ids, so no files beyond those the default model installs).
THIRD = {
    "argument": "mini-qwen",
    "name": "mini-qwen",
    "label": "a Qwen2.5 miniature",
    "entry": {"source": "miniature", "architecture": "qwen-2.5-7b", "vocab_size": 4096, "dtype": "float32"},
}


@pytest.mark.llm
def test_a_registered_embedded_model_is_measured_by_its_name(tmp_path, monkeypatch, capsys, embedded_cached):
    """One record in :data:`kvdiverge.models.embedded.EMBEDDED_MODELS` is all a third embedded model
    needs: the command line's help lists it, its argument names it, and a measurement runs on it."""
    from kvdiverge.models import embedded

    monkeypatch.setattr(embedded, "EMBEDDED_MODELS", (*embedded.EMBEDDED_MODELS, embedded.EmbeddedModel(**THIRD)))
    with pytest.raises(SystemExit):
        cli.main(["measure", "--help"])
    assert "'mini-qwen' (a Qwen2.5 miniature)" in " ".join(capsys.readouterr().out.split())
    argv = ["measure", "mini-qwen", "--sotu", "2", "-T", "4", "-R", "2", "--threads", "1"]
    res = run_main([*argv, "--press", "KnormPress:compression_ratio=0.5", "--out", "out"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = pl.read_parquet(tmp_path / "out" / "summary.parquet")
    assert summary["policy"].to_list() == ["KnormPress:compression_ratio=0.5"]
    assert summary["n_docs"].to_list() == [2] and summary["T"].to_list() == [4]
    assert pl.read_parquet(tmp_path / "out" / "trajectories.parquet")["model"].unique().to_list() == ["mini-qwen"]
    # the miniature's vocabulary: small_vocabulary moves Qwen2.5's two EOS ids to the last two of 4,096
    assert json.loads((tmp_path / "out" / "provenance.json").read_text())["eos_ids"] == [4094, 4095]
