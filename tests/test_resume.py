"""A run killed hard (SIGKILL) during generation resumes after `snakemake --unlock` and
gives the same tables as an uninterrupted run (docs/configs.md, "an interrupted run resumes").

The interrupted run starts from a copy of the session's smoke run (fixture ``smoke_run``)
with the shards and estimate of one run deleted, builds that estimate again, and is
compared with it."""

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
from conftest import copy_run, results_dir, snakemake_here, tree_env

pytestmark = [pytest.mark.workflow, pytest.mark.llm]

TIMEOUT = 1800  # seconds for each stage of the test (a smoke run takes minutes)


def _tables(results: Path) -> dict[str, pl.DataFrame]:
    """Every shard and estimate table under ``results``, without timing columns."""
    out = {}
    for stage in ("trajectories", "estimates"):
        for path in sorted((results / stage).rglob("*.parquet")):
            frame = pl.read_parquet(path)
            out[str(path.relative_to(results))] = frame.drop([c for c in frame.columns if c == "seconds"])
    return out


# the run whose shards and estimates the resumed run builds again (2 of the 14 shards: the
# exploratory split's two jobs, one per core, which write every exploratory policy's shard again);
# the other runs' are kept
REGENERATED = [("snapkv-50", "exploratory")]


@pytest.mark.long
def test_hard_killed_run_resumes_after_unlock(smoke_run, tmp_path):
    """From a copy of the session's smoke run with the shards and estimates of one run and
    every shard log deleted, `snakemake <their estimates>` is killed once generation starts,
    refuses to start again at the stale lock, and after `--unlock` resumes to the same tables."""
    work = copy_run(Path(smoke_run).parent, tmp_path / "run")
    rdir = results_dir("smoke.yaml")
    results = work / rdir
    shards = results / "trajectories"
    shard_logs = results / "logs" / "trajectories"
    model = next(p.name for p in shards.iterdir())
    targets = [f"{rdir}/estimates/{model}/{policy}/{split}.parquet" for policy, split in REGENERATED]
    for policy, split in REGENERATED:
        shutil.rmtree(shards / model / policy / split)
        for suffix in (".parquet", ".replicates.parquet"):
            (results / "estimates" / model / policy / f"{split}{suffix}").unlink()
    shutil.rmtree(shard_logs)
    assert len(list(shards.rglob("shard-*.parquet"))) == 14 - 2 * len(REGENERATED)
    env = tree_env(work)
    # targets before --configfile, which takes every following word as a config file
    cmd = [sys.executable, "-m", "snakemake", "--cores", "2", *targets, "--configfile", "config/smoke.yaml"]

    # 1. start the run in its own process group; SIGKILL the group once generation starts
    with open(tmp_path / "killed.log", "w") as out:
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + TIMEOUT
    try:
        while not (shard_logs.exists() and any(shard_logs.rglob("*.log"))):
            assert proc.poll() is None, (
                "the run ended before generation started:\n" + (tmp_path / "killed.log").read_text()[-3000:]
            )
            assert time.monotonic() < deadline, "generation did not start in time"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert len(list(shards.rglob("shard-*.parquet"))) < 14  # killed during generation (7 runs x 2 shards)
    assert not any((work / t).exists() for t in targets)

    # 2. the plain rerun stops at the stale lock ... (the same command line, in this process:
    # Snakemake's jobs still run as processes of their own)
    args = cmd[3:]
    res = snakemake_here(work, *args)
    assert res.returncode != 0
    assert "LockException" in res.stdout, res.stdout[-3000:]
    # 3. ... `--unlock` with the same --configfile removes it, and the same command resumes
    res = snakemake_here(work, *args, "--unlock")
    assert res.returncode == 0, res.stdout[-3000:]
    res = snakemake_here(work, *args)
    assert res.returncode == 0, res.stdout[-6000:]

    # 4. every shard and estimate table equals the uninterrupted run's (timing aside)
    resumed, reference = _tables(results), _tables(smoke_run)
    assert sorted(resumed) == sorted(reference)
    assert sum(k.startswith("trajectories") for k in reference) == 14  # the noise floor included
    for name, frame in reference.items():
        assert resumed[name].equals(frame), name
