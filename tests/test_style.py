"""Lint and format: ``ruff check`` and ``ruff format --check`` pass on the whole repository.

The rules live in ``pyproject.toml`` (``[tool.ruff]``): pyflakes, the syntax and statement
checks of pycodestyle, import order, and unused ``noqa`` comments; the workflow's scripts
see ``snakemake`` as a builtin, as they do when Snakemake runs them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RUFF = Path(sys.executable).with_name("ruff")


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff_passes(command):
    res = subprocess.run([str(RUFF), *command, "."], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]


def test_ruff_finds_an_unused_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n")
    res = subprocess.run(
        [str(RUFF), "check", "--config", str(REPO / "pyproject.toml"), str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 1 and "F401" in res.stdout, res.stdout
