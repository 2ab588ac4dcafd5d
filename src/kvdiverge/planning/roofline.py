"""The study's GPU time and memory per model, predicted from the architecture (a roofline).

No GPU run of the paper's models exists yet; these are predictions to plan and request with,
from the written-out architectures (:data:`kvdiverge.models.standins.PAPER`), the config's token
counts (:func:`kvdiverge.planning.cost.study_cost`) and the planner's memory formula
(:mod:`kvdiverge.engine.llm.planner`). Replace them with a measurement as soon as there is one
(``benchmarks/gpu_speed.py``).

**FLOPs per token-step** (Kaplan et al. 2020, "Scaling Laws for Neural Language Models",
Table 1; with the attention-times-values product counted beside the query-key one, as Hoffmann
et al. 2022, "Training Compute-Optimal Large Language Models", Appendix F, do)::

    flops_per_token = 2 N + 2 d_model V + 4 n_layers n_ctx d_attn

``N`` the non-embedding weights (attention and MLP matrices), ``2 d_model V`` the logits
(the output matrix), ``d_attn`` the query heads x head dim, ``n_ctx`` the tokens attended to.

**Bytes moved per forward**: every weight once (``weights_bytes``), plus every attended key
and value of every row (``rows x n_ctx x kv_bytes_per_token``).

**Time per decode forward** of ``rows = B x R x 2`` rows (``B`` documents per forward, ``R``
replicates, two sides)::

    max(rows x flops_per_token / (peak x efficiency), bytes / (bandwidth x efficiency))

and the study's time is that, times the decode forwards of every run, plus the prefills (one
forward of ``n_prompt`` tokens each, compute-bound). ``B`` is what the planner would choose
on the accelerator: 80% of the memory left after the weights, over the planner's bytes per
document (:func:`kvdiverge.engine.llm.planner.document_bytes`), at most the 12 documents of a
shard; a shard of more documents runs in groups of at most ``B``.

**GPU memory** of a generation job: the weights, plus ``B`` x the planner's bytes per document
(KV cache of every row at its widest, ``prompt + 2T - 2`` columns, the two prefill caches and
the logits' buffer, :data:`~kvdiverge.engine.llm.planner.LOGIT_BYTES_PER_ENTRY` bytes per row and
vocabulary entry). ``B = 1`` is the least a job can run with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvdiverge.engine.llm.planner import document_bytes

__all__ = [
    "Accelerator",
    "H200",
    "ModelPrediction",
    "flops_per_token",
    "gpu_job_request",
    "kv_bytes",
    "parameter_counts",
    "predict_model",
]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: The planner's share of the free memory on CUDA (:func:`kvdiverge.engine.llm.planner.default_memory_budget`).
BUDGET_SHARE = 0.8


@dataclass(frozen=True)
class Accelerator:
    """An accelerator's dense peak throughput per dtype (FLOP/s), memory bandwidth (bytes/s) and memory (bytes)."""

    name: str
    peak_flops: dict[str, float]
    bandwidth: float
    memory: float


#: NVIDIA H200 SXM, from NVIDIA's datasheet: 67 TFLOPS float32 (no tensor cores: PyTorch's
#: default for float32 matmuls), 989 TFLOPS bfloat16/float16 dense (the datasheet's 1,979 is
#: with sparsity), 4.8 TB/s, 141 GB.
H200 = Accelerator(
    name="NVIDIA H200 SXM",
    peak_flops={"float32": 67e12, "bfloat16": 989e12, "float16": 989e12},
    bandwidth=4.8e12,
    memory=141e9,
)


def _sizes(values: dict[str, Any]) -> tuple[int, int, int, int, int, int, int]:
    d = int(values["hidden_size"])
    heads = int(values["num_attention_heads"])
    kv_heads = int(values.get("num_key_value_heads") or heads)
    head_dim = int(values.get("head_dim") or d // heads)
    return (
        d,
        heads,
        kv_heads,
        head_dim,
        int(values["intermediate_size"]),
        int(values["num_hidden_layers"]),
        int(values["vocab_size"]),
    )


def parameter_counts(values: dict[str, Any]) -> dict[str, int]:
    """Weights of a Llama-type decoder (Llama, Qwen2, Gemma 3), from its config values.

    Parameters
    ----------
    values : dict
        Config values (:data:`kvdiverge.models.standins.PAPER` entry): ``hidden_size``,
        ``num_attention_heads``, ``num_key_value_heads``, ``head_dim`` (optional),
        ``intermediate_size``, ``num_hidden_layers``, ``vocab_size``, ``tie_word_embeddings``,
        ``attention_bias``/``model_type`` (Qwen2's q/k/v biases).

    Returns
    -------
    dict
        ``non_embedding`` (attention, MLP and norm weights), ``embedding``, ``output`` (the
        logits' matrix; 0 when tied) and ``total``, in weights.
    """
    d, heads, kv_heads, head_dim, ff, layers, vocab = _sizes(values)
    attention = d * heads * head_dim * 2 + d * kv_heads * head_dim * 2
    if values.get("attention_bias") or values.get("model_type") == "qwen2":
        attention += heads * head_dim + 2 * kv_heads * head_dim
    per_layer = attention + 3 * d * ff + 2 * d
    if values.get("model_type") == "gemma3_text":  # norms after attention and MLP too, and on queries and keys
        per_layer += 2 * d + 2 * head_dim
    non_embedding = layers * per_layer + d
    embedding = vocab * d
    output = 0 if values.get("tie_word_embeddings") else vocab * d
    return {
        "non_embedding": non_embedding,
        "embedding": embedding,
        "output": output,
        "total": non_embedding + embedding + output,
    }


def flops_per_token(values: dict[str, Any], context: float) -> float:
    """Forward FLOPs of one token attending to ``context`` tokens (module docstring's formula).

    Parameters
    ----------
    values : dict
        Config values, as :func:`parameter_counts`.
    context : float
        Tokens attended to (``n_ctx``).

    Returns
    -------
    float
        FLOPs (a multiply-add counts 2).
    """
    d, heads, _, head_dim, _, layers, vocab = _sizes(values)
    n = parameter_counts(values)["non_embedding"]
    return 2.0 * n + 2.0 * d * vocab + 4.0 * layers * float(context) * heads * head_dim


def kv_bytes(values: dict[str, Any], dtype: str) -> int:
    """KV-cache bytes of one token in one row: layers x kv heads x head dim x 2 (keys, values) x dtype bytes."""
    _, _, kv_heads, head_dim, _, layers, _ = _sizes(values)
    return layers * kv_heads * head_dim * 2 * DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class ModelPrediction:
    """One model's predicted generation stage on one accelerator (:func:`predict_model`).

    Attributes
    ----------
    parameters : int
        Weights.
    weights_bytes, kv_bytes_per_token, document_bytes : int
        Memory of the weights, of one cached token in one row, of one document in a batch (planner).
    batch_documents : int
        ``B`` on the accelerator.
    gpu_memory_bytes, least_gpu_memory_bytes : int
        The job's GPU memory at that ``B``, and at ``B = 1``.
    flops_per_token_step : float
        At the mean context.
    forward_seconds : float
        One decode forward of ``B`` documents.
    bound : str
        ``"compute"`` or ``"memory"``: which term of the roofline sets the forward's time.
    hours : float
        The model's generation stage on one accelerator: decode forwards and prefills.
    teacher_hours : float
        The model's teacher-forced pass (one job, every run): the full-cache greedy continuation
        of each document (``T`` forwards of one row, memory-bound), and per document and run
        one forward over ``prompt + T`` tokens (compute-bound), the reference's once per document.
    """

    parameters: int
    weights_bytes: int
    kv_bytes_per_token: int
    document_bytes: int
    batch_documents: int
    gpu_memory_bytes: int
    least_gpu_memory_bytes: int
    flops_per_token_step: float
    forward_seconds: float
    bound: str
    hours: float
    teacher_hours: float


def predict_model(
    values: dict[str, Any],
    costs,
    *,
    dtype: str,
    prompt_mean: float,
    prompt_max: int,
    accelerator: Accelerator = H200,
    efficiency: float = 0.5,
) -> ModelPrediction:
    """Predict one model's generation stage (module docstring for the formulas).

    Parameters
    ----------
    values : dict
        The model's config values (:data:`kvdiverge.models.standins.PAPER` entry).
    costs : sequence of kvdiverge.planning.cost.RunCost
        The model's runs (:func:`kvdiverge.planning.cost.study_cost`, filtered to the model).
    dtype : str
        ``"float32"``, ``"bfloat16"`` or ``"float16"``: the weights', the cache's and the peak's.
    prompt_mean, prompt_max : float, int
        Prompt tokens: the mean (for FLOPs and bytes moved) and the longest (for memory).
    accelerator : Accelerator
        Default :data:`H200`.
    efficiency : float
        Fraction of the peak throughput and bandwidth reached, in (0, 1].

    Returns
    -------
    ModelPrediction

    Raises
    ------
    ValueError
        If ``efficiency`` is outside (0, 1], ``dtype`` unknown, or the weights and one document
        do not fit the accelerator's memory.
    """
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency must be in (0, 1], got {efficiency}")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    costs = list(costs)
    R, T = costs[0].replicates, costs[0].T
    params = parameter_counts(values)["total"]
    weights = params * DTYPE_BYTES[dtype]
    kv = kv_bytes(values, dtype)
    doc = document_bytes(
        kv_bytes_per_token=kv, prompt_len=prompt_max, T=T, replicates=R, vocab_size=values["vocab_size"]
    )
    shard_docs = max(math.ceil(c.documents / c.shards) for c in costs)
    B = min(shard_docs, int(BUDGET_SHARE * (accelerator.memory - weights) // doc))
    if B < 1:
        raise ValueError(f"{accelerator.name}: {weights / 1e9:.1f} GB of weights and one document do not fit")
    context = prompt_mean + T  # mean over a run: the cache grows from the prompt to about prompt + 2T - 2
    flops = flops_per_token(values, context)
    peak, bandwidth = accelerator.peak_flops[dtype] * efficiency, accelerator.bandwidth * efficiency

    def forward(documents: int) -> tuple[float, float]:  # (compute s, memory s) of one decode forward
        rows = documents * R * 2
        return rows * flops / peak, (weights + rows * context * kv) / bandwidth

    seconds = 0.0
    for c in costs:
        for n in _shard_sizes(c.documents, c.shards):
            for group in _shard_sizes(n, math.ceil(n / B)):
                seconds += (2 * T - 2) * max(forward(group))
        seconds += c.prefill_forwards * prompt_mean * flops_per_token(values, prompt_mean / 2) / peak
    compute_s, memory_s = forward(B)
    documents = sum(max(c.documents for c in costs if c.split == split) for split in {c.split for c in costs})
    sequence = prompt_mean + T
    teacher_s = documents * T * (weights + sequence * kv) / bandwidth  # greedy continuations
    teacher_s += (sum(c.documents for c in costs) + documents) * sequence * flops_per_token(values, sequence / 2) / peak
    return ModelPrediction(
        parameters=params,
        weights_bytes=weights,
        kv_bytes_per_token=kv,
        document_bytes=doc,
        batch_documents=B,
        gpu_memory_bytes=weights + B * doc,
        least_gpu_memory_bytes=weights + doc,
        flops_per_token_step=flops,
        forward_seconds=max(compute_s, memory_s),
        bound="compute" if compute_s >= memory_s else "memory",
        hours=seconds / 3600.0,
        teacher_hours=teacher_s / 3600.0,
    )


def _shard_sizes(documents: int, shards: int) -> list[int]:
    """Documents per shard when ``documents`` are split as evenly as possible over ``shards``."""
    base, extra = divmod(int(documents), int(shards))
    return [base + (i < extra) for i in range(int(shards)) if base + (i < extra)]


def gpu_job_request(
    prediction: ModelPrediction, shards: int, *, load_bytes_per_s: float = 0.5e9, margin: float = 10.0
) -> dict[str, dict[str, int]]:
    """SLURM requests of one generation job on a GPU, from a prediction.

    ``mem_mb`` is host memory: the weights once (they pass through host memory while they
    load) and 8 GB for the interpreter, the CUDA context and the tables, rounded up to 1,000 MB.
    ``runtime`` (minutes) is ``margin`` x (the predicted generation of one shard, or the
    teacher-forced pass, plus loading the weights at ``load_bytes_per_s`` from a shared
    filesystem), rounded up to 10 minutes: the margin is wide because the prediction has not
    met a GPU yet.

    Parameters
    ----------
    prediction : ModelPrediction
        The model's (:func:`predict_model`).
    shards : int
        Generation jobs of the model (runs x shards per run).
    load_bytes_per_s : float
        Bytes per second the weights load at (0.5 GB/s by default).
    margin : float
        Factor on the predicted time.

    Returns
    -------
    dict
        ``{"trajectories": {"mem_mb": int, "runtime": int}, "teacher_forced": {...}}``.
    """
    mem_mb = int(math.ceil((prediction.weights_bytes + 8e9) / 1e6 / 1000) * 1000)
    load_s = prediction.weights_bytes / float(load_bytes_per_s)

    def runtime(seconds: float) -> int:
        return int(math.ceil(margin * (seconds + load_s) / 60 / 10) * 10)

    return {
        "trajectories": {"mem_mb": mem_mb, "runtime": runtime(prediction.hours * 3600 / int(shards))},
        "teacher_forced": {"mem_mb": mem_mb, "runtime": runtime(prediction.teacher_hours * 3600)},
    }
