"""One generation job per GPU locally (kvdiverge.study.devices), on a simulated device list."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvdiverge.study import devices
from kvdiverge.study.devices import ENV_GPUS, ENV_LOCK_DIR, NoDeviceError, bind_device, gpu_cap

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
import json, sys, time
from kvdiverge.study.devices import bind_device
with bind_device("cuda", poll_s=0.05) as dev:
    start = time.time()
    time.sleep(float(sys.argv[1]))
    print(json.dumps({"device": dev, "start": start, "end": time.time()}))
"""


def test_parallel_processes_get_distinct_devices(gpus):
    """Four jobs on three GPUs: three run at once on distinct devices, the fourth waits."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, "1.5"], env=env, stdout=subprocess.PIPE,
                              text=True) for _ in range(4)]
    out = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
    out.sort(key=lambda r: r["start"])
    first3, last = out[:3], out[3]
    assert sorted(r["device"] for r in first3) == ["cuda:0", "cuda:1", "cuda:2"]
    # the fourth started only once one of the first three had released its device
    assert last["start"] >= min(r["end"] for r in first3) - 0.01
    # at no time did two jobs hold one device
    for i, a in enumerate(out):
        for b in out[i + 1:]:
            if a["device"] == b["device"]:
                assert a["end"] <= b["start"] + 0.01 or b["end"] <= a["start"] + 0.01


def test_a_killed_job_leaves_no_stale_lock(gpus, monkeypatch):
    monkeypatch.setenv(ENV_GPUS, "a")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.Popen([sys.executable, "-c", WORKER, "60"], env=env, stdout=subprocess.PIPE)
    deadline = time.time() + 30
    while not (gpus / "gpu-a.lock").exists() or not (gpus / "gpu-a.lock").read_text().strip():
        assert time.time() < deadline, "worker never took its lock"
        time.sleep(0.05)
    with pytest.raises(TimeoutError):
        with bind_device("cuda", poll_s=0.05, timeout_s=0.2):
            pass
    proc.kill()
    proc.wait()
    with bind_device("cuda", timeout_s=5) as dev:
        assert dev == "cuda:0"


def _dry_run(tmp_path, *args, gpus="2"):
    env = {**os.environ, ENV_GPUS: gpus,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))}
    res = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "-s", str(REPO / "Snakefile"), "-d", str(tmp_path),
         "--configfile", str(REPO / "config" / "paper.yaml"), *args],
        cwd=REPO, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout + res.stderr


def test_dry_run_of_the_paper_config_shows_the_cap(tmp_path):
    out = _dry_run(tmp_path)
    assert "local GPU cap gpu=2 (KVDIVERGE_GPUS)" in out
    assert "trajectories      336" in out  # 14 runs (noise floor included) x 24 shards
    assert "local GPU cap gpu=1 (--resources)" in _dry_run(tmp_path, "--resources", "gpu=1")
    # a cluster run (SLURM profile, --jobs) gets no local cap
    slurm = _dry_run(tmp_path, "--profile", str(REPO / "profiles" / "slurm"))
    assert "local GPU cap" not in slurm and "trajectories      336" in slurm


def test_schema_checks_the_gpus_key():
    from kvdiverge.study.config import ConfigError, load_config, validate

    paper = load_config(REPO / "config" / "paper.yaml")
    assert validate({**paper, "gpus": 2})["gpus"] == 2
    with pytest.raises(ConfigError, match="gpus"):
        validate({**paper, "gpus": -1})
