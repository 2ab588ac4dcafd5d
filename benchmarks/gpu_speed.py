"""GPU benchmark: one paper-sized shard on the exact paper architectures, random weights.

Builds Llama-3.1-8B and Qwen2.5-7B (architectures written out in
:mod:`kvdiverge.models.standins`, no download) with random weights in the config's dtype
(paper.yaml: float32) on the GPU,
runs one shard of ``config/paper.yaml`` size through the engine
(:func:`kvdiverge.engine.runner.run_documents`: 12 documents of about 1200 random tokens,
``R = 8``, ``T = 256``, the ``snapkv-50`` policy) and prints, per model:

- token-steps/s (one token-step = one next-token distribution of one row on one side;
  counted from what the engine did: chain steps + branch steps, both sides);
- peak GPU memory;
- the documents per forward ``B`` (``kvdiverge.engine.llm.planner.plan_batch`` where the engine
  batches documents, with the arguments the runner gives it; else 1);
- the projected hours of the whole ``config/paper.yaml`` generation stage on one GPU:
  the config's token-steps (:mod:`kvdiverge.planning.cost`, upper bound ``2T - 1`` steps per side)
  divided by the measured rate of each model.

With ``--compare-stock`` the same shard runs a second time on the engine's stock kernels
(transformers' ``DynamicCache`` and ``sdpa`` attention with repeated keys and values,
:func:`kvdiverge.engine.llm.pair_base.stock_kernels`) and the ratio of the two times is
printed: the engine's decoding kernels (caches written in place, grouped attention without
``repeat_kv``) are the same code on CUDA and CPU, in float32 and bfloat16.

Random weights give near-uniform next-token distributions, so chains rarely stop early and
the top-p nucleus is large: the decoding transform works harder than on a trained model,
and the measured rate is, if anything, pessimistic.

    python benchmarks/gpu_speed.py                       # both models on cuda
    python benchmarks/gpu_speed.py --models qwen-2.5-7b --json results/gpu_speed.json
    python benchmarks/gpu_speed.py --tiny --device cpu   # miniatures on the CPU (what the tests run)
    python benchmarks/gpu_speed.py --compare-stock --dtype bfloat16   # also the stock kernels, bfloat16

Without CUDA (and without ``--device cpu``) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kvdiverge.config.workflow import load_config
from kvdiverge.engine.core.sampling import Decoding, Sampling
from kvdiverge.engine.llm.pair_base import stock_kernels
from kvdiverge.engine.presses.policies import Policy
from kvdiverge.engine.runner import Document, RunOptions, run_documents
from kvdiverge.models.standins import MINIATURE, PAPER, random_model
from kvdiverge.planning.cost import study_cost

REPO = Path(__file__).resolve().parents[1]


def make_documents(n: int, tokens: int, vocab: int, eos: set[int], seed: int = 0) -> list[Document]:
    """``n`` documents of random token ids, lengths spread over ``tokens`` +- 10 %."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [round(tokens * (0.9 + 0.2 * i / max(n - 1, 1))) for i in range(n)]
    fill = next(t for t in range(vocab) if t not in eos)
    stop = torch.tensor(sorted(eos), dtype=torch.long)
    docs = []
    for i, length in enumerate(lengths):
        ids = torch.randint(0, vocab, (length,), generator=gen)
        ids[torch.isin(ids, stop)] = fill  # no EOS inside a prompt
        docs.append(Document(f"bench-{i:02d}", ids.tolist()))
    return docs


def plan(model, docs: list[Document], R: int, T: int, budget_gb: float | None, override: int | None) -> tuple[int, str]:
    """Documents per forward ``B`` as the engine will choose them, and where ``B`` comes from.

    ``kvdiverge.engine.llm.planner.plan_batch`` with the arguments the runner gives it (matched by
    name; a planner this script cannot call falls back to ``override`` or 1).
    """
    try:
        from kvdiverge.engine.llm import planner
    except ImportError:
        return override or 1, "no kvdiverge.engine.llm.planner"
    param = next(model.parameters())
    lens = [d.prompt_len for d in docs]
    known: dict[str, Any] = {
        "prompt_len": max(lens),
        "prompt_lens": lens,
        "T": T,
        "replicates": R,
        "vocab_size": int(model.config.vocab_size),
        "documents": len(docs),
        "override": override,
        "model_config": model.config,
        "dtype": param.dtype,
        "device": param.device,
        "memory_budget_gb": budget_gb,
    }
    if hasattr(planner, "kv_bytes_per_token"):
        known["kv_bytes_per_token"] = planner.kv_bytes_per_token(model.config, param.dtype)
    if budget_gb is not None:
        known["memory_budget_bytes"] = int(budget_gb * 2**30)
    elif hasattr(planner, "default_memory_budget"):
        known["memory_budget_bytes"] = planner.default_memory_budget(param.device)
    params = inspect.signature(planner.plan_batch).parameters
    kwargs = {k: known[k] for k in params if k in known}
    missing = [
        k
        for k, p in params.items()
        if p.default is inspect.Parameter.empty and k not in kwargs and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    ]
    if missing:
        return override or 1, f"plan_batch needs {missing}"
    return max(1, int(planner.plan_batch(**kwargs))), "kvdiverge.engine.llm.planner.plan_batch"


def engine_steps(records: list[dict[str, Any]]) -> int:
    """Token-steps the engine did: per record (chain steps + branch steps) x 2 sides."""
    steps = 0
    for r in records:
        chain = sum(1 for v in r["tv"] if v == v)  # NaN after a stopped chain
        steps += 2 * (chain + len(r["branch_tv"]))
    return steps


def bench_model(name: str, args, config: dict[str, Any]) -> dict[str, Any]:
    values = MINIATURE[name] if args.tiny else PAPER[name]
    # default: the config's dtype for this model on cuda (paper.yaml: float32, see the README's
    # "Numerical noise floor"), float32 on the CPU
    config_dtype = (config.get("models", {}).get(name) or {}).get("dtype", "float32")
    dtype = args.dtype or (config_dtype if str(args.device).startswith("cuda") else "float32")
    cuda = str(args.device).startswith("cuda")
    t0 = time.perf_counter()
    model = random_model(
        values,
        dtype=dtype,
        device=args.device,
        seed=0,
        attn_implementation=args.attn,
        initializer_range=0.1 if args.tiny else 0.02,
    )
    build_s = time.perf_counter() - t0
    n_params = sum(p.numel() for p in model.parameters())
    eos = set(model.generation_config.eos_token_id)
    docs = make_documents(args.docs, args.prompt_tokens, model.config.vocab_size, eos)
    policy = Policy.from_config(args.policy, config["policies"][args.policy])
    B, why = plan(model, docs, args.R, args.T, args.memory_budget_gb, args.batch_documents)
    sampling = Sampling(
        T=args.T, replicates=args.R, decoding=Decoding(temperature=0.7, top_p=0.95), seed=1, model_name=name
    )
    common = {"sampling": sampling, "options": RunOptions(batch_documents=B, memory_budget_gb=args.memory_budget_gb)}
    # warm-up (kernels, allocator): one short document, not timed
    run_documents(model, docs[:1], policy, sampling.replace(T=min(4, args.T)), common["options"])
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    seconds, records = timed_run(model, docs, policy, args.T, common, cuda)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    stock_s = None
    if args.compare_stock:
        with stock_kernels():
            stock_s, _ = timed_run(model, docs, policy, args.T, common, cuda)
    steps = engine_steps(records)
    out = {
        "model": name,
        "architecture": "miniature" if args.tiny else "exact",
        "parameters": n_params,
        "dtype": dtype,
        "device": str(args.device),
        "attn": args.attn,
        "policy": args.policy,
        "documents": len(docs),
        "prompt_tokens": [d.prompt_len for d in docs],
        "R": args.R,
        "T": args.T,
        "B": B,
        "B_source": why,
        "build_s": build_s,
        "seconds": seconds,
        "token_steps": steps,
        "token_steps_upper": len(docs) * args.R * 2 * (2 * args.T - 1),
        "token_steps_per_s": steps / seconds,
        "seconds_per_document": seconds / len(docs),
        "peak_gpu_gb": peak,
        "stock_seconds": stock_s,
        "stock_over_fast": None if stock_s is None else stock_s / seconds,
    }
    del model, records
    if cuda:
        torch.cuda.empty_cache()
    return out


def timed_run(model, docs, policy, T: int, common: dict[str, Any], cuda: bool) -> tuple[float, list]:
    """Seconds of one engine run over ``docs`` (CUDA synchronized at both ends), and its records."""
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    records = run_documents(model, docs, policy, common["sampling"].replace(T=T), common["options"])
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0, records


def project(config: dict[str, Any], results: list[dict[str, Any]]) -> dict[str, float]:
    """Hours of the config's generation stage on one GPU at the measured rates.

    ``by_token_steps``: per model, the config's upper-bound token-steps / its measured rate.
    ``by_documents``: per model, the config's document runs x measured seconds per document.
    A model of the config that was not measured takes the mean of the measured ones.
    """
    rate = {r["model"]: r["token_steps_per_s"] for r in results}
    per_doc = {r["model"]: r["seconds_per_document"] for r in results}
    mean_rate = sum(rate.values()) / len(rate)
    mean_doc = sum(per_doc.values()) / len(per_doc)
    steps_h = docs_h = 0.0
    for c in study_cost(config, batch_documents=1):
        steps_h += c.token_steps / rate.get(c.model, mean_rate) / 3600
        docs_h += c.documents * per_doc.get(c.model, mean_doc) / 3600
    return {"by_token_steps": steps_h, "by_documents": docs_h}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(PAPER), choices=list(PAPER))
    ap.add_argument(
        "--config",
        default=str(REPO / "config" / "paper.yaml"),
        help="config whose policy is run and whose cost is projected",
    )
    ap.add_argument("--policy", default="snapkv-50")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: the config's model dtype on cuda, float32 on cpu")
    ap.add_argument("--attn", default="sdpa", help="attn_implementation (sdpa, eager, flash_attention_2)")
    ap.add_argument(
        "--tiny",
        action="store_true",
        help="miniature architectures (kvdiverge.models.standins.MINIATURE), small defaults",
    )
    ap.add_argument("--docs", type=int, default=None, help="documents in the shard (default 12; tiny 2)")
    ap.add_argument("--prompt-tokens", type=int, default=None, help="mean prompt length (default 1200; tiny 150)")
    ap.add_argument("--R", type=int, default=None, help="replicates (default 8; tiny 2)")
    ap.add_argument("--T", type=int, default=None, help="horizon (default 256; tiny 4)")
    ap.add_argument(
        "--batch-documents", type=int, default=None, help="documents per forward, passed to the planner as its override"
    )
    ap.add_argument("--memory-budget-gb", type=float, default=None, help="passed to the planner")
    ap.add_argument(
        "--compare-stock",
        action="store_true",
        help="also run the shard on the stock kernels (DynamicCache, sdpa with repeat_kv) and print the ratio",
    )
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    small = args.tiny
    args.docs = args.docs or (2 if small else 12)
    args.prompt_tokens = args.prompt_tokens or (150 if small else 1200)
    args.R = args.R or (2 if small else 8)
    args.T = args.T or (4 if small else 256)

    if str(args.device).startswith("cuda") and not torch.cuda.is_available():
        print(
            f"CUDA is not available (torch {torch.__version__}, CUDA build {torch.version.cuda}): "
            f"nothing to benchmark. Run on a GPU machine, or use --tiny --device cpu."
        )
        return 0
    if str(args.device).startswith("cuda"):
        print(f"device: {torch.cuda.get_device_name(args.device)}, torch {torch.__version__}")
    config = load_config(args.config)
    if args.policy not in config["policies"]:
        ap.error(
            f"--policy {args.policy!r} is not a policy of {args.config} (policies: {', '.join(config['policies'])})"
        )
    results = []
    for name in args.models:
        res = bench_model(name, args, config)
        results.append(res)
        print(
            f"{name} ({res['architecture']}, {res['parameters'] / 1e6:,.1f} M parameters, {res['dtype']}): "
            f"{res['documents']} docs x ~{args.prompt_tokens} tokens, R={args.R}, T={args.T}, B={res['B']} "
            f"({res['B_source']})",
            flush=True,
        )
    head = (
        f"{'model':<14}{'B':>3}{'seconds':>10}{'token-steps':>13}{'token-steps/s':>15}{'s/doc':>8}{'peak GPU GB':>13}"
    )
    print("\n" + head + "\n" + "-" * len(head))
    for r in results:
        peak = f"{r['peak_gpu_gb']:.1f}" if r["peak_gpu_gb"] is not None else "-"
        print(
            f"{r['model']:<14}{r['B']:>3}{r['seconds']:>10.1f}{r['token_steps']:>13,}"
            f"{r['token_steps_per_s']:>15,.0f}{r['seconds_per_document']:>8.2f}{peak:>13}"
        )
        if r["stock_seconds"] is not None:
            print(f"{'':<14}stock kernels: {r['stock_seconds']:.1f} s, {r['stock_over_fast']:.2f}x the engine's time")
    hours = project(config, results)
    total = sum(c.token_steps for c in study_cost(config, batch_documents=1))
    print(
        f"\nprojected for {Path(args.config).name} on one GPU: {hours['by_token_steps']:.2f} h "
        f"({total:,} token-steps, upper bound, at the measured rates); "
        f"{hours['by_documents']:.2f} h by seconds per document"
    )
    if math.isfinite(hours["by_token_steps"]) and args.tiny:
        print("(--tiny: miniature architectures, the projection says nothing about a GPU)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"results": results, "projected_hours": hours}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
