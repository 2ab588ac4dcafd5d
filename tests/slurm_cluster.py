"""A throw-away one-node SLURM cluster for the tests.

Three daemons are enough: ``munged`` (with its own key and socket), ``slurmctld -D -i`` and
``slurmd -D``, no accounting database. Everything they write lives in one temporary
directory, except ``/etc/slurm/slurm.conf``: the slurm executor plugin's job step drops
``SLURM_CONF`` before its inner ``srun``, so the configuration has to sit at the compiled-in
path. A file already there is put back afterwards, and an exclusive lock on ``/etc/slurm``
keeps a second test cluster on the same machine from starting meanwhile.

Usage::

    reason = unavailable_reason()          # None where a cluster can be started
    with SlurmCluster(root) as cluster:    # root: an empty directory
        subprocess.run([...], env=cluster.env)

``SlurmCluster.stop`` (also run by ``__exit__``, so when the body fails) cancels what is still
queued, stops the daemons it started by their process ids and restores ``/etc/slurm``.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

PACKAGES = ("slurm-wlm", "munge")
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "sinfo")
SYSTEM_CONF = Path("/etc/slurm/slurm.conf")
CONF_HEADER = "# Written by kvdiverge's tests (tests/slurm_cluster.py)"
PARTITION = "kvtest"


class ClusterBusy(RuntimeError):
    """Another test cluster runs on this machine (it holds /etc/slurm)."""


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]


def unavailable_reason() -> str | None:
    """Why no cluster can be started here, or None where one can (possibly after apt)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "the SLURM test cluster needs root (it installs packages and runs slurmd)"
    if missing_binaries() and shutil.which("apt-get") is None:
        return f"SLURM is not installed ({', '.join(missing_binaries())} missing) and there is no apt-get"
    return None


def ensure_installed(timeout: float = 600) -> None:
    """Install slurm-wlm and munge with apt where they are missing.

    Raises RuntimeError, with apt's output, when the install fails.
    """
    if not missing_binaries():
        return
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (
        ["apt-get", "update"],
        ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES],
    ):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )
    if missing_binaries():
        raise RuntimeError(f"after apt-get install, still missing: {', '.join(missing_binaries())}")


def die_with_parent() -> None:
    """preexec_fn: SIGTERM this child when the process that started it dies (Linux).

    A test run that is killed outright (its finally blocks never run) then leaves no
    daemon, and no Snakemake polling a cluster that is gone.
    """
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _free_ports(n: int) -> list[int]:
    """n distinct loopback ports that are free now (all bound at once, then released)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _node_line() -> str:
    """What `slurmd -C` reports for this machine, as a NodeName line (first line only)."""
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout
    return out.splitlines()[0].strip()


class SlurmCluster:
    """One controller, one compute node (this machine), partition ``PARTITION``."""

    def __init__(self, root: Path, partition: str = PARTITION, min_job_age: int = 600):
        self.root = Path(root)
        self.partition = partition
        self.min_job_age = min_job_age
        self.procs: dict[str, subprocess.Popen] = {}
        self._conf_backup: bytes | None = None
        self._conf_written = False
        self._etc_slurm_created = False
        self._lock_fd: int | None = None
        self.node_name = ""
        self.cpus = 0
        self.real_memory = 0

    # --- paths -----------------------------------------------------------------------------
    @property
    def munge_socket(self) -> Path:
        return self.root / "munge" / "munge.socket.2"

    @property
    def env(self) -> dict[str, str]:
        """Environment for commands that talk to this cluster."""
        return dict(os.environ, SLURM_CONF=str(SYSTEM_CONF))

    def log(self, name: str) -> str:
        p = self.root / "log" / name
        return p.read_text(errors="replace")[-4000:] if p.exists() else f"({p} missing)"

    # --- life cycle ------------------------------------------------------------------------
    def __enter__(self) -> "SlurmCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout: float = 60, lock_wait: float = 30) -> None:
        """Start the three daemons; on failure, stop what was started and raise.

        Raises ClusterBusy when another test cluster holds this machine's /etc/slurm
        for longer than ``lock_wait`` seconds.
        """
        try:
            self._lock(lock_wait)
            self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def _lock(self, wait: float) -> None:
        """Hold an exclusive lock on /etc/slurm: one test cluster per machine at a time.

        A lock on the directory writes nothing, and dies with the process that holds it.
        """
        if not SYSTEM_CONF.parent.exists():
            SYSTEM_CONF.parent.mkdir(parents=True)
            self._etc_slurm_created = True
        fd = os.open(SYSTEM_CONF.parent, os.O_RDONLY)
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise ClusterBusy(
                        f"another SLURM test cluster holds {SYSTEM_CONF.parent} on this machine (waited {wait:.0f} s)"
                    ) from None
                time.sleep(1)
        self._lock_fd = fd

    def _start(self, timeout: float) -> None:
        for d in ("munge", "log", "state", "spool", "run"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        # munge checks the socket's directories: reachable, not writable by others
        for d in (self.root, self.root / "munge"):
            os.chmod(d, 0o711)
        self._start_munge(timeout)
        self._write_conf()
        self.procs["slurmctld"] = self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(SYSTEM_CONF)])
        self._wait(lambda: self._ok(["scontrol", "ping"], "UP"), timeout, "slurmctld to answer", "slurmctld.log")
        self.procs["slurmd"] = self._spawn("slurmd", ["slurmd", "-D", "-f", str(SYSTEM_CONF), "-N", self.node_name])
        self._wait(self._node_idle, timeout, "the node to become idle", "slurmd.log")

    def _start_munge(self, timeout: float) -> None:
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        self.procs["munged"] = self._spawn(
            "munged",
            [
                "munged",
                "--foreground",
                "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={key}",
                f"--pid-file={self.root / 'munge' / 'munged.pid'}",
                f"--seed-file={self.root / 'munge' / 'munged.seed'}",
                f"--log-file={self.root / 'log' / 'munged.log'}",
            ],
        )
        self._wait(self.munge_socket.exists, timeout, "munged's socket", "munged.log")

    def _write_conf(self) -> None:
        node = _node_line()  # NodeName=vm CPUs=2 ... RealMemory=24105
        fields = dict(kv.split("=", 1) for kv in node.split())
        self.node_name = fields["NodeName"]
        self.cpus = int(fields["CPUs"])
        self.real_memory = int(fields["RealMemory"])
        host = socket.gethostname().split(".")[0]
        ctld_port, slurmd_port = _free_ports(2)
        r = self.root
        conf = f"""\
{CONF_HEADER} for a throw-away cluster; removed afterwards.
ClusterName=kvtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={r / "state"}
SlurmdSpoolDir={r / "spool"}
SlurmctldPidFile={r / "run" / "slurmctld.pid"}
SlurmdPidFile={r / "run" / "slurmd.pid"}
SlurmctldLogFile={r / "log" / "slurmctld.log"}
SlurmdLogFile={r / "log" / "slurmd.log"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
# keep finished jobs visible to `squeue` long enough for the executor's status checks
MinJobAge={self.min_job_age}
SlurmctldTimeout=30
SlurmdTimeout=30
{node} NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName={self.partition} Nodes={self.node_name} Default=YES MaxTime=INFINITE State=UP
"""
        if SYSTEM_CONF.exists() and not SYSTEM_CONF.read_text(errors="replace").startswith(CONF_HEADER):
            self._conf_backup = SYSTEM_CONF.read_bytes()  # a site's own: put back afterwards
            # (one with our header was left by a test run killed outright: not kept)
        self._conf_written = True
        SYSTEM_CONF.write_text(conf)
        (r / "slurm.conf").write_text(conf)  # a copy next to the logs, for debugging

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        out = open(self.root / "log" / f"{name}.out", "wb")
        try:
            return subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        finally:
            out.close()

    def _ok(self, cmd: list[str], needle: str) -> bool:
        p = subprocess.run(cmd, capture_output=True, text=True, env=self.env, timeout=30)
        return p.returncode == 0 and needle in p.stdout

    def _node_idle(self) -> bool:
        p = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, env=self.env, timeout=30)
        return p.returncode == 0 and p.stdout.strip().startswith("idle")

    def _wait(self, ready, timeout: float, what: str, logname: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited ({proc.returncode}) while waiting for {what}:\n"
                        f"{self.log(name + '.out')}\n{self.log(name + '.log')}"
                    )
            if ready():
                return
            time.sleep(0.5)
        raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}:\n{self.log(logname)}")

    def queue(self) -> str:
        p = subprocess.run(["squeue", "-h", "-o", "%i %j %T"], capture_output=True, text=True, env=self.env, timeout=30)
        return p.stdout.strip()

    def stop(self) -> None:
        """Cancel leftover jobs, stop our daemons by pid, restore /etc/slurm. Never raises."""
        try:
            if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
                subprocess.run(
                    ["scancel", f"--partition={self.partition}"], env=self.env, capture_output=True, timeout=30
                )
                deadline = time.monotonic() + 15
                while time.monotonic() < deadline and any(
                    s in self.queue() for s in ("RUNNING", "PENDING", "COMPLETING")
                ):
                    time.sleep(0.5)
        except Exception:
            pass
        # reverse start order: slurmd, slurmctld, munged
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.pop(name, None)
            if proc is None:
                continue
            for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
                if proc.poll() is not None:
                    break
                try:
                    # the daemon leads its own session: its pid is the group id, which also
                    # reaches job steps it forked (slurmstepd) if any survived scancel
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=wait)
                except subprocess.TimeoutExpired:
                    pass
        if self._conf_written:
            if self._conf_backup is not None:
                SYSTEM_CONF.write_bytes(self._conf_backup)
            else:
                SYSTEM_CONF.unlink(missing_ok=True)
            self._conf_written = False
        if self._etc_slurm_created:
            try:
                SYSTEM_CONF.parent.rmdir()
            except OSError:
                pass
            self._etc_slurm_created = False
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the lock
            self._lock_fd = None
