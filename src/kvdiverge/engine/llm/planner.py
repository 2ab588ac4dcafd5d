"""How many documents share one batched forward: the memory planner.

The engine decodes ``B`` documents x ``R`` replicates x 2 sides as the rows of one forward
per step (:func:`kvdiverge.engine.runner.run_policies`, :class:`kvdiverge.engine.llm.side.JointSides`;
every evicted row is as wide as its reference row). Its memory grows with the KV cache of
those rows::

    kv_bytes_per_token = layers x kv_heads x head_dim x 2 (keys and values) x dtype_bytes
    bytes_per_document = R x 2 sides x (prompt_len + 2T - 2) x kv_bytes_per_token
                       + 2 x prompt_len x kv_bytes_per_token
                       + R x 2 sides x vocab x LOGIT_BYTES_PER_ENTRY
    B = floor(memory_budget / bytes_per_document), clipped to [1, documents]

A decode-time policy counts ``3R`` rows instead of ``2R`` (the evicted side's chain lane
and replay lanes can coexist: :mod:`kvdiverge.engine.llm.decode_pair`).

``prompt_len`` is the longest prompt of the shard (every row is padded to the longest
of its batch). Every forward appends one column to every row of the batched cache, and
a rewind only masks the abandoned columns (they leave when no remaining row attends to
them), so a cache is at most ``prompt_len + 2T - 2`` columns wide
(:func:`cache_columns`): a chain that runs all ``T`` steps appends ``T - 1`` tokens, and
a branch from ``t* = 1`` then appends ``T - 1`` more. The second term is the
per-document prefill caches (the reference and the evicted one, batch 1) that are
alive while :meth:`kvdiverge.engine.llm.llm_pair.LLMKernelPair.start` merges them into
the batched caches. The third is the per-row working memory of the decoding transform
and the coupling math (float64 log-probabilities, probabilities and cumulative sums over
the vocabulary). Model weights and the prefill's activations (one document at a time,
so independent of ``B``) are not in the budget: the budget is what is left for the
batch.
"""

from __future__ import annotations

import math
from typing import Any

import torch

# the element counts are torch-free (the cost model and the config check read them): re-exported here
from kvdiverge.engine.presses.cache_facts import kv_elements_by_layer_type, kv_elements_per_token

__all__ = [
    "LOGIT_BYTES_PER_ENTRY",
    "cache_columns",
    "kv_bytes_per_token",
    "kv_elements_by_layer_type",
    "kv_elements_per_token",
    "default_memory_budget",
    "document_bytes",
    "plan_batch",
]

#: Bytes per (row, vocabulary entry) of the logits and coupling temporaries: raw logits
#: (4) plus about six float64 (B, V) tensors alive at once (48).
LOGIT_BYTES_PER_ENTRY = 52


def cache_columns(prompt_len: int, T: int) -> int:
    """The widest a batched cache gets over a run of horizon ``T``: ``prompt_len + 2T - 2`` columns.

    Parameters
    ----------
    prompt_len : int
        Longest prompt of the batch (tokens).
    T : int
        Horizon (tokens), ``>= 1``.

    Returns
    -------
    int
        Columns (tokens) of one row's cache at its widest.
    """
    return int(prompt_len) + max(2 * int(T) - 2, 0)


def document_bytes(
    *, kv_bytes_per_token: int, prompt_len: int, T: int, replicates: int, vocab_size: int, decode_time: bool = False
) -> int:
    """Bytes one document adds to a batch (module docstring for the formula; ``3R`` rows when decode-time)."""
    kv = int(kv_bytes_per_token)
    rows = int(replicates) * (3 if decode_time else 2)
    return (
        rows * (cache_columns(prompt_len, T) * kv + int(vocab_size) * LOGIT_BYTES_PER_ENTRY) + 2 * int(prompt_len) * kv
    )


def kv_bytes_per_token(model_config: Any, dtype: torch.dtype) -> int:
    """KV-cache bytes one token takes in one row: :func:`kv_elements_per_token` x dtype size.

    Parameters
    ----------
    model_config : transformers.PretrainedConfig
        See :func:`kv_elements_per_token`.
    dtype : torch.dtype
        Dtype of the cache (the model's).

    Returns
    -------
    int
        Bytes per token per row.

    Raises
    ------
    ValueError
        If the config lacks ``num_hidden_layers`` or the attention sizes.
    """
    return kv_elements_per_token(model_config) * torch.empty((), dtype=dtype).element_size()


def default_memory_budget(device: torch.device | str) -> int:
    """Bytes for the batch when the config gives no ``generation.memory_budget_gb``.

    On CUDA, 80% of the device's free memory now (after the model is loaded); elsewhere
    4 GiB, a share a laptop can spare.
    """
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(0.8 * free)
    return 4 * 2**30


def plan_batch(
    *,
    kv_bytes_per_token: int,
    prompt_len: int,
    T: int,
    replicates: int,
    vocab_size: int,
    memory_budget_bytes: int,
    documents: int,
    override: int | None = None,
    decode_time: bool = False,
) -> int:
    """Documents per batched forward ``B`` (module docstring for the formula).

    Parameters
    ----------
    kv_bytes_per_token : int
        From :func:`kv_bytes_per_token`.
    prompt_len : int
        Longest prompt of the documents to batch (tokens).
    T : int
        Horizon (tokens).
    replicates : int
        ``R``.
    vocab_size : int
        Vocabulary size ``V``.
    memory_budget_bytes : int
        Bytes the batch may take.
    documents : int
        Documents to run (``B`` never exceeds it).
    override : int, optional
        ``B`` from the config (``generation.batch_documents``); clipped to ``documents``.
    decode_time : bool
        A decode-time policy (:class:`kvdiverge.engine.llm.decode_pair.DecodeTimePair`): a
        document's evicted side can hold its chain lane (rows that left it ride along)
        and its replay lanes at once, up to ``2R`` rows, so ``3R`` rows are counted.

    Returns
    -------
    int
        ``B >= 1`` (1 also when even one document exceeds the budget).

    Raises
    ------
    ValueError
        If ``override`` is below 1.
    """
    if override is not None:
        if int(override) < 1:
            raise ValueError(f"generation.batch_documents must be >= 1 or 'auto', got {override}")
        return max(1, min(int(override), int(documents)))
    per_doc = document_bytes(
        kv_bytes_per_token=kv_bytes_per_token,
        prompt_len=prompt_len,
        T=T,
        replicates=replicates,
        vocab_size=vocab_size,
        decode_time=decode_time,
    )
    return max(1, min(int(documents), math.floor(memory_budget_bytes / per_doc)))
