"""Shared fixtures: synthetic kernel pairs, the embedded model converted once, and the
workflow runs (smoke and frontier smoke) that every workflow test reads."""

from __future__ import annotations

import os

# One torch (OpenMP) thread per test process, and for the commands the tests start, unless
# the caller sets OMP_NUM_THREADS: the model tests' matrices are small, and where other work
# shares the cores two spinning OpenMP threads per forward pass are many times slower than
# one (tests/test_batching.py's model tests: 580 s with torch's default on a loaded 2-core
# machine, 153 s with one thread). Set before numpy or any test module imports torch.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


def results_dir(config_name: str = "smoke.yaml") -> str:
    """The ``results_dir`` of a shipped config (where its outputs and logs go)."""
    import yaml

    config = yaml.safe_load((REPO / "config" / config_name).read_text())
    return config.get("results_dir", "results")


# --------------------------------------------------------------------------- markers


#: markers whose tests run only when ``-m`` names them (CI's ``make test-all`` names all three)
OPT_IN = ("slurm", "docs", "long")

#: a test that uses one of these fixtures (directly or through another) carries the marker
FIXTURE_MARKERS = {
    "embedded_dir": "llm",
    "gemma": "llm",
    "smoke_run": "workflow",
    "frontier_run": "workflow",
    "bf16_run": "workflow",
}


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected
def pytest_collection_modifyitems(config, items):
    """Check the markers of tests on the shared fixtures (``FIXTURE_MARKERS``), then leave
    out the tests of :data:`OPT_IN` (``slurm``: they install system packages and write
    /etc/slurm; ``docs``: the documentation site's build, ``make docs``; ``long``: checks only
    a long run can make) unless ``-m`` names their marker: ``-m slurm`` alone,
    ``-m "slurm or docs or long or not slurm"`` for everything (``make test-all``, ``.ci/run``).

    Where the session's workflow runs will be built in the background
    (:func:`pytest_collection_finish`), the tests that read them run last, in order, so that
    all the others run meanwhile, those of the same files included (a module-scoped fixture that
    both halves of a file use is set up once for each: none of them is costly).
    """
    unmarked = [
        f"{item.nodeid} uses {fixture} but is not marked {marker}"
        for item in items
        for fixture, marker in FIXTURE_MARKERS.items()
        if fixture in item.fixturenames and item.get_closest_marker(marker) is None
    ]
    if unmarked:
        raise pytest.UsageError("\n".join(unmarked))
    for opt_in in OPT_IN:
        if opt_in not in (config.option.markexpr or ""):
            keep = [item for item in items if item.get_closest_marker(opt_in) is None]
            if len(keep) < len(items):
                config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker(opt_in)])
                items[:] = keep
    if background_builds(config, items):
        readers = [item for item in items if set(item.fixturenames) & BACKGROUND_FIXTURES]
        items[:] = [item for item in items if item not in readers] + readers


# --------------------------------------------------------------------------- synthetic kernels


def history_kernel(hx: tuple[int, ...], hy: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """A 3-token pair whose TV depends on the history, on shared prefixes and after divergence.

    The reference ``p`` rotates with the sum of its history; the evicted ``q`` rotates with
    twice the sum plus the length of its own, and is sharper after token 2.
    """
    p = np.roll(np.array([0.6, 0.3, 0.1]), sum(hx) % 3)
    base = np.array([0.5, 0.2, 0.3]) if (hy and hy[-1] == 2) else np.array([0.7, 0.2, 0.1])
    q = np.roll(base, (2 * sum(hy) + len(hy)) % 3)
    return p, q


def eos_kernel(hx, hy):
    """Two tokens, token 1 is EOS: ``p`` always emits 0, ``q`` is a fair coin."""
    return np.array([1.0, 0.0]), np.array([0.5, 0.5])


@pytest.fixture
def quiet_kvpress():
    """Silence kvpress's warnings (untested models, KVzip's cost) and every Python warning for one test."""
    import logging
    import warnings

    logging.disable(logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    logging.disable(logging.NOTSET)


@pytest.fixture(scope="session")
def kernel():
    """The history-dependent 3-token synthetic kernel function."""
    return history_kernel


@pytest.fixture(scope="session")
def eos_kern():
    """The 2-token kernel whose token 1 is EOS (:func:`eos_kernel`)."""
    return eos_kernel


# --------------------------------------------------------------------------- built once per session


def session_dir(tmp_path_factory) -> Path:
    """A directory that every pytest-xdist worker of this session shares (the plain base
    temporary directory without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def build_once(tmp_path_factory, name: str, build) -> Path:
    """``session_dir/name``, made by ``build(path)`` once per session, across xdist workers.

    A file lock lets one worker build while the others wait, then read what it built; a
    failed build is not retried by the others: they raise its error.

    Raises
    ------
    RuntimeError
        If the build failed (in this or another worker).
    """
    from filelock import FileLock

    root = session_dir(tmp_path_factory)
    out, done, failed = root / name, root / f"{name}.done", root / f"{name}.failed"
    with FileLock(str(root / f"{name}.lock")):
        if failed.exists():
            raise RuntimeError(f"{name} failed in another worker:\n{failed.read_text()}")
        if not done.exists():
            try:
                build(out)
            except BaseException as exc:
                failed.write_text(f"{type(exc).__name__}: {exc}")
                raise
            done.touch()
    return out


# --------------------------------------------------------------------------- the embedded model


def kept_conversions_dir() -> Path:
    """Where the test sessions keep converted GGUF models and assembled GGUF files:
    ``$XDG_CACHE_HOME/kvdiverge-tests``, else ``~/.cache/kvdiverge-tests``. Apart from the
    user's cache (``~/.cache/kvdiverge``), kept between sessions like it: a conversion is
    keyed by what decides it (:func:`kvdiverge.models.loading.conversion_key`: the file's
    SHA-256, dtype, attention, library versions, the rebuilt tokenizer's version), and
    tests/test_models.py checks the kept conversion against a load of the GGUF file itself."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvdiverge-tests"


def pytest_sessionstart(session):
    """Converted GGUF models are kept in :func:`kept_conversions_dir` (``KVDIVERGE_CACHE_DIR``,
    :func:`kvdiverge.models.sources.conversion_cache`), shared by the test process, its
    xdist workers and the workflow runs it starts, never the user's: a machine converts the
    embedded models once per dtype for all its test sessions (about 40 s for SmolLM2, a
    minute for Gemma 3). ``KVDIVERGE_CACHE_DIR`` set before the session wins (a fresh
    temporary directory converts everything again)."""
    from kvdiverge.models.sources import CACHE_ENV

    if CACHE_ENV not in os.environ:
        os.environ[CACHE_ENV] = str(kept_conversions_dir())


@pytest.fixture(scope="session")
def embedded_dir(tmp_path_factory) -> Path:
    """The embedded model (GGUF) converted once per session into a local Hugging Face
    directory (:func:`kvdiverge.models.loading.convert_to_directory`); it loads in about a
    second, with the weights ``load_model`` gives from the GGUF file (tests/test_models.py)."""
    from kvdiverge.models.embedded import EMBEDDED_MODEL
    from kvdiverge.models.loading import convert_to_directory

    return build_once(
        tmp_path_factory, "embedded-model", lambda out: convert_to_directory(EMBEDDED_MODEL, out, "smollm2-135m")
    )


@pytest.fixture(scope="session")
def embedded_entry(embedded_dir) -> dict:
    """The ``source: local`` entry of the converted embedded model (float32, CPU, sdpa)."""
    from kvdiverge.models.embedded import EMBEDDED_MODEL
    from kvdiverge.models.loading import local_entry

    return local_entry(EMBEDDED_MODEL, embedded_dir)


@pytest.fixture(scope="session")
def embedded(embedded_entry):
    """``(model, tokenizer)`` of the embedded model, loaded once per session (eval mode).

    Tests share it: a test that adds hooks or presses removes them when done.
    """
    from kvdiverge.models.loading import load_model

    return load_model(embedded_entry, "smollm2-135m")


@pytest.fixture(scope="session")
def gemma(tmp_path_factory):
    """``(model, tokenizer)`` of the second embedded model, Gemma 3 270M, loaded once per session
    from its conversion (kept under the session's ``KVDIVERGE_CACHE_DIR``: the chunks assembled,
    the tokenizer rebuilt and de-quantized once, about 20 s; then about a second)."""
    from kvdiverge.models.embedded import GEMMA_MODEL, GEMMA_NAME
    from kvdiverge.models.loading import convert_to_directory, load_model, local_entry

    out = build_once(tmp_path_factory, "gemma-model", lambda o: convert_to_directory(GEMMA_MODEL, o, GEMMA_NAME))
    return load_model(local_entry(GEMMA_MODEL, out), GEMMA_NAME)


@pytest.fixture
def embedded_cached(embedded_dir):
    """In this test, in-process loads of the embedded GGUF entry (``load_model(EMBEDDED_MODEL)``,
    ``kvdiverge measure embedded`` through ``kvdiverge.doors.cli.main``) read the session's kept
    conversion (``KVDIVERGE_CACHE_DIR``, :func:`pytest_sessionstart`), made by then: about a
    second instead of about 20 s, the same weights and token ids."""
    return embedded_dir


def run_main(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``kvdiverge *argv`` through :func:`kvdiverge.doors.cli.main` in this process, in ``cwd``:
    its exit code and what it printed (stdout, stderr: the progress bars too)."""
    import io
    from contextlib import redirect_stderr, redirect_stdout

    from kvdiverge.doors.cli import main

    out, err, here = io.StringIO(), io.StringIO(), os.getcwd()
    os.chdir(cwd)
    try:
        with redirect_stdout(out), redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exc:  # argparse's own errors
                code = exc.code
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(["kvdiverge", *argv], code, out.getvalue(), err.getvalue())


# --------------------------------------------------------------------------- workflow runs


def _copy_tree(dest: Path) -> None:
    """Copy the working tree (tracked and untracked-but-not-ignored files) into ``dest``."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO,
        check=True,
        capture_output=True,
    ).stdout.decode()
    for rel in filter(None, out.split("\0")):
        src = REPO / rel
        if not src.is_file():
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)


def copy_run(src: Path, dest: Path) -> Path:
    """Copy a finished run's working directory ``src`` to ``dest`` (mtimes kept, so that
    Snakemake sees the same up-to-date outputs); the converted models (``<results>/models``)
    are hard-linked, never rewritten. Returns ``dest``."""
    src, dest = Path(src), Path(dest)
    models = [m for m in src.glob("*/models") if (m.parent / "logs").is_dir()]
    shutil.copytree(src, dest, ignore=lambda d, names: ["models"] if Path(d) / "models" in models else [])
    for m in models:
        shutil.copytree(m, dest / m.relative_to(src), copy_function=os.link)
    return dest


def tree_env(work: Path, **extra: str) -> dict[str, str]:
    """The environment for a run in the copied tree ``work``: its own ``src`` first on the path."""
    return {
        **os.environ,
        **extra,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(work / "src"), os.environ.get("PYTHONPATH")])),
    }


def _snakemake_all(work: Path, runs: dict[str, list[list[str]]]) -> None:
    """Run each entry's commands in order, the entries side by side (one process each at a time).

    Each command runs in a process group of its own; when the session ends first
    (``_STOP``, set by :func:`pytest_unconfigure`), the groups are stopped and RuntimeError
    is raised.
    """
    snakemake = [sys.executable, "-m", "snakemake"]
    pending = {name: list(cmds) for name, cmds in runs.items()}
    procs: dict[str, tuple[list[str], subprocess.Popen, object]] = {}
    failures = []

    def start(name):
        cmd = snakemake + pending[name].pop(0)
        log = open(work.parent / f"{work.name}-{name}-{len(runs[name]) - len(pending[name])}.log", "w+")
        proc = subprocess.Popen(
            cmd, cwd=work, env=tree_env(work), stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        procs[name] = (cmd, proc, log)

    for name in pending:
        start(name)
    while procs:
        if _STOP.is_set():
            for cmd, proc, log in procs.values():
                _stop_group(proc)
                log.close()
            raise RuntimeError(f"the session ended before {', '.join(procs)} finished")
        for name, (cmd, proc, log) in list(procs.items()):
            if proc.poll() is None:
                continue
            del procs[name]
            if proc.returncode != 0:
                log.seek(0)
                failures.append(f"{name} run failed: {' '.join(cmd)}\n{log.read()[-8000:]}")
            elif pending[name]:
                start(name)
            log.close()
        time.sleep(0.5)
    if failures:
        raise RuntimeError("\n".join(failures))


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the process group that ``proc`` leads (Snakemake and its jobs), SIGKILL if it stays."""
    import signal

    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def _run_workflows(work: Path) -> None:
    """The smoke config and the frontier smoke config, in one copy of the tree, side by side."""
    _copy_tree(work)
    smoke, frontier = results_dir("smoke.yaml"), results_dir("frontier-smoke.yaml")
    runs = {}
    for name, config, results in (("smoke", "smoke.yaml", smoke), ("frontier", "frontier-smoke.yaml", frontier)):
        # the report after the run in the same process: the workflow is parsed once
        runs[name] = [
            [
                "--cores",
                "2",
                "--report",
                f"{results}/report.html",
                "--report-after-run",
                "--configfile",
                f"config/{config}",
            ]
        ]
    _snakemake_all(work, runs)


#: what the bfloat16 run builds: every estimate (pool and floor need them all), the analysis
#: tables and the provenance; the figures, summary page and report are not built
BF16_TARGETS = ["provenance", "pool", "gaps", "floor", "confirmatory"]
#: what the model's dtype changes: the conversion and everything after it (the corpus stays)
FROM_THE_MODEL = ("models", "prompts", "trajectories", "estimates", "analysis", "figures")


def _run_bf16(smoke_results: Path, work: Path) -> None:
    """The smoke config with ``dtype: bfloat16`` and one shard per run, up to ``BF16_TARGETS``,
    in ``work``: a copy of the smoke run (``smoke_results``'s parent) with everything made
    from the model deleted, so that Snakemake keeps its corpus (same settings) and builds
    the rest (tests/test_precision.py)."""
    import yaml

    copy_run(Path(smoke_results).parent, work)
    results = work / Path(smoke_results).name
    for stage in FROM_THE_MODEL:
        shutil.rmtree(results / stage)
    (results / "report.html").unlink()
    config = yaml.safe_load((work / "config" / "smoke.yaml").read_text())
    for spec in config["models"].values():
        spec["dtype"] = "bfloat16"
    config["shards"] = 1  # half the jobs; each shard is one process that imports torch
    (work / "config" / "smoke-bf16.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    # targets before --configfile, which takes every following word as a config file
    _snakemake_all(work, {"bf16": [["--cores", "2", *BF16_TARGETS, "--configfile", "config/smoke-bf16.yaml"]]})


def _workflow_runs(tmp_path_factory) -> Path:
    """The working directory (a copy of the tree) where the whole workflow ran once this
    session on ``config/smoke.yaml`` and, beside it, on ``config/frontier-smoke.yaml``.

    Each config builds every target of ``rule all`` with 2 cores, then its HTML report in the
    same process (``snakemake --report <results_dir>/report.html --report-after-run``). Both run at once: their serial
    stages (conversion, corpus, analyses) leave a core free for the other. They start in the
    background once the tests are collected (:func:`pytest_collection_finish`).

    Set ``KVDIVERGE_WORKFLOW_RUNS`` to such a directory of an earlier session (a copy of
    it: pytest removes old temporary directories) to reuse it instead of running.
    """
    reuse = os.environ.get("KVDIVERGE_WORKFLOW_RUNS")
    if reuse:
        return Path(reuse)
    return session_build(tmp_path_factory, "workflow", _run_workflows)


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory) -> Path:
    """The results directory of the session's smoke run (``results_dir`` of the smoke config,
    e.g. ``<work>/results-smoke``); its parent is the run's working directory.

    Set ``KVDIVERGE_SMOKE_RESULTS`` to an existing results directory to reuse it instead
    of running (useful when iterating on tests; or ``KVDIVERGE_WORKFLOW_RUNS`` for both runs).
    """
    reuse = os.environ.get("KVDIVERGE_SMOKE_RESULTS")
    if reuse:
        return Path(reuse)
    return _workflow_runs(tmp_path_factory) / results_dir("smoke.yaml")


@pytest.fixture(scope="session")
def frontier_run(tmp_path_factory) -> Path:
    """The results directory of the session's frontier smoke run (beside the smoke run)."""
    return _workflow_runs(tmp_path_factory) / results_dir("frontier-smoke.yaml")


@pytest.fixture(scope="session")
def bf16_run(smoke_run, tmp_path_factory) -> Path:
    """The results directory of the session's bfloat16 run (:func:`_run_bf16`), made from
    the smoke run after it."""
    work = session_build(tmp_path_factory, "smoke-bf16", lambda out: _run_bf16(smoke_run, out))
    return work / Path(smoke_run).name


# --------------------------------------------------------------------------- built in the background

#: the session's builds, started in a thread once the tests are collected: name -> Future
_BACKGROUND: dict[str, Future] = {}
#: set when the session ends: builds still running stop
_STOP = threading.Event()
#: the background builds in the order they run, each with the fixtures that read it
BACKGROUND_BUILDS = (("workflow", ("smoke_run", "frontier_run")), ("smoke-bf16", ("bf16_run",)))
BACKGROUND_FIXTURES = {f for _, fixtures in BACKGROUND_BUILDS for f in fixtures}


def session_build(tmp_path_factory, name: str, build) -> Path:
    """``session_dir/name``: the background build of that name where one was started
    (:func:`pytest_collection_finish`; waits for it), else :func:`build_once` now."""
    future = _BACKGROUND.get(name)
    return future.result() if future is not None else build_once(tmp_path_factory, name, build)


def _build_in_background(factory, names: list[str]) -> None:
    """Run the builds ``names`` (of ``BACKGROUND_BUILDS``) one after the other, each
    result or error into its Future."""
    workflow = None
    for name in names:
        future = _BACKGROUND[name]
        try:
            if name == "workflow":
                workflow = build_once(factory, name, _run_workflows)
                future.set_result(workflow)
            else:
                smoke = workflow / results_dir("smoke.yaml")
                future.set_result(build_once(factory, name, lambda out: _run_bf16(smoke, out)))
        except BaseException as exc:
            future.set_exception(exc)
            for rest in names[names.index(name) + 1 :]:
                _BACKGROUND[rest].set_exception(RuntimeError(f"{rest} not built: {name} failed: {exc}"))
            return


def background_builds(config, items) -> list[str]:
    """The builds of ``BACKGROUND_BUILDS`` that the tests ``items`` read, in order, where
    they are built in the background: not when ``KVDIVERGE_WORKFLOW_RUNS`` or
    ``KVDIVERGE_SMOKE_RESULTS`` points at an earlier run, nor when only collecting. Under
    pytest-xdist every worker starts them: the first to take a build's file lock builds it
    (:func:`build_once`), the others' threads wait for it, and their tests run meanwhile."""
    if (
        config.option.collectonly
        or os.environ.get("KVDIVERGE_WORKFLOW_RUNS")
        or os.environ.get("KVDIVERGE_SMOKE_RESULTS")
    ):
        return []
    used = {f for item in items for f in item.fixturenames}
    names = [name for name, fixtures in BACKGROUND_BUILDS if used & set(fixtures)]
    return ["workflow", *names] if names == ["smoke-bf16"] else names


def pytest_collection_finish(session):
    """Start the session's workflow runs (and the bfloat16 run after them) in a background
    thread as soon as the selected tests are known, when any of them reads one
    (:func:`background_builds`): Snakemake and its jobs then run while the tests that need
    no workflow run in this process, which keeps both cores busy."""
    names = background_builds(session.config, session.items)
    if not names:
        return
    for name in names:
        _BACKGROUND[name] = Future()
    factory = session.config._tmp_path_factory  # pytest's tmp_path_factory (tmpdir plugin)
    factory.getbasetemp()  # made here, in this thread, before the build's thread reads it
    thread = threading.Thread(target=_build_in_background, args=(factory, names), name="kvdiverge-builds", daemon=True)
    thread.start()
    _THREADS.append(thread)


#: the background thread, joined at the end of the session
_THREADS: list[threading.Thread] = []


def pytest_unconfigure(config):
    """Stop background builds that are still running (a session ended early: -x, Ctrl-C),
    and wait until their processes are gone."""
    _STOP.set()
    for thread in _THREADS:
        thread.join(timeout=60)


# --------------------------------------------------------------------------- Snakemake in this process


def snakemake_here(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """``snakemake *args`` run in ``cwd`` inside this process (no interpreter start, no
    imports: a dry run of the smoke config takes about 2 s instead of about 10 s).

    The command line is Snakemake's own (``snakemake.cli``: profiles, ``--configfile``,
    targets); the workflow imports the ``kvdiverge`` of this test session. Use it for dry
    runs (``-n``) and other commands that run no job. The environment is this process's:
    set variables with ``monkeypatch.setenv``.

    Returns
    -------
    subprocess.CompletedProcess
        ``returncode`` 0 or 1 as the command line's, ``stdout`` everything Snakemake and the
        Snakefile printed or logged (``stderr`` empty).
    """
    import io
    from contextlib import redirect_stderr, redirect_stdout

    from snakemake.cli import args_to_api, parse_args, print_exception

    text, here = io.StringIO(), os.getcwd()
    os.chdir(cwd)
    try:
        with redirect_stdout(text), redirect_stderr(text):
            try:
                parser, parsed = parse_args(list(args))
                ok = args_to_api(parsed, parser)
            except Exception as exc:
                print_exception(exc)
                ok = False
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(["snakemake", *args], 0 if ok else 1, text.getvalue(), "")
