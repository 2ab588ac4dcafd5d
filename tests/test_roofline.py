"""The GPU prediction's parts: weights counted as the built models hold them, FLOPs and bytes by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdiverge.config.workflow import load_config
from kvdiverge.models.standins import MINIATURE, PAPER
from kvdiverge.planning.cost import study_cost
from kvdiverge.planning.roofline import H200, Accelerator, flops_per_token, kv_bytes, parameter_counts, predict_model

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("arch", sorted(MINIATURE))
def test_the_weights_counted_are_the_built_models(arch):
    from kvdiverge.models.standins import random_model

    model = random_model(MINIATURE[arch])
    assert parameter_counts(MINIATURE[arch])["total"] == sum(p.numel() for p in model.parameters())


def test_the_paper_models_have_their_published_sizes():
    # Llama-3.1-8B: 8,030,261,248 weights; Qwen2.5-7B: 7.61 B (its model card)
    assert parameter_counts(PAPER["llama-3.1-8b"])["total"] == 8_030_261_248
    assert parameter_counts(PAPER["qwen-2.5-7b"])["total"] == 7_615_616_512
    assert kv_bytes(PAPER["llama-3.1-8b"], "float32") == 32 * 8 * 128 * 2 * 4
    assert kv_bytes(PAPER["qwen-2.5-7b"], "bfloat16") == 28 * 4 * 128 * 2 * 2


TOY = {
    "model_type": "llama",
    "hidden_size": 8,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 16,
    "num_hidden_layers": 1,
    "vocab_size": 10,
    "tie_word_embeddings": False,
}


def test_flops_per_token_by_hand():
    # attention: q and o 8x8 each, k and v 8x4 each = 192; MLP 3 x 8 x 16 = 384; two norms 16; final norm 8
    assert parameter_counts(TOY) == {"non_embedding": 600, "embedding": 80, "output": 80, "total": 760}
    # 2 x 600 + 2 x 8 x 10 + 4 x 1 layer x 5 tokens x 8 (2 heads x head dim 4)
    assert flops_per_token(TOY, 5) == 1200 + 160 + 160


def test_a_toy_prediction_by_hand():
    # one run: 2 documents in 1 shard, R 1, T 2; float32 weights 760 x 4 = 3,040 bytes; kv 1 x 1 x 4 x 2 x 4 = 32
    [cost] = [c for c in study_cost(_toy_config()) if (c.model, c.policy) == ("llama-3.1-8b", "snapkv-50")]
    gpu = Accelerator("toy", {"float32": 1e6}, bandwidth=1e5, memory=3040 + 2 * 10_000)
    p = predict_model(TOY, [cost], dtype="float32", prompt_mean=4, prompt_max=4, accelerator=gpu, efficiency=1.0)
    # planner: rows 2 x (4 + 2) x 32 + 10 x 52 x 2 rows + 2 x 4 x 32 = 384 + 1,040 + 256 = 1,680 bytes
    assert p.document_bytes == 1680 and p.batch_documents == 2  # 0.8 x 20,000 // 1,680 = 9, at most 2
    # forward of 2 documents = 4 rows at context 4 + 2 = 6: compute 4 x (1200 + 160 + 192) / 1e6 = 6.2 ms;
    # memory (3,040 + 4 x 6 x 32) / 1e5 = 38 ms: memory-bound
    assert p.flops_per_token_step == 1200 + 160 + 4 * 6 * 8
    assert p.bound == "memory" and p.forward_seconds == pytest.approx((3040 + 4 * 6 * 32) / 1e5)
    # 2T - 2 = 2 decode forwards, plus 2 documents' prefills of 4 tokens at context 2
    prefill = cost.prefill_forwards * 4 * flops_per_token(TOY, 2) / 1e6
    assert p.hours * 3600 == pytest.approx(2 * p.forward_seconds + prefill)
    # teacher-forced: 2 greedy continuations of T = 2 one-row forwards (weights + 6 cached tokens),
    # then 2 documents x (1 run + the reference) forwards over 6 tokens at context 3
    greedy = 2 * 2 * (3040 + 6 * 32) / 1e5
    assert p.teacher_hours * 3600 == pytest.approx(greedy + 4 * 6 * flops_per_token(TOY, 3) / 1e6)


def _toy_config() -> dict:
    config = load_config(REPO / "config" / "paper.yaml")
    config["corpus"]["documents"] = {"exploratory": 2, "confirmatory": 2}
    config.update(shards=1, replicates=1)
    config["decoding"]["max_new_tokens"] = 2
    return config


def test_the_paper_fits_an_h200_in_float32_with_ten_documents_per_forward():
    config = load_config(REPO / "config" / "paper.yaml")
    costs = [c for c in study_cost(config) if c.model == "llama-3.1-8b"]
    p = predict_model(PAPER["llama-3.1-8b"], costs, dtype="float32", prompt_mean=830, prompt_max=1230)
    assert p.weights_bytes == 8_030_261_248 * 4
    # planner's bytes per document: 16 rows x (1230 + 510) x 262,144 + 16 x 128,256 x 52 + 2 x 1230 x 262,144
    assert p.document_bytes == 16 * 1740 * 262144 + 16 * 128256 * 52 + 2 * 1230 * 262144
    assert p.batch_documents == int(0.8 * (H200.memory - p.weights_bytes) // p.document_bytes) == 10
    assert p.bound == "compute"


def test_bad_input_is_named():
    config = load_config(REPO / "config" / "paper.yaml")
    costs = [c for c in study_cost(config) if c.model == "llama-3.1-8b"]
    with pytest.raises(ValueError, match="efficiency must be in"):
        predict_model(PAPER["llama-3.1-8b"], costs, dtype="float32", prompt_mean=1, prompt_max=1, efficiency=0)
    small = Accelerator("small", {"float32": 1e12}, bandwidth=1e12, memory=16e9)
    with pytest.raises(ValueError, match="small: 32.1 GB of weights and one document do not fit"):
        predict_model(PAPER["llama-3.1-8b"], costs, dtype="float32", prompt_mean=1, prompt_max=1, accelerator=small)


def test_the_workflows_gpu_requests_are_the_predictions():
    """common.smk's GPU_REQUESTS: the largest over config/paper.yaml's models of gpu_job_request."""
    import ast
    import re

    from kvdiverge.planning.roofline import gpu_job_request

    text = (REPO / "workflow" / "rules" / "common.smk").read_text()
    written = ast.literal_eval(re.search(r"^GPU_REQUESTS = (\{.*\})$", text, re.M).group(1))
    config = load_config(REPO / "config" / "paper.yaml")
    costs = study_cost(config)
    requests = []
    for name, entry in config["models"].items():
        runs = [c for c in costs if c.model == name]
        p = predict_model(PAPER[name], runs, dtype=entry["dtype"], prompt_mean=830, prompt_max=1230)
        requests.append(gpu_job_request(p, sum(c.shards for c in runs)))
    assert written == {
        rule: {key: max(r[rule][key] for r in requests) for key in ("mem_mb", "runtime")} for rule in written
    }
