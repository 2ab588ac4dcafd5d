"""The built wheel, installed outside the checkout, runs the README's examples.

The wheel is built from a copy of the project's files (``pip wheel --no-deps
--no-build-isolation``, with this environment's setuptools) and installed with ``pip install
--no-deps --target DIR``; the commands then run from a directory outside the checkout with
``PYTHONPATH=DIR``, so they import the installed package (checked: ``kvdiverge.__file__`` lies
under DIR) on top of this environment's dependencies. They run the command line's example,
``kvdiverge measure embedded ...``, and a :func:`kvdiverge.measure` call as in a notebook.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

pytestmark = [pytest.mark.llm, pytest.mark.long]  # a wheel built and installed, each example in a process of its own

#: A notebook's use of the package: the schema, a measurement and its summary.
NOTEBOOK = """
import kvdiverge, kvpress
from kvdiverge.config.workflow import SCHEMA_PATH, load_schema
from kvdiverge.models.loading import EMBEDDED_MODEL, load_model

print("file", kvdiverge.__file__)
print("schema", SCHEMA_PATH)
assert "policies" in load_schema()["properties"]
model, tokenizer = load_model(EMBEDDED_MODEL)
m = kvdiverge.measure(
    model,
    tokenizer,
    ["Why is the sky blue?"],
    {"knorm-50": kvpress.KnormPress(compression_ratio=0.5)},
    max_new_tokens=2,
    replicates=2,
    bootstrap=50,
    progress=False,
)
print("rows", m.trajectories.height)
print("presses", ",".join(m.summary["policy"].to_list()))
"""


def _copy_project(dest: Path) -> Path:
    """The files a wheel is built from, copied to ``dest`` (the build writes nothing in the checkout)."""
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, dest / name)
    shutil.copytree(REPO / "src", dest / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    return dest


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The wheel, built and installed into a directory of its own: that directory."""
    root = tmp_path_factory.mktemp("wheel")
    (root / "project").mkdir()
    project = _copy_project(root / "project")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    build = subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(root / "dist"), str(project)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    wheels = list((root / "dist").glob("kvdiverge-*-py3-none-any.whl"))
    assert len(wheels) == 1, wheels
    names = set(zipfile.ZipFile(wheels[0]).namelist())
    assert {"kvdiverge/schemas/config.schema.yaml", "kvdiverge/py.typed", "kvdiverge/__main__.py"} <= names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), sorted(names)[-8:]
    target = root / "site"
    install = subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", "--target", str(target), str(wheels[0])],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    return target


def _run(args: list[str], site: Path, cwd: Path) -> subprocess.CompletedProcess:
    """``args`` in ``cwd`` with only the installed wheel (and this environment) on the path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(ONE_THREAD, PYTHONPATH=str(site), PATH=f"{site / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_the_installed_wheel_is_what_runs(installed, tmp_path):
    res = _run(
        [sys.executable, "-c", "import kvdiverge; print(kvdiverge.__file__, kvdiverge.__version__)"],
        installed,
        tmp_path,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    where, version = res.stdout.split()
    assert Path(where).resolve().is_relative_to(installed.resolve()) and not Path(where).resolve().is_relative_to(REPO)
    import tomllib

    assert version == tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def test_the_readme_command_runs_from_the_wheel(installed, tmp_path, embedded_cached):
    """``kvdiverge measure embedded`` (the console script of the wheel, ``DIR/bin/kvdiverge``): exit 0, the tables."""
    script = installed / "bin" / "kvdiverge"
    assert script.is_file()
    args = [str(script), "measure", "embedded", "--sotu", "1", "-T", "2", "-R", "2", "--bootstrap", "50"]
    res = _run(
        [*args, "--press", "SnapKVPress:compression_ratio=0.5,window_size=4", "--out", "out", "--quiet"],
        installed,
        tmp_path,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "SnapKVPress" in res.stdout
    assert {"trajectories.parquet", "survival.png"} <= {p.name for p in (tmp_path / "out").iterdir()}
    import polars as pl

    assert pl.read_parquet(tmp_path / "out" / "trajectories.parquet").height == 2  # 1 prompt x 2 replicates


def test_the_notebook_example_runs_from_the_wheel(installed, tmp_path, embedded_cached):
    res = _run([sys.executable, "-c", NOTEBOOK], installed, tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = dict(
        line.split(" ", 1) for line in res.stdout.splitlines() if line.startswith(("file ", "schema ", "rows "))
    )
    assert Path(lines["file"]).resolve().is_relative_to(installed.resolve())
    assert Path(lines["schema"]).resolve().is_relative_to(installed.resolve())
    assert lines["rows"] == "2"  # 1 prompt x 2 replicates
    assert "presses knorm-50" in res.stdout.splitlines()
