"""Shared fixtures: synthetic kernel pairs for exact tests and the smoke workflow run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


def results_dir(config_name: str = "smoke.yaml") -> str:
    """The ``results_dir`` of a shipped config (where its outputs and logs go)."""
    import yaml

    config = yaml.safe_load((REPO / "config" / config_name).read_text())
    return config.get("results_dir", "results")


# --------------------------------------------------------------------------- synthetic kernels


def history_kernel(hx: tuple[int, ...], hy: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """A 3-token pair whose TV depends on the history, on shared prefixes and after divergence.

    The reference ``p`` rotates with the sum of its history; the evicted ``q`` rotates with
    twice the sum plus the length of its own, and is sharper after token 2.
    """
    p = np.roll(np.array([0.6, 0.3, 0.1]), sum(hx) % 3)
    base = np.array([0.5, 0.2, 0.3]) if (hy and hy[-1] == 2) else np.array([0.7, 0.2, 0.1])
    q = np.roll(base, (2 * sum(hy) + len(hy)) % 3)
    return p, q


def eos_kernel(hx, hy):
    """Two tokens, token 1 is EOS: ``p`` always emits 0, ``q`` is a fair coin."""
    return np.array([1.0, 0.0]), np.array([0.5, 0.5])


@pytest.fixture(scope="session")
def kernel():
    """The history-dependent 3-token synthetic kernel function."""
    return history_kernel


@pytest.fixture(scope="session")
def eos_kern():
    """The 2-token kernel whose token 1 is EOS (:func:`eos_kernel`)."""
    return eos_kernel


# --------------------------------------------------------------------------- smoke workflow run


def _copy_tree(dest: Path) -> None:
    """Copy the working tree (tracked and untracked-but-not-ignored files) into ``dest``."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                         cwd=REPO, check=True, capture_output=True).stdout.decode()
    for rel in filter(None, out.split("\0")):
        src = REPO / rel
        if not src.is_file():
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory) -> Path:
    """Run the whole workflow on ``config/smoke.yaml`` in a temporary copy of the tree.

    Builds every target of ``rule all`` with 2 cores, then the HTML report
    (``snakemake --report results-smoke/report.html``: the smoke config's ``results_dir``).

    Set ``KVDIVERGE_SMOKE_RESULTS`` to an existing results directory to reuse it instead
    of running (useful when iterating on tests).

    Returns
    -------
    pathlib.Path
        The results directory of the run (``results_dir`` of the smoke config, e.g.
        ``<work>/results-smoke``); its parent is the run's working directory.
    """
    reuse = os.environ.get("KVDIVERGE_SMOKE_RESULTS")
    if reuse:
        return Path(reuse)
    work = tmp_path_factory.mktemp("smoke")
    _copy_tree(work)
    snakemake = [sys.executable, "-m", "snakemake"]
    # the package from the copied tree, so the run uses exactly the copied files
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(work / "src"),
                                                                     os.environ.get("PYTHONPATH")]))}
    base = snakemake + ["--cores", "2", "--configfile", "config/smoke.yaml"]
    results = results_dir("smoke.yaml")
    for cmd in (base, base + ["--report", f"{results}/report.html"]):
        res = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"smoke run failed: {' '.join(cmd)}\n{res.stdout[-4000:]}\n{res.stderr[-8000:]}")
    return work / results
