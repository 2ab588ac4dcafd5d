"""A run killed hard (SIGKILL) during generation resumes after `snakemake --unlock` and
gives the same tables as an uninterrupted run (README, "an interrupted run resumes").

The interrupted run starts from a copy of the session's smoke run (fixture ``smoke_run``)
with some of its shards and everything after them deleted, and is compared with it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest

from conftest import copy_run, results_dir, tree_env

pytestmark = [pytest.mark.workflow, pytest.mark.llm]

TIMEOUT = 1800  # seconds for each stage of the test (a smoke run takes minutes)


def _tables(results: Path) -> dict[str, pl.DataFrame]:
    """Every shard, estimate and analysis table under ``results``, without timing columns."""
    out = {}
    for stage in ("trajectories", "estimates", "analysis"):
        for path in sorted((results / stage).rglob("*.parquet")):
            frame = pl.read_parquet(path)
            out[str(path.relative_to(results))] = frame.drop([c for c in frame.columns if c == "seconds"])
    return out


# the runs whose shards the resumed run regenerates: a prefill press, the decode-time
# window, the noise floor on the other split (6 of the 14 shards)
REGENERATED = [("snapkv-50", "exploratory"), ("window-50", "exploratory"), ("noise-floor", "confirmatory")]


def test_hard_killed_run_resumes_after_unlock(smoke_run, tmp_path):
    """From a copy of the session's smoke run with the shards of three runs, every shard log,
    estimate and analysis deleted: the run is killed once generation starts, refuses to
    start again at the stale lock, and after `--unlock` resumes to the same tables."""
    work = copy_run(Path(smoke_run).parent, tmp_path / "run")
    results = work / results_dir("smoke.yaml")
    shards = results / "trajectories"
    shard_logs = results / "logs" / "trajectories"
    model = next(p.name for p in shards.iterdir())
    for policy, split in REGENERATED:
        shutil.rmtree(shards / model / policy / split)
    for stage in (shard_logs, results / "estimates", results / "analysis", results / "figures"):
        shutil.rmtree(stage)
    (results / "report.html").unlink()
    assert len(list(shards.rglob("shard-*.parquet"))) == 14 - 2 * len(REGENERATED)
    env = tree_env(work)
    cmd = [sys.executable, "-m", "snakemake", "--cores", "2", "--configfile", "config/smoke.yaml"]

    def run(args):
        return subprocess.run(args, cwd=work, env=env, capture_output=True, text=True, timeout=TIMEOUT)

    # 1. start the run in its own process group; SIGKILL the group once generation starts
    with open(tmp_path / "killed.log", "w") as out:
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + TIMEOUT
    try:
        while not (shard_logs.exists() and any(shard_logs.rglob("*.log"))):
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
