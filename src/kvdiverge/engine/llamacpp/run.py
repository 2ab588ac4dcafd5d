"""Coupled runs of llama.cpp cache policies: the trajectories frame the estimators read, and its provenance.

:func:`run_caches` runs every :class:`~kvdiverge.engine.llamacpp.caches.LlamaCache` on every document through
:class:`~kvdiverge.engine.llamacpp.pair.LlamaKernelPair` and the unchanged coupling core; the frame has
:data:`~kvdiverge.estimation.schema.TRAJECTORY_SCHEMA`, so the estimators, tables and report read it as
they read the transformers backend's. :func:`check_policies` refuses, in one sentence and before any work,
what llama.cpp cannot run (a kvpress press).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import polars as pl

from kvdiverge.engine.core.coupled import run_batch, to_frame
from kvdiverge.engine.core.sampling import Sampling
from kvdiverge.engine.llamacpp.caches import LlamaCache, refused_policy
from kvdiverge.engine.llamacpp.context import build_info, load_model
from kvdiverge.engine.llamacpp.pair import LlamaKernelPair

__all__ = ["check_policies", "provenance", "run_caches"]


def check_policies(policies: Mapping[str, Any]) -> None:
    """Refuse a policy that is not a llama.cpp cache type.

    Raises
    ------
    ValueError
        Naming the policy: kvpress presses and other engines' policies cannot run on llama.cpp.
    """
    for name, policy in policies.items():
        if not isinstance(policy, LlamaCache):
            raise ValueError(refused_policy(f"policy {name!r} ({type(policy).__name__})"))


def provenance(policies: Mapping[str, LlamaCache], threads: int) -> dict[str, Any]:
    """What changes the numbers: the llama.cpp build, each policy's cache types, rotation and flash attention, threads."""
    caches = {
        name: {"type_k": c.type_k, "type_v": c.type_v, "rotation": c.rotation, "flash_attn": c.flash_attn}
        for name, c in policies.items()
    }
    return {"backend": "llama_cpp", **build_info(), "threads": int(threads), "caches": caches}


def run_caches(
    model,
    policies: Mapping[str, LlamaCache],
    documents: Mapping[str, Sequence[int]],
    sampling: Sampling,
    threads: int,
    *,
    split: str = "llama_cpp",
    progress: Callable[[str, int], Any] | None = None,
) -> pl.DataFrame:
    """The coupled run of each policy on each document (full f16 cache against the policy's).

    Parameters
    ----------
    model : str, os.PathLike, llama_cpp.Llama or LoadedModel
        A GGUF file, a loaded ``llama_cpp.Llama`` (its weights are shared, its context unused), or a model
        :func:`kvdiverge.engine.llamacpp.context.load_model` loaded.
    policies : mapping of str to LlamaCache
        Policy name to cache; checked first (:func:`check_policies`).
    documents : mapping of str to sequence of int
        Document id to prompt tokens.
    sampling : Sampling
        ``T``, replicates, decoding, seed and model name (enters the seeds).
    threads : int
        CPU threads per llama.cpp context.
    split : str
        The ``split`` column (it enters the bootstrap's seeds).
    progress : callable, optional
        ``progress(name, total)`` returns a bar (a context manager with ``update``, e.g. tqdm's) for one
        policy, as :class:`kvdiverge.engine.runner.RunOptions`'s: its total counts the transformers runner's
        ``2T - 1`` steps per document, and it advances by a document's steps when the document is done.

    Returns
    -------
    polars.DataFrame
        One row per (policy, document, replicate), :data:`~kvdiverge.estimation.schema.TRAJECTORY_SCHEMA`;
        ``kept_len`` is the prompt length (a cache type keeps every position).
    """
    check_policies(policies)
    LlamaKernelPair.check(sampling)
    loaded = load_model(model)
    rows = []
    for name, cache in policies.items():
        with progress(name, len(documents) * (2 * sampling.T - 1)) if progress else contextlib.nullcontext() as bar:
            for doc_id, prompt in documents.items():
                start = time.perf_counter()
                pair = LlamaKernelPair(loaded, cache, prompt, sampling.T, sampling, threads)
                try:
                    records = run_batch(
                        pair, sampling.T, sampling.replicates, sampling.seed, sampling.model_name, [doc_id]
                    )
                finally:
                    pair.close()
                meta = {
                    "model": sampling.model_name,
                    "policy": name,
                    "split": split,
                    "doc_id": doc_id,
                    "prompt_len": len(prompt),
                    "kept_len": len(prompt),
                    "seconds": time.perf_counter() - start,
                }
                rows += [{**meta, **rec} for rec in records]
                if bar is not None:
                    bar.update(2 * sampling.T - 1)
    return to_frame(rows)
