"""One generation job per GPU locally (kvdiverge.jobs.devices), on a simulated device list."""

import json
import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvdiverge.jobs import devices
from kvdiverge.jobs.devices import ENV_GPUS, ENV_LOCK_DIR, NoDeviceError, bind_device, gpu_cap

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def gpus(monkeypatch, tmp_path):
    """Three simulated devices and a private lock directory."""
    monkeypatch.setenv(ENV_GPUS, "a,b,c")
    monkeypatch.setenv(ENV_LOCK_DIR, str(tmp_path / "locks"))
    return tmp_path / "locks"


def test_simulated_device_list(monkeypatch):
    monkeypatch.setenv(ENV_GPUS, "4")
    assert devices.gpu_count() == 4 and devices.device_ids() == ["0", "1", "2", "3"]
    monkeypatch.setenv(ENV_GPUS, "0,1,5")
    assert devices.device_ids() == ["0", "1", "5"]
    monkeypatch.setenv(ENV_GPUS, "1,1")
    with pytest.raises(ValueError, match="repeat"):
        devices.device_ids()


def test_cap_comes_from_the_config_key_then_the_devices(gpus):
    assert gpu_cap({}) == (3, ENV_GPUS)
    assert gpu_cap({"gpus": 1}) == (1, "config key gpus")
    with pytest.raises(ValueError, match="config key gpus"):
        gpu_cap({"gpus": -1})


def test_binding_takes_free_devices_in_order_and_releases_them(gpus):
    with bind_device("cuda") as first, bind_device("cuda") as second:
        assert (first, second) == ("cuda:0", "cuda:1")
        with bind_device("cuda:2") as third:
            assert third == "cuda:2"
            with pytest.raises(TimeoutError):  # all three taken
                with bind_device("cuda", poll_s=0.05, timeout_s=0.2):
                    pass
    with bind_device("cuda") as again:  # released on exit
        assert again == "cuda:0"
    assert sorted(p.name for p in gpus.iterdir()) == ["gpu-a.lock", "gpu-b.lock", "gpu-c.lock"]


def test_non_cuda_devices_pass_through_and_missing_gpus_are_named(gpus, monkeypatch):
    with bind_device("cpu") as dev:
        assert dev == "cpu"
    with pytest.raises(NoDeviceError, match="only 3"):
        with bind_device("cuda:3"):
            pass
    monkeypatch.setenv(ENV_GPUS, "0")
    with pytest.raises(NoDeviceError, match="no CUDA device is visible"):
        with bind_device("cuda"):
            pass


WORKER = """
import json, sys
from kvdiverge.jobs.devices import bind_device
with bind_device("cuda", poll_s=0.05) as dev:
    print(json.dumps({"device": dev}), flush=True)
    sys.stdin.readline()  # holds the device until the test writes a line
print("released", flush=True)
"""


def _worker(env):
    return subprocess.Popen(
        [sys.executable, "-c", WORKER], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def _holders(procs, n, timeout_s=60):
    """The first ``n`` of ``procs`` to report the device they hold: {process: device}."""
    held, deadline = {}, time.monotonic() + timeout_s
    while len(held) < n:
        left = deadline - time.monotonic()
        assert left > 0, f"only {len(held)} of {n} workers took a device"
        ready, _, _ = select.select([p.stdout for p in procs if p not in held], [], [], left)
        for p in procs:
            if p.stdout in ready:
                held[p] = json.loads(p.stdout.readline())["device"]
    return held


def _release(proc):
    proc.stdin.write("\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "released"
    assert proc.wait(timeout=60) == 0


def test_parallel_processes_get_distinct_devices(gpus):
    """Four jobs on three GPUs: three hold distinct devices at once, the fourth waits until
    one is given back and then gets that one (events, not timings)."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    procs = [_worker(env) for _ in range(4)]
    try:
        first = _holders(procs, 3)
        assert sorted(first.values()) == ["cuda:0", "cuda:1", "cuda:2"]
        (fourth,) = [p for p in procs if p not in first]
        # all three devices are held: the fourth keeps polling (every 0.05 s) and gets none
        assert select.select([fourth.stdout], [], [], 0.5)[0] == []
        assert fourth.poll() is None
        # one job gives its device back: the fourth gets exactly that one, the others stay held
        freed = next(p for p, dev in first.items() if dev == "cuda:1")
        _release(freed)
        assert _holders([fourth], 1) == {fourth: "cuda:1"}
        for p in [*first, fourth]:
            if p is not freed:
                _release(p)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_killed_job_leaves_no_stale_lock(gpus, monkeypatch):
    monkeypatch.setenv(ENV_GPUS, "a")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = _worker(env)
    try:
        assert _holders([proc], 1) == {proc: "cuda:0"}
        assert (gpus / "gpu-a.lock").read_text().strip()  # the holder wrote itself into the lock
        with pytest.raises(TimeoutError):
            with bind_device("cuda", poll_s=0.05, timeout_s=0.2):
                pass
    finally:
        proc.kill()
        proc.wait()
    with bind_device("cuda", timeout_s=5) as dev:
        assert dev == "cuda:0"


def _dry_run(tmp_path, monkeypatch, *args, gpus="2"):
    """A dry run of the paper config in this process (tests/conftest.py, ``snakemake_here``)."""
    from conftest import snakemake_here

    monkeypatch.setenv(ENV_GPUS, gpus)
    res = snakemake_here(
        REPO,
        "-n",
        "-s",
        str(REPO / "Snakefile"),
        "-d",
        str(tmp_path),
        "--configfile",
        str(REPO / "config" / "paper.yaml"),
        *args,
    )
    assert res.returncode == 0, res.stdout[-3000:]
    return res.stdout


@pytest.mark.workflow
def test_dry_run_of_the_paper_config_shows_the_cap(tmp_path, monkeypatch):
    out = _dry_run(tmp_path, monkeypatch)
    assert "local GPU cap gpu=2 (KVDIVERGE_GPUS)" in out
    # 14 runs (noise floor included) x 24 shards, made by one job per (model, split, shard)
    assert re.search(r"^trajectories_exploratory +48$", out, re.M) and re.search(
        r"^trajectories_confirmatory +48$", out, re.M
    )
    assert "local GPU cap gpu=1 (--resources)" in _dry_run(tmp_path, monkeypatch, "--resources", "gpu=1")
    # a cluster run (SLURM profile, --jobs) gets no local cap
    slurm = _dry_run(tmp_path, monkeypatch, "--profile", str(REPO / "profiles" / "slurm"))
    assert "local GPU cap" not in slurm and re.search(r"^trajectories_exploratory +48$", slurm, re.M)


def test_schema_checks_the_gpus_key():
    from kvdiverge.config.workflow import ConfigError, load_config, validate

    paper = load_config(REPO / "config" / "paper.yaml")
    assert validate({**paper, "gpus": 2})["gpus"] == 2
    with pytest.raises(ConfigError, match="gpus"):
        validate({**paper, "gpus": -1})
