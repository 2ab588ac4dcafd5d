"""benchmarks/gpu_speed.py runs (--tiny --device cpu) so that it cannot rot."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("gpu_speed", REPO / "benchmarks" / "gpu_speed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.miniature
def test_tiny_cpu_run_reports_rate_batch_and_projection(bench, tmp_path, capsys):
    out_json = tmp_path / "gpu_speed.json"
    assert (
        bench.main(
            [
                "--tiny",
                "--device",
                "cpu",
                "--docs",
                "2",
                "--prompt-tokens",
                "100",
                "--T",
                "4",
                "--R",
                "2",
                "--json",
                str(out_json),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "token-steps/s" in text and "projected for paper.yaml on one GPU" in text
    data = json.loads(out_json.read_text())
    assert [r["model"] for r in data["results"]] == ["llama-3.1-8b", "qwen-2.5-7b"]
    for r in data["results"]:
        assert r["architecture"] == "miniature" and r["B"] >= 1
        assert r["prompt_tokens"] == [90, 110]  # +-10 % around --prompt-tokens
        # chain steps + branch steps, both sides: at most 2 docs x R x 2 x (2T - 1) = 56
        assert r["token_steps_upper"] == 56 and 2 * 2 * 2 * 4 <= r["token_steps"] <= 56
        assert r["token_steps_per_s"] == pytest.approx(r["token_steps"] / r["seconds"])
    hours = data["projected_hours"]["by_token_steps"]
    rates = [r["token_steps_per_s"] for r in data["results"]]
    # paper.yaml: 28,648,704 token-steps (noise floor on both splits included), half on each model
    assert hours == pytest.approx(28_648_704 / 2 * sum(1 / x for x in rates) / 3600)


def test_random_prompts_avoid_eos(bench):
    docs = bench.make_documents(3, 50, vocab=4, eos={1, 2})
    assert [d.prompt_len for d in docs] == [45, 50, 55]
    assert all(t in (0, 3) for d in docs for t in d.input_ids)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_says_so_and_exits_0(bench, capsys):
    assert bench.main([]) == 0
    assert "CUDA is not available" in capsys.readouterr().out


@pytest.mark.miniature
def test_bfloat16_on_the_cpu_compares_the_stock_kernels(bench, tmp_path, capsys):
    out_json = tmp_path / "bf16.json"
    assert (
        bench.main(
            [
                "--tiny",
                "--device",
                "cpu",
                "--dtype",
                "bfloat16",
                "--compare-stock",
                "--docs",
                "2",
                "--prompt-tokens",
                "100",
                "--T",
                "3",
                "--R",
                "2",
                "--models",
                "qwen-2.5-7b",
                "--json",
                str(out_json),
            ]
        )
        == 0
    )
    assert "stock kernels:" in capsys.readouterr().out
    (r,) = json.loads(out_json.read_text())["results"]
    assert r["dtype"] == "bfloat16" and r["stock_seconds"] > 0
    assert r["stock_over_fast"] == pytest.approx(r["stock_seconds"] / r["seconds"])
