"""The front door: ``kvdiverge.measure`` and ``kvdiverge measure`` share the workflow's path.

- unit tests of argument parsing, prompt files, press adapters (no model);
- the command on the embedded model (two prompts, T = 4, R = 2; ``llm``) and its exit
  codes for bad input;
- the API on the smoke run's documents gives the workflow's tables (``workflow``: session
  fixture ``smoke_run``), and a user's own presses, the compression check and the noise
  floor on the smoke run's converted model;
- the README's "Measure one press" examples, run as written (``llm``).
"""

from __future__ import annotations

import ast
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import polars as pl
import pytest
from conftest import run_main
from polars.testing import assert_frame_equal

from kvdiverge.config.inputs import InputError, check_lengths, model_entry, prepare_documents, prepare_presses
from kvdiverge.config.prompt_sources import read_prompts
from kvdiverge.doors import cli
from kvdiverge.doors.cli import main
from kvdiverge.engine.core.errors import PressError, PressExpressionError
from kvdiverge.engine.presses.expressions import parse_press, parse_value, press_spec
from kvdiverge.engine.presses.policies import Policy, PressPolicy, press_from_spec
from kvdiverge.engine.runner import Document

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
# One torch thread: on a busy 2-core test machine two OpenMP threads per forward pass are
# 10-50x slower than one (measured: a 300-token prefill of the embedded model 14 s vs 1.7 s).
ONE_THREAD = {"OMP_NUM_THREADS": "1"}

USER_PRESSES = '''
from dataclasses import dataclass

import torch
from kvpress import BasePress, ScorerPress


@dataclass
class KeepAllPress(BasePress):
    """A user's press that compresses nothing."""

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        return keys, values


@dataclass
class RecentPress(ScorerPress):
    """A user's score-based press: keeps the most recent positions."""

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        n = keys.shape[-2]
        return torch.arange(n, dtype=keys.dtype, device=keys.device).expand(keys.shape[:-1])
'''


@pytest.fixture
def one_torch_thread():
    """torch on one thread for the test (see ONE_THREAD), restored afterwards."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def user_presses(tmp_path_factory) -> Path:
    """A directory with ``mypresses.py`` (press classes kvpress does not ship), on sys.path."""
    d = tmp_path_factory.mktemp("user")
    (d / "mypresses.py").write_text(USER_PRESSES)
    sys.path.insert(0, str(d))
    yield d
    sys.path.remove(str(d))


def run_cli(args: list[str], cwd: Path, extra_path: Path | None = None) -> subprocess.CompletedProcess:
    """``python -m kvdiverge`` with this tree's sources first on the path."""
    path = [str(REPO / "src")] + ([str(extra_path)] if extra_path else []) + [os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path)), **ONE_THREAD}
    return subprocess.run(
        [PYTHON, "-m", "kvdiverge", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=1800
    )


# --------------------------------------------------------------------------- no model


def test_parse_value_types():
    assert parse_value("3") == 3 and isinstance(parse_value("3"), int)
    assert parse_value("0.5") == 0.5
    assert parse_value("1e-3") == 0.001
    assert parse_value("True") is True and parse_value("false") is False
    assert parse_value("none") is None
    assert parse_value("max") == "max"


def test_parse_press_names_classes_and_parameters():
    assert parse_press("SnapKVPress") == ("SnapKVPress", {})
    assert parse_press("SnapKVPress:compression_ratio=0.5,window_size=16") == (
        "SnapKVPress",
        {"compression_ratio": 0.5, "window_size": 16},
    )
    assert parse_press("mypkg.presses:MyPress") == ("mypkg.presses:MyPress", {})
    assert parse_press("mypkg:MyPress:k=2,flag=true") == ("mypkg:MyPress", {"k": 2, "flag": True})
    with pytest.raises(PressExpressionError, match="not name=value"):
        parse_press("SnapKVPress:compression_ratio=0.5,oops")
    with pytest.raises(PressExpressionError, match="given twice"):
        parse_press("SnapKVPress:window_size=1,window_size=2")


def build_press(text):
    """The press object of a ``--press`` value, as the command line builds it."""
    return press_from_spec(press_spec(text), None, f"press {text!r}")


def test_build_press_objects_and_errors(user_presses):
    from kvpress import SnapKVPress

    press = build_press("SnapKVPress:compression_ratio=0.25,window_size=8")
    assert isinstance(press, SnapKVPress) and press.compression_ratio == 0.25 and press.window_size == 8
    assert type(build_press("mypresses:KeepAllPress")).__name__ == "KeepAllPress"
    with pytest.raises(PressError, match="unknown press 'SnapPress'"):
        build_press("SnapPress:compression_ratio=0.5")
    with pytest.raises(PressError, match=r"has no parameter\(s\) \['windowsize'\]; accepted: .*window_size"):
        build_press("SnapKVPress:windowsize=8")
    with pytest.raises(PressError, match="cannot import module 'no_such_module'"):
        build_press("no_such_module:Press")
    with pytest.raises(PressError, match="has no attribute 'Nope'"):
        build_press("mypresses:Nope")
    with pytest.raises(PressError, match="failed"):
        build_press("SnapKVPress:compression_ratio=1.5")


def test_read_prompts_text_jsonl_parquet(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_text("first prompt\n\n  second prompt  \n")
    assert read_prompts(txt) == {"prompt-0": "first prompt", "prompt-1": "second prompt"}
    jl = tmp_path / "p.jsonl"
    jl.write_text('{"id": "a", "body": "alpha"}\n{"id": "b", "body": "beta"}\n')
    assert read_prompts(jl, field="body", id_field="id") == {"a": "alpha", "b": "beta"}
    pq = tmp_path / "p.parquet"
    pl.DataFrame({"question": ["x?", "y?", "z?"]}).write_parquet(pq)
    assert list(read_prompts(pq, field="question").values()) == ["x?", "y?", "z?"]
    with pytest.raises(InputError, match=r"no column 'text' \(columns: question\)"):
        read_prompts(pq)
    with pytest.raises(InputError, match="line 1 has no field 'text'"):
        read_prompts(jl)
    with pytest.raises(InputError, match="prompts file not found"):
        read_prompts(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(InputError, match="no prompts"):
        read_prompts(tmp_path / "empty.txt")


def test_read_prompts_drops_a_byte_order_mark(tmp_path):
    txt, jl = tmp_path / "p.txt", tmp_path / "p.jsonl"
    txt.write_bytes(b"\xef\xbb\xbffirst prompt\r\nsecond prompt\r\n")
    assert read_prompts(txt) == {"prompt-0": "first prompt", "prompt-1": "second prompt"}
    jl.write_bytes(b'\xef\xbb\xbf{"id": "a", "text": "alpha"}\n')
    assert read_prompts(jl, id_field="id") == {"a": "alpha"}


def test_model_entry_kinds(tmp_path):
    assert model_entry("gemma3-270m")[1]["source"] == "gguf_chunks"
    name, spec = model_entry("embedded", "bfloat16", "cpu")
    assert name == "smollm2-135m" and spec["source"] == "gguf_package" and spec["dtype"] == "bfloat16"
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert model_entry(str(tmp_path / "m.gguf"))[1] == {
        "source": "local",
        "path": str(tmp_path),
        "gguf_file": "m.gguf",
        "dtype": "float32",
        "device": "cpu",
    }
    assert model_entry(str(tmp_path))[1]["source"] == "local"
    assert model_entry("Qwen/Qwen2.5-7B-Instruct") == (
        "Qwen/Qwen2.5-7B-Instruct",
        {"source": "hub", "id": "Qwen/Qwen2.5-7B-Instruct", "dtype": "float32", "device": "cpu"},
    )
    with pytest.raises(InputError, match="model not found"):
        model_entry(str(tmp_path / "nowhere" / "model"))
    (tmp_path / "w.bin").write_bytes(b"x")
    with pytest.raises(InputError, match="not a GGUF file"):
        model_entry(str(tmp_path / "w.bin"))


def test_embedded_model_is_the_default_configs_model():
    import yaml

    from kvdiverge.models.embedded import EMBEDDED_MODEL, EMBEDDED_NAME

    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    assert config["models"] == {EMBEDDED_NAME: EMBEDDED_MODEL}


def test_prepare_presses_names_and_kinds(user_presses):
    from kvpress import KnormPress, SnapKVPress
    from mypresses import KeepAllPress

    s = prepare_presses(
        {
            "snap": SnapKVPress(compression_ratio=0.5),
            "own": KeepAllPress(),
            "b64": {"press": "SnapKVPress", "budget": 64, "window_size": 8},
        }
    )
    assert isinstance(s["snap"], PressPolicy) and isinstance(s["own"], PressPolicy)
    assert isinstance(s["b64"], Policy) and s["b64"].budget == 64
    auto = prepare_presses([KnormPress(0.5), KnormPress(0.25)])
    assert list(auto) == ["KnormPress", "KnormPress-2"] and auto["KnormPress-2"].press.compression_ratio == 0.25
    assert list(prepare_presses(KnormPress(0.5))) == ["KnormPress"]
    with pytest.raises(ValueError, match="SnapKVPress has no parameter"):
        prepare_presses({"bad": {"press": "SnapKVPress", "compression_ratio": 0.5, "windowsize": 8}})
    with pytest.raises(ValueError, match=r"^press 'x': 0\.5 \(float\) is not a press; allowed: a kvpress\.BasePress "):
        prepare_presses({"x": 0.5})
    with pytest.raises(ValueError, match="no presses"):
        prepare_presses({})


def test_press_policy_minimum_and_kept():
    from kvpress import AdaKVPress, KnormPress, SnapKVPress, StreamingLLMPress

    snap = PressPolicy("s", SnapKVPress(compression_ratio=0.5, window_size=16))
    assert snap.min_prompt_tokens == 17
    assert snap.expected_kept(101, snap.press) == 50  # kvpress.utils.compute_n_kept
    with pytest.raises(ValueError, match="press 's' needs a prompt of at least 17 tokens, got 16"):
        snap.build_press(16)
    assert snap.build_press(17) is snap.press
    assert PressPolicy("k", KnormPress(0.0)).expected_kept(40, KnormPress(0.0)) == 40
    wrapped = PressPolicy("a", AdaKVPress(StreamingLLMPress(0.5, n_sink=4)))
    promise = wrapped.expected_kept(40, wrapped.press)  # head-wise: 20 per head on average, per layer
    assert (
        wrapped.min_prompt_tokens == 5
        and promise.scope == "layer"
        and promise.counts(SimpleNamespace(num_hidden_layers=2)) == (20, 20)
    )
    # the same kept count as the config's policy for the same ratio
    policy = Policy.from_config("p", {"press": "SnapKVPress", "compression_ratio": 0.3, "window_size": 16})
    assert all(
        snap.expected_kept(n, SnapKVPress(compression_ratio=0.3)) == policy.kept_tokens(n) for n in range(17, 400)
    )


def test_prepare_documents_ids_and_errors():
    docs = prepare_documents({"a": [1, 2, 3], "b": (4, 5)})
    assert docs == [Document("a", [1, 2, 3]), Document("b", [4, 5])]
    assert [d.doc_id for d in prepare_documents([[1], [2], [3]])] == ["prompt-0", "prompt-1", "prompt-2"]
    with pytest.raises(ValueError, match="pass the model's tokenizer"):
        prepare_documents(["some text"])
    with pytest.raises(ValueError, match="has no tokens"):
        prepare_documents([[]])
    with pytest.raises(TypeError, match="token ids"):
        prepare_documents([[1.5, 2.0]])
    with pytest.raises(ValueError, match="press 'snap' needs at least 17"):
        check_lengths(
            docs, prepare_presses({"snap": {"press": "SnapKVPress", "compression_ratio": 0.5, "window_size": 16}}), 4
        )
    with pytest.raises(ValueError, match="exceed the model context of 6 tokens"):
        check_lengths(docs, {}, 4, context=6)


def test_console_script_entry_and_light_import():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"kvdiverge": "kvdiverge.doors.cli:main"}
    assert cli.main is main
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    out = subprocess.run(
        [
            PYTHON,
            "-c",
            "import sys, kvdiverge; print('torch' in sys.modules, 'polars' in sys.modules);"
            "import kvdiverge.doors.cli; print('torch' in sys.modules, 'kvpress' in sys.modules);"
            "import kvdiverge.doors.measurement; print(callable(kvdiverge.measure))",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out == ["False", "False", "False", "False", "True"]  # the command line parses without torch


def _error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def test_cli_cache_entries():
    from kvdiverge.doors.arguments import cli_entries

    got = cli_entries(["KnormPress:compression_ratio=0.5"], ["quanto:nbits=2,residual_length=16"], None, 0.0)
    q = {"cache": "quantized", "backend": "quanto", "nbits": 2, "residual_length": 16}
    assert got == {
        "KnormPress:compression_ratio=0.5": {"press": "KnormPress", "params": {}, "compression_ratio": 0.5},
        "quanto:nbits=2,residual_length=16": q,
        "KnormPress:compression_ratio=0.5+quanto:nbits=2,residual_length=16": {
            "press": "KnormPress",
            "params": {},
            "compression_ratio": 0.5,
            **q,
        },
    }


def test_cli_bad_input_exits_2_with_one_line(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"text": "hello"}\n')
    base = ["measure", "embedded", "--prompts", str(prompts), "-T", "4", "-R", "2"]
    cases = [
        (base + ["--press", "SnapPress:compression_ratio=0.5"], "unknown press 'SnapPress'"),
        (base + ["--press", "SnapKVPress:ratio=0.5"], "SnapKVPress has no parameter(s) ['ratio']"),
        (
            ["measure", "embedded", "--prompts", str(tmp_path / "none.txt"), "--press", "KnormPress"],
            "prompts file not found",
        ),
        (base + ["--press", "KnormPress", "--field", "question"], "line 1 has no field 'question'"),
        (
            ["measure", str(tmp_path / "no" / "model"), "--prompts", str(prompts), "--press", "KnormPress"],
            "model not found",
        ),
        (
            base + ["--press", "KnormPress", "-T", "0"],
            "-T/--max-new-tokens: 0 is not allowed; allowed: an integer >= 1",
        ),
        (["measure", "embedded", "--press", "KnormPress"], "one of the arguments --prompts --sotu is required"),
        (base, "give at least one --press or --cache"),
        (base + ["--cache", "gptq:nbits=4"], "--cache 'gptq:nbits=4': the backend must be one of ['hqq', 'quanto']"),
        (base + ["--cache", "quanto:bits=4"], "unknown parameter 'bits'; allowed: nbits, q_group_size"),
        (base + ["--cache", "quanto:nbits=3"], "nbits must be one of [2, 4] for backend 'quanto', got 3"),
        # --cache with --ratios adds the cache's frontier points; --cache-ratios needs both
        (
            base + ["--press", "KnormPress", "--cache", "quanto", "--cache-ratios", "0.5"],
            "--cache-ratios needs --ratios and at least one --cache",
        ),
    ]
    for argv, message in cases:
        try:
            rc = main(argv)
        except SystemExit as exc:  # argparse's own errors
            rc = exc.code
        assert rc == 2, argv
        err = capsys.readouterr().err
        assert message in _error_line(err), (argv, err)


# --------------------------------------------------------------------------- the command on the embedded model


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory, user_presses, embedded_dir):
    """``kvdiverge measure embedded`` (``kvdiverge.doors.cli.main`` in this process, the embedded
    model read from the session's kept conversion, fixture ``embedded_dir``): two prompts,
    T = 4, R = 2, SnapKV and a user press."""
    work = tmp_path_factory.mktemp("cli")
    (work / "prompts.txt").write_text(
        "Describe the water cycle in four sentences for a science class of twelve-year-olds.\n"
        "List three reasons why bridges are built with expansion joints, and explain each briefly.\n"
    )
    start = time.perf_counter()
    res = run_main(
        [
            "measure",
            "embedded",
            "--prompts",
            "prompts.txt",
            "-T",
            "4",
            "-R",
            "2",
            "--seed",
            "7",
            "--bootstrap",
            "200",
            "--press",
            "SnapKVPress:compression_ratio=0.5,window_size=8",
            "--press",
            "mypresses:KeepAllPress",
            "--out",
            "out",
        ],
        work,
    )
    seconds = time.perf_counter() - start
    print(f"\n[measure] kvdiverge measure embedded, 2 prompts, T=4, R=2, 2 presses: {seconds:.1f} s")
    return work, res


@pytest.mark.llm
def test_cli_on_embedded_model_writes_tables(cli_run):
    work, res = cli_run
    assert res.returncode == 0, res.stderr[-3000:]
    out = work / "out"
    snap, own = "SnapKVPress:compression_ratio=0.5,window_size=8", "mypresses:KeepAllPress"
    traj = pl.read_parquet(out / "trajectories.parquet")
    assert traj.height == 2 * 2 * 2  # presses x prompts x replicates
    assert set(traj["policy"]) == {snap, own} and set(traj["doc_id"]) == {"prompt-0", "prompt-1"}
    assert (traj["T"] == 4).all() and (traj["model"] == "smollm2-135m").all()
    assert traj["chain_token"].list.len().to_list() == [4] * 8
    docs = pl.read_parquet(out / "documents.parquet")
    assert docs.height == 4 and (docs["R"] == 2).all()
    summary = pl.read_parquet(out / "summary.parquet")
    assert summary["policy"].to_list() == [snap, own]  # the order given
    s = {r["policy"]: r for r in summary.iter_rows(named=True)}
    assert not s[snap]["untouched"] and 0.45 < s[snap]["kept_fraction"] < 0.55
    assert s[own]["untouched"] and s[own]["kept_fraction"] == 1.0
    assert s[own]["p_div"] == 0.0 and s[own]["E_M"] == 0.0  # the same cache: never diverges
    pooled = pl.read_parquet(out / "pooled.parquet")
    assert pooled.height == 2 and (pooled["n_docs"] == 2).all()
    for row in pooled.iter_rows(named=True):
        assert row["E_M"] == pytest.approx(row["first_mismatch_term"] + row["exposure_rate_term"], abs=1e-12)
    assert pl.read_parquet(out / "survival.parquet").height == 2 * 5  # t = 0..T per press
    gaps = pl.read_parquet(out / "gaps.parquet")
    assert gaps["term"].to_list() == ["delta", "first_mismatch", "exposure", "rate"]
    assert (gaps["policy_a"] == snap).all() and (gaps["policy_b"] == own).all()
    for name in ("replicates", "timing", "branch_tv", "variance"):
        assert (out / f"{name}.parquet").stat().st_size > 0
    assert (out / "summary.csv").read_text().startswith("policy,n_docs,T,R,kept_fraction,untouched,no_divergence,p_div")
    assert (out / "survival.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "survival.pdf").read_bytes()[:4] == b"%PDF"
    settings = json.loads((out / "measure.json").read_text())
    assert (
        settings["T"] == 4 and settings["R"] == 2 and settings["seed"] == 7 and list(settings["presses"]) == [snap, own]
    )
    # the printed summary: one row per press, the decomposition, the untouched flag, the absent floor
    assert "E[M] [CI]" in res.stdout and "= p_div/T" in res.stdout and "+ (E[L]/T)*rho" in res.stdout
    assert re.search(r"mypresses:KeepAllPress\s+2\s+100%\*", res.stdout)
    assert (
        "left the cache untouched (TV 0 at every step: the same kernel as the full cache): mypresses:KeepAllPress"
        in res.stdout
    )
    assert "noise floor: not measured" in res.stdout
    # the self-speculative line: the untouched cache accepts all 4 drafted tokens, 5 per forward
    assert re.search(
        r"self-speculative first block \(k=4.*mypresses:KeepAllPress 5\.00 \[5\.00, 5\.00\] "
        r"\(iid 5\.00\)",
        res.stdout,
    )
    spec = pl.read_parquet(out / "speculative.parquet")
    assert spec.height == 2 * 4 and spec.filter(pl.col("policy") == own)["A"].to_list() == [1.0, 2.0, 3.0, 4.0]
    assert "step/s" in res.stderr or "it/s" in res.stderr  # progress bars


@pytest.mark.llm
def test_cli_prompt_shorter_than_press_needs_exits_2(tmp_path, embedded_cached):
    (tmp_path / "p.txt").write_text("Hi.\n")
    res = run_main(
        [
            "measure",
            "embedded",
            "--prompts",
            "p.txt",
            "-T",
            "4",
            "-R",
            "2",
            "--press",
            "SnapKVPress:compression_ratio=0.5,window_size=500",
        ],
        tmp_path,
    )
    assert res.returncode == 2
    line = _error_line(res.stderr)
    assert re.fullmatch(
        r"kvdiverge measure: error: prompt 'prompt-0' has \d+ tokens; press "
        r"'SnapKVPress:compression_ratio=0.5,window_size=500' needs at least 501",
        line,
    ), line


def test_the_command_as_a_process_exits_2_with_one_line(tmp_path):
    """The command line in a process of its own (the console script where installed, else
    ``python -m kvdiverge``): bad input is one line on stderr and exit code 2."""
    args = ["measure", "embedded", "--prompts", "none.txt", "--press", "KnormPress"]
    if shutil.which("kvdiverge") is None:  # the console script needs `pip install -e .` (make setup)
        res = run_cli(args, tmp_path)
    else:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])),
        }
        res = subprocess.run(["kvdiverge", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 2 and res.stdout == ""
    assert _error_line(res.stderr).startswith("kvdiverge measure: error: prompts file not found"), res.stderr


# --------------------------------------------------------------------------- API = workflow (smoke run)


@pytest.fixture(scope="module")
def smoke(smoke_run):
    """(config, converted model, exploratory prompts) of the smoke run."""
    from kvdiverge.config.workflow import load_config
    from kvdiverge.models.loading import load_model, local_entry

    config = load_config(REPO / "config" / "smoke.yaml")
    name = next(iter(config["models"]))
    model, tokenizer = load_model(local_entry(config["models"][name], smoke_run / "models" / name), name)
    prompts = pl.read_parquet(smoke_run / "prompts" / f"{name}.parquet").filter(
        (pl.col("split") == "exploratory") & pl.col("exclusion_reason").is_null()
    )
    return config, name, model, tokenizer, prompts


def _same(ours: pl.DataFrame, theirs: pl.DataFrame, keys: list[str], what: str) -> None:
    drop = [c for c in ours.columns if c == "seconds"]
    assert set(ours.columns) == set(theirs.columns), what
    a = ours.drop(drop).sort(keys)
    b = theirs.drop(drop).select(a.columns).sort(keys)
    assert a.height > 0, what
    try:
        assert_frame_equal(a, b, check_exact=True, check_dtypes=False)
    except AssertionError as exc:
        raise AssertionError(f"{what}: {exc}") from None


@pytest.mark.workflow
def test_measure_gives_the_workflows_tables(smoke_run, smoke, one_torch_thread):
    """The API on the smoke config's exploratory documents, presses and settings equals the
    workflow's trajectories (but ``seconds``), estimates and analysis tables."""
    import kvdiverge

    config, name, model, _, prompts = smoke
    policies = config["runs"]["exploratory"]
    # one thread (fixture), as the workflow's trajectory jobs (threads: 1): the same float rounding
    m = kvdiverge.measure(
        model,
        None,
        {r["doc_id"]: r["input_ids"] for r in prompts.iter_rows(named=True)},
        {p: config["policies"][p] for p in policies},
        max_new_tokens=config["decoding"]["max_new_tokens"],
        replicates=config["replicates"],
        temperature=config["decoding"]["temperature"],
        top_p=config["decoding"]["top_p"],
        seed=config["seed"],
        window=config["window"],
        windows={k: config["confirmatory"][k] for k in ("early", "late")},
        bootstrap=config["analysis"]["bootstrap"],
        confidence=config["analysis"]["confidence"],
        model_name=name,
        split="exploratory",
        progress=False,
        batch_documents=1,
    )  # as the smoke run's shards, which hold one document each
    run = ["model", "policy", "split", "doc_id"]
    shards = pl.concat(
        [
            pl.read_parquet(f)
            for p in policies
            for f in glob.glob(str(smoke_run / "trajectories" / name / p / "exploratory" / "*.parquet"))
        ]
    )
    _same(m.trajectories, shards, run + ["replicate"], "trajectories")
    for p in policies:
        est = smoke_run / "estimates" / name / p
        _same(m.documents.filter(pl.col("policy") == p), pl.read_parquet(est / "exploratory.parquet"), run, p)
        _same(
            m.replicates.filter(pl.col("policy") == p),
            pl.read_parquet(est / "exploratory.replicates.parquet"),
            run + ["replicate"],
            p + " replicates",
        )
    ours_runs = (pl.col("split") == "exploratory") & pl.col("policy").is_in(policies)
    for table in ("pooled", "timing", "survival", "branch_tv", "variance"):
        theirs = pl.read_parquet(smoke_run / "analysis" / f"{table}.parquet").filter(ours_runs)
        ours = getattr(m, table)
        _same(ours, theirs, [c for c in ("model", "policy", "split", "t", "lag") if c in ours.columns], table)
    ((a, b),) = config["analysis"]["gaps"]
    _same(m.gap(a, b), pl.read_parquet(smoke_run / "analysis" / "gaps.parquet"), ["term"], "gaps")


@pytest.mark.workflow
def test_measure_user_presses_compression_check_and_noise_floor(smoke, user_presses, tmp_path, one_torch_thread):
    import matplotlib.pyplot as plt
    from kvpress import SnapKVPress
    from mypresses import KeepAllPress, RecentPress

    import kvdiverge
    from kvdiverge.engine.core.errors import CompressionError

    config, name, model, tokenizer, prompts = smoke
    ids = {r["doc_id"]: r["input_ids"] for r in prompts.head(1).iter_rows(named=True)}
    presses = {
        "recent-30": RecentPress(compression_ratio=0.3),
        "keep-all": KeepAllPress(),
        "snapkv": SnapKVPress(compression_ratio=0.5, window_size=16),
        "noise-floor": {"press": "SnapKVPress", "compression_ratio": 0.0},
    }
    with pytest.warns(UserWarning, match="press 'keep-all' left the cache untouched") as record:
        m = kvdiverge.measure(
            model,
            tokenizer,
            ids,
            presses,
            max_new_tokens=4,
            replicates=2,
            seed=3,
            window=2,
            bootstrap=100,
            progress=False,
        )
    assert len(record) == 1  # the noise floor keeps every position by design: no warning
    n = next(iter(ids.values()))
    comp = {r["policy"]: r for r in m.compression.iter_rows(named=True)}
    assert comp["recent-30"]["kept_len"] == max(1, int(len(n) * 0.7))  # a user's ScorerPress, checked
    assert comp["keep-all"]["untouched"] and comp["noise-floor"]["untouched"]
    assert not comp["snapkv"]["untouched"]
    s = {r["policy"]: r for r in m.summary.iter_rows(named=True)}
    assert m.noise_floor == "noise-floor" and s["noise-floor"]["E_M_minus_floor"] is None
    for p in ("recent-30", "snapkv"):  # the floor here is the identical cache, so the difference is E[M] itself
        assert s[p]["E_M_minus_floor"] == pytest.approx(s[p]["E_M"], abs=1e-12)
        assert s[p]["p_div_minus_floor"] == pytest.approx(s[p]["p_div"], abs=1e-12)
        assert s[p]["E_M_minus_floor_lo"] <= s[p]["E_M_minus_floor"] <= s[p]["E_M_minus_floor_hi"]
    assert s["keep-all"]["p_div"] == 0.0 and s["snapkv"]["p_div"] > 0
    text = m.format_summary()
    assert "E[M] - noise-floor [CI]" in text and "(floor)" in text
    assert "left the cache untouched (TV 0 at every step: the same kernel as the full cache): keep-all\n" in text + "\n"
    spec = m.speculative
    assert spec.filter(pl.col("policy") == "keep-all")["k"].to_list() == [1, 2, 3, 4]  # min(8, T)
    # the identical cache accepts every drafted token: A_k = k, k + 1 tokens per target forward
    assert spec.filter(pl.col("policy") == "keep-all")["tokens_per_forward"].to_list() == [2.0, 3.0, 4.0, 5.0]
    snap = spec.filter(pl.col("policy") == "snapkv").sort("k")
    assert snap["A"].to_numpy() == pytest.approx(
        np.cumsum(m.survival.filter((pl.col("policy") == "snapkv") & (pl.col("t") > 0)).sort("t")["S"].to_numpy())
    )
    assert "self-speculative first block (k=4" in text and "keep-all 5.00 [5.00, 5.00] (iid 5.00)" in text
    assert m.gaps.height == 4 * 6  # every pair of 4 presses, 4 terms each
    with pytest.raises(ValueError, match="unknown press 'nope'"):
        m.gap("snapkv", "nope")
    fig, ax = plt.subplots()
    assert m.plot_survival(ax) is ax
    texts = [t.get_text().replace("\n", " ") for t in ax.get_legend().get_texts()]
    assert texts[:4] == sorted(presses)  # one entry per press, then one per group of coinciding curves
    # keep-all and the floor (here the full cache itself) both lie at S_t = 1: the legend names them as one curve
    assert texts[4].startswith("on one curve (markers offset): keep-all; noise-floor")
    assert all(t.startswith("on one curve") for t in texts[4:])
    plt.close(fig)
    written = m.save(tmp_path / "out")
    assert {p.name for p in written} >= {
        "trajectories.parquet",
        "summary.csv",
        "gaps.parquet",
        "measure.json",
        "speculative.parquet",
        "speculative.csv",
    }
    assert m.plot_survival(tmp_path / "s.svg").read_text().lstrip().startswith("<?xml")
    # a press that promises compression and keeps everything stops the run
    from dataclasses import dataclass

    @dataclass
    class LyingPress(KeepAllPress):
        compression_ratio: float = 0.5

    with pytest.raises(CompressionError, match="left the cache at the full"):
        kvdiverge.measure(
            model, tokenizer, ids, {"lying": LyingPress()}, max_new_tokens=2, replicates=1, progress=False
        )


# --------------------------------------------------------------------------- README examples


def readme_blocks(language: str) -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("## Measure one press", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)


@pytest.mark.llm
def test_readme_python_example_runs(tmp_path, monkeypatch, one_torch_thread, embedded_cached):
    # embedded_cached: its load_model(EMBEDDED_MODEL) reads the session's kept conversion (tests/conftest.py)
    (code,) = readme_blocks("python")
    assert len(ast.parse(code).body) == 5  # five statements (ruff format spreads the call over lines)
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(code, "README.md", "exec"), ns)
    summary = ns["m"].summary
    assert summary["policy"].to_list() == ["knorm-50"] and summary["T"].to_list() == [16]
    assert 0.0 <= summary["p_div"][0] <= 1.0 and not summary["untouched"][0]


@pytest.mark.llm
def test_readme_cli_example_runs(tmp_path, embedded_cached):
    """The README's command line, word for word, through ``kvdiverge.doors.cli.main`` in this process
    (the embedded model read from the session's kept conversion: fixture ``embedded_cached``)."""
    (code,) = readme_blocks("bash")
    command = code.replace("\\\n", " ").strip()
    argv = shlex.split(command)
    assert argv[:3] == ["kvdiverge", "measure", "embedded"]
    start = time.perf_counter()
    res = run_main(argv[1:], tmp_path)
    print(f"\n[measure] README command-line example: {time.perf_counter() - start:.1f} s")
    assert res.returncode == 0, res.stderr[-3000:]
    summary = pl.read_parquet(tmp_path / "measure-out" / "summary.parquet")
    assert summary.height == 2 and (summary["n_docs"] == 2).all() and (summary["T"] == 16).all()
    assert (tmp_path / "measure-out" / "survival.png").exists()
