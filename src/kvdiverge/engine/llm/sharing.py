"""Prefill forwards shared between policies: within a batch, and carried to a later runner call.

:func:`shared_prefills` prefills each document of a batch once for several policies' presses
(:func:`kvdiverge.engine.llm.prefill.prefill_shared`). :class:`PrefillCarry` keeps the prefills that
one :func:`kvdiverge.engine.runner.run_policies` call made for the policies of a later call on some of
the same documents: a workflow job's controls, the noise floor and the ``none`` control, which run on
the first documents of a shard in a call of their own (their batches are their own); or those the
teacher-forced pass made on a shard's documents before its coupled run
(:func:`kvdiverge.engine.forced.teacher_forced_policies`). Either way a press's prefill is the one it
makes alone, bit for bit.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from kvdiverge.engine.core.documents import Document
from kvdiverge.engine.llm.decode_pair import takes_prefill
from kvdiverge.engine.llm.prefill import prefill_seed, prefill_shared, seeded
from kvdiverge.engine.presses.registry import is_decode_time, needs_attentions, shares_prefill

__all__ = ["PrefillCarry", "joins_shared_prefill", "shared_prefills"]

log = logging.getLogger(__name__)


def shared_prefills(
    twin, batch: Sequence[Document], presses: Mapping[str, list], sampling, *, least: int = 2
) -> dict[str, list | None]:
    """Per policy, per document of ``batch``: its prefill from one forward shared with the others, or ``None``.

    A press that scores with the attention weights (:func:`~kvdiverge.engine.presses.registry.needs_attentions`)
    shares a forward only with presses that do too: that forward hands the weights to every press, and a
    press that computes its own (SnapKV's window attention) would score with them instead.

    Parameters
    ----------
    twin : torch.nn.Module
        The model's evicted twin (:func:`kvdiverge.engine.llm.twin.evicted_twin`) the presses enter.
    batch : sequence of Document
        The documents.
    presses : mapping of str to list
        Policy name -> one press (or ``None``) per document; those that cannot join a shared forward
        (:func:`joins_shared_prefill`) are prefilled by their pairs.
    sampling : Sampling
        ``seed`` and ``model_name``: each document's prefill seed
        (:func:`kvdiverge.engine.llm.prefill.prefill_seed`).
    least : int
        The fewest presses a document's forward serves: with fewer, their pairs prefill alone (1: a
        prefill for every press that can join one, to be carried).

    Returns
    -------
    dict of str to list or None
        Per policy, per document, a :func:`kvdiverge.engine.llm.prefill.prefill_shared`
        prefill (``None`` where the document was not shared: fewer than ``least`` presses allow it,
        a question after compression, or the shared forward failed and each pair prefills
        alone, where a failing press is named); ``None`` for the whole policy when no
        document's prefill was shared.
    """
    device = next(twin.parameters()).device
    got: dict[str, list] = {name: [None] * len(batch) for name in presses}
    for j, doc in enumerate(batch):
        # a forward that supplies attention weights serves only presses that score with them
        kinds: dict[bool, list[str]] = {}
        for name in presses:
            if joins_shared_prefill(presses[name][j]):
                kinds.setdefault(needs_attentions(presses[name][j]), []).append(name)
        for names in kinds.values():
            if len(names) < least or doc.n_question:  # a question after compression: each pair prefills it
                continue
            done = _shared(twin, doc, [presses[name][j] for name in names], sampling, device)
            for name, one in zip(names, done or []):
                got[name][j] = one
    return {name: (None if all(p is None for p in ps) else ps) for name, ps in got.items()}


def joins_shared_prefill(press) -> bool:
    """True when ``press``'s prefill can come from a forward shared with other presses: it shares its
    prefill forward (:func:`~kvdiverge.engine.presses.registry.shares_prefill`) and, if it evicts while
    decoding, its lanes can start from that prefill
    (:func:`~kvdiverge.engine.llm.decode_pair.takes_prefill`, a sliding window)."""
    return press is not None and shares_prefill(press) and (not is_decode_time(press) or takes_prefill(press))


def _shared(twin, doc: Document, presses: list, sampling, device):
    """One document's :func:`~kvdiverge.engine.llm.prefill.prefill_shared` under its prefill seed; None when it
    fails (each pair then prefills alone, where a failing press is named)."""
    ids = torch.as_tensor(list(doc.input_ids), dtype=torch.long, device=device)
    try:
        with torch.inference_mode(), seeded(prefill_seed(sampling.seed, sampling.model_name, doc.doc_id), device):
            return prefill_shared(twin, ids, presses)
    except Exception as exc:
        log.warning(
            "%s: shared prefill failed (%s: %s); each policy prefills it alone", doc.doc_id, type(exc).__name__, exc
        )
        return None


def _cache_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


@dataclass
class PrefillCarry:
    """Prefills made in one runner call for the policies of a later call on the same documents.

    Give the same object to each :func:`kvdiverge.engine.runner.run_policies` call of one model, in
    order. A call prefills its documents also for the ``later`` policies that run on them (in the
    shared forward of its first group of policies), where the memory budget leaves room for them
    beside its batch; the later policy's call then takes those prefills and runs on its own batches.
    Only presses that join a shared forward are carried (:func:`joins_shared_prefill`). A press that evicts
    while decoding keeps its state after the prompt in the press object, which each lane enters a deep copy
    of (:class:`kvdiverge.engine.llm.lanes.Lane`): it is held beside its prefill, untouched by the pairs that
    ran from it before. The teacher-forced pass of the same documents,
    run before the calls, holds its prefills for them too (:meth:`keep`). The records are those of each
    call run without a carry, bit for bit.

    Parameters
    ----------
    later : dict of str to (PressSource, collection of str)
        Per policy of a later call: its source (``build_press(prompt_len)``) and the ``doc_id`` of
        the documents it runs on.
    room : int, optional
        Bytes that :meth:`keep` may fill (a job's memory budget); a call lets go of what exceeds the
        budget beside its batch (:meth:`fit`).

    Attributes
    ----------
    held : dict of (str, str) to (PressSource, press, Prefill)
        Per (policy, ``doc_id``): the source the press was built from, the press built for the
        document and its prefill, until taken (a call of another source under that name prefills its own).
    """

    later: dict[str, tuple[Any, Collection[str]]] = field(default_factory=dict)
    room: int | None = None
    held: dict[tuple[str, str], tuple[Any, Any, Any]] = field(default_factory=dict)

    def keep(self, name: str, source, doc: Document, press, done) -> bool:
        """Hold ``done``, the prefill of ``press`` (built by ``source``) on ``doc``, made outside the calls, for
        the later call of policy ``name``; True if held. Held only where that call runs ``doc`` with that
        source, the press joins a shared forward (:func:`joins_shared_prefill`), the document has no question after compression
        and :attr:`room` has space for it."""
        wanted = self.later.get(name)
        if wanted is None or wanted[0] is not source or doc.doc_id not in wanted[1]:
            return False
        if not joins_shared_prefill(press) or doc.n_question or (name, doc.doc_id) in self.held:
            return False
        new = _cache_bytes(done.ev) + (0 if any(key[1] == doc.doc_id for key in self.held) else _cache_bytes(done.ref))
        if self.room is not None and self.held_bytes() + new > self.room:
            return False
        self.held[(name, doc.doc_id)] = (source, press, replace(done, forwards=0))  # its forward ran elsewhere
        return True

    def begin(self, names: Collection[str]) -> None:
        """A call of policies ``names`` begins: they are no longer prefilled ahead, and what earlier calls of
        other policies left held (documents their call did not run) is let go."""
        for name in names:
            self.later.pop(name, None)
        for key in [k for k in self.held if k[0] not in names and k[0] not in self.later]:
            del self.held[key]

    def fit(
        self,
        names: Collection[str],
        documents: Sequence[Document],
        token_bytes: int,
        stages: Sequence[tuple[Collection[str], int]],
        first: Collection[str],
    ) -> None:
        """Hold no more than the memory budget leaves beside each batch of a call of policies ``names``.

        ``stages``: per batch, in the order the call runs them, its ``doc_id`` and the bytes the budget leaves
        beside it (its decoding and the prefills of its first group of policies, ``first``). Beside a batch,
        what is held for its first group is not counted (the batch takes it at once, in place of the prefills
        the budget counts), nor what is held for the call's policies on the batches before it (taken).
        The carry prefills nothing more for later calls when what it holds and what it would hold for the later
        policies' documents of this call (per document, its full cache and one evicted cache per later policy,
        at most its prompt's ``token_bytes`` each) exceed what a batch leaves; then it lets go of what it holds
        for the other calls, if the budget is exceeded beside a batch, and of this call's own, the last held
        first, until it is not."""
        names, first = set(names), set(first)
        beside, ran = [], set()
        for docs, left in stages:
            beside.append(({(n, d) for d in docs for n in first} | {(n, d) for d in ran for n in names}, left))
            ran |= set(docs)
        need = sum(
            doc.prompt_len * token_bytes * (1 + n)
            for doc in documents
            if (
                n := sum(
                    doc.doc_id in ids and (name, doc.doc_id) not in self.held for name, (_, ids) in self.later.items()
                )
            )
        )
        if need and any(self.held_bytes(keys) + need > left for keys, left in beside):
            log.info("the later policies' prefills (%d MiB) exceed the memory left: not carried", need >> 20)
            self.later = {}

        def over() -> bool:
            return any(self.held_bytes(keys) > left for keys, left in beside)

        if over():
            for key in [k for k in self.held if k[0] not in names]:
                del self.held[key]
        for key in reversed([k for k in self.held if k not in beside[0][0]]):
            if not over():
                break
            del self.held[key]

    def held_bytes(self, batch: Collection[tuple[str, str]] = frozenset()) -> int:
        """Bytes of the held caches (a document's full cache, which its prefills share, counted once), those held
        for the keys of ``batch`` left out (a full cache only when nothing else of its document is held)."""
        kept = {key: value for key, value in self.held.items() if key not in batch}
        full = {doc_id: _cache_bytes(done.ref) for (_, doc_id), (_, _, done) in kept.items()}
        return sum(full.values()) + sum(_cache_bytes(done.ev) for _, _, done in kept.values())

    def group_prefills(self, twin, batch: Sequence[Document], group: Mapping[str, Any], sampling, ahead: bool):
        """``(presses, prefills, later)`` for one group of policies (name -> source) on ``batch``.

        Per policy, per document, the press and the prefill held for it, or a press built here and its
        prefill from one forward per document shared with the group's other presses
        (:func:`shared_prefills`; ``None`` where the pair prefills alone, as a decode-time press whose
        lanes cannot start from it: :func:`joins_shared_prefill`); with ``ahead`` (a call's first group) the later policies' presses
        join those forwards and their prefills are held. ``later``: how many later policies did.
        """
        held = {name: self._take(name, source, batch) for name, source in group.items()}
        presses = {
            name: [p if p is not None else group[name].build_press(d.context_len) for p, d in zip(held[name][0], batch)]
            for name in group
        }
        wanted = self._wanted(batch) if ahead else {}
        own = {name: [None if g is not None else p for p, g in zip(ps, held[name][1])] for name, ps in presses.items()}
        bank = shared_prefills(twin, batch, own | wanted, sampling)
        for name, built in wanted.items():
            for doc, press, done in zip(batch, built, bank[name] or [None] * len(batch)):
                if press is not None and done is not None:
                    self.held[(name, doc.doc_id)] = (self.later[name][0], press, done)
        merged = {
            name: [g if g is not None else b for g, b in zip(held[name][1], bank[name] or [None] * len(batch))]
            for name in group
        }
        return (
            presses,
            {name: None if all(g is None for g in got) else got for name, got in merged.items()},
            len(wanted),
        )

    def _wanted(self, batch: Sequence[Document]) -> dict[str, list]:
        """Per later policy that runs on a document of ``batch``: its press per document (``None`` where it
        does not run, its prefill is held already, its press cannot be built (the later call says why) or
        does not join a shared forward: :func:`joins_shared_prefill`)."""
        out = {}
        for name, (source, ids) in self.later.items():
            presses = [
                self._press(source, doc) if doc.doc_id in ids and (name, doc.doc_id) not in self.held else None
                for doc in batch
            ]
            presses = [p if joins_shared_prefill(p) else None for p in presses]
            if any(p is not None for p in presses):
                out[name] = presses
        return out

    @staticmethod
    def _press(source, doc: Document):
        try:
            return source.build_press(doc.context_len)
        except Exception:  # a prompt too short for it: its own call refuses it, named
            return None

    def _take(self, name: str, source, batch: Sequence[Document]) -> tuple[list, list]:
        """Policy ``name``'s held presses and prefills for ``batch``, given up by the carry (``None`` where none
        is held, or it was held for another source of that name)."""
        got = [self.held.pop((name, doc.doc_id), None) for doc in batch]
        got = [g if g is not None and g[0] is source else None for g in got]
        return [g and g[1] for g in got], [g and g[2] for g in got]
