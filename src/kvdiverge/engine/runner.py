"""The one path from (model, documents, press) to trajectory records.

Both doors call :func:`run_documents`: the workflow (``kvdiverge.study.shard.run_shard``,
one shard of one (model, policy, split)) and the Python/command-line front door
(``kvdiverge.measure``). Batching, device placement and progress live here or below
(:mod:`kvdiverge.engine.core.pairs`, :mod:`kvdiverge.engine.core.coupled`), never in the doors.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tqdm.auto import tqdm

__all__ = ["Document", "PressSource", "build_pair", "plan_documents", "run_documents"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Document:
    """One prompt to run.

    Parameters
    ----------
    doc_id : str
        Document id; enters the seeds of the uniform streams.
    input_ids : sequence of int
        Chat-rendered prompt token ids (tokens), used as they are.
    """

    doc_id: str
    input_ids: Sequence[int]

    @property
    def prompt_len(self) -> int:
        """Prompt length (tokens)."""
        return len(self.input_ids)


class PressSource(Protocol):
    """What the runner needs of a policy: a press per prompt length, and the kept count.

    ``expected_kept`` returns an int (every layer and head keeps that many), a
    :class:`kvdiverge.engine.presses.promises.KeptPromise`, or ``None``.

    :class:`kvdiverge.engine.presses.policies.Policy` implements it.
    """

    name: str

    def build_press(self, prompt_len: int) -> Any: ...

    def expected_kept(self, prompt_len: int, press: Any) -> Any: ...


def plan_documents(
    model,
    documents: Sequence[Document],
    *,
    T: int,
    replicates: int,
    batch_documents: int | None = None,
    memory_budget_gb: float | None = None,
    decode_time: bool = False,
) -> int:
    """Documents per batched forward ``B`` for running ``documents`` on ``model``.

    Reads the device's free memory once (when ``memory_budget_gb`` is None); a caller
    that runs the same documents under several policies plans once and passes the
    result as ``batch_documents`` to each :func:`run_documents`, so every policy runs
    in the same batches.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        The model (its config gives the KV bytes per token and the vocabulary size).
    documents : sequence of Document
        The documents to run (the longest prompt sizes the batch).
    T, replicates : int
        Horizon (tokens) and ``R``.
    batch_documents : int, optional
        ``B`` to use (clipped to the number of documents); None plans it.
    decode_time : bool
        The policy evicts during decoding (``3R`` rows per document, :mod:`kvdiverge.engine.llm.planner`).
    memory_budget_gb : float, optional
        GiB the batch may take; default
        :func:`kvdiverge.engine.llm.planner.default_memory_budget` of the model's device.

    Returns
    -------
    int
        ``B`` in ``[1, len(documents)]`` (1 when there are no documents).

    Raises
    ------
    ValueError
        If ``batch_documents`` is below 1.
    """
    from kvdiverge.engine.llm.planner import default_memory_budget, kv_bytes_per_token, plan_batch

    param = next(model.parameters())
    if batch_documents is None:
        budget = (default_memory_budget(param.device) if memory_budget_gb is None
                  else int(float(memory_budget_gb) * 2**30))
    else:
        budget = 0  # unused: the override decides
    return plan_batch(
        kv_bytes_per_token=kv_bytes_per_token(model.config, param.dtype),
        prompt_len=max((doc.prompt_len for doc in documents), default=0), T=int(T), replicates=int(replicates),
        vocab_size=int(model.config.vocab_size), memory_budget_bytes=budget, documents=max(len(documents), 1),
        override=batch_documents, decode_time=decode_time,
    )


def run_documents(
    model,
    documents: Sequence[Document],
    policy: PressSource,
    *,
    T: int,
    replicates: int,
    temperature: float,
    top_p: float,
    seed: int,
    model_name: str,
    eos_ids: Sequence[int] | None = None,
    progress: tqdm | None = None,
    batch_documents: int | None = None,
    memory_budget_gb: float | None = None,
) -> list[dict[str, Any]]:
    """Coupled trajectories of every document under one policy.

    A decode-time policy (:func:`kvdiverge.engine.presses.registry.is_decode_time`: the press
    also evicts while tokens are generated) runs on
    :class:`kvdiverge.engine.llm.decode_pair.DecodeTimePair` (lanes with exact branch replay),
    every other on :class:`kvdiverge.engine.llm.llm_pair.LLMKernelPair`; ``kept_len`` is then
    the fewest positions the evicted cache held along the agreement chain.

    Documents run ``B`` at a time as the rows of one kernel pair
    (:meth:`kvdiverge.engine.llm.llm_pair.LLMKernelPair.from_documents`, :func:`kvdiverge.engine.core.coupled.run_batch`):
    ``B x R`` rows per side per forward. Batches group documents of similar length
    (sorted by prompt length, ties by input order) to keep padding small; records come
    back in input order. A document's results depend on its batch only through the
    rounding of the batched forward; for a given config and document set they are
    reproducible bit for bit.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        Causal LM in eval mode, supported by kvpress.
    documents : sequence of Document
        Prompts (token ids), each run with its own press from ``policy``.
    policy : PressSource
        Supplies ``build_press(prompt_len)`` and ``expected_kept(prompt_len, press)``.
    T : int
        Horizon ``max_new_tokens`` (tokens = steps).
    replicates : int
        ``R`` coupled replicates per document.
    temperature, top_p : float
        Decoding transform (:func:`kvdiverge.engine.core.decoding.decode_log_probs`).
    seed : int
        Master seed.
    model_name : str
        Enters the seeds (with ``doc_id`` and the replicate; never the policy).
    eos_ids : sequence of int, optional
        End-of-sequence ids; default ``model.generation_config.eos_token_id``.
    progress : tqdm, optional
        Advanced by ``2T - 1`` per document.
    batch_documents : int, optional
        Documents per batched forward ``B``; ``None`` lets :func:`plan_documents` choose it
        from the model's KV bytes per token and ``memory_budget_gb``.
    memory_budget_gb : float, optional
        Memory the batch may take (GiB); default
        :func:`kvdiverge.engine.llm.planner.default_memory_budget` of the model's device.

    Returns
    -------
    list[dict]
        One record per (document, replicate), in input order: ``doc_id``, ``prompt_len``,
        ``kept_len`` (prompt positions kept per key-value head, mean over layers and heads),
        ``kept_per_layer`` (per layer, summed over its key-value heads), ``seconds`` (the batch's wall time divided by its documents) and the
        columns of :func:`kvdiverge.engine.core.coupled.run_batch`.

    Raises
    ------
    kvdiverge.engine.core.errors.CompressionError
        When a press does not keep the promised number of positions.
    kvdiverge.engine.core.errors.PressError
        Before any forward, when the registry refuses the press on this model
        (:func:`kvdiverge.engine.presses.registry.refusal`); when kvpress raises an
        ``ImportError``, ``AssertionError``, ``TypeError``, ``AttributeError`` or ``IndexError`` during the
        run (the message names the policy, the press and the cause).
    kvdiverge.engine.core.errors.NonFiniteLogitsError
        When the model returns NaN/±inf logits (names model, document, replicate, step, side).
    ValueError
        When a prompt is too short for the policy.
    """
    from kvdiverge.engine.presses.registry import is_decode_time

    if not documents:
        return []
    longest = max(documents, key=lambda doc: doc.prompt_len)
    decode_time = is_decode_time(policy.build_press(longest.prompt_len))
    B = plan_documents(model, documents, T=T, replicates=replicates, batch_documents=batch_documents,
                       memory_budget_gb=memory_budget_gb, decode_time=decode_time)
    order = sorted(range(len(documents)), key=lambda i: (documents[i].prompt_len, i))
    log.info("%d documents, %d per batched forward (%d rows per side)", len(documents), B, B * int(replicates))
    by_index: dict[int, list[dict[str, Any]]] = {}
    done = 0
    for lo in range(0, len(order), B):
        batch = [documents[i] for i in order[lo:lo + B]]
        start = time.perf_counter()
        pair, reps = _run_one_batch(model, batch, policy, T=T, replicates=replicates, seed=seed,
                                    model_name=model_name, temperature=temperature, top_p=top_p, eos_ids=eos_ids,
                                    progress=progress)
        seconds = (time.perf_counter() - start) / len(batch)
        done += len(batch)
        if progress is not None:
            progress.update(done * (2 * T - 1) - progress.n)  # chains that stop early skip steps
        for j, doc in enumerate(batch):
            meta = {"doc_id": doc.doc_id, "prompt_len": doc.prompt_len, "kept_len": pair.kept_lens[j],
                    "kept_per_layer": pair.kept_per_layer[j], "seconds": seconds}
            by_index[order[lo + j]] = [{**meta, **rec} for rec in reps[j * int(replicates):(j + 1) * int(replicates)]]
            log.info("%s: prompt %d tokens, kept %d, %.1f s", doc.doc_id, doc.prompt_len, pair.kept_lens[j], seconds)
    return [rec for i in range(len(documents)) for rec in by_index[i]]


def build_pair(model, batch: Sequence[Document], policy: PressSource, *, seed: int, model_name: str,
               temperature: float, top_p: float, eos_ids: Sequence[int] | None = None):
    """The kernel pair of one batch of documents under one policy, each document with its own press.

    A decode-time policy (:func:`kvdiverge.engine.presses.registry.is_decode_time`) gets a
    :class:`kvdiverge.engine.llm.decode_pair.DecodeTimePair`, every other an
    :class:`kvdiverge.engine.llm.llm_pair.LLMKernelPair`; each document's prefill seeds torch's
    generator from ``(seed, model_name, doc_id)`` (:func:`kvdiverge.engine.llm.prefill.prefill_seed`).

    Returns
    -------
    kvdiverge.engine.core.pairs.KernelPair
        Not started; its ``presses`` and ``expected`` are the documents' presses and promises.

    Raises
    ------
    kvdiverge.engine.core.errors.PressError
        When the registry refuses the press on this model (config attributes the press reads).
    """
    from kvdiverge.engine.core.errors import PressError
    from kvdiverge.engine.llm.decode_pair import DecodeTimePair
    from kvdiverge.engine.llm.llm_pair import LLMKernelPair
    from kvdiverge.engine.llm.prefill import prefill_seed
    from kvdiverge.engine.presses.registry import is_decode_time, refusal

    presses = [policy.build_press(doc.prompt_len) for doc in batch]
    reason = refusal(presses[0], model)  # what only the model tells (config attributes the press reads)
    if reason:
        raise PressError(f"policy {policy.name!r}", reason)
    kind = DecodeTimePair if is_decode_time(presses[0]) else LLMKernelPair
    return kind.from_documents(
        model, [doc.input_ids for doc in batch], presses,
        [policy.expected_kept(doc.prompt_len, press) for doc, press in zip(batch, presses)],
        temperature=float(temperature), top_p=float(top_p), eos_ids=eos_ids,
        prefill_seeds=[prefill_seed(int(seed), model_name, doc.doc_id) for doc in batch],
    )


def _run_one_batch(model, batch: Sequence[Document], policy, *, T, replicates, seed, model_name,
                   temperature, top_p, eos_ids, progress):
    """One batch of documents through one kernel pair: ``(pair, records)`` (see :func:`run_documents`)."""
    from kvdiverge.engine.core.coupled import run_batch
    from kvdiverge.engine.core.errors import raise_kvpress_error

    pair = build_pair(model, batch, policy, seed=seed, model_name=model_name, temperature=temperature, top_p=top_p,
                      eos_ids=eos_ids)
    try:
        reps = run_batch(pair, int(T), int(replicates), int(seed), model_name, [doc.doc_id for doc in batch],
                         progress=progress)
    except (ImportError, AssertionError, TypeError, AttributeError, IndexError) as exc:  # kvpress's bare errors, named
        raise_kvpress_error(exc, f"policy {policy.name!r} ({type(pair.presses[0]).__name__})", "during the prefill")
    finally:
        if hasattr(pair, "close"):
            pair.close()
    return pair, reps
