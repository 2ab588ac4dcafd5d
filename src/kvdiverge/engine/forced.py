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
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import polars as pl
import torch

from kvdiverge.engine.core.sampling import Sampling
from kvdiverge.engine.llm.decode_pair import takes_prefill
from kvdiverge.engine.llm.teacher import (
    Forced,
    TeacherForcing,
    forced_log_probs,
    greedy_continuation,
    position_measures,
)
from kvdiverge.engine.llm.twin import evicted_twin
from kvdiverge.engine.presses.registry import is_decode_time
from kvdiverge.engine.runner import (
    Document,
    PressSource,
    build_pair,
    check_policy,
    check_prompt_lengths,
    shared_prefills,
)
from kvdiverge.estimation.teacher_forced import POSITION_SCHEMA

__all__ = ["Continuation", "TeacherPass", "continuation_budget", "teacher_forced_policies"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Continuation:
    """The tokens fed after one document's prompt, and where they come from.

    Parameters
    ----------
    tokens : tuple of int
        ``c_1 .. c_L``.
    source : str
        ``"corpus"`` (the text that follows the excerpt in its source) or ``"greedy"``
        (the full-cache model's arg-max continuation).
    """

    tokens: tuple[int, ...]
    source: str


def continuation_budget(prompt_len: int, forcing: TeacherForcing, context: int | None) -> int:
    """Continuation tokens for a prompt: ``forcing.length``, cut to what ``context`` leaves (at least 1)."""
    if context is None:
        return forcing.length
    return max(1, min(forcing.length, int(context) - int(prompt_len)))


def _continuation(model, doc: Document, given, forcing: TeacherForcing, sampling: Sampling, context) -> Continuation:
    budget = continuation_budget(doc.prompt_len, forcing, context)
    if given is not None and len(given):
        return Continuation(tuple(int(t) for t in given[:budget]), "corpus")
    return Continuation(tuple(greedy_continuation(model, doc.input_ids, budget, sampling.eos_ids)), "greedy")


def teacher_forced_policies(
    model,
    documents: Sequence[Document],
    policies: Mapping[str, PressSource],
    *,
    settings: TeacherPass,
    continuations: Mapping[str, Sequence[int]] | None = None,
    documents_of: Mapping[str, Collection[str]] | None = None,
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
    continuations : mapping of str to sequence of int, optional
        Per ``doc_id``, the corpus text that follows the document (tokens, no special
        tokens); documents without one get the greedy continuation.
    documents_of : mapping of str to collection of str, optional
        Per policy, the ``doc_id`` of the documents it runs on (default: every document).
        A document is prefilled once, and its reference side run once, for all the
        policies that run on it.

    Returns
    -------
    polars.DataFrame
        :data:`kvdiverge.estimation.teacher_forced.POSITION_SCHEMA`, one row per
        (policy, document, position), policies in the given order.

    Raises
    ------
    kvdiverge.engine.core.errors.PressError, ValueError
        As :func:`kvdiverge.engine.runner.run_policies`: a press the model cannot run, a
        document shorter than a policy needs; ``documents_of`` without a policy's entry.
    """
    runs_on = {name: _documents_of(documents, documents_of, name) for name in policies}
    for name, source in policies.items():
        if runs_on[name]:
            check_policy(model, runs_on[name], source, f"policy {name!r}", settings.forcing.length)
            check_prompt_lengths(runs_on[name], {name: source}, "policy")
    if not any(runs_on.values()):
        return pl.DataFrame(schema=POSITION_SCHEMA)
    ids = {name: {doc.doc_id for doc in docs} for name, docs in runs_on.items()}
    context = getattr(model.config, "max_position_embeddings", None)
    given = continuations or {}
    frames, sampling, forcing = [], settings.sampling, settings.forcing
    twin = evicted_twin(model)  # where the shared prefills' presses enter
    for doc in documents:
        here = {name: source for name, source in policies.items() if doc.doc_id in ids[name]}
        if not here:
            continue
        cont = _continuation(model, doc, given.get(doc.doc_id), forcing, sampling, context)
        presses, prefilled = _shared_prefills(twin, doc, here, sampling)
        reference = None  # the reference side's log-distributions, once per document
        for name, source in here.items():
            made = (presses[name], prefilled.get(name))
            frame, forced = _one(model, doc, (name, source, made), cont, settings, reference)
            frames.append(frame)
            if reference is None and forced.shareable:
                reference = forced.logp
        del presses, prefilled, reference
        _return_freed_memory()
    order = {name: i for i, name in enumerate(policies)}
    out = pl.concat(frames).with_columns(pl.col("policy").replace_strict(order).alias("_order"))
    return out.sort("_order", maintain_order=True).drop("_order")


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


def _shared_prefills(twin, doc: Document, policies: Mapping[str, PressSource], sampling: Sampling):
    """Each policy's press for ``doc``, and the prefills of the presses that share one forward
    (:func:`kvdiverge.engine.runner.shared_prefills`, as the coupled run shares them): the prefill-only
    presses, and the decode-time ones whose lanes can start from it
    (:func:`kvdiverge.engine.llm.decode_pair.takes_prefill`, a sliding window)."""
    presses = {name: source.build_press(doc.context_len) for name, source in policies.items()}
    sharing = {n: [p] for n, p in presses.items() if p is None or not is_decode_time(p) or takes_prefill(p)}
    bank = shared_prefills(twin, [doc], sharing, sampling)
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
        sampling.untransformed().replace(T=len(cont.tokens)),
        checked=True,
        presses=[press],
        prefilled=None if prefilled is None else [prefilled],
    )
    if hasattr(pair, "joint"):
        pair.joint = False  # the sides apart: a forward for the evicted side alone (forced_log_probs)
    ids = torch.as_tensor(list(cont.tokens), dtype=torch.long, device=pair.device)
    try:
        forced = forced_log_probs(pair, ids, run.forcing, reference)
    finally:
        if hasattr(pair, "close"):
            pair.close()
    L = len(cont.tokens)
    cols = {k: v.cpu().numpy() for k, v in position_measures(forced.logp, forced.logq, ids).items()}
    frame = pl.DataFrame(
        {
            "model": [sampling.model_name] * L,
            "policy": [name] * L,
            "split": [run.split] * L,
            "doc_id": [doc.doc_id] * L,
            "position": list(range(L)),
            "token": list(cont.tokens),
            "continuation": [cont.source] * L,
            "one_forward": [forced.one_forward] * L,
            **cols,
        },
        schema=POSITION_SCHEMA,
    )
    return frame, forced
