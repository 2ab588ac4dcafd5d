"""The teacher-forced pass over documents and policies: what the doors call for the ``teacher_forced`` tables.

Each (document, policy) gets its own one-document kernel pair, built by the runner's
:func:`kvdiverge.engine.runner.build_pair` exactly as the coupled run builds it (the same
press per prompt length, kept-count promise and prefill seed; a document's prefill forward is
shared by every policy whose press allows it, as in the coupled run), at temperature 1 and
``top_p`` 1, with its sides decoding apart, and
:func:`kvdiverge.engine.llm.teacher.forced_log_probs` feeds it the document's continuation;
the reference side's log-distributions are computed once per document and given to the
later policies' pairs, which run their evicted side only. Where the caller gives no
continuation for a document, the full-cache model's greedy continuation is generated once
and shared by every policy.

Two more targets ride on the same pass. The reconstruction (KVzip's context reconstruction,
Kim et al. 2025): the caller gives each document a :class:`Continuation` whose ``prefix`` (a
repeat instruction in the model's chat template) is fed first and not scored, and whose
``tokens`` are the prompt's own text. Key tokens (LongPPL, Fang et al. 2025;
:mod:`kvdiverge.estimation.key_tokens`): one forward of the full-cache model on the prompt's
last tokens and the same fed tokens per document gives ``ll_short``, and LongPPL's rule on it
and the reference side's ``ll_ref`` marks the ``key`` positions, once per document.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import polars as pl
import torch

from kvdiverge.engine.core.sampling import Sampling
from kvdiverge.engine.llm.sharing import PrefillCarry, shared_prefills
from kvdiverge.engine.llm.teacher import (
    Forced,
    TeacherForcing,
    forced_log_probs,
    greedy_continuation,
    position_measures,
    short_log_probs,
)
from kvdiverge.engine.llm.twin import evicted_twin
from kvdiverge.engine.refusals import PressSource, check_policy, check_prompt_lengths
from kvdiverge.engine.runner import Document, build_pair
from kvdiverge.estimation.key_tokens import key_mask
from kvdiverge.estimation.teacher_forced import POSITION_SCHEMA

__all__ = ["Continuation", "TeacherPass", "continuation_budget", "teacher_forced_policies"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Continuation:
    """The tokens fed after one document's prompt, and where they come from.

    Parameters
    ----------
    tokens : tuple of int
        ``c_1 .. c_L``: the scored tokens.
    source : str
        ``"corpus"`` (the text that follows the excerpt in its source), ``"greedy"`` (the
        full-cache model's arg-max continuation) or ``"prompt"`` (the prompt's own text: the
        reconstruction target).
    prefix : tuple of int
        Tokens fed before ``tokens`` and not scored: the reconstruction target's repeat
        instruction (in the model's chat template); empty for a continuation.
    """

    tokens: tuple[int, ...]
    source: str
    prefix: tuple[int, ...] = ()

    @property
    def fed(self) -> tuple[int, ...]:
        """Every token fed after the prompt: ``prefix``, then ``tokens``."""
        return (*self.prefix, *self.tokens)


def continuation_budget(prompt_len: int, forcing: TeacherForcing, context: int | None) -> int:
    """Scored tokens for a prompt (with what is fed before them): ``forcing.length``, cut to what
    ``context`` leaves (at least 1)."""
    if context is None:
        return forcing.length
    return max(1, min(forcing.length, int(context) - int(prompt_len)))


def _continuation(model, doc: Document, given, forcing: TeacherForcing, sampling: Sampling, context) -> Continuation:
    if isinstance(given, Continuation):  # a target the caller built (the reconstruction), cut to the budget
        budget = continuation_budget(doc.prompt_len + len(given.prefix), forcing, context)
        return Continuation(given.tokens[:budget], given.source, given.prefix)
    budget = continuation_budget(doc.prompt_len, forcing, context)
    if given is not None and len(given):
        return Continuation(tuple(int(t) for t in given[:budget]), "corpus")
    return Continuation(tuple(greedy_continuation(model, doc.input_ids, budget, sampling.eos_ids)), "greedy")


def _check_targets(documents: Sequence[Document], given: Mapping, forcing: TeacherForcing) -> None:
    """Refuse, before any forward, a reconstruction without a document's target."""
    if forcing.target != "reconstruction":
        return
    missing = [doc.doc_id for doc in documents if not isinstance(given.get(doc.doc_id), Continuation)]
    if missing:
        raise ValueError(f"teacher-forced pass: no reconstruction target given for document {missing[0]!r}")


def teacher_forced_policies(
    model,
    documents: Sequence[Document],
    policies: Mapping[str, PressSource],
    *,
    settings: TeacherPass,
    continuations: Mapping[str, Sequence[int]] | None = None,
    documents_of: Mapping[str, Collection[str]] | None = None,
    carry: PrefillCarry | None = None,
) -> pl.DataFrame:
    """Every policy's teacher-forced pass on the same documents and continuations.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        The model, in eval mode, no press entered.
    documents : sequence of Document
        The prompts.
    policies : mapping of str to PressSource
        Policy name (the ``policy`` column) -> policy.
    settings : TeacherPass
        The pass's sampling settings, continuation settings and ``split`` column.
    continuations : mapping of str to sequence of int or Continuation, optional
        Per ``doc_id``, the corpus text that follows the document (tokens, no special
        tokens), or a :class:`Continuation` built by the caller (every document's, for the
        reconstruction target); documents without one get the greedy continuation.
    documents_of : mapping of str to collection of str, optional
        Per policy, the ``doc_id`` of the documents it runs on (default: every document).
        A document is prefilled once, and its reference side run once, for all the
        policies that run on it.
    carry : kvdiverge.engine.llm.sharing.PrefillCarry, optional
        The prefills of a coupled run of the same documents to come
        (:func:`kvdiverge.engine.runner.run_policies` with this carry): each document's prefill is then
        made in one forward even for one press, and held for the carry's later policies where it takes
        it (:meth:`~kvdiverge.engine.llm.sharing.PrefillCarry.keep`: the same source, within its room).
        Neither the positions nor the coupled run's records change.

    Returns
    -------
    polars.DataFrame
        :data:`kvdiverge.estimation.teacher_forced.POSITION_SCHEMA`, one row per
        (policy, document, scored position), policies in the given order. With ``settings.forcing.key``,
        ``ll_short`` from one short-context forward per document
        (:func:`kvdiverge.engine.llm.teacher.short_log_probs`) and ``key`` from the document's first
        policy's reference side (:func:`kvdiverge.estimation.key_tokens.key_mask`), the same for
        every policy of the document.

    Raises
    ------
    kvdiverge.engine.core.errors.PressError, ValueError
        As :func:`kvdiverge.engine.runner.run_policies`: a press the model cannot run, a
        document shorter than a policy needs; ``documents_of`` without a policy's entry; the
        reconstruction target without a document's :class:`Continuation`.
    """
    runs_on = {name: _documents_of(documents, documents_of, name) for name in policies}
    given = continuations or {}
    _check_targets([doc for docs in runs_on.values() for doc in docs], given, settings.forcing)
    prefix = max((len(c.prefix) for c in given.values() if isinstance(c, Continuation)), default=0)
    for name, source in policies.items():
        if runs_on[name]:
            check_policy(model, runs_on[name], source, f"policy {name!r}", settings.forcing.length + prefix)
            check_prompt_lengths(runs_on[name], {name: source}, "policy")
    if not any(runs_on.values()):
        return pl.DataFrame(schema=POSITION_SCHEMA)
    ids = {name: {doc.doc_id for doc in docs} for name, docs in runs_on.items()}
    context = getattr(model.config, "max_position_embeddings", None)
    frames, sampling, forcing = [], settings.sampling, settings.forcing
    twin = evicted_twin(model)  # where the shared prefills' presses enter
    for doc in documents:
        here = {name: source for name, source in policies.items() if doc.doc_id in ids[name]}
        if not here:
            continue
        cont = _continuation(model, doc, given.get(doc.doc_id), forcing, sampling, context)
        frames += _document_frames(model, (doc, cont), here, settings, (twin, carry))
        _return_freed_memory()
    order = {name: i for i, name in enumerate(policies)}
    out = pl.concat(frames).with_columns(pl.col("policy").replace_strict(order).alias("_order"))
    return out.sort("_order", maintain_order=True).drop("_order")


def _document_frames(model, target, policies: Mapping[str, PressSource], settings: TeacherPass, shared) -> list:
    """One document's rows under each policy: ``target`` = (document, :class:`Continuation`), ``shared`` =
    (the evicted twin, a carry or None); its prefill shared where the presses allow (and held in the carry
    for a later coupled run), its reference side run once, its key tokens selected once."""
    doc, cont = target
    twin, carry = shared
    key = settings.forcing.key
    short = None if key is None else short_log_probs(model, doc.input_ids[-key.short :], cont.fed, len(cont.tokens))
    presses, prefilled = _shared_prefills(twin, doc, policies, settings.sampling, 1 if carry is not None else 2)
    if carry is not None:
        for name, done in prefilled.items():
            carry.keep(name, policies[name], doc, presses[name], done)
    reference, keys, frames = None, None, []  # the reference side's log-distributions, once per document
    for name, source in policies.items():
        made = (presses[name], prefilled.get(name))
        frame, forced = _one(model, doc, (name, source, made), cont, settings, reference)
        if short is not None:
            keys = key_mask(frame["ll_ref"].to_numpy(), short.numpy(), key) if keys is None else keys
            frame = frame.with_columns(pl.Series("ll_short", short.numpy()), pl.Series("key", keys))
        frames.append(frame)
        if reference is None and forced.shareable:
            reference = forced.logp
    return frames


def _return_freed_memory() -> None:
    """Hand the heap's free memory back to the system (glibc's ``malloc_trim(0)``; elsewhere nothing).

    A document's pass frees its presses' caches, some MB each, and blocks of logits; glibc's
    allocator serves such blocks from its heap once its mmap threshold has risen (malloc(3),
    ``M_MMAP_THRESHOLD``), and its free memory was not reused: on ``config/frontier.yaml``
    (25 policies a document, 64 continuation tokens) the process grew by about 1.8 GB a
    document, to a peak of 12 GB at the sixth; with a trim after each document it holds
    1.2 GB between documents and peaks at 3.7 GB.
    """
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):  # not glibc (macOS, musl): its allocator keeps its own ways
        pass


def _documents_of(documents: Sequence[Document], documents_of, name: str) -> list[Document]:
    """The documents policy ``name`` runs on (all of them when ``documents_of`` is None)."""
    if documents_of is None:
        return list(documents)
    if name not in documents_of:
        raise ValueError(f"documents_of names no documents for policy {name!r}")
    wanted = set(documents_of[name])
    return [doc for doc in documents if doc.doc_id in wanted]


def _shared_prefills(twin, doc: Document, policies: Mapping[str, PressSource], sampling: Sampling, least: int):
    """Each policy's press for ``doc``, and the prefills of the presses that share one forward, where at least
    ``least`` do (:func:`kvdiverge.engine.llm.sharing.shared_prefills`, as the coupled run shares them): the
    prefill-only presses, and the decode-time ones whose lanes can start from it
    (:func:`kvdiverge.engine.llm.sharing.joins_shared_prefill`, a sliding window)."""
    presses = {name: source.build_press(doc.context_len) for name, source in policies.items()}
    bank = shared_prefills(twin, [doc], {n: [p] for n, p in presses.items()}, sampling, least=least)
    return presses, {name: got[0] for name, got in bank.items() if got is not None}


@dataclass(frozen=True)
class TeacherPass:
    """What every (document, policy) of one teacher-forced pass shares.

    Parameters
    ----------
    sampling : Sampling
        ``seed`` and ``model_name`` (prefill seeds, the ``model`` column) and ``eos_ids``
        (where a greedy continuation stops); its temperature and ``top_p`` are not used:
        the pass runs at temperature 1 on the raw logits
        (:meth:`kvdiverge.engine.llm.teacher.TeacherForcing.sampling` makes it).
    forcing : TeacherForcing
        Continuation length and whether to feed it in one forward.
    split : str
        The ``split`` column.
    """

    sampling: Sampling
    forcing: TeacherForcing
    split: str


def _one(model, doc, policy, cont: Continuation, run: TeacherPass, reference) -> tuple[pl.DataFrame, Forced]:
    """One (document, policy): its pair (``policy`` = name, source, (press, shared prefill or None)), the
    pass (the document's ``reference`` log-distributions where an earlier pair gave them), the rows."""
    name, source, (press, prefilled) = policy
    sampling = run.sampling
    pair = build_pair(
        model,
        [doc],
        source,
        sampling.untransformed().replace(T=len(cont.fed)),
        checked=True,
        presses=[press],
        prefilled=None if prefilled is None else [prefilled],
    )
    if hasattr(pair, "joint"):
        pair.joint = False  # the sides apart: a forward for the evicted side alone (forced_log_probs)
    ids = torch.as_tensor(list(cont.fed), dtype=torch.long, device=pair.device)
    try:
        forced = forced_log_probs(pair, ids, run.forcing, reference)
    finally:
        if hasattr(pair, "close"):
            pair.close()
    L, s = len(cont.tokens), len(cont.prefix)  # the scored positions: after the prefix
    cols = {k: v.cpu().numpy() for k, v in position_measures(forced.logp[s:], forced.logq[s:], ids[s:]).items()}
    frame = pl.DataFrame(
        {
            "model": [sampling.model_name] * L,
            "policy": [name] * L,
            "split": [run.split] * L,
            "doc_id": [doc.doc_id] * L,
            "position": list(range(L)),
            "token": list(cont.tokens),
            "continuation": [cont.source] * L,
            "target": [run.forcing.target] * L,
            "one_forward": [forced.one_forward] * L,
            **cols,
            "ll_short": [None] * L,
            "key": [None] * L,
        },
        schema=POSITION_SCHEMA,
    )
    return frame, forced
