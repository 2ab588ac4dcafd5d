"""The smoke config submitted through a real (one-node, throw-away) SLURM cluster.

Runs `snakemake --configfile config/smoke.yaml --profile profiles/slurm <targets>` plus the
test-only overrides below in a copy of the local smoke run's working tree, for one run's
estimates (``SLURM_TARGETS``: corpus, conversion, prompts, its two shards and its estimate, six
jobs, each through the cluster), and checks that every table it made equals the same table
of the session's local smoke run (fixture `smoke_run`). Needs root: it installs `slurm-wlm` and `munge`
with apt where missing and starts munged, slurmctld and slurmd (see tests/slurm_cluster.py).
Elsewhere it is skipped with the reason. The two tests that start the cluster are marked
`slurm`: outside the default `make test`, run by `make test-all` and `.ci/run` (alone:
`pytest -m slurm`). The profile's dry run needs no cluster and runs by default.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
import yaml
from polars.testing import assert_frame_equal

from kvdiverge.config.workflow import load_config, runs

sys.path.insert(0, str(Path(__file__).resolve().parent))  # whatever pytest's import mode
from slurm_cluster import (
    CONF_HEADER,
    SYSTEM_CONF,
    ClusterBusy,
    SlurmCluster,
    die_with_parent,
    ensure_installed,
    unavailable_reason,
)

_UNAVAILABLE = unavailable_reason()
# the tests that start a cluster (root; apt installs, /etc/slurm): `slurm`, outside the
# default run (`make test-all`, `.ci/run`); the skip is decided before any fixture runs,
# so that a machine without root does not first pay for the local smoke run
needs_cluster = pytest.mark.skipif(_UNAVAILABLE is not None, reason=str(_UNAVAILABLE))

REPO = Path(__file__).resolve().parent.parent
PROFILE = REPO / "profiles" / "slurm" / "config.yaml"
GENERATION_RULES = ("trajectories_exploratory", "trajectories_confirmatory")  # one rule per split
MODEL_RULES = (*GENERATION_RULES, "teacher_forced_exploratory", "teacher_forced_confirmatory")  # run the model: GPUs
TABLE_SUFFIXES = (".parquet", ".csv")
LOCAL_CORES = 2  # what the smoke_run fixture (tests/conftest.py) runs with
SMOKE_TIMEOUT_S = 1200  # generous; the run itself takes a few minutes on 2 cores
# what goes through SLURM: one run's estimates, so every job of the chain up to them (corpus,
# conversion, prompts, the split's two shard jobs, the estimate); the other runs' jobs are the same rules
SLURM_RUN = ("smollm2-135m", "snapkv-50", "exploratory")
SLURM_TARGETS = [
    f"{yaml.safe_load((REPO / 'config' / 'smoke.yaml').read_text())['results_dir']}"
    f"/estimates/{'/'.join(SLURM_RUN)}.parquet"
]
#: the policies of the run's split (every run of the smoke config on it, in order): each shard job
#: of the split writes every one's shard
SPLIT_POLICIES = [
    policy
    for model, policy, split in runs(load_config(REPO / "config" / "smoke.yaml"))
    if (model, split) == (SLURM_RUN[0], SLURM_RUN[2])
]
#: the tables those jobs write, relative to the results directory
SLURM_TABLES = [
    "corpus/documents.parquet",
    f"prompts/{SLURM_RUN[0]}.parquet",
    *(f"trajectories/{SLURM_RUN[0]}/{p}/{SLURM_RUN[2]}/shard-{i}.parquet" for p in SPLIT_POLICIES for i in range(2)),
    # the teacher-forced positions each shard job computes, with the settings the workflow exports to the jobs
    *(f"teacher_forced/{SLURM_RUN[0]}/_shards/{SLURM_RUN[2]}/shard-{i}.parquet" for i in range(2)),
    f"estimates/{'/'.join(SLURM_RUN)}.parquet",
    f"estimates/{'/'.join(SLURM_RUN)}.replicates.parquet",
    f"estimates/{'/'.join(SLURM_RUN)}.drift.parquet",
]
# what a run leaves in its directory: not copied into the SLURM run's directory
RUN_OUTPUTS = ("results", "results-smoke", "logs", ".snakemake", ".venv", ".git", ".pytest_cache")


def start_cluster(root: Path) -> SlurmCluster:
    """A started cluster, or a skip (with the reason, which `-ra` prints) where none can run."""
    try:
        ensure_installed()
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"could not install SLURM with apt: {e}")
    cluster = SlurmCluster(root)
    try:
        cluster.start()  # stops what it started when it fails
    except ClusterBusy as e:
        pytest.skip(str(e))
    return cluster


@pytest.fixture
def slurm(tmp_path_factory):
    """A running one-node cluster; stopped and /etc/slurm restored afterwards, even on failure."""
    cluster = start_cluster(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.mark.slurm
@needs_cluster
def test_cluster_runs_a_job_and_cleans_up(tmp_path):
    """The cluster helper itself: a job runs, and stop() leaves no daemon and no slurm.conf."""
    before = SYSTEM_CONF.read_bytes() if SYSTEM_CONF.exists() else None
    if before is not None and before.startswith(CONF_HEADER.encode()):
        before = None  # left by a test run killed outright: removed, not put back
    cluster = start_cluster(tmp_path)
    pids = {name: proc.pid for name, proc in cluster.procs.items()}
    try:
        job = subprocess.run(
            ["srun", "--cpus-per-task=1", "echo", "hello"], env=cluster.env, capture_output=True, text=True, timeout=60
        )
        assert job.returncode == 0 and job.stdout.strip() == "hello", job
    finally:
        cluster.stop()
    assert set(pids) == {"munged", "slurmctld", "slurmd"}
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # gone and reaped, not merely signalled
    after = SYSTEM_CONF.read_bytes() if SYSTEM_CONF.exists() else None
    assert after == before


def dry_run_resources(configfile: str, workdir: Path) -> list[tuple[str, dict[str, str]]]:
    """(rule, resources) of every job that `snakemake -n --profile profiles/slurm` lists."""
    from conftest import snakemake_here  # in this process: no interpreter start

    proc = snakemake_here(
        workdir,
        "-n",
        "--snakefile",
        str(REPO / "Snakefile"),
        "--configfile",
        str(REPO / configfile),
        "--profile",
        str(PROFILE.parent),
        "--directory",
        str(workdir),
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    jobs, rule = [], None
    for line in proc.stdout.splitlines():
        if m := re.match(r"(?:local)?rule (\w+):$", line):
            rule = m.group(1)
        elif (m := re.match(r"\s+resources: (.*)$", line)) and rule:
            jobs.append((rule, dict(kv.split("=", 1) for kv in m.group(1).split(", "))))
            rule = None
    return jobs


@pytest.mark.workflow
def test_paper_profile_asks_gpus_for_the_model_rules_only(tmp_path):
    """With config/paper.yaml, every job that runs the model (generation, the teacher-forced pass)
    goes to the GPU partition with one GPU (the plugin turns `gpu=1` into `sbatch --gpus=1`),
    and no other job asks for a GPU."""
    profile = yaml.safe_load(PROFILE.read_text())
    cpu_partition = str(profile["default-resources"]["slurm_partition"])
    gpu_partition = str(profile["set-resources"][GENERATION_RULES[0]]["slurm_partition"])
    jobs = dry_run_resources("config/paper.yaml", tmp_path)
    generation = [(rule, res) for rule, res in jobs if rule in MODEL_RULES]
    others = [(rule, res) for rule, res in jobs if rule not in MODEL_RULES]
    assert {rule for rule, _ in generation} == set(MODEL_RULES) and others
    for rule, res in generation:
        assert res.get("gpu") == "1" and res["slurm_partition"] == gpu_partition, (rule, res)
    for rule, res in others:
        assert res.get("gpu", "0") == "0" and res["slurm_partition"] == cpu_partition, (rule, res)


# resources in the profile that name things of a real site: replaced or dropped for the test node
SITE_RESOURCES = ("slurm_partition", "slurm_account", "gpu_model", "constraint", "qos")


def fit_resources(resources: dict, cluster: SlurmCluster) -> dict:
    """A profile's resource mapping with its site lines fitted to the one-node test cluster."""
    fitted = {k: v for k, v in resources.items() if k not in SITE_RESOURCES}
    fitted["slurm_partition"] = cluster.partition
    if "mem_mb" in fitted:  # so that one job per CPU fits at once
        fitted["mem_mb"] = min(int(fitted["mem_mb"]), cluster.real_memory // cluster.cpus)
    return fitted


def cluster_overrides(cluster: SlurmCluster) -> list[str]:
    """Command-line options that fit profiles/slurm to the test cluster.

    Only the profile's site lines change (partitions, account, GPU type, memory above the
    node's); the rest of the profile (executor, jobs, latency-wait, keep-going, ...) and the
    rules' own resources (threads, mem_mb, runtime, gpu) apply as for a user. A top-level
    key given on the command line replaces the profile's whole entry, so the entries are
    rebuilt from the profile here rather than listed by hand.
    """
    profile = yaml.safe_load(PROFILE.read_text())
    default = fit_resources(profile.get("default-resources") or {}, cluster)
    per_rule = [
        f"{rule}:{key}={value}"
        for rule, resources in (profile.get("set-resources") or {}).items()
        for key, value in fit_resources(resources, cluster).items()
    ]
    return [
        "--slurm-status-command",
        "squeue",  # no accounting database: sacct cannot answer
        "--slurm-init-seconds-before-status-checks",
        "2",
        "--seconds-between-status-checks",
        "2",
        "--slurm-no-account",
        "--default-resources",
        *(f"{k}={v}" for k, v in default.items()),
        *(["--set-resources", *per_rule] if per_rule else []),
        # the local run's thread counts (smoke_run uses --cores 2): torch's float reductions
        # depend on the number of threads, and the numbers must match bit for bit
        "--max-threads",
        str(min(LOCAL_CORES, cluster.cpus)),
        "--retries",
        "0",  # fail fast: a retry would hide a flaky job
    ]


def tables(results: Path) -> dict[str, Path]:
    return {
        p.relative_to(results).as_posix(): p
        for p in sorted(results.rglob("*"))
        if p.is_file() and p.suffix in TABLE_SUFFIXES
    }


def read_table(path: Path) -> pl.DataFrame:
    df = pl.read_parquet(path) if path.suffix == ".parquet" else pl.read_csv(path)
    # wall-clock timings differ between any two runs; every other number must match
    return df.drop([c for c in df.columns if c == "seconds" or c.endswith("_seconds")])


@pytest.mark.slurm
@pytest.mark.workflow
@needs_cluster
def test_smoke_run_through_slurm_equals_local(smoke_run, slurm, tmp_path, capsys):
    # smoke_run first: the cluster starts once the local run is done
    # the very files the local run used (its working tree), so that both run one workflow
    local_tree = Path(smoke_run).parent
    work = tmp_path / "work"
    shutil.copytree(
        local_tree, work, ignore=lambda d, names: [n for n in names if Path(d) == local_tree and n in RUN_OUTPUTS]
    )
    # targets before --configfile, which takes every following word as a config file
    cmd = [
        sys.executable,
        "-m",
        "snakemake",
        *SLURM_TARGETS,
        "--configfile",
        "config/smoke.yaml",
        "--profile",
        "profiles/slurm",
        *cluster_overrides(slurm),
    ]
    # the package from that tree too (smoke_run puts a src/ first as well); the executor
    # submits with --export=ALL, so the jobs see this environment
    pythonpath = [str(work / "src"), os.environ.get("PYTHONPATH")]
    env = {**slurm.env, "PYTHONPATH": os.pathsep.join(filter(None, pythonpath))}
    start = time.monotonic()
    proc = subprocess.run(
        cmd, cwd=work, env=env, capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S, preexec_fn=die_with_parent
    )
    elapsed = time.monotonic() - start
    with capsys.disabled():  # shown in every run: the cost of going through SLURM
        print(f"\n[slurm] smoke run through SLURM: {elapsed:.0f} s", file=sys.stderr)
    assert proc.returncode == 0, (
        f"snakemake through SLURM failed ({proc.returncode}) after {elapsed:.0f} s\n"
        f"command: {' '.join(cmd)}\n--- stderr (tail) ---\n{proc.stderr[-8000:]}\n"
        f"--- queue ---\n{slurm.queue()}\n--- slurmctld.log ---\n{slurm.log('slurmctld.log')}"
    )
    # the jobs really went through the cluster: each of the six was submitted
    assert proc.stderr.count("has been submitted with SLURM jobid") == 6, proc.stderr[-8000:]

    local, remote = tables(Path(smoke_run)), tables(work / Path(smoke_run).name)
    assert set(SLURM_TABLES) <= set(local), f"the local smoke run lacks tables under {smoke_run}"
    assert sorted(remote) == sorted(SLURM_TABLES)  # what the targets need, nothing else
    for rel, path in remote.items():
        try:  # exact: same columns, dtypes, rows in the same order, bit-equal numbers
            assert_frame_equal(read_table(path), read_table(local[rel]), check_exact=True)
        except AssertionError as e:
            pytest.fail(f"{rel}: the SLURM run's table (left) differs from the local run's: {e}")
