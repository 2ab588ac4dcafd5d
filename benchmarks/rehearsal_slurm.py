"""The paper's study at full size on its stand-ins, through a real one-node SLURM, with faults.

Runs ``config/paper-rehearsal.yaml`` as a user would on a cluster: ``snakemake --profile
profiles/slurm`` (the executor plugin submits every job with sbatch), on the test suite's
one-node cluster (``tests/slurm_cluster.py``: root, apt's slurm-wlm and munge). Only the
profile's site lines are fitted to the node (partition, no account, memory per CPU, squeue for
the status); everything else, ``retries: 1`` and ``rerun-incomplete`` included, is the profile's.

Three faults, at set numbers of finished generation shards (of 336):

1. ``scancel`` a running generation job once its log shows decoding: the profile's retry
   resubmits it;
2. SIGTERM to the controller: Snakemake stops submitting and waits for its jobs, every queued
   one included; a second signal (SIGINT) a minute later makes it exit, leaving them queued.
   Restarted as docs/cluster.md says: cancel the run's jobs (``scancel --name <SLURM run ID>``),
   the same command;
3. SIGKILL to the controller: its jobs keep running and its lock stays. Restarted as
   docs/rehearsal.md says: cancel the run's jobs (``scancel --name <SLURM run ID>``), ``snakemake
   --unlock``, the same command.

Then the shards that a fault interrupted are generated again without SLURM and without a
fault, in a copy of the prompts, and compared with the killed run's (``table_digest.py``).
Everything is written under ``WORKDIR``: the run (``work/``), the controller logs, and
``faults.json`` with the times, the jobs hit and the digests::

    sudo .venv/bin/python benchmarks/rehearsal_slurm.py /tmp/rehearsal        # about 1.5 h on 2 cores
    python benchmarks/rule_table.py /tmp/rehearsal/work/results-rehearsal       # the per-rule table
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "benchmarks")]

from slurm_cluster import SlurmCluster  # noqa: E402
from table_digest import file_digest  # noqa: E402

CONFIG = "config/paper-rehearsal.yaml"
RESULTS = "results-rehearsal"
#: Finished generation shards at which each fault strikes (of 336).
SCANCEL_AT, SIGTERM_AT, SIGKILL_AT = 12, 110, 220


def overrides(cluster: SlurmCluster) -> list[str]:
    """The profile's site lines fitted to the test node (as tests/test_slurm.py's, with the profile's retries)."""
    from test_slurm import cluster_overrides

    args = cluster_overrides(cluster)
    i = args.index("--retries")
    return args[:i] + args[i + 2 :]


def shards(work: Path) -> list[Path]:
    return sorted((work / RESULTS / "trajectories").glob("*/*/*/shard-*.parquet"))


def queue(env: dict) -> list[dict]:
    """Jobs in the queue: id, name (the run ID), state and comment (rule and wildcards)."""
    out = subprocess.run(["squeue", "-h", "-o", "%i|%j|%T|%k"], env=env, capture_output=True, text=True).stdout
    return [dict(zip(("id", "name", "state", "comment"), line.split("|", 3))) for line in out.splitlines() if line]


def run_id(log: Path) -> str | None:
    m = re.search(r"SLURM run ID: (\S+)", log.read_text(errors="replace")) if log.exists() else None
    return m.group(1) if m else None


def start(cmd: list[str], work: Path, env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=work, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def wait_for(pred, proc: subprocess.Popen, poll: float = 5.0) -> bool:
    """Poll until ``pred()``; False when the controller exited first."""
    while not pred():
        if proc.poll() is not None:
            return False
        time.sleep(poll)
    return True


def decoding_job(work: Path, env: dict) -> dict | None:
    """A running generation job whose log shows its progress bar (mid-shard)."""
    for job in queue(env):
        w = shard_of(job)
        if job["state"] != "RUNNING" or not w:
            continue
        log = work / RESULTS / "logs/trajectories" / f"{w}.log"
        if log.exists() and "step/s" in log.read_text(errors="replace"):
            return {**job, "shard": w, "log": str(log)}
    return None


def shard_of(job: dict) -> str | None:
    """``model/split/shard-i`` of a generation job (one per (model, split, shard), every policy of the
    split), from its comment: the rule ``trajectories_<split>`` and its wildcard values joined with ``_``
    (none of this config's names holds one)."""
    m = re.fullmatch(r"rule_trajectories_(exploratory|confirmatory)_wildcards_([^_]+)_(\d+)", job["comment"])
    return f"{m[2]}/{m[1]}/shard-{m[3]}" if m else None


def running_shards(env: dict) -> list[str]:
    """``model/split/shard-i`` of the generation jobs in the queue."""
    return [w for job in queue(env) if job["state"] == "RUNNING" and (w := shard_of(job))]


def faulted_run(work: Path, cluster: SlurmCluster, out: Path) -> dict:
    """The whole run with its three faults; returns what happened, with times in seconds from the start."""
    env = {**cluster.env, "PYTHONPATH": str(work / "src")}
    cmd = [
        sys.executable,
        "-m",
        "snakemake",
        "--configfile",
        CONFIG,
        "--profile",
        "profiles/slurm",
        *overrides(cluster),
    ]
    record: dict = {"command": " ".join(cmd[1:]), "events": [], "interrupted": []}
    t0 = time.monotonic()

    def note(what: str, **extra) -> None:
        record["events"].append(
            {"t_s": round(time.monotonic() - t0, 1), "shards": len(shards(work)), "what": what, **extra}
        )
        print(f"[{record['events'][-1]['t_s']:8.1f} s] {what} {extra or ''}", flush=True)

    proc = start(cmd, work, env, out / "controller-1.log")
    note("controller 1 started")
    wait_for(lambda: len(shards(work)) >= SCANCEL_AT and decoding_job(work, env), proc)
    job = decoding_job(work, env)
    subprocess.run(["scancel", job["id"]], env=env, check=True)
    record["interrupted"].append(job["shard"])
    note("scancel", job=job["id"], shard=job["shard"])

    wait_for(lambda: len(shards(work)) >= SIGTERM_AT, proc)
    proc.send_signal(signal.SIGTERM)  # Snakemake stops submitting and waits for its jobs: every queued one
    note("SIGTERM to the controller", running=running_shards(env))
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # a second signal: it exits, its jobs left in the queue
        note("SIGINT to the controller", running=running_shards(env))
        proc.wait(timeout=300)
    note("controller 1 exited", rc=proc.returncode, queue_after=len(queue(env)))
    record["interrupted"] += running_shards(env)
    name = run_id(out / "controller-1.log")
    subprocess.run(["scancel", "--name", name], env=env, check=True)  # as the docs say, before a restart
    note("scancel --name <run ID>", run_id=name)

    proc = start(cmd, work, env, out / "controller-2.log")
    note("controller 2 started")
    wait_for(lambda: len(shards(work)) >= SIGKILL_AT, proc)
    time.sleep(20)  # let the next jobs get into their shards
    record["interrupted"] += running_shards(env)
    proc.kill()
    proc.wait()
    note("SIGKILL to the controller", running=running_shards(env))
    name = run_id(out / "controller-2.log")
    subprocess.run(["scancel", "--name", name], env=env, check=True)
    subprocess.run([*cmd, "--unlock"], cwd=work, env=env, check=True, capture_output=True)
    note("scancel --name <run ID>, snakemake --unlock", run_id=name)

    proc = start(cmd, work, env, out / "controller-3.log")
    note("controller 3 started")
    proc.wait()
    note("controller 3 exited", rc=proc.returncode)
    record["wall_s"] = round(time.monotonic() - t0, 1)
    record["rc"] = proc.returncode
    for i in (1, 2, 3):
        text = (out / f"controller-{i}.log").read_text(errors="replace")
        record[f"controller_{i}_submitted"] = text.count("has been submitted with SLURM jobid")
    return record


def clean_shards(work: Path, interrupted: list[str], out: Path) -> dict:
    """The shards of the interrupted jobs (``model/split/shard-i``) again, locally and without a fault,
    compared by digest with the killed run's."""
    clean = out / "clean"
    clean.mkdir(exist_ok=True)
    targets = []
    for job in sorted(set(interrupted)):
        model, split, shard = job.split("/")
        found = (work / RESULTS / "trajectories" / model).glob(f"*/{split}/{shard}.parquet")
        targets += sorted(str(path.relative_to(work)) for path in found)
    for stage in ("corpus", "prompts"):  # the killed run's inputs, times kept: nothing upstream reruns
        shutil.copytree(work / RESULTS / stage, clean / RESULTS / stage, dirs_exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "snakemake",
        *targets,
        "--cores",
        "2",
        "--snakefile",
        str(work / "Snakefile"),
        "--configfile",
        str(work / CONFIG),
        "--directory",
        str(clean),
    ]
    env = {**os.environ, "PYTHONPATH": str(work / "src")}
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    (out / "clean.log").write_text(proc.stdout + proc.stderr)
    digests = {t: {"killed": file_digest(work / t)[:16], "clean": file_digest(clean / t)[:16]} for t in targets}
    return {"rc": proc.returncode, "shards": digests, "equal": all(d["killed"] == d["clean"] for d in digests.values())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workdir", type=Path, help="an empty directory: the run's copy of the repository goes to work/")
    args = ap.parse_args(argv)
    out = args.workdir.resolve()
    work = out / "work"
    if not work.exists():
        subprocess.run(["git", "clone", "-q", str(REPO), str(work)], check=True)
    with SlurmCluster(out / "slurm") as cluster:
        record = faulted_run(work, cluster, out)
    record["clean"] = clean_shards(work, record["interrupted"], out)
    (out / "faults.json").write_text(json.dumps(record, indent=2))
    print(json.dumps({k: v for k, v in record.items() if k != "events"}, indent=2))
    return 0 if record["rc"] == 0 and record["clean"]["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
