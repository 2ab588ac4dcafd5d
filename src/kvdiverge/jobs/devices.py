"""One generation job per GPU on a local workstation: the device count and a lock per device.

Run locally (``snakemake --cores all --configfile config/paper.yaml``), Snakemake would
start as many generation jobs as there are cores, and every job would load its model onto
``cuda`` (GPU 0). Two pieces prevent that:

1. **A cap.** ``register_gpu_cap`` (``workflow/rules/common.smk``, called by the
   Snakefile) provides the ``gpu`` resource that the
   ``trajectories`` rule requests (1 per job with a CUDA model) as
   :func:`gpu_cap`: ``--resources gpu=N`` on the command line wins, then the config
   key ``gpus``, then the number of visible devices (:func:`gpu_count`). At most that
   many generation jobs run at once. Cluster runs (``--jobs``/a SLURM profile) are left
   alone: there the scheduler hands each job its own GPU.
2. **A binding.** Each generation job takes a lock on one free device when its shard
   starts and releases it when the shard ends (:func:`bind_device`); the model goes onto
   that ``cuda:i``. The locks are ``fcntl.flock`` locks on one file per device in
   :func:`lock_dir`; the kernel drops them when the process ends, so a killed job never
   leaves a stale lock.

A simulated device list for tests and odd setups: ``KVDIVERGE_GPUS`` holds either a count
(``"4"``) or comma-separated device ids (``"0,1,5"``); it replaces the CUDA query.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "ENV_GPUS",
    "ENV_LOCK_DIR",
    "gpu_count",
    "device_ids",
    "gpu_cap",
    "lock_dir",
    "bind_device",
    "NoDeviceError",
    "device_problem",
]

log = logging.getLogger(__name__)

#: Simulated or explicit device list: a count (``"4"``) or comma-separated ids (``"0,1,5"``).
ENV_GPUS = "KVDIVERGE_GPUS"
#: Directory of the per-device lock files (default: ``<tmp>/kvdiverge-gpu-locks``).
ENV_LOCK_DIR = "KVDIVERGE_LOCK_DIR"


class NoDeviceError(RuntimeError):
    """A CUDA model was asked for, but no CUDA device is visible."""


def _simulated() -> list[str] | None:
    value = os.environ.get(ENV_GPUS)
    if value is None:
        return None
    value = value.strip()
    if re.fullmatch(r"\d+", value):
        return [str(i) for i in range(int(value))]
    ids = [v.strip() for v in value.split(",") if v.strip()]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{ENV_GPUS}={value!r}: device ids repeat")
    return ids


def gpu_count() -> int:
    """Number of CUDA devices this process sees.

    ``KVDIVERGE_GPUS`` when set, otherwise ``torch.cuda.device_count()`` (which honours
    ``CUDA_VISIBLE_DEVICES``; 0 where torch has no CUDA).
    """
    sim = _simulated()
    if sim is not None:
        return len(sim)
    import torch

    return int(torch.cuda.device_count())


def device_ids() -> list[str]:
    """Stable identities of the visible devices, in ``cuda:i`` order (the lock file names).

    The GPU's UUID where torch reports one, so that two processes that see the same
    physical GPU under different indices (``CUDA_VISIBLE_DEVICES`` differs, e.g. SLURM
    jobs that each see their GPU as device 0) lock the same file, and different GPUs
    never share one. Otherwise the ``CUDA_VISIBLE_DEVICES`` entry, otherwise the index.
    ``KVDIVERGE_GPUS`` replaces all of this.
    """
    sim = _simulated()
    if sim is not None:
        return sim
    import torch

    n = torch.cuda.device_count()
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    ids = []
    for i in range(n):
        uuid = None
        with contextlib.suppress(Exception):
            uuid = getattr(torch.cuda.get_device_properties(i), "uuid", None)
        if uuid:
            ids.append(str(uuid))
        elif len(visible) == n:
            ids.append(visible[i])
        else:
            ids.append(str(i))
    return [re.sub(r"[^A-Za-z0-9._-]", "_", s) for s in ids]


def gpu_cap(config: dict[str, Any]) -> tuple[int, str]:
    """How many generation jobs may run at once locally, and where the number comes from.

    Parameters
    ----------
    config : dict
        Workflow config; its optional top-level key ``gpus`` sets the count.

    Returns
    -------
    (int, str)
        The count and its source: ``"config key gpus"``, ``"KVDIVERGE_GPUS"`` or
        ``"visible CUDA devices"``. (``--resources gpu=N`` is read by Snakemake itself
        and wins over both; see ``register_gpu_cap`` in ``workflow/rules/common.smk``.)

    Raises
    ------
    ValueError
        If ``gpus`` is not an integer >= 0.
    """
    value = config.get("gpus")
    if value is not None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"config key gpus: {value!r} must be an integer >= 0")
        return int(value), "config key gpus"
    if os.environ.get(ENV_GPUS) is not None:
        return gpu_count(), ENV_GPUS
    return gpu_count(), "visible CUDA devices"


def counted_by_torch(config: dict[str, Any]) -> bool:
    """True when :func:`gpu_cap` counts the visible CUDA devices with torch (neither the config key
    ``gpus`` nor ``KVDIVERGE_GPUS`` gives the count): a dry run leaves the count to the run itself."""
    return config.get("gpus") is None and os.environ.get(ENV_GPUS) is None


def lock_dir() -> Path:
    """Directory of the device lock files: ``KVDIVERGE_LOCK_DIR`` or ``<tmp>/kvdiverge-gpu-locks``.

    Machine-wide by default, so that two runs on one workstation (two checkouts, two
    users) share the locks; created world-writable with the sticky bit, like ``/tmp``.
    """
    path = os.environ.get(ENV_LOCK_DIR)
    if path:
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        return out
    out = Path(tempfile.gettempdir()) / "kvdiverge-gpu-locks"
    if not out.is_dir():
        out.mkdir(exist_ok=True)
        with contextlib.suppress(OSError):
            os.chmod(out, 0o1777)
    return out


def _try_lock(path: Path) -> int | None:
    """An open descriptor holding an exclusive flock on ``path``, or None when it is taken."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except PermissionError:  # another user's lock file: a read-only descriptor locks as well
        fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            return None
        raise
    with contextlib.suppress(OSError):  # who holds it, for a person looking at the file
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def device_problem(device: str, name: str = "device") -> str | None:
    """Why ``device`` cannot hold a model in this process, in one sentence; ``None`` when it can.

    ``cpu``; ``cuda`` or ``cuda:N`` with a visible CUDA device ``N`` (torch built with CUDA,
    :func:`gpu_count` devices); ``mps`` where torch's MPS backend is available. Read
    before any model is loaded (loading onto a missing device fails deep inside torch).
    """
    import torch

    text = str(device).strip()
    allowed = "cpu, cuda, cuda:N or mps"
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        return f"{name}: {device!r} is not a device; allowed: {allowed}"
    if dev.type == "cpu":
        return None
    if dev.type == "cuda":
        n = gpu_count() if torch.cuda.is_available() else 0
        if n == 0:
            return (
                f"{name}: {device!r} asks for a CUDA device, but this torch ({torch.__version__}) sees none; "
                f"allowed here: cpu"
            )
        if dev.index is not None and dev.index >= n:
            return (
                f"{name}: {device!r} asks for CUDA device {dev.index}, but only {n} are visible; "
                f"allowed: cuda:0 to cuda:{n - 1}"
            )
        return None
    if dev.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        return (
            None
            if mps is not None and mps.is_available()
            else (f"{name}: {device!r} asks for Apple's MPS backend, which this torch does not have; allowed here: cpu")
        )
    return f"{name}: {device!r} is a {dev.type} device, which kvdiverge does not run on; allowed: {allowed}"


def _requested_index(device: str) -> int | None:
    m = re.fullmatch(r"cuda(?::(\d+))?", device.strip())
    if m is None:
        return None
    return int(m.group(1)) if m.group(1) is not None else -1


@contextlib.contextmanager
def bind_device(
    device: str, *, poll_s: float = 1.0, timeout_s: float | None = None, set_current: bool = True
) -> Iterator[str]:
    """Hold a lock on one free CUDA device for the duration of the block.

    Parameters
    ----------
    device : str
        The model entry's ``device``. ``"cuda"``: any free visible device (the first
        free one in index order). ``"cuda:k"``: device ``k``, waiting until it is free.
        Anything else (``"cpu"``, ``"mps"``) is yielded unchanged, without a lock.
    poll_s : float
        Seconds between attempts while every candidate is locked (seconds).
    timeout_s : float, optional
        Give up after this long (seconds); default: wait as long as it takes.
    set_current : bool
        Also make the device torch's current CUDA device, where CUDA is available
        (so that code which says ``"cuda"`` lands on it too).

    Yields
    ------
    str
        ``"cuda:i"``, the locked device (or ``device`` unchanged when it is not CUDA).

    Raises
    ------
    NoDeviceError
        If ``device`` is CUDA but no device is visible, or ``cuda:k`` is out of range.
    TimeoutError
        If no device became free within ``timeout_s``.
    """
    wanted = _requested_index(str(device))
    if wanted is None:
        yield device
        return
    ids = device_ids()
    if not ids:
        raise NoDeviceError(
            f"the model's device is {device!r} but no CUDA device is visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); "
            f"run on a machine with a GPU, or set the model's device to cpu"
        )
    if wanted >= len(ids):
        raise NoDeviceError(f"device {device!r} requested, but only {len(ids)} CUDA device(s) are visible")
    candidates = range(len(ids)) if wanted < 0 else [wanted]
    directory = lock_dir()
    start = time.monotonic()
    waited = False
    while True:
        for i in candidates:
            fd = _try_lock(directory / f"gpu-{ids[i]}.lock")
            if fd is None:
                continue
            try:
                if waited:
                    log.info("got cuda:%d after %.0f s", i, time.monotonic() - start)
                log.info("bound to cuda:%d (lock %s)", i, directory / f"gpu-{ids[i]}.lock")
                if set_current and os.environ.get(ENV_GPUS) is None:
                    import torch

                    if torch.cuda.is_available():
                        torch.cuda.set_device(i)
                yield f"cuda:{i}"
            finally:
                with contextlib.suppress(OSError):
                    fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
            return
        if not waited:
            log.warning(
                "every candidate CUDA device (%s) is locked by another job; waiting",
                ", ".join(f"cuda:{i}" for i in candidates),
            )
            waited = True
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            raise TimeoutError(f"no free CUDA device within {timeout_s} s (locks in {directory})")
        time.sleep(poll_s)
