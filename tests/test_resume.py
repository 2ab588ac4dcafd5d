"""A run killed hard (SIGKILL) during generation resumes after `snakemake --unlock` and
gives the same tables as an uninterrupted run (README, "an interrupted run resumes")."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest

from conftest import _copy_tree, results_dir

pytestmark = [pytest.mark.e2e, pytest.mark.llm]

TIMEOUT = 1800  # seconds for each stage of the test (a smoke run takes minutes)


def _tables(results: Path) -> dict[str, pl.DataFrame]:
    """Every shard, estimate and analysis table under ``results``, without timing columns."""
    out = {}
    for stage in ("trajectories", "estimates", "analysis"):
        for path in sorted((results / stage).rglob("*.parquet")):
            frame = pl.read_parquet(path)
            out[str(path.relative_to(results))] = frame.drop([c for c in frame.columns if c == "seconds"])
    return out


def test_hard_killed_run_resumes_after_unlock(smoke_run, tmp_path):
    work = tmp_path / "run"
    work.mkdir()
    _copy_tree(work)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(work / "src"),
                                                                     os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "snakemake", "--cores", "2", "--configfile", "config/smoke.yaml"]

    def run(args):
        return subprocess.run(args, cwd=work, env=env, capture_output=True, text=True, timeout=TIMEOUT)

    # 1. start the smoke run in its own process group; SIGKILL the group once generation starts
    with open(tmp_path / "killed.log", "w") as out:
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    results = work / results_dir("smoke.yaml")
    shards = results / "trajectories"
    shard_logs = results / "logs" / "trajectories"
    deadline = time.monotonic() + TIMEOUT
    try:
        while not (any(shard_logs.rglob("*.log")) or any(shards.rglob("shard-*.parquet"))):
            assert proc.poll() is None, "the run ended before generation started:\n" + \
                (tmp_path / "killed.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "generation did not start in time"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert len(list(shards.rglob("shard-*.parquet"))) < 14  # killed during generation (7 runs x 2 shards)
    assert not (results / "analysis").exists()

    # 2. the plain rerun stops at the stale lock ...
    res = run(cmd)
    assert res.returncode != 0
    assert "LockException" in res.stdout + res.stderr, res.stderr[-3000:]
    # 3. ... `--unlock` with the same --configfile removes it, and the same command resumes
    res = run(cmd + ["--unlock"])
    assert res.returncode == 0, res.stderr[-3000:]
    res = run(cmd)
    assert res.returncode == 0, res.stderr[-6000:]

    # 4. every shard, estimate and analysis table equals the uninterrupted run's (timing aside)
    resumed, reference = _tables(results), _tables(smoke_run)
    assert sorted(resumed) == sorted(reference)
    assert sum(k.startswith("trajectories") for k in reference) == 14  # the noise floor included
    for name, frame in reference.items():
        assert resumed[name].equals(frame), name
