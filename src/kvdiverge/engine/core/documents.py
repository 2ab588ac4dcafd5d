"""The runner's input, one prompt to run (:class:`~kvdiverge.engine.core.documents.Document`):
torch-free, so that the task and prompt stages build documents without loading the engine
(:mod:`kvdiverge.engine.runner` re-exports it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Document"]


@dataclass(frozen=True)
class Document:
    """One prompt to run.

    Parameters
    ----------
    doc_id : str
        Document id; enters the seeds of the uniform streams.
    input_ids : sequence of int
        Chat-rendered prompt token ids (tokens), used as they are.
    n_question : int
        Trailing tokens (the question) prefilled after compression and never evicted, as
        kvpress's pipeline does (:func:`kvdiverge.engine.llm.prefill.append_question`); the
        press sees the ``context_len`` tokens before them. 0: the press sees the whole prompt.
    greedy_tokens : sequence of int, optional
        The full cache's greedy continuation (``T`` tokens), set by
        :func:`kvdiverge.engine.runner.run_policies` for a greedy run of several policies
        (:func:`kvdiverge.engine.llm.reference.greedy_reference`):
        :func:`kvdiverge.engine.runner.build_pair` hands it to the pair, which then decodes its
        evicted side alone.
    """

    doc_id: str
    input_ids: Sequence[int]
    n_question: int = 0
    greedy_tokens: Sequence[int] | None = None

    @property
    def context_len(self) -> int:
        """Tokens the press sees (the prompt without its trailing question)."""
        return len(self.input_ids) - int(self.n_question)

    @property
    def prompt_len(self) -> int:
        """Prompt length (tokens)."""
        return len(self.input_ids)
