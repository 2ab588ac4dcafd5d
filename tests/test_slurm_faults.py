"""A generation job of the small rehearsal killed through a real (one-node) SLURM and requeued.

Runs two generation jobs of ``config/paper-rehearsal.yaml`` + ``config/rehearsal-small.yaml``
(4 documents, the stand-ins' 4,096-id vocabulary; one job per (model, split, shard), each writing
every policy of its split) with ``--profile profiles/slurm`` on the test cluster
(tests/slurm_cluster.py), its site lines fitted as in tests/test_slurm.py and its ``retries: 1``
kept. Once one job is decoding (its log shows the progress bar), the test ``scancel``s it. The
profile's retry submits it again; the run ends with rc 0, and its tables equal those of the same
targets run locally without a fault. The other job ran once.
T is 256, the paper's, so that the decoding lasts long enough to be caught.

Marked `slurm` (root, apt, /etc/slurm): run by `make test-all` and `.ci/run`, not `make test`.
docs/rehearsal.md reports the same faults at the study's full size (benchmarks/rehearsal_slurm.py).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from polars.testing import assert_frame_equal

sys.path.insert(0, str(Path(__file__).resolve().parent))  # whatever pytest's import mode
from slurm_cluster import die_with_parent
from test_slurm import cluster_overrides, needs_cluster, read_table, start_cluster

REPO = Path(__file__).resolve().parent.parent
CONFIGS = ("config/paper-rehearsal.yaml", "config/rehearsal-small.yaml", "config/kill.yaml")
RESULTS = "results-kill"
KILL_OVERRIDE = f"results_dir: {RESULTS}\ndecoding:\n  max_new_tokens: 256\n"
# one shard of each split's job (the model's exploratory and confirmatory jobs, shard 0)
SHARDS = ("llama-3.1-8b/snapkv-50/exploratory/shard-0", "llama-3.1-8b/snapkv-90/confirmatory/shard-0")
TARGETS = [f"{RESULTS}/trajectories/{s}.parquet" for s in SHARDS]
TABLES = ["corpus/documents.parquet", "prompts/llama-3.1-8b.parquet", *(f"trajectories/{s}.parquet" for s in SHARDS)]
TREE = ("Snakefile", "environment.yml", "workflow", "config", "profiles", "src")
TIMEOUT_S = 900


def work_tree(root: Path) -> Path:
    """The files a run reads, copied to ``root``, with the test's config override."""
    root.mkdir(parents=True)
    for name in TREE:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, root / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(src, root / name)
    (root / CONFIGS[-1]).write_text(KILL_OVERRIDE)
    return root


def env_for(work: Path, base: dict) -> dict:
    return {**base, "PYTHONPATH": str(work / "src")}


def queue(env: dict) -> list[tuple[str, str, str]]:
    """(job id, state, comment) of every job in the queue."""
    out = subprocess.run(["squeue", "-h", "-o", "%i|%T|%k"], env=env, capture_output=True, text=True).stdout
    return [tuple(line.split("|", 2)) for line in out.splitlines() if line]


def decoding_job(work: Path, env: dict) -> tuple[str, str] | None:
    """(job id, ``split/model_shard``) of a running generation job whose log shows its progress bar (the
    plugin's comment joins the rule's wildcard values, model and shard, with ``_``)."""
    for job, state, comment in queue(env):
        m = re.fullmatch(r"rule_trajectories_(exploratory|confirmatory)_wildcards_([^_]+)_(\d+)", comment)
        if state != "RUNNING" or not m:
            continue
        log = work / RESULTS / "logs" / "trajectories" / m[2] / m[1] / f"shard-{m[3]}.log"
        if log.exists() and "step/s" in log.read_text(errors="replace"):
            return job, f"{m[1]}/{m[2]}_{m[3]}"
    return None


def job_of(shard: str) -> str:
    """``split/model_shard`` of the job that writes ``model/policy/split/shard-i``."""
    model, _, split, name = shard.split("/")
    return f"{split}/{model}_{name.removeprefix('shard-')}"


@pytest.mark.slurm
@pytest.mark.workflow
@needs_cluster
def test_a_killed_generation_job_is_requeued_and_its_tables_equal_an_uninterrupted_run(tmp_path, capsys):
    local = work_tree(tmp_path / "local")
    configfiles = ["--configfile", *CONFIGS]
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", *TARGETS, "--cores", "2", *configfiles],
        cwd=local,
        env=env_for(local, dict(os.environ)),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]

    cluster = start_cluster(tmp_path / "slurm")
    try:
        work = work_tree(tmp_path / "slurm-run")
        env = env_for(work, cluster.env)
        overrides = cluster_overrides(cluster)
        i = overrides.index("--retries")  # the profile's own retries: 1
        cmd = [sys.executable, "-m", "snakemake", *TARGETS, *configfiles, "--profile", "profiles/slurm"]
        cmd += [*overrides[:i], *overrides[i + 2 :]]
        start = time.monotonic()
        log = tmp_path / "controller.log"  # a file, not a pipe: nobody reads a pipe while the test polls
        with log.open("w") as out:
            run = subprocess.Popen(
                cmd, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent
            )
            killed = None
            while killed is None and run.poll() is None and time.monotonic() - start < TIMEOUT_S:
                killed = decoding_job(work, env)
                time.sleep(0.2)
            if killed is not None:
                subprocess.run(["scancel", killed[0]], env=env, check=True)
            run.wait(timeout=TIMEOUT_S)
        output = log.read_text()
        queue_left = cluster.queue()
        assert killed is not None, f"no generation job was caught decoding\n{output[-6000:]}"
    finally:
        cluster.stop()
    with capsys.disabled():
        print(f"\n[slurm] killed {killed[1]} (job {killed[0]}); run: {time.monotonic() - start:.0f} s", file=sys.stderr)
    assert run.returncode == 0, f"{output[-8000:]}\n--- queue ---\n{queue_left}"
    submitted = re.findall(r"submitted with SLURM jobid \d+ \(log: \S+/rule_(\w+)/(\S+)/\d+\.log", output)
    jobs = [f"{rule.removeprefix('trajectories_')}/{w}" for rule, w in submitted if rule.startswith("trajectories_")]
    # the killed job twice (its retry), the other once: a finished job is not redone
    assert sorted(jobs) == sorted([*(job_of(s) for s in SHARDS), killed[1]])
    for rel in TABLES:
        try:  # exact: same columns, dtypes, rows in the same order, bit-equal numbers
            assert_frame_equal(read_table(work / RESULTS / rel), read_table(local / RESULTS / rel), check_exact=True)
        except AssertionError as e:
            pytest.fail(f"{rel}: the killed and requeued run's table (left) differs from the uninterrupted run's: {e}")
