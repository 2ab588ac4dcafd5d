"""What the two language-model kernel pairs share: documents, decoding transform, reference side.

:class:`kvdiverge.engine.llm.llm_pair.LLMKernelPair` (prefill presses) and
:class:`kvdiverge.engine.llm.decode_pair.DecodeTimePair` (decode-time presses) both hold
one model, ``B`` documents (each a :class:`PairDocument`: its prompt, press, kept-count
promise, prefill seed, and for the prefill pair its prefill and question length), the
decoding transform, and a reference side :class:`kvdiverge.engine.llm.side.CacheSide`
batched over the documents. :class:`LLMPairBase` holds those; the pairs add their evicted
sides.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvdiverge.engine.core.coupling import coupling_dtype
from kvdiverge.engine.core.decoding import RepeatHistory
from kvdiverge.engine.core.errors import check_logits_finite
from kvdiverge.engine.core.sampling import Decoding
from kvdiverge.engine.llm.masks import clear_key_masks
from kvdiverge.engine.llm.planner import cache_columns
from kvdiverge.engine.llm.prefill import Prefill
from kvdiverge.engine.llm.side import DEFAULT_SPARE, CacheSide, merge_caches
from kvdiverge.engine.presses.promises import KeptPromise

__all__ = ["GreedyReference", "LLMPairBase", "PairDocument", "model_eos_ids", "stock_kernels"]

#: ``fast`` of pairs built without one (:func:`stock_kernels` switches it for a block).
_FAST_DEFAULT = [True]


@contextlib.contextmanager
def stock_kernels():
    """Within the block, pairs built without ``fast`` use the stock ``DynamicCache`` and attention.

    For comparisons through callers that build their own pairs
    (:func:`kvdiverge.engine.runner.run_policies`, ``benchmarks/``).
    """
    _FAST_DEFAULT.append(False)
    try:
        yield
    finally:
        _FAST_DEFAULT.pop()


def model_eos_ids(model) -> list[int]:
    """End-of-sequence token ids of a model, from its generation config.

    Falls back to ``model.config.eos_token_id``. Never reads the tokenizer's
    ``eos_token`` (wrong for GGUF tokenizers under transformers 5.2).
    """
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if ids is None:
        ids = getattr(model.config, "eos_token_id", None)
    if ids is None:
        return []
    if isinstance(ids, int):
        ids = [ids]
    return sorted({int(i) for i in ids})


@dataclass(frozen=True)
class PairDocument:
    """One document of a kernel pair: its prompt and how its evicted side is prefilled.

    Parameters
    ----------
    input_ids : sequence of int
        The chat-rendered prompt, ``prompt_len`` token ids; held as a tuple of int.
    press : kvpress.BasePress or None
        The document's eviction press; ``None`` leaves the evicted cache equal to the full one.
    expected_kept : int, KeptPromise or None
        What the press promises to keep (:func:`kvdiverge.engine.presses.registry.kept_promise`):
        an int, that many prompt positions in every layer and head (for
        :class:`kvdiverge.engine.llm.decode_pair.DecodeTimePair`, the positions every layer
        holds after the prefill); ``None`` only checks that a compressing press evicted
        something.
    prefill_seed : int or None
        Seed of torch's global generator during the document's prefills
        (:func:`kvdiverge.engine.llm.prefill.prefill_seed`,
        :func:`kvdiverge.engine.llm.prefill.seeded`), for presses that draw from it;
        ``None`` leaves the generator as it is.
    prefilled : Prefill or None
        The document's prefill already run for this press
        (:func:`kvdiverge.engine.llm.prefill.prefill_shared`: one forward for several
        policies), which :meth:`kvdiverge.engine.llm.llm_pair.LLMKernelPair.start` checks
        and merges as its own; ``None``: the pair prefills the document.
    n_question : int
        Trailing question tokens (of ``input_ids``), prefilled after compression onto both
        caches and never evicted (:func:`kvdiverge.engine.llm.prefill.append_question`, as
        kvpress's pipeline); the press sees, and promises its kept count for, the tokens
        before them. 0: the press sees every prompt token.
    greedy_tokens : sequence of int or None
        Under greedy decoding, the full cache's greedy continuation of the prompt (``T``
        tokens, :func:`kvdiverge.engine.llm.reference.greedy_reference`), computed once for
        every policy: the pair then decodes its evicted side alone and reads its reference
        side from these (:class:`~kvdiverge.engine.llm.pair_base.GreedyReference`). Every document of a pair has them or none.
    """

    input_ids: Sequence[int]
    press: Any = None
    expected_kept: int | KeptPromise | None = None
    prefill_seed: int | None = None
    prefilled: Prefill | None = None
    n_question: int = 0
    greedy_tokens: Sequence[int] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_ids", tuple(int(i) for i in self.input_ids))
        object.__setattr__(self, "n_question", int(self.n_question))
        if self.greedy_tokens is not None:
            object.__setattr__(self, "greedy_tokens", tuple(int(i) for i in self.greedy_tokens))


class GreedyReference:
    """A pair's reference side read from the full cache's greedy tokens: the point mass on ``g_t``.

    Rows follow the pair's (document-major, ``R`` per document, then as
    :meth:`keep_rows` and :meth:`rewind` leave them); each row's history length picks its next token.

    Parameters
    ----------
    tokens : torch.Tensor
        int64 (B, T), each document's greedy continuation
        (:func:`kvdiverge.engine.llm.reference.greedy_reference`), on the pair's device.
    vocab_size : int
        Width of the log-distributions (the evicted side's logits).
    dtype : torch.dtype
        Their dtype (:func:`kvdiverge.engine.core.coupling.coupling_dtype`).
    """

    def __init__(self, tokens: torch.Tensor, vocab_size: int, dtype: torch.dtype):
        self.tokens, self.vocab_size, self.dtype = tokens, int(vocab_size), dtype
        self._doc = self._hist = torch.zeros(0, dtype=torch.long, device=tokens.device)

    def _next(self) -> torch.Tensor:
        """int64 (rows,): each row's next full-cache token (the last one past the horizon)."""
        return self.tokens[self._doc, self._hist.clamp(max=self.tokens.shape[1] - 1)]

    def _point_masses(self) -> torch.Tensor:
        out = torch.full(
            (self._doc.numel(), self.vocab_size), float("-inf"), dtype=self.dtype, device=self.tokens.device
        )
        return out.scatter_(-1, self._next().unsqueeze(1), 0.0)

    def start(self, n_rows: int) -> torch.Tensor:
        """``n_rows / B`` rows per document, none generated; ``log p_1`` (n_rows, vocab_size)."""
        B = self.tokens.shape[0]
        self._doc = torch.arange(B, device=self.tokens.device).repeat_interleave(n_rows // B)
        self._hist = torch.zeros_like(self._doc)
        return self._point_masses()

    def advance(self, x: torch.Tensor) -> torch.Tensor:
        """Append ``x`` (int64 (rows,)); the next log-distributions.

        Raises
        ------
        RuntimeError
            When ``x`` is not each row's next greedy token: the run is not greedy on this side.
        """
        if not torch.equal(x.to(self.tokens.device), self._next()):
            raise RuntimeError("the reference side appended a token that is not its greedy continuation")
        self._hist = self._hist + 1
        return self._point_masses()

    def rewind(self, length: torch.Tensor) -> None:
        """Row ``r`` keeps its first ``length[r]`` tokens (int64 (rows,))."""
        self._hist = length.to(self.tokens.device).clone()

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (int64 indices into the current rows), in this order."""
        rows = rows.to(self.tokens.device)
        self._doc, self._hist = self._doc[rows], self._hist[rows]


class LLMPairBase:
    """One model, ``B`` documents, the decoding transform and the batched reference side.

    The subclasses' constructors pass these to ``_setup``.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A causal LM in eval mode, with no press entered.
    documents : sequence of PairDocument
        The documents, in row order (row ``d*R + r`` is replicate ``r`` of document ``d``).
        The pair keeps them without their prefills (``documents``); those it holds
        apart until ``start()`` merges them.
    decoding : kvdiverge.engine.core.sampling.Decoding
        Decoding transform (:func:`kvdiverge.engine.core.decoding.decode_log_probs`) and
        end-of-sequence ids (``None``: :func:`model_eos_ids`).
    horizon : int or None
        ``T``: each side's cache is allocated for ``prompt + 2T - 2`` columns; ``None``
        allocates ``DEFAULT_SPARE`` extra columns and grows.
    fast : bool or None
        ``True``: caches with capacity and grouped decoding attention; ``False``: the
        stock ``DynamicCache`` and the model's attention (for comparison); ``None``:
        ``True`` but inside :func:`stock_kernels`.

    Attributes
    ----------
    documents : tuple of PairDocument
        The documents, each with ``prefilled=None``.
    prompts : list of torch.Tensor
        Per document, its prompt ids, int64 (prompt_len,), on the model's device.
    reference : GreedyReference or None
        After ``start()``, the reference side read from the documents' ``greedy_tokens``;
        ``None``: the pair decodes its reference side itself.

    Raises
    ------
    ValueError
        If ``documents`` is empty, or some but not all have ``greedy_tokens``.
    """

    def _setup(
        self,
        model,
        documents: Sequence[PairDocument],
        decoding: Decoding,
        *,
        horizon: int | None = None,
        fast: bool | None = None,
    ) -> None:
        if not documents:
            raise ValueError("a pair needs at least one document")
        clear_key_masks(model)
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = coupling_dtype(self.device)
        self._prefilled = [doc.prefilled for doc in documents]
        self.documents = tuple(replace(doc, prefilled=None) for doc in documents)
        self.prompts = [torch.as_tensor(doc.input_ids, dtype=torch.long, device=self.device) for doc in documents]
        self.decoding = decoding
        self.eos_ids = tuple(model_eos_ids(model) if decoding.eos_ids is None else decoding.eos_ids)
        self.vocab_size = int(model.config.vocab_size)
        penalty = decoding.repetition_penalty
        self._repeats = None if penalty == 1 else RepeatHistory(self.prompts, self.vocab_size, penalty)
        self.horizon = None if horizon is None else int(horizon)
        self.fast = _FAST_DEFAULT[-1] if fast is None else bool(fast)
        self.kept_lens: list[int] = []
        self.kept_per_layer: list[list[int]] = []
        given = [doc.greedy_tokens for doc in documents]
        if any(g is not None for g in given) and not all(g is not None and len(g) == len(given[0]) for g in given):
            raise ValueError("greedy_tokens: every document of a pair has them, all of one length, or none has")
        self._greedy = None if given[0] is None else torch.tensor(given, dtype=torch.long, device=self.device)
        self.reference: GreedyReference | None = None

    def _greedy_reference(self, vocab_size: int) -> GreedyReference | None:
        """The reference side read from the documents' ``greedy_tokens`` (``None`` without them)."""
        return None if self._greedy is None else GreedyReference(self._greedy, vocab_size, self.dtype)

    @property
    def presses(self) -> list:
        """Per document, its press (the objects given, not copies)."""
        return [doc.press for doc in self.documents]

    @property
    def expected(self) -> list:
        """Per document, its kept-count promise (int, KeptPromise or ``None``)."""
        return [doc.expected_kept for doc in self.documents]

    @property
    def prefill_seeds(self) -> list[int | None]:
        """Per document, the seed of torch's generator during its prefills (``None``: not seeded)."""
        return [doc.prefill_seed for doc in self.documents]

    @property
    def n_documents(self) -> int:
        """Documents in the pair (B)."""
        return len(self.prompts)

    @property
    def prompt_lens(self) -> list[int]:
        """Uncompressed prompt length of each document (tokens)."""
        return [int(p.numel()) for p in self.prompts]

    def _record(self, event: str, *args) -> None:
        """Tell the repetition penalty's :class:`~kvdiverge.engine.core.decoding.RepeatHistory` what
        the pair did to its rows (``reset``, ``begin``, ``append``, ``rewind``, ``keep_rows``);
        nothing without a penalty."""
        if self._repeats is not None:
            getattr(self._repeats, event)(*args)

    def _transform(self, logits: torch.Tensor, side: str) -> torch.Tensor:
        check_logits_finite(logits, side)
        if self._repeats is not None:
            logits = self._repeats.penalize(logits, side)
        return self.decoding.log_probs(logits, self.dtype)

    def _positions(self, starts: Sequence[int], R: int):
        """RoPE position of each row's first generated token: an int for one document, else int64 (B * R,)."""
        if len(starts) == 1:
            return int(starts[0])
        return torch.tensor(list(starts), device=self.device).repeat_interleave(R)

    def _capacity(self, width: int) -> int | None:
        """Columns to allocate for a side whose prompt part is ``width`` wide (``None``: the stock cache)."""
        if not self.fast:
            return None
        return cache_columns(width, self.horizon) if self.horizon is not None else int(width) + DEFAULT_SPARE

    def _side(
        self, caches: Sequence, widths: Sequence[int], starts: Sequence[int], R: int, masks=None, modules: Sequence = ()
    ) -> CacheSide:
        """One side from per-document caches: merged (:func:`merge_caches`), ``R`` rows per document."""
        capacity = self._capacity(max(widths))
        cache, valid = merge_caches(list(caches), list(widths), R, self.device, capacity)
        return CacheSide(cache, valid, self._positions(starts, R), masks, modules, capacity=capacity, grouped=self.fast)
