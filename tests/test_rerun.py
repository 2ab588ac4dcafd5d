"""Cached stages never go stale: a changed setting reruns exactly the jobs it affects.

Every test starts from a copy of the finished smoke run (session fixture ``smoke_run``,
tests/conftest.py): its results, logs and Snakemake's metadata (``.snakemake/``), with
the converted model hard-linked (never rewritten). The dry runs read that copy only, and run
in this process through Snakemake's command line (``snakemake_here``); the tests that run
jobs make their own copy, and run Snakemake in this process too, or as commands when two
runs go side by side.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import yaml
from conftest import copy_run, snakemake_here
from polars.testing import assert_frame_equal

pytestmark = pytest.mark.workflow

REPO = Path(__file__).resolve().parents[1]
SMOKE = yaml.safe_load((REPO / "config" / "smoke.yaml").read_text())
RES = SMOKE["results_dir"]
MODEL = "smollm2-135m"
RUNS = [
    ("snapkv-50", "exploratory"),
    ("snapkv-b128", "exploratory"),
    ("window-50", "exploratory"),
    ("noise-floor", "exploratory"),
    ("snapkv-90", "confirmatory"),
    ("noise-floor", "confirmatory"),
    ("none", "exploratory"),
]
#: each split's first run: a job of the split (shard or teacher-forced) is named by that run's output
FIRST = {s: next(p for p, split in RUNS if split == s) for _, s in RUNS}
# rules whose jobs the tests tell apart by their first output; the others run once
PER_FILE = (
    "trajectories_exploratory", "trajectories_confirmatory", "estimate", "teacher_forced_exploratory",
    "teacher_forced_confirmatory",
)  # fmt: skip


def env_for(work: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(work / "src"), os.environ.get("PYTHONPATH")])),
    }


def write_config(work: Path, change=None, name="changed.yaml") -> str:
    config = yaml.safe_load((work / "config" / "smoke.yaml").read_text())
    if change is not None:
        change(config)
    (work / name).write_text(yaml.safe_dump(config, sort_keys=True))  # keys reordered: no change
    return name


def planned_jobs(text: str) -> set[tuple[str, str | None]]:
    """The jobs of a dry run's output: ``(rule, first output)`` for PER_FILE rules, ``(rule, None)`` else."""
    jobs, rule = set(), None
    for line in text.splitlines():
        m = re.match(r"^(?:local)?rule (\w+):$", line.strip())
        if m:
            rule = m.group(1)
            if rule not in PER_FILE:
                jobs.add((rule, None))
            continue
        m = re.match(r"^\s+output: ([^,\s]+)", line)
        if m and rule in PER_FILE:
            jobs.add((rule, m.group(1)))
            rule = None
    return jobs


def snakemake_dry(work: Path, *args: str) -> str:
    """``snakemake -n *args`` in ``work``, in this process (tests/conftest.py, ``snakemake_here``):
    no interpreter start per dry run. Returns what it printed."""
    out = snakemake_here(work, "-n", *args)
    assert out.returncode == 0, f"snakemake -n {' '.join(args)} failed:\n{out.stdout[-5000:]}"
    return out.stdout


def dry_run(work: Path, change=None, *extra: str) -> set[tuple[str, str | None]]:
    text = snakemake_dry(work, "--configfile", write_config(work, change), *extra)
    jobs = planned_jobs(text)
    assert jobs or "Nothing to be done" in text, text[-3000:]
    return jobs


# ---------------------------------------------------------------- expected job sets


def splits_of(policies=None):
    """The splits on which any of ``policies`` runs (every split with runs when None)."""
    return {s for p, s in RUNS if policies is None or p in policies}


def shards(policies=None, n=2):
    """The shard jobs that make the shards of ``policies``: one job per (split, shard) writes every policy
    of the split, named by its first output (the split's first run)."""
    return {
        (f"trajectories_{s}", f"{RES}/trajectories/{MODEL}/{FIRST[s]}/{s}/shard-{i}.parquet")
        for s in splits_of(policies)
        for i in range(n)
    }


def estimates(policies=None):
    """The estimates that a rerun of the shard jobs of ``policies`` remakes: every run of their splits."""
    splits = splits_of(policies)
    return {("estimate", f"{RES}/estimates/{MODEL}/{p}/{s}.parquet") for p, s in RUNS if s in splits}


# the analyses with an HTML page, drawn by a rule of its own: a rerun analysis redraws its page
PAGES = {"confirmatory": "confirmatory_page", "speculative": "speculative_page"}


def rules(*names):
    return {(n, None) for n in names} | {(PAGES[n], None) for n in names if n in PAGES}


def teacher(policies=None):
    """The teacher-forced jobs that make the positions of ``policies``: one job per split writes every run
    of the split, named by its first output (the split's first run's positions); and their table."""
    jobs = {
        (f"teacher_forced_{s}", f"{RES}/teacher_forced/{MODEL}/{FIRST[s]}/{s}.parquet") for s in splits_of(policies)
    }
    return jobs | rules("teacher_forced_table", "all")


FIGURES_UP = rules("figure", "summary", "all")
SPECULATIVE = rules("speculative", "drift", "figure")  # read every estimate (the drift: every estimate's drift table)
ANALYSES = rules("pool", "gaps", "confirmatory", "floor") | SPECULATIVE | FIGURES_UP
GENERATION = shards() | estimates() | rules("provenance") | ANALYSES


def setter(path: str, value):
    """A config change: set the dotted key ``path`` to ``value``."""

    def change(config):
        *parents, last = path.split(".")
        node = config
        for key in parents:
            node = node.setdefault(key, {})  # a section the config leaves to its defaults
        node[last] = value

    change.__name__ = f"{path}={value}"
    return change


CASES = [
    # setting, new value, the jobs that must rerun (and no other);
    # the teacher-forced pass reads no decoding setting, replicates or shards: a rerun shard job reruns
    # its split's teacher-forced job only to gather the shards' positions
    ("decoding.temperature", 0.9, GENERATION | teacher()),
    ("decoding.top_p", 0.9, GENERATION | teacher()),
    ("replicates", 3, GENERATION | teacher()),
    ("seed", 1, GENERATION | teacher()),
    ("shards", 3, shards(n=3) | estimates() | rules("provenance") | ANALYSES | teacher()),
    ("decoding.max_new_tokens", 9, rules("prompts") | GENERATION | teacher()),
    ("teacher_forced.length", 8, teacher()),
    ("teacher_forced.target", "reconstruction", teacher()),
    ("teacher_forced.key_tokens.short", 32, teacher()),
    (
        "policies.snapkv-50.compression_ratio",
        0.4,
        shards(["snapkv-50"])
        | estimates(["snapkv-50"])
        | rules("provenance", "pool", "gaps", "floor")
        | SPECULATIVE
        | FIGURES_UP
        | teacher(["snapkv-50"]),
    ),
    (
        "policies.snapkv-90.kernel_size",
        3,
        shards(["snapkv-90"])
        | estimates(["snapkv-90"])
        | rules("provenance", "pool", "confirmatory", "floor")
        | SPECULATIVE
        | FIGURES_UP
        | teacher(["snapkv-90"]),
    ),
    ("policies.snapkv-b128.budget", 120, rules("prompts") | GENERATION | teacher()),
    (
        "runs.control.documents",
        2,
        shards(["none"])
        | estimates(["none"])
        | rules("provenance", "pool", "gaps", "floor")
        | SPECULATIVE
        | FIGURES_UP
        | teacher(["none"]),
    ),
    (
        "runs.floor.documents",
        1,
        shards(["noise-floor"])
        | estimates(["noise-floor"])
        | rules("provenance", "pool", "gaps", "floor", "confirmatory")
        | SPECULATIVE
        | FIGURES_UP
        | teacher(["noise-floor"]),
    ),
    (
        "policies.noise-floor.seed",
        1,
        shards(["noise-floor"])
        | estimates(["noise-floor"])
        | rules("provenance", "pool", "gaps", "floor", "confirmatory")
        | SPECULATIVE
        | FIGURES_UP
        | teacher(["noise-floor"]),
    ),
    (
        f"models.{MODEL}.attn_implementation",
        "eager",
        rules("convert_model", "prompts") | GENERATION | teacher(),
    ),
    ("corpus.split_seed", 8, rules("corpus", "prompts") | GENERATION | teacher()),
    ("window", 3, estimates() | ANALYSES),
    ("drift.min_repeats", 4, estimates() | ANALYSES),
    ("confirmatory.late", [3, 5], estimates() | ANALYSES),
    ("analysis.bootstrap", 100, ANALYSES | rules("teacher_forced_table")),
    ("analysis.confidence", 0.9, ANALYSES | rules("teacher_forced_table")),
    ("confirmatory.alpha", 0.1, rules("confirmatory") | FIGURES_UP),
    ("analysis.gaps", [["snapkv-b128", "snapkv-50"]], rules("gaps") | FIGURES_UP),
    # the same settings written differently: nothing
    ("replicates", 2.0, set()),
    ("decoding.max_new_tokens", 8.0, set()),
    ("teacher_forced.length", 16.0, set()),
    # read by the reconstruction target only (the smoke config's is the continuation)
    ("teacher_forced.repeat_instruction", "Say it again.", set()),
]


@pytest.fixture(scope="module")
def finished(smoke_run, tmp_path_factory) -> Path:
    """A copy of the finished smoke run's working directory, for dry runs only."""
    return copy_run(Path(smoke_run).parent, tmp_path_factory.mktemp("rerun") / "work")


def test_the_finished_run_is_up_to_date(finished):
    assert dry_run(finished) == set()


@pytest.mark.parametrize("key, value, expected", CASES, ids=[f"{k}={v}" for k, v, _ in CASES])
def test_a_changed_setting_reruns_exactly_the_jobs_it_affects(finished, key, value, expected):
    assert dry_run(finished, setter(key, value)) == expected


@pytest.mark.llm
def test_a_shard_made_with_another_temperature_is_refused(smoke_run, tmp_path):
    import torch

    from kvdiverge.config.workflow import load_config
    from kvdiverge.jobs.params import ShardSettings
    from kvdiverge.jobs.shard import run_shard
    from kvdiverge.models.loading import load_model, local_entry

    work = copy_run(Path(smoke_run).parent, tmp_path / "work")
    shard = f"{RES}/trajectories/{MODEL}/snapkv-50/exploratory/shard-0.parquet"
    # the same shard, made with temperature 0.9 (the config says 0.7), copied into place
    config = load_config(work / "config" / "smoke.yaml")
    config["decoding"]["temperature"] = 0.9
    model, _ = load_model(local_entry(config["models"][MODEL], work / RES / "models" / MODEL), MODEL)
    made = tmp_path / "elsewhere" / "shard-0.parquet"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workflow's shard jobs (threads: 1); more threads only contend
    try:
        job = ShardSettings.from_config(config, MODEL, "snapkv-50", "exploratory", 0)
        frame = run_shard(job, str(work / RES / "prompts" / f"{MODEL}.parquet"), str(made), model=model)
    finally:
        torch.set_num_threads(threads)
    assert frame.height == 2  # 1 document x R = 2
    shutil.copy(made, work / shard)

    estimate = f"{RES}/estimates/{MODEL}/snapkv-50/exploratory.parquet"
    # targets before --configfile, which takes every following word as a config file
    out = snakemake_here(work, "--cores", "1", estimate, "--configfile", "config/smoke.yaml")  # in this process
    assert out.returncode != 0
    log = (work / RES / "logs" / "estimate" / MODEL / "snapkv-50" / "exploratory.log").read_text()
    assert f"{shard}: decoding.temperature = 0.9 in the shard, 0.7 in the config" in log
    assert "shard-1.parquet:" not in log  # the other shard matches
    command = log.split("Regenerate them with:")[1].strip().splitlines()[0]
    assert command == f"snakemake --cores all --configfile config/smoke.yaml --forcerun {shard}"
    # that command remakes the shard and what depends on it, nothing else
    assert planned_jobs(snakemake_dry(work, *command.split()[1:])) == (
        {("trajectories_exploratory", shard)}  # the job of the split's shard 0: every exploratory policy's
        | teacher(["snapkv-50"])  # the split's teacher-forced job gathers the shard's positions again
        | estimates(["snapkv-50"])
        | rules("provenance", "pool", "gaps", "floor")
        | SPECULATIVE
        | FIGURES_UP
    )


@pytest.mark.llm
@pytest.mark.long
def test_changing_shards_gives_the_tables_of_a_clean_run(smoke_run, tmp_path):
    """shards 2 -> 1: a document moves (shard-1's into shard-0); rerun = clean run, no document lost."""
    src = Path(smoke_run).parent
    rerun, clean = copy_run(src, tmp_path / "rerun"), copy_run(src, tmp_path / "clean")
    for stage in ("trajectories", "estimates"):  # the clean run: no shard, no estimate yet
        shutil.rmtree(clean / RES / stage)
    target = f"{RES}/estimates/{MODEL}/snapkv-50/exploratory.parquet"
    # the two runs side by side, each with one single-threaded shard job at a time: the rerun
    # as a command, the clean run meanwhile in this process
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "snakemake",
            "--cores",
            "1",
            target,
            "--configfile",
            write_config(rerun, setter("shards", 1)),
        ],
        cwd=rerun,
        env=env_for(rerun),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        res = snakemake_here(clean, "--cores", "1", target, "--configfile", write_config(clean, setter("shards", 1)))
    finally:
        out = proc.communicate(timeout=900)[0]
    assert res.returncode == 0, f"snakemake in clean failed:\n{res.stdout[-5000:]}"
    assert proc.returncode == 0, f"snakemake in rerun failed:\n{out[-5000:]}"

    before = pl.read_parquet(src / target)
    shard0 = pl.read_parquet(rerun / RES / "trajectories" / MODEL / "snapkv-50" / "exploratory" / "shard-0.parquet")
    assert sorted(shard0["doc_id"].unique()) == sorted(before["doc_id"]) and before.height == 2

    def table(work, suffix):
        df = pl.read_parquet(work / target.replace(".parquet", suffix))
        return df.drop([c for c in df.columns if c == "seconds" or c.endswith("_seconds")])

    for suffix in (".parquet", ".replicates.parquet"):
        got, want = table(rerun, suffix), table(clean, suffix)
        assert got["doc_id"].n_unique() == before.height  # no document lost, none twice
        assert_frame_equal(got, want, check_exact=True)
