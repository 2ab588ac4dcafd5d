"""The full cache's side of a greedy run, computed once per document for every policy.

Under greedy decoding (temperature 0) both kernels are point masses, and the full cache's
history along a coupled run is always a prefix of the full cache's own greedy continuation
``g_1..g_T`` of the prompt: on the agreement chain the appended token is the common arg-max,
``g_t``; the branch starts with ``x* = g_{t*}`` (the reference's residual is its point mass)
and goes on with the reference's own arg-maxes. So ``p_t`` is the point mass on ``g_t`` for
every row at every step, whatever the press. :func:`greedy_reference` decodes ``g`` once
per document (one prefill, ``T - 1`` forwards of a batch of documents), and
:class:`kvdiverge.engine.llm.pair_base.GreedyReference` serves it as a pair's reference side: the pairs
(:class:`kvdiverge.engine.llm.llm_pair.LLMKernelPair`,
:class:`kvdiverge.engine.llm.decode_pair.DecodeTimePair`) then decode their evicted side
alone. :func:`kvdiverge.engine.runner.run_policies` does this for a greedy run of several
policies; ``benchmarks/greedy_reuse.py`` measures it.

The tokens are those the pairs' own reference sides compute up to the rounding of the
batched forward (which rows share it); equal arg-maxes, so equal records, except at a
near-tie of the top two logits within float rounding.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch

from kvdiverge.engine.core.errors import NonFiniteLogitsError
from kvdiverge.engine.core.sampling import Decoding, Sampling
from kvdiverge.engine.hf import DynamicCache
from kvdiverge.engine.llm.pair_base import LLMPairBase, PairDocument

__all__ = ["full_prefill", "greedy_reference", "with_greedy_tokens"]


def full_prefill(model, ids: torch.Tensor, n_question: int = 0):
    """The full cache of one prompt and its last logits, as the pairs' reference prefill computes them.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        The reference model (no press entered).
    ids : torch.Tensor
        int64 (n,), the prompt.
    n_question : int
        Trailing question tokens, prefilled in a second forward as
        :func:`kvdiverge.engine.llm.prefill.append_question` does on the reference side.

    Returns
    -------
    (transformers.DynamicCache, torch.Tensor)
        The cache (batch 1) and the logits (1, vocab_size).
    """
    n = int(ids.numel()) - int(n_question)
    cache = DynamicCache()
    out = model(input_ids=ids[:n].unsqueeze(0), past_key_values=cache, use_cache=True, logits_to_keep=1)
    if n_question:
        pos = torch.arange(n, int(ids.numel()), device=ids.device).unsqueeze(0)
        out = model(
            input_ids=ids[n:].unsqueeze(0), past_key_values=cache, position_ids=pos, use_cache=True, logits_to_keep=1
        )
    return cache, out.logits[:, -1, :]


class _FullSide(LLMPairBase):
    """The documents, the decoding transform and the batched side of :class:`LLMPairBase`, for one side."""

    def __init__(self, model, documents: Sequence[PairDocument], decoding: Decoding, horizon: int):
        self._setup(model, documents, decoding, horizon=horizon)


@torch.inference_mode()
def greedy_reference(
    model, documents: Sequence[PairDocument], *, decoding: Decoding, horizon: int, given: Sequence | None = None
) -> torch.Tensor:
    """Each document's greedy continuation on its full cache: ``T`` tokens, one batched forward per step.

    The prompts are prefilled alone (:func:`full_prefill`, or taken from ``given``), merged into
    one batched side and decoded as a pair's reference side decodes (the decoding transform, a
    repetition penalty on the side's own history, the fast kernels). A row that emits EOS keeps
    it (EOS is absorbing); the forwards stop once every row has.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        The reference model.
    documents : sequence of PairDocument
        The prompts and their question lengths (the presses are not read).
    decoding : kvdiverge.engine.core.sampling.Decoding
        A greedy decoding (temperature 0).
    horizon : int
        ``T`` (tokens).
    given : sequence of (cache, logits) or None, optional
        Per document, its full cache and last logits from a prefill already run (a shared
        prefill's, :func:`kvdiverge.engine.llm.prefill.prefill_shared`), read and never
        changed; ``None`` entries prefill here.

    Returns
    -------
    torch.Tensor
        int64 (B, T) on the model's device.

    Raises
    ------
    ValueError
        When ``decoding`` is not greedy.
    kvdiverge.engine.core.errors.NonFiniteLogitsError
        With ``rows`` the bad documents' indices and ``step`` the 1-based step (the caller names them).
    """
    if not decoding.greedy:
        raise ValueError(f"the full cache's greedy tokens need temperature 0, got {decoding.temperature}")
    run, T = _FullSide(model, documents, decoding, horizon), int(horizon)
    given = list(given) if given is not None else [None] * len(documents)
    caches, logits = [], []
    for ids, doc, one in zip(run.prompts, run.documents, given, strict=True):
        cache, last = one if one is not None else full_prefill(model, ids, doc.n_question)
        caches.append(_view(cache))
        logits.append(last)
    run._record("reset")
    side = run._side(caches, run.prompt_lens, run.prompt_lens, 1)
    run._record("begin", 1)
    eos = torch.tensor(run.eos_ids, dtype=torch.long, device=run.device)
    tokens = torch.empty(len(documents), T, dtype=torch.long, device=run.device)
    tokens[:, 0] = _arg_max(run, torch.cat(logits), 1)
    for t in range(1, T):
        last = tokens[:, t - 1]
        ended = torch.isin(last, eos)
        if bool(ended.all()):
            tokens[:, t:] = last.unsqueeze(1)
            break
        step = side.forward(model, last)
        run._record("append", last, last)
        tokens[:, t] = torch.where(ended, last, _arg_max(run, step, t + 1))
    return tokens


def _arg_max(run: _FullSide, logits: torch.Tensor, step: int) -> torch.Tensor:
    """The greedy token of each row's transformed ``logits`` (1-based ``step`` named in a non-finite error)."""
    try:
        return run._transform(logits, "reference").argmax(-1)
    except NonFiniteLogitsError as err:
        err.step = step  # the caller names the document (kvdiverge.engine.runner)
        raise


def _view(cache):
    """A cache object of its own over ``cache``'s tensors (no copy), so merging never changes a given cache."""
    out = copy.copy(cache)
    out.layers = [copy.copy(layer) for layer in cache.layers]
    return out


def with_greedy_tokens(model, batch: Sequence, sampling: Sampling, bank: Mapping[str, list | None]) -> list:
    """The documents of ``batch`` with their full cache's greedy continuation (``greedy_tokens``), decoded once.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        The reference model.
    batch : sequence of kvdiverge.engine.runner.Document
        The documents (``doc_id``, ``input_ids``, ``n_question``).
    sampling : Sampling
        A greedy decoding and ``T``.
    bank : mapping of str to list or None
        :func:`kvdiverge.engine.llm.sharing.shared_prefills` of the batch: a document's full cache and logits are taken
        from any shared prefill of it (one forward fewer); the others are prefilled
        (:func:`full_prefill`).

    Returns
    -------
    list of kvdiverge.engine.runner.Document
        Copies with ``greedy_tokens`` set (``T`` each).

    Raises
    ------
    kvdiverge.engine.core.errors.NonFiniteLogitsError
        Naming the model, the document and the step, on the reference side.
    """
    given: list = [None] * len(batch)
    for prefills in bank.values():
        for j, one in enumerate(prefills or []):
            if one is not None and given[j] is None:
                given[j] = (one.ref, one.ref_logits)
    docs = [PairDocument(doc.input_ids, n_question=doc.n_question) for doc in batch]
    try:
        tokens = greedy_reference(model, docs, decoding=sampling.decoding, horizon=sampling.T, given=given)
    except NonFiniteLogitsError as err:
        raise NonFiniteLogitsError(
            err.side,
            err.rows,
            err.kind,
            model=sampling.model_name,
            doc_id=batch[err.rows[0]].doc_id,
            replicate=0,
            step=err.step,
            phase="agreement chain",
        ) from None
    return [replace(doc, greedy_tokens=row) for doc, row in zip(batch, tokens.tolist())]
