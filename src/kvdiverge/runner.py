"""The one path from (model, documents, press) to trajectory records.

Both doors call :func:`run_documents`: the workflow (``kvdiverge.trajectories.run_shard``,
one shard of one (model, policy, split)) and the Python/command-line front door
(``kvdiverge.measure``). Batching, device placement and progress live here or below
(:mod:`kvdiverge.kernels`, :mod:`kvdiverge.trajectories`), never in the doors.
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

    :class:`kvdiverge.policies.Policy` implements it.
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
) -> list[dict[str, Any]]:
    """Coupled trajectories of every document under one policy.

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
        Decoding transform (:func:`kvdiverge.decoding.decode_log_probs`).
    seed : int
        Master seed.
    model_name : str
        Enters the seeds (with ``doc_id`` and the replicate; never the policy).
    eos_ids : sequence of int, optional
        End-of-sequence ids; default ``model.generation_config.eos_token_id``.
    progress : tqdm, optional
        Advanced by ``2T - 1`` per document.

    Returns
    -------
    list[dict]
        One record per (document, replicate): ``doc_id``, ``prompt_len``, ``kept_len``,
        ``seconds`` and the columns of :func:`kvdiverge.trajectories.run_document`.

    Raises
    ------
    kvdiverge.kernels.CompressionError
        When a press does not keep the promised number of positions.
    ValueError
        When a prompt is too short for the policy.
    """
    from kvdiverge.kernels import LLMKernelPair
    from kvdiverge.trajectories import run_document

    records: list[dict[str, Any]] = []
    for i, doc in enumerate(documents):
        start = time.perf_counter()
        press = policy.build_press(doc.prompt_len)
        pair = LLMKernelPair(
            model, doc.input_ids, press,
            temperature=float(temperature), top_p=float(top_p),
            expected_kept=policy.expected_kept(doc.prompt_len, press),
            eos_ids=eos_ids,
        )
        reps = run_document(pair, int(T), int(replicates), int(seed), model_name, doc.doc_id, progress=progress)
        seconds = time.perf_counter() - start
        if progress is not None:
            progress.update((i + 1) * (2 * T - 1) - progress.n)  # chains that stop early skip steps
        meta = {"doc_id": doc.doc_id, "prompt_len": doc.prompt_len, "kept_len": pair.kept_len,
                "seconds": seconds}
        records.extend({**meta, **rec} for rec in reps)
        log.info("%s: prompt %d tokens, kept %d, %.1f s", doc.doc_id, doc.prompt_len, pair.kept_len, seconds)
    return records
