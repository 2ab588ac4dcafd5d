"""The one path from (model, documents, press) to trajectory records.

Both doors call :func:`run_policies`: the workflow (``kvdiverge.jobs.shard.run_shard``,
one shard of one (model, policy, split)) and the Python/command-line front door
(``kvdiverge.measure``, any number of policies on the same prompts). It checks each press
once, plans the documents per batched forward once (decode-time policies counted) and runs
every policy in one batch loop. Each door builds one
:class:`~kvdiverge.engine.core.sampling.Sampling` and passes it down. Batching, device placement and progress live here or below
(:mod:`kvdiverge.engine.core.pairs`, :mod:`kvdiverge.engine.core.coupled`), never in the doors.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from kvdiverge.engine.core.coupled import run_batch, to_frame
from kvdiverge.engine.core.documents import Document  # re-exported: the runner's input
from kvdiverge.engine.core.errors import CompressionError, NonFiniteLogitsError, PressError, raise_kvpress_error
from kvdiverge.engine.core.pairs import PhaseTracker
from kvdiverge.engine.core.sampling import Sampling
from kvdiverge.engine.llm.decode_pair import DecodeTimePair, takes_prefill
from kvdiverge.engine.llm.llm_pair import LLMKernelPair
from kvdiverge.engine.llm.pair_base import PairDocument
from kvdiverge.engine.llm.planner import default_memory_budget, document_bytes, kv_bytes_per_token, plan_batch
from kvdiverge.engine.llm.prefill import prefill_seed
from kvdiverge.engine.llm.reference import with_greedy_tokens
from kvdiverge.engine.llm.sharing import PrefillCarry
from kvdiverge.engine.llm.twin import evicted_twin
from kvdiverge.engine.presses.adapters import walk
from kvdiverge.engine.presses.registry import is_decode_time, question_after_problem, refusal
from kvdiverge.engine.refusals import PressSource, check_policy, check_prompt_lengths

__all__ = [
    "Document",
    "PolicyRuns",
    "RunOptions",
    "build_pair",
    "plan_documents",
    "run_documents",
    "run_policies",
]

log = logging.getLogger(__name__)


def plan_documents(
    model,
    documents: Sequence[Document],
    sampling: Sampling,
    batch_documents: int | None = None,
    memory_budget_gb: float | None = None,
    *,
    decode_time: bool = False,
) -> int:
    """Documents per batched forward ``B`` for running ``documents`` on ``model``.

    Reads the device's free memory once (when ``memory_budget_gb`` is None);
    :func:`run_policies` plans once for all its policies, so every policy runs in the same
    batches.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        The model (its config gives the KV bytes per token and the vocabulary size).
    documents : sequence of Document
        The documents to run (the longest prompt sizes the batch).
    sampling : kvdiverge.engine.core.sampling.Sampling
        Its horizon ``T`` (tokens) and ``R``.
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
    param = next(model.parameters())
    if batch_documents is None:
        budget = (
            default_memory_budget(param.device) if memory_budget_gb is None else int(float(memory_budget_gb) * 2**30)
        )
    else:
        budget = 0  # unused: the override decides
    return plan_batch(
        kv_bytes_per_token=kv_bytes_per_token(model.config, param.dtype),
        prompt_len=max((doc.prompt_len for doc in documents), default=0),
        T=sampling.T,
        replicates=sampling.replicates,
        vocab_size=int(model.config.vocab_size),
        memory_budget_bytes=budget,
        documents=max(len(documents), 1),
        override=batch_documents,
        decode_time=decode_time,
    )


@dataclass(frozen=True)
class RunOptions:
    """How :func:`run_policies` batches and reports; never what it computes.

    Parameters
    ----------
    batch_documents : int, optional
        Documents per batched forward ``B``; ``None`` lets :func:`plan_documents` choose it
        from the model's KV bytes per token and ``memory_budget_gb`` (config
        ``generation.batch_documents: auto``).
    memory_budget_gb : float, optional
        Memory the batch may take (GiB); default
        :func:`kvdiverge.engine.llm.planner.default_memory_budget` of the model's device.
    progress : callable, optional
        ``progress(name, total)`` returns a tqdm bar (a context manager) for one policy of
        ``total`` steps (``2T - 1`` per document); None shows none.
    owner : str
        What a refused press is called in the message: ``"policy"`` or ``"press"``.
    share_reference : bool
        Under greedy decoding with two policies or more, decode each document's full cache
        once for all of them (:func:`run_policies`); ``False`` decodes it in every policy's pair.
    """

    batch_documents: int | None = None
    memory_budget_gb: float | None = None
    progress: Callable[[str, int], Any] | None = None
    owner: str = "policy"
    share_reference: bool = True


def run_documents(
    model, documents: Sequence[Document], policy: PressSource, sampling: Sampling, options: RunOptions = RunOptions()
) -> list[dict[str, Any]]:
    """The records of :func:`run_policies` for one policy, without ``model``, ``policy`` and ``split``."""
    return _run_records(model, documents, {policy.name: policy}, sampling, options)[0][policy.name]


@dataclass(frozen=True)
class PolicyRuns:
    """What :func:`run_policies` ran.

    Attributes
    ----------
    trajectories : polars.DataFrame
        One row per (policy, document, replicate), policies in the given order, documents
        in input order (:data:`kvdiverge.estimation.schema.TRAJECTORY_SCHEMA`).
    batch_documents : int or None
        Documents per batched forward ``B`` every policy ran with; None without documents.
    counts : dict of str to dict of str to int
        Per policy: ``documents``, ``batches``, and the forwards its kernel pairs counted
        (``prefill_forwards``; a decode-time pair's lane, replay and reference forwards and
        row-steps too, ``DecodeTimePair.counts``).
    """

    trajectories: Any
    batch_documents: int | None
    counts: dict[str, dict[str, int]]


def run_policies(
    model,
    documents: Sequence[Document],
    policies: Mapping[str, PressSource],
    sampling: Sampling,
    *,
    split: str,
    options: RunOptions = RunOptions(),
    carry: PrefillCarry | None = None,
) -> PolicyRuns:
    """Every policy on the same documents, in the same batches: the engine both doors run.

    Checks each policy's press once (:func:`~kvdiverge.engine.refusals.check_policy`, every policy before any
    forward), plans ``B`` once for all of them (:func:`plan_documents`; ``3R`` rows per
    document when any policy is decode-time, so every policy runs in the same batches)
    and runs the documents batch by batch, every policy on each batch. Up to ``2R`` policies
    share each document's prefill forward (:func:`kvdiverge.engine.llm.prefill.prefill_shared`)
    where their presses allow: those that evict at prefill only, and the decode-time ones whose
    lanes start from it (:func:`~kvdiverge.engine.llm.decode_pair.takes_prefill`, a sliding
    window); their records are those of each policy run alone, bit for bit.

    Under greedy decoding (temperature 0) with two policies or more, each batch's full-cache
    greedy tokens are decoded once (:func:`kvdiverge.engine.llm.reference.greedy_reference`)
    and every pair decodes its evicted side alone, reading the reference side from them
    (``options.share_reference``; equal records up to a near-tie of the top two logits within
    the rounding of a batched forward). A sampled run decodes each pair's reference side.

    A decode-time policy (:func:`kvdiverge.engine.presses.registry.is_decode_time`: the press
    also evicts while tokens are generated) runs on
    :class:`kvdiverge.engine.llm.decode_pair.DecodeTimePair` (lanes with exact branch replay),
    every other on :class:`kvdiverge.engine.llm.llm_pair.LLMKernelPair`; ``kept_len`` is then
    the fewest positions the evicted cache held along the agreement chain.

    Documents run ``B`` at a time as the rows of one kernel pair (:func:`build_pair`,
    :func:`kvdiverge.engine.core.coupled.run_batch`): ``B x R`` rows per side per forward.
    Batches group documents of similar length (sorted by prompt length, ties by input
    order) to keep padding small; records come back in input order. A document's results
    depend on its batch only through the rounding of the batched forward; for a given
    config and document set they are reproducible bit for bit.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        Causal LM in eval mode, supported by kvpress.
    documents : sequence of Document
        Prompts (token ids), each run with its own press from each policy.
    policies : mapping of str to PressSource
        Policy name (the ``policy`` column) -> policy, run in this order; each supplies
        ``build_press(prompt_len)`` and ``expected_kept(prompt_len, press)``.
    sampling : kvdiverge.engine.core.sampling.Sampling
        ``T``, ``R``, the decoding transform, the master seed and the model name (which
        enters the seeds with ``doc_id`` and the replicate; never the policy); ``eos_ids``
        ``None`` takes ``model.generation_config.eos_token_id``.
    split : str
        The ``split`` column.
    options : RunOptions
        Batch size, memory budget, progress bars and the message's word for a policy.
    carry : kvdiverge.engine.llm.sharing.PrefillCarry, optional
        Prefills carried between the calls of one model (the same object to each, in order): this
        call's policies take those an earlier call made for them, and its documents are prefilled
        also for the carry's later policies, within the memory budget. Records are unchanged.

    Returns
    -------
    PolicyRuns
        Its trajectories hold, per (policy, document, replicate): ``model``, ``policy``,
        ``split``, ``doc_id``, ``prompt_len``, ``kept_len`` (prompt positions kept per
        key-value head, mean over layers and heads), ``kept_per_layer`` (per layer, summed
        over its key-value heads), ``seconds`` (the batch's wall time divided by its
        documents, the policy's share of shared prefills included) and the columns of
        :func:`kvdiverge.engine.core.coupled.run_batch`.

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
        When a prompt is too short for a policy.
    """
    by_policy, counts, B = _run_records(model, documents, policies, sampling, options, carry)
    name_ = sampling.model_name
    records = [{"model": name_, "policy": name, "split": split, **rec} for name in policies for rec in by_policy[name]]
    return PolicyRuns(to_frame(records), B, {name: counts[name] for name in policies})


def _run_records(
    model, documents: Sequence[Document], policies: Mapping[str, PressSource], sampling, options, carry=None
):
    """``(records, counts, B)`` of :func:`run_policies`: per policy, its records in input order and its counts."""
    if carry is not None:
        carry.begin(policies)
    if not documents:
        return {name: [] for name in policies}, {name: {"documents": 0, "batches": 0} for name in policies}, None
    # a row's cache spans prompt + 2T - 2 columns after a branch's rewind (planner.cache_columns)
    span = 2 * sampling.T - 2
    flags = {
        name: check_policy(model, documents, src, f"{options.owner} {name!r}", span) for name, src in policies.items()
    }
    check_prompt_lengths(documents, policies, options.owner)
    budget = options.memory_budget_gb
    if budget is None:  # the free memory, read once for the batch and the groups
        budget = default_memory_budget(next(model.parameters()).device) / 2**30
    B = plan_documents(model, documents, sampling, options.batch_documents, budget, decode_time=any(flags.values()))
    # alone: decode-time policies whose lanes cannot start from a shared prefill (takes_prefill), asked
    # of the longest document's press
    longest = max(doc.prompt_len for doc in documents)
    alone = {n: flag and not takes_prefill(policies[n].build_press(longest)) for n, flag in flags.items()}
    shared = [name for name, one in alone.items() if not one]
    left, token_bytes = _left_bytes(model, documents, sampling, budget)
    group = int(max(1, min(2 * sampling.replicates, left(B) // max(B * longest * token_bytes, 1))))
    group = group if len(shared) >= 2 else 1
    groups = [shared[lo : lo + group] for lo in range(0, len(shared), group)]
    groups += [[name] for name, one in alone.items() if one]
    greedy = options.share_reference and sampling.greedy and len(policies) >= 2
    carry = PrefillCarry() if carry is None else carry
    # beside each batch, in the order they run: the budget less the batch and its first group's prefills
    stages = [
        ([documents[i].doc_id for i in batch], left(len(batch)) - len(groups[0]) * len(batch) * longest * token_bytes)
        for batch in _batches(documents, B)
    ]
    carry.fit(policies, documents, token_bytes, stages, groups[0])
    got = _run_batches(model, documents, policies, _Plan(B, groups, greedy, carry), sampling, options.progress)
    return {name: got[name][0] for name in policies}, {name: got[name][1] for name in policies}, B


@dataclass(frozen=True)
class _Plan:
    """Documents per batched forward ``B``, the policies in the order and groups they run (a group's
    policies share each document's prefill forward where their presses allow), whether each
    batch's full-cache greedy tokens are decoded once for all of them (``greedy``), and the prefills
    carried between calls (``carry``; an empty one when the caller gives none)."""

    B: int
    groups: list[list[str]]
    greedy: bool = False
    carry: PrefillCarry = field(default_factory=PrefillCarry)


def _left_bytes(model, documents: Sequence[Document], sampling: Sampling, memory_budget_gb: float):
    """``(left, kv bytes per token)``: ``left(n)`` is what the memory budget (GiB) leaves beside a batch of ``n``
    documents' decoding (:mod:`kvdiverge.engine.llm.planner`) for shared prefills (bytes).

    The shared prefills of one batch hold, per policy, one evicted cache per document (at most the
    prompt's width): a group of up to ``2R`` policies holds at most what the batch's own decoding cache
    holds (``R`` rows per side), and what this leaves beside a batch of ``B`` bounds it further (at least 1).
    """
    param = next(model.parameters())
    kv = kv_bytes_per_token(model.config, param.dtype)
    longest = max(doc.prompt_len for doc in documents)
    batch = document_bytes(
        kv_bytes_per_token=kv,
        prompt_len=longest,
        T=sampling.T,
        replicates=sampling.replicates,
        vocab_size=int(model.config.vocab_size),
    )
    budget = int(float(memory_budget_gb) * 2**30)
    return (lambda n: budget - n * batch), kv


def _batches(documents: Sequence[Document], B: int) -> list[list[int]]:
    """The indices of each batch of ``B`` documents (by prompt length, :func:`_order`), in the order they run:
    a last batch of fewer than ``B`` first, so that the prefills held for the full batches
    (:class:`~kvdiverge.engine.llm.sharing.PrefillCarry`) wait beside the smallest one. A document's
    records do not depend on the order (its random numbers are its own: :mod:`kvdiverge.engine.core.streams`)."""
    order = _order(documents)
    batches = [order[lo : lo + B] for lo in range(0, len(order), B)]
    return batches[-1:] + batches[:-1] if len(batches) > 1 and len(batches[-1]) < B else batches


def _run_batches(
    model, documents: Sequence[Document], policies: Mapping[str, PressSource], plan: _Plan, sampling, progress
):
    """``{name: (records, counts)}`` of checked policies: the one batch loop.

    Batch by batch (``plan.B`` documents, sorted by prompt length; a last batch of fewer first:
    :func:`_batches`), the policies run in
    ``plan.groups``: each document of the batch is prefilled once for the group's presses
    that share their prefill (:func:`kvdiverge.engine.llm.prefill.prefill_shared`), then each
    policy of the group runs the batch on its pair with those prefills. A press that does
    not share its prefill, a group of one, or a shared forward that fails leaves the pair
    to prefill the document alone (a failing press then raises there, named). With
    ``plan.greedy`` the batch's full-cache greedy tokens are decoded once, after the first
    group's prefills (whose full caches they start from), and every pair reads its reference
    side from them (:func:`kvdiverge.engine.llm.reference.with_greedy_tokens`). With ``plan.carry`` a policy
    takes the prefills an earlier call held for it, and the first group's forward also prefills the
    carry's later policies (:class:`~kvdiverge.engine.llm.sharing.PrefillCarry`). The caches and so the
    records are those of each policy run alone, bit for bit; ``seconds`` adds the policy's share of the shared work.
    """
    B, T = plan.B, sampling.T
    names = [name for group in plan.groups for name in group]
    log.info(
        "%d documents, %d per batched forward (%d rows per side); %d policies, prefilled in groups of up to %d%s",
        len(documents),
        B,
        B * sampling.replicates,
        len(names),
        max(len(group) for group in plan.groups),
        "; the full cache decoded once for all" if plan.greedy else "",
    )
    by_index: dict[str, dict[int, list[dict[str, Any]]]] = {name: {} for name in names}
    counts = {name: Counter(documents=len(documents)) for name in names}
    twin = evicted_twin(model)
    batches = _batches(documents, B)
    with _Bars(progress, len(documents) * (2 * T - 1), len(names) > 1) as bars:
        for bi, indices in enumerate(batches):
            batch, extra = [documents[i] for i in indices], 0.0
            for gi, group in enumerate(plan.groups):
                start = time.perf_counter()
                group_of = {n: policies[n] for n in group}
                presses, bank, ahead = plan.carry.group_prefills(twin, batch, group_of, sampling, gi == 0)
                shared_seconds = (time.perf_counter() - start) / (len(group) + ahead)
                if plan.greedy and gi == 0:
                    start = time.perf_counter()
                    batch = with_greedy_tokens(model, batch, sampling, bank)
                    extra = (time.perf_counter() - start) / len(names)
                for name in group:
                    bar = bars.open(name)
                    start = time.perf_counter()
                    pair, reps = _run_one_batch(
                        model, batch, policies[name], sampling, bar, presses=presses[name], prefilled=bank.pop(name)
                    )
                    seconds = (time.perf_counter() - start + shared_seconds + extra) / len(batch)
                    counts[name].update(_pair_counts(pair))
                    bars.advance(name, sum(len(b) for b in batches[: bi + 1]) * (2 * T - 1), bi == len(batches) - 1)
                    by_index[name].update(
                        _batch_records(batch, indices, pair, reps, sampling.replicates, seconds, bars.label(name))
                    )
    return {
        name: ([rec for i in range(len(documents)) for rec in by_index[name][i]], dict(counts[name])) for name in names
    }


def _order(documents: Sequence[Document]) -> list[int]:
    """The indices of ``documents`` in the order the batches take them: by prompt length, then input order."""
    return sorted(range(len(documents)), key=lambda i: (documents[i].prompt_len, i))


class _Bars:
    """One progress bar per policy (``progress(name, total)``; none without ``progress``), opened at
    its first batch and closed after its last; a context manager that closes them all."""

    def __init__(self, progress, total: int, labelled: bool):
        self.progress, self.total, self.labelled = progress, total, labelled
        self.stack, self.bars = ExitStack(), {}

    def __enter__(self) -> "_Bars":
        return self

    def __exit__(self, *exc) -> None:
        self.stack.close()

    def open(self, name: str):
        """The policy's bar (``None`` without progress)."""
        if name not in self.bars:
            self.bars[name] = self.stack.enter_context(
                self.progress(name, self.total) if self.progress else nullcontext()
            )
        return self.bars[name]

    def advance(self, name: str, done: int, last: bool) -> None:
        """Bring the bar to ``done`` steps (chains that stop early skip steps); close it after the last batch."""
        bar = self.bars.get(name)
        if bar is not None:
            bar.update(done - bar.n)
            if last:
                bar.close()

    def label(self, name: str) -> str:
        """The log lines' prefix for the policy (none when it runs alone)."""
        return f"{name}: " if self.labelled else ""


def _batch_records(
    batch: Sequence[Document], indices: Sequence[int], pair, reps: list, replicates, seconds: float, label: str = ""
) -> dict[int, list[dict[str, Any]]]:
    """One batch's records per document (by its input index ``indices[j]``), with the document's columns; logged."""
    R = int(replicates)
    out = {}
    for j, doc in enumerate(batch):
        meta = {
            "doc_id": doc.doc_id,
            "prompt_len": doc.prompt_len,
            "kept_len": pair.kept_lens[j],
            "kept_per_layer": pair.kept_per_layer[j],
            "seconds": seconds,
        }
        out[indices[j]] = [{**meta, **rec} for rec in reps[j * R : (j + 1) * R]]
        log.info(
            "%s%s: prompt %d tokens, kept %d, %.1f s", label, doc.doc_id, doc.prompt_len, pair.kept_lens[j], seconds
        )
    return out


def _pair_counts(pair) -> dict[str, int]:
    """The forwards one batch's kernel pair counted, and the batch itself."""
    counts = getattr(pair, "counts", None)
    if counts is None:
        counts = {"prefill_forwards": sum(getattr(pair, "prefill_forwards", []))}
    return {"batches": 1, **counts}


def _press_files(press) -> list[str]:
    """Source files of ``press``'s class and the classes of the presses it wraps, kvpress's excepted."""
    out = []
    for p in walk(press):
        for cls in type(p).__mro__:
            if cls.__module__.split(".")[0] not in ("kvpress", "builtins", "abc"):
                try:
                    out.append(inspect.getfile(cls))
                except (TypeError, OSError):
                    pass
    return out


def build_pair(
    model,
    batch: Sequence[Document],
    policy: PressSource,
    sampling: Sampling,
    *,
    checked: bool = False,
    presses: Sequence | None = None,
    prefilled: Sequence | None = None,
):
    """The kernel pair of one batch of documents under one policy, each document with its own press.

    Each side's cache is allocated once for its widest need, ``prompt + 2T - 2`` columns
    (:func:`kvdiverge.engine.llm.planner.cache_columns`, ``T`` of ``sampling``).

    A decode-time policy (:func:`kvdiverge.engine.presses.registry.is_decode_time`) gets a
    :class:`kvdiverge.engine.llm.decode_pair.DecodeTimePair`, every other an
    :class:`kvdiverge.engine.llm.llm_pair.LLMKernelPair`, with ``sampling.decoding``; each
    document's prefill seeds torch's generator from ``(seed, model_name, doc_id)``
    (:func:`kvdiverge.engine.llm.prefill.prefill_seed`).

    ``presses`` (one per document, built by ``policy``) and ``prefilled`` (their prefills,
    :func:`kvdiverge.engine.llm.prefill.prefill_shared`; ``None`` entries prefill alone) come
    from a shared prefill; both default to building and prefilling here.

    Returns
    -------
    kvdiverge.engine.core.pairs.KernelPair
        Not started; its ``presses`` and ``expected`` are the documents' presses and promises.

    Raises
    ------
    kvdiverge.engine.core.errors.PressError
        When the registry refuses the press on this model (config attributes the press reads);
        not asked with ``checked=True`` (:func:`run_policies` checked it once: :func:`~kvdiverge.engine.refusals.check_policy`).
    """
    if presses is None:
        presses = [policy.build_press(doc.context_len) for doc in batch]
    reason = None if checked else refusal(presses[0], model)  # config attributes the press reads
    if reason:
        raise PressError(f"policy {policy.name!r}", reason)
    decode_time = is_decode_time(presses[0])
    if (
        prefilled is not None
        and decode_time
        and not all(g is None or takes_prefill(p) for p, g in zip(presses, prefilled))
    ):
        raise ValueError(f"policy {policy.name!r} evicts while decoding; its prefill is not shared")
    if any(doc.n_question for doc in batch):
        problem = question_after_problem(presses[0])
        if problem:
            raise ValueError(f"policy {policy.name!r}: {problem}")
    prefilled = [None] * len(batch) if prefilled is None else prefilled
    documents = [
        PairDocument(
            doc.input_ids,
            press,
            policy.expected_kept(doc.context_len, press),
            prefill_seed(sampling.seed, sampling.model_name, doc.doc_id),
            given,
            doc.n_question,
            doc.greedy_tokens,
        )
        for doc, press, given in zip(batch, presses, prefilled, strict=True)
    ]
    kind = DecodeTimePair if decode_time else LLMKernelPair
    return kind.from_documents(model, documents, decoding=sampling.decoding, horizon=sampling.T)


def _run_one_batch(model, batch: Sequence[Document], policy, sampling: Sampling, progress, *, presses, prefilled):
    """One batch of documents through one kernel pair: ``(pair, records)`` (see :func:`run_policies`)."""
    pair = build_pair(model, batch, policy, sampling, checked=True, presses=presses, prefilled=prefilled)
    phased = PhaseTracker(pair)
    try:
        reps = run_batch(
            phased,
            sampling.T,
            sampling.replicates,
            sampling.seed,
            sampling.model_name,
            [doc.doc_id for doc in batch],
            progress=progress,
        )
    except (PressError, CompressionError, NonFiniteLogitsError, torch.OutOfMemoryError):
        raise
    except Exception as exc:  # raised inside kvpress or the user's own press: named, with the phase
        raise_kvpress_error(
            exc,
            f"policy {policy.name!r} ({type(pair.presses[0]).__name__})",
            phased.phase,
            _press_files(pair.presses[0]),
        )
    finally:
        if hasattr(pair, "close"):
            pair.close()
    return pair, reps
