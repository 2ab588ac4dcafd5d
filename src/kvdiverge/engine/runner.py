"""The one path from (model, documents, press) to trajectory records.

Both doors call :func:`run_documents`: the workflow (``kvdiverge.study.shard.run_shard``,
one shard of one (model, policy, split)) and the Python/command-line front door
(``kvdiverge.measure``). Batching, device placement and progress live here or below
(:mod:`kvdiverge.engine.pairs`, :mod:`kvdiverge.engine.coupled`), never in the doors.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tqdm.auto import tqdm

__all__ = ["Document", "PressSource", "run_documents"]

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

    :class:`kvdiverge.engine.policies.Policy` implements it.
    """

    name: str

    def build_press(self, prompt_len: int) -> Any: ...

    def expected_kept(self, prompt_len: int, press: Any) -> int | None: ...


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

    A decode-time policy (:func:`kvdiverge.engine.decode_pair.is_decode_time`: the press
    also evicts while tokens are generated) runs on
    :class:`kvdiverge.engine.decode_pair.DecodeTimePair` (lanes with exact branch replay),
    every other on :class:`kvdiverge.engine.llm_pair.LLMKernelPair`; ``kept_len`` is then
    the fewest positions the evicted cache held along the agreement chain.

    Documents run ``B`` at a time as the rows of one kernel pair
    (:meth:`kvdiverge.engine.llm_pair.LLMKernelPair.from_documents`, :func:`kvdiverge.engine.coupled.run_batch`):
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
        Decoding transform (:func:`kvdiverge.engine.decoding.decode_log_probs`).
    seed : int
        Master seed.
    model_name : str
        Enters the seeds (with ``doc_id`` and the replicate; never the policy).
    eos_ids : sequence of int, optional
        End-of-sequence ids; default ``model.generation_config.eos_token_id``.
    progress : tqdm, optional
        Advanced by ``2T - 1`` per document.
    batch_documents : int, optional
        Documents per batched forward ``B``; ``None`` lets :func:`kvdiverge.engine.planner.plan_batch`
        choose it from the model's KV bytes per token and ``memory_budget_gb``.
    memory_budget_gb : float, optional
        Memory the batch may take (GiB); default
        :func:`kvdiverge.engine.planner.default_memory_budget` of the model's device.

    Returns
    -------
    list[dict]
        One record per (document, replicate), in input order: ``doc_id``, ``prompt_len``,
        ``kept_len``, ``seconds`` (the batch's wall time divided by its documents) and the
        columns of :func:`kvdiverge.engine.coupled.run_batch`.

    Raises
    ------
    kvdiverge.engine.errors.CompressionError
        When a press does not keep the promised number of positions.
    kvdiverge.engine.errors.NonFiniteLogitsError
        When the model returns NaN/±inf logits (names model, document, replicate, step, side).
    ValueError
        When a prompt is too short for the policy.
    """
    from kvdiverge.engine.decode_pair import DecodeTimePair, is_decode_time
    from kvdiverge.engine.llm_pair import LLMKernelPair
    from kvdiverge.engine.planner import default_memory_budget, kv_bytes_per_token, plan_batch
    from kvdiverge.engine.coupled import run_batch

    if not documents:
        return []
    device = next(model.parameters()).device
    longest = max(documents, key=lambda doc: doc.prompt_len)
    decode_time = is_decode_time(policy.build_press(longest.prompt_len))
    budget = (default_memory_budget(device) if memory_budget_gb is None
              else int(float(memory_budget_gb) * 2**30))
    B = plan_batch(
        kv_bytes_per_token=kv_bytes_per_token(model.config, next(model.parameters()).dtype),
        prompt_len=max(doc.prompt_len for doc in documents), T=int(T), replicates=int(replicates),
        vocab_size=int(model.config.vocab_size), memory_budget_bytes=budget, documents=len(documents),
        override=batch_documents, decode_time=decode_time,
    )
    order = sorted(range(len(documents)), key=lambda i: (documents[i].prompt_len, i))
    log.info("%d documents, %d per batched forward (%d rows per side)", len(documents), B, B * int(replicates))
    by_index: dict[int, list[dict[str, Any]]] = {}
    done = 0
    for lo in range(0, len(order), B):
        batch = [documents[i] for i in order[lo:lo + B]]
        start = time.perf_counter()
        presses = [policy.build_press(doc.prompt_len) for doc in batch]
        kind = DecodeTimePair if decode_time else LLMKernelPair
        pair = kind.from_documents(
            model, [doc.input_ids for doc in batch], presses,
            [policy.expected_kept(doc.prompt_len, press) for doc, press in zip(batch, presses)],
            temperature=float(temperature), top_p=float(top_p), eos_ids=eos_ids,
        )
        reps = run_batch(pair, int(T), int(replicates), int(seed), model_name, [doc.doc_id for doc in batch],
                         progress=progress)
        if hasattr(pair, "close"):
            pair.close()
        seconds = (time.perf_counter() - start) / len(batch)
        done += len(batch)
        if progress is not None:
            progress.update(done * (2 * T - 1) - progress.n)  # chains that stop early skip steps
        for j, doc in enumerate(batch):
            meta = {"doc_id": doc.doc_id, "prompt_len": doc.prompt_len, "kept_len": pair.kept_lens[j],
                    "seconds": seconds}
            by_index[order[lo + j]] = [{**meta, **rec} for rec in reps[j * int(replicates):(j + 1) * int(replicates)]]
            log.info("%s: prompt %d tokens, kept %d, %.1f s", doc.doc_id, doc.prompt_len, pair.kept_lens[j], seconds)
    return [rec for i in range(len(documents)) for rec in by_index[i]]
