"""The llama.cpp backend: exactness of the kernel pair of two llama.cpp contexts and of its teacher-forced KLD.

Small on purpose: SmolLM2's GGUF file, one prompt of 9 tokens, T <= 8, two threads.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
import torch

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (make llamacpp)")

from kvdiverge.engine.core.coupled import run_batch  # noqa: E402
from kvdiverge.engine.core.sampling import Decoding, Sampling  # noqa: E402
from kvdiverge.engine.llamacpp.caches import CACHE_TYPES, INSTALL, LlamaCache, parse_cache  # noqa: E402
from kvdiverge.engine.llamacpp.context import LlamaContext, load_model  # noqa: E402
from kvdiverge.engine.llamacpp.pair import FULL, LlamaKernelPair, forced_kld  # noqa: E402
from kvdiverge.models.embedded import EMBEDDED_MODEL  # noqa: E402
from kvdiverge.models.sources import resolve  # noqa: E402

pytestmark = pytest.mark.llm

PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 1345, 30]
THREADS = 2
T = 8


@pytest.fixture(scope="module")
def path() -> str:
    try:
        where, kwargs = resolve(EMBEDDED_MODEL)
    except Exception as exc:  # the package may be absent
        pytest.skip(f"the embedded SmolLM2 GGUF file is not installed: {exc}")
    return os.path.join(where, kwargs["gguf_file"])


@pytest.fixture(scope="module")
def model(path):
    return load_model(path)


def _reference_log_softmax(scores: np.ndarray) -> np.ndarray:
    """log-softmax by torch, independent of the backend's numpy one."""
    return torch.log_softmax(torch.from_numpy(np.asarray(scores, dtype=np.float64)), dim=-1).numpy()


class _Recording(LlamaKernelPair):
    """The pair, remembering each row's two histories and the log-distributions it returned."""

    def start(self, n_rows):
        self.tokens = [([], []) for _ in range(n_rows)]
        self.seen = []
        logp, logq = super().start(n_rows)
        self._record(logp, logq)
        return logp, logq

    def _record(self, logp, logq):
        for row, (a, b) in enumerate(self.tokens):
            self.seen.append((tuple(a), tuple(b), logp[row].numpy(), logq[row].numpy()))

    def advance(self, x, y):
        for row, (a, b) in enumerate(zip(x.tolist(), y.tolist())):
            self.tokens[row][0].append(a)
            self.tokens[row][1].append(b)
        logp, logq = super().advance(x, y)
        self._record(logp, logq)
        return logp, logq

    def rewind(self, length):
        super().rewind(length)
        for row, n in enumerate(length.tolist()):
            del self.tokens[row][0][n:], self.tokens[row][1][n:]

    def keep_rows(self, rows):
        super().keep_rows(rows)
        self.tokens = [self.tokens[i] for i in rows.tolist()]


def test_f16_control_is_exactly_zero(model):
    """f16 against f16: TV exactly 0 at every step, no divergence, and a teacher-forced KLD of exactly 0."""
    pair = LlamaKernelPair(model, FULL, PROMPT, T, Sampling(T=T, replicates=2), THREADS)
    records = run_batch(pair, T, 2, 0, "smollm2", ["d0"])
    pair.close()
    tv = np.array([r["tv"] for r in records], dtype=np.float64)
    assert tv.shape == (2, T) and np.all(tv == 0.0)
    assert all(r["t_star"] is None and r["tau_naive"] is None for r in records)
    kld = forced_kld(model, FULL, PROMPT, list(range(200, 200 + T)), THREADS)
    assert kld.shape == (T,) and np.all(kld == 0.0)


def test_greedy_full_side_is_llama_cpps_greedy_generation(model, path):
    """Greedy decoding: the chain (f16 on both sides) is what llama.cpp's own generate emits, token for token."""
    sampling = Sampling(T=T, replicates=1, decoding=Decoding(temperature=0.0))
    pair = LlamaKernelPair(model, FULL, PROMPT, T, sampling, THREADS)
    chain = run_batch(pair, T, 1, 0, "smollm2", ["d0"])[0]["chain_token"]
    pair.close()
    llm = llama_cpp.Llama(path, n_ctx=256, n_threads=THREADS, flash_attn=True, verbose=False)
    expected = []
    for token in llm.generate(PROMPT, temp=0.0, top_k=1, reset=True):
        expected.append(int(token))
        if len(expected) == T or token in model.eos_ids:
            break
    assert list(chain[: len(expected)]) == expected


def test_chain_and_branch_match_a_fresh_evaluation(model):
    """Every distribution the pair returned (chain and branch, both sides) is a fresh context's
    evaluation of the same prefix within 1e-5 in log-probability (0 on this machine's build: with flash
    attention a token's logits do not depend on the batch it is decoded in, nor on its cells' order)."""
    cache = parse_cache("q4_0")
    pair = _Recording(model, cache, PROMPT, T, Sampling(T=T, replicates=3, decoding=Decoding(temperature=1.0)), THREADS)
    records = run_batch(pair, T, 3, 1, "smollm2", ["d0"])
    pair.close()
    assert any(r["t_star"] is not None for r in records), "no branch to check"
    checked = 0
    for hist_p, hist_q, logp, logq in pair.seen[::5]:
        for c, hist, got in ((FULL, hist_p, logp), (cache, hist_q, logq)):
            ctx = LlamaContext(model, c, 256, 1, THREADS)
            fresh = _reference_log_softmax(ctx.prefill(PROMPT + list(hist))[0])
            ctx.close()
            finite = np.isfinite(fresh)
            assert np.abs(got[finite] - fresh[finite]).max() < 1e-5
            checked += 1
    assert checked >= 4


@pytest.mark.parametrize("spec", ["q4_0", "q8_0:norot"])
def test_forced_kld_equals_one_from_llama_scores(model, path, spec):
    """The teacher-forced KLD equals KL(P||Q) computed here from two ``Llama.scores`` tables."""
    cache = parse_cache(spec)
    continuation = [260, 1345, 314, 1037, 30, 504, 3458, 282]
    got = forced_kld(model, cache, PROMPT, continuation, THREADS)
    scores = []
    for c in (FULL, cache):
        before = os.environ.pop("LLAMA_ATTN_ROT_DISABLE", None)
        if not c.rotation:
            os.environ["LLAMA_ATTN_ROT_DISABLE"] = "1"
        kv = {"type_k": getattr(llama_cpp, f"GGML_TYPE_{c.type_k.upper()}"), "flash_attn": c.flash_attn}
        kv["type_v"] = getattr(llama_cpp, f"GGML_TYPE_{c.type_v.upper()}")
        llm = llama_cpp.Llama(path, n_ctx=256, n_threads=THREADS, logits_all=True, verbose=False, **kv)
        os.environ.pop("LLAMA_ATTN_ROT_DISABLE", None)
        if before is not None:
            os.environ["LLAMA_ATTN_ROT_DISABLE"] = before
        llm.eval(PROMPT + continuation[:-1])
        scores.append(_reference_log_softmax(llm.scores[len(PROMPT) - 1 : len(PROMPT) - 1 + len(continuation)]))
    logp, logq = scores
    expected = np.array([np.sum(np.exp(a) * (a - b)) for a, b in zip(logp, logq)])
    assert expected.mean() > 1e-4  # a compressed cache changes the distributions
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-7)


def test_rotation_is_per_context(model):
    """Rotation off changes q4_0's KLD and leaves the environment as it was."""
    before = os.environ.get("LLAMA_ATTN_ROT_DISABLE")
    continuation = [260, 1345, 314, 1037]
    on = forced_kld(model, LlamaCache("q4_0", "q4_0", True), PROMPT, continuation, THREADS)
    off = forced_kld(model, LlamaCache("q4_0", "q4_0", False), PROMPT, continuation, THREADS)
    assert not np.array_equal(on, off)
    assert os.environ.get("LLAMA_ATTN_ROT_DISABLE") == before


@pytest.mark.parametrize(
    ("spec", "expected"),
    [("q4_0", LlamaCache("q4_0", "q4_0", True)), ("q8_0/f16:norot", LlamaCache("q8_0", "f16", False))],
)
def test_parse_cache(spec, expected):
    assert parse_cache(spec) == expected
    assert expected.flash_attn and expected.bits == (CACHE_TYPES[expected.type_k] + CACHE_TYPES[expected.type_v]) / 2


@pytest.mark.parametrize("spec", ["q3_0", "q4_0:x", "f16/q2_k"])
def test_parse_cache_refuses(spec):
    with pytest.raises(ValueError, match="--cache"):
        parse_cache(spec)


def test_install_sentence_names_the_extra():
    assert "pip install kvdiverge[llamacpp]" in INSTALL and INSTALL.count(". ") == 0


def test_run_caches_gives_the_estimators_frame_from_a_llama_object(path):
    """A ``llama_cpp.Llama`` as the model: the frame has the trajectory schema, the f16 control's TV is 0, and
    a kvpress press is refused in one sentence before any work."""
    from kvdiverge.engine.llamacpp.run import provenance, run_caches
    from kvdiverge.estimation.schema import TRAJECTORY_SCHEMA

    llm = llama_cpp.Llama(path, n_ctx=64, n_threads=THREADS, verbose=False)
    policies = {"none": FULL, "q4_0": parse_cache("q4_0")}
    sampling = Sampling(T=4, replicates=2, model_name="smollm2")
    bars = []

    class Bar(contextlib.nullcontext):
        def __init__(self, name, total):
            super().__init__(self)
            bars.append([name, total, 0])

        def update(self, n):
            bars[-1][2] += n

    frame = run_caches(llm, policies, {"d0": PROMPT, "d1": PROMPT[:5]}, sampling, THREADS, progress=Bar)
    assert frame.schema == TRAJECTORY_SCHEMA and frame.height == 2 * 2 * 2
    assert bars == [["none", 2 * 7, 2 * 7], ["q4_0", 2 * 7, 2 * 7]]  # a bar per cache: 2 documents of 2T - 1 steps
    control = np.array(frame.filter(frame["policy"] == "none")["tv"].to_list(), dtype=np.float64)
    assert np.all(control == 0.0)
    assert provenance(policies, THREADS)["caches"]["q4_0"]["rotation"] is True
    with pytest.raises(ValueError, match="'knorm' .* cannot run on the llama_cpp backend"):
        run_caches("/nonexistent.gguf", {"knorm": object()}, {"d0": PROMPT}, sampling, THREADS)


@pytest.fixture(scope="module")
def llm(path):
    """A user's ``llama_cpp.Llama`` (the door's model), closed after the module's tests."""
    model = llama_cpp.Llama(path, n_ctx=64, n_threads=THREADS, verbose=False)
    yield model
    model.close()


def test_measure_takes_a_llama_and_cache_types_and_runs_the_engines_coupled_run(llm):
    """``kvdiverge.measure`` with a ``llama_cpp.Llama`` and cache policies: the trajectories are
    :func:`run_caches`' own, the f16 control's divergence is exactly 0, and the settings record what
    changes the numbers."""
    import kvdiverge
    from kvdiverge.engine.llamacpp.run import run_caches

    policies = {"f16": FULL, "q4_0": parse_cache("q4_0"), "q4_0:norot": parse_cache("q4_0:norot")}
    prompts = {"d0": PROMPT, "d1": PROMPT[:6]}
    with pytest.warns(UserWarning, match="press 'f16' left the cache untouched"):
        m = kvdiverge.measure(llm, None, prompts, policies, max_new_tokens=4, replicates=2, seed=3, bootstrap=20,
                              split="test", progress=False)  # fmt: skip
    sampling = Sampling(T=4, replicates=2, seed=3, model_name="SmolLM2-135M-Instruct.Q4_1",
                        decoding=Decoding(temperature=0.7, top_p=0.95, eos_ids=m.eos_ids))  # fmt: skip
    again = run_caches(llm, policies, prompts, sampling, THREADS, split="test")
    assert m.trajectories.drop("seconds").equals(again.drop("seconds"))
    summary = {r["policy"]: r for r in m.summary.iter_rows(named=True)}
    assert summary["f16"]["p_div"] == 0.0 and summary["f16"]["E_M"] == 0.0
    # the cache types on the KV-bytes axis: SmolLM2 caches 30 x 3 x (64 + 64) = 11,520 elements per token,
    # in 2 bytes at f16 and ggml's 18 bytes per 32 elements at q4_0, every prompt position kept
    frontier = {r["policy"]: r for r in m.frontier().iter_rows(named=True)}
    assert {n: (r["bits_per_element"], r["kv_bytes_per_token"]) for n, r in frontier.items()} == {
        "f16": (16.0, 23040.0), "q4_0": (4.5, 6480.0), "q4_0:norot": (4.5, 6480.0)
    }  # fmt: skip
    assert {n: r["E_M"] for n, r in frontier.items()} == {n: r["E_M"] for n, r in summary.items()}
    assert m.settings.presses["q4_0:norot"] == {
        "backend": "llama_cpp", "llama_cpp_python": llama_cpp.__version__, "threads": THREADS,
        "type_k": "q4_0", "type_v": "q4_0", "rotation": False, "flash_attn": True,
    }  # fmt: skip


@pytest.mark.parametrize(
    "settings, sentence",
    [
        (
            {"ratios": [0.5]},
            "ratios: the llama_cpp backend runs the coupled measurement of KV cache types, not a "
            "frontier of ratios or budgets (kvpress presses); leave ratios out with llama.cpp cache "
            "policies",
        ),  # fmt: skip
        ({"task": "niah"}, "task: the llama_cpp backend runs the coupled measurement of KV cache types, not a task"),
        (
            {"teacher_tokens": 8},
            "teacher_tokens: the llama_cpp backend runs the coupled measurement of KV cache "
            "types, not the teacher-forced pass",
        ),  # fmt: skip
        (
            {"presses": {"q4_0": parse_cache("q4_0"), "knorm": {"press": "KnormPress", "compression_ratio": 0.5}}},
            "policy 'knorm' (dict) cannot run on the llama_cpp backend",
        ),  # fmt: skip
        ({"model": object()}, "model: llama.cpp cache policies (q4_0) run on a llama_cpp.Llama, got object"),
        (
            {"eos_ids": [10**6]},
            "eos_ids: token ids 1000000 are outside the model's vocabulary; allowed: integers from 0 to 49151",
        ),  # fmt: skip
        (
            {"prompts": [[1, 10**6]]},
            "prompt 'prompt-0': token ids 1000000 are outside the model's vocabulary; "
            "allowed: integers from 0 to 49151",
        ),  # fmt: skip
    ],
)
def test_measure_refuses_what_the_llama_cpp_backend_cannot_run_before_any_forward(llm, settings, sentence):
    import kvdiverge

    args = {"model": llm, "prompts": [PROMPT], "presses": {"q4_0": parse_cache("q4_0")}}
    args |= {k: settings.pop(k) for k in list(settings) if k in args}
    with pytest.raises(ValueError) as err:
        kvdiverge.measure(args["model"], None, args["prompts"], args["presses"], progress=False, **settings)
    assert str(err.value).startswith(sentence)


def test_the_command_line_measures_cache_types_against_f16_on_the_embedded_gguf(capsys):
    from kvdiverge.doors.cli import main

    code = main(["measure", "embedded", "--sotu", "1", "--backend", "llama_cpp", "--cache", "q8_0", "--cache",
                 "q4_0:norot", "-T", "4", "-R", "2", "--threads", str(THREADS), "--bootstrap", "20", "--quiet"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("f16 ", "q8_0 ", "q4_0"))}
    assert list(rows) == ["f16", "q8_0", "q4_0:norot"]
    assert rows["f16"][1:5] == ["1", "100%*", "0", "[0,"]  # the control: one prompt, every position, p_div 0


@pytest.mark.parametrize(
    "arguments, sentence",
    [
        (["--cache", "q4_0", "--press", "KnormPress"], "--press is a kvpress option: leave it out"),
        (["--cache", "q4_0", "--ratios", "0.5"], "--ratios is a kvpress option: leave it out"),
        ([], "give at least one --cache"),
        (["--cache", "q3_0"], "--cache 'q3_0': cache types must be among f16, q8_0"),
    ],
)
def test_the_command_line_refuses_what_llama_cpp_does_not_run_before_the_model_loads(capsys, arguments, sentence):
    from kvdiverge.doors.cli import main

    code = main(["measure", "embedded", "--sotu", "1", "--backend", "llama_cpp", *arguments])
    assert code == 2 and sentence in capsys.readouterr().err


def test_gemmas_sliding_window_layers_rewind_exactly_past_the_window():
    """Gemma 3 270M in llama.cpp: 15 of its 18 layers attend to the last 512 positions. llama.cpp caches them
    in a full-size cache of their own (its default ``swa_full``) and masks each query to its window. On a
    prompt of 700 tokens, past the window, every chain and branch distribution of the pair equals a fresh
    context that prefills the prompt and decodes the same tokens one at a time, as llama.cpp generates,
    rewound branches included. (A fresh prefill of the whole prefix in one batch is not the reference here:
    llama.cpp's Gemma 3 path on the CPU gives a one-token decode other logits than the same position in a
    multi-token batch, up to 0.5 nats apart in log-probability on this prompt.)"""
    try:
        from kvdiverge.models.embedded import EMBEDDED_MODELS
        from kvdiverge.models.sources import gguf_path

        entry = next(m for m in EMBEDDED_MODELS if m.name == "gemma3-270m").entry
        gemma = load_model(gguf_path(entry, "gemma3-270m"))
    except Exception as exc:  # the chunk packages may be absent
        pytest.skip(f"the embedded Gemma 3 GGUF file is not installed: {exc}")
    prompt = [2] + np.random.default_rng(0).integers(1000, 20000, 699).tolist()
    cache = parse_cache("q8_0")
    sampling = Sampling(T=T, replicates=2, decoding=Decoding(temperature=1.0))
    pair = _Recording(gemma, cache, prompt, T, sampling, THREADS)
    records = run_batch(pair, T, 2, 1, "gemma", ["d0"])
    pair.close()
    assert any(r["t_star"] is not None for r in records), "no branch to check"
    checked = 0
    for hist_p, hist_q, logp, logq in pair.seen[1::4]:
        for c, hist, got in ((FULL, hist_p, logp), (cache, hist_q, logq)):
            ctx = LlamaContext(gemma, c, 1024, 1, THREADS)
            logits = ctx.prefill(prompt)[0]
            for i, token in enumerate(hist):
                logits = ctx.decode([token], [0], [len(prompt) + i], [True])[0]
            ctx.close()
            fresh = _reference_log_softmax(logits)
            finite = np.isfinite(fresh)
            assert np.abs(got[finite] - fresh[finite]).max() < 1e-5
            checked += 1
    assert checked >= 4


def _tiny_workflow_config() -> dict:
    """config/llamacpp.yaml cut down: SmolLM2 alone, q4_0 and the f16 control on 2 + 1 short documents, T 4, R 2."""
    import yaml

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "config", "llamacpp.yaml"), encoding="utf-8") as fh:
        config = yaml.safe_load(fh)
    config["models"] = {"smollm2-135m": config["models"]["smollm2-135m"]}
    config["policies"] = {k: config["policies"][k] for k in ("none", "q4_0")}
    config["corpus"].update(min_words=150, max_words=250, documents={"exploratory": 2, "confirmatory": 1})
    config["runs"] = {"exploratory": ["q4_0"], "confirmatory": ["q4_0"],
                      "control": {"policy": "none", "split": "exploratory", "documents": 2}}  # fmt: skip
    config["decoding"]["max_new_tokens"], config["replicates"], config["shards"] = 4, 2, 1
    config["confirmatory"].update(early=[1, 1], late=[2, 3])
    config["analysis"] = {"bootstrap": 50, "confidence": 0.95, "gaps": []}
    config["results_dir"] = "results-llamacpp-tiny"
    return config


@pytest.mark.workflow
@pytest.mark.long
def test_the_workflow_runs_llama_cpps_cache_types_to_the_pooled_tables(path, tmp_path):
    """A llama_cpp config through ``snakemake`` to the pooled tables: no conversion, the f16 control exactly 0 at
    every step, q4_0's shard equal to :func:`run_caches` on the same documents, and each shard's provenance
    recording the llama.cpp build, the cache, the rotation and the job's threads."""
    import subprocess
    import sys

    import polars as pl
    import yaml

    from kvdiverge.config.provenance import read_provenance
    from kvdiverge.config.workflow import load_config
    from kvdiverge.engine.llamacpp.run import run_caches
    from kvdiverge.jobs.documents import select_documents
    from kvdiverge.settings.checks import config_sampling

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    configfile = tmp_path / "llamacpp-tiny.yaml"
    configfile.write_text(yaml.safe_dump(_tiny_workflow_config()))
    results = tmp_path / "results-llamacpp-tiny"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.join(root, "src"),
                                                                       os.environ.get("PYTHONPATH")]))}  # fmt: skip
    run = subprocess.run(
        [sys.executable, "-m", "snakemake", "--snakefile", os.path.join(root, "Snakefile"), "--cores", "2",
         "--configfile", str(configfile), "--directory", str(tmp_path), "results-llamacpp-tiny/analysis/pooled.parquet"],
        cwd=tmp_path, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    assert not (results / "models").exists()  # the GGUF file runs as it is
    shards = results / "trajectories" / "smollm2-135m"
    control = pl.read_parquet(shards / "none" / "exploratory" / "shard-0.parquet")
    assert control.height == 2 * 2
    assert all(np.all(np.asarray(tv, dtype=np.float64) == 0.0) for tv in control["tv"].to_list())
    pooled = pl.read_parquet(results / "analysis" / "pooled.parquet").filter(pl.col("policy") == "none")
    assert pooled.height == 1 and pooled["p_div"].to_list() == [0.0]

    config = load_config(configfile)
    prompts = select_documents(pl.read_parquet(results / "prompts" / "smollm2-135m.parquet"), "exploratory", 1, 0, None)
    documents = {r["doc_id"]: list(r["input_ids"]) for r in prompts.iter_rows(named=True)}
    model = load_model(path)
    sampling = config_sampling(config, "smollm2-135m")
    sampling = sampling.replace(decoding=sampling.decoding.replace(eos_ids=model.eos_ids))
    again = run_caches(model, {"q4_0": parse_cache("q4_0")}, documents, sampling, 1, split="exploratory")
    shard = shards / "q4_0" / "exploratory" / "shard-0.parquet"
    assert pl.read_parquet(shard).drop("seconds").equals(again.drop("seconds"))

    recorded = read_provenance(shard)
    assert recorded.settings["policy"] == {"cache": "llama_cpp", "type_k": "q4_0", "type_v": "q4_0"}
    assert recorded.batch == {"batch_documents": 1} and recorded.eos == {"eos_ids": sorted(model.eos_ids)}
    assert {k: v for k, v in recorded.backend.items() if k != "system_info"} == {
        "backend": "llama_cpp", "llama_cpp_python": llama_cpp.__version__, "threads": 1,
        "caches": {"q4_0": {"type_k": "q4_0", "type_v": "q4_0", "rotation": True, "flash_attn": True}},
    }  # fmt: skip
    assert recorded.backend["system_info"]
