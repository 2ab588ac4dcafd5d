"""Prefill forwards shared between policies: within a batch, and carried to a later runner call.

:func:`shared_prefills` prefills each document of a batch once for several policies' presses
(:func:`kvdiverge.engine.llm.prefill.prefill_shared`). :class:`PrefillCarry` keeps the prefills that
one :func:`kvdiverge.engine.runner.run_policies` call made for the policies of a later call on some of
the same documents: a workflow job's controls, the noise floor and the ``none`` control, which run on
the first documents of a shard in a call of their own (their batches are their own). Either way a
press's prefill is the one it makes alone, bit for bit.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvdiverge.engine.core.documents import Document
from kvdiverge.engine.llm.prefill import prefill_seed, prefill_shared, seeded
from kvdiverge.engine.presses.registry import is_decode_time, shares_prefill

__all__ = ["PrefillCarry", "shared_prefills"]

log = logging.getLogger(__name__)


def shared_prefills(twin, batch: Sequence[Document], presses: Mapping[str, list], sampling) -> dict[str, list | None]:
    """Per policy, per document of ``batch``: its prefill from one forward shared with the others, or ``None``.

    Parameters
    ----------
    twin : torch.nn.Module
        The model's evicted twin (:func:`kvdiverge.engine.llm.twin.evicted_twin`) the presses enter.
    batch : sequence of Document
        The documents.
    presses : mapping of str to list
        Policy name -> one press (or ``None``) per document: prefill presses, decode-time ones that ``takes_prefill``.
    sampling : Sampling
        ``seed`` and ``model_name``: each document's prefill seed
        (:func:`kvdiverge.engine.llm.prefill.prefill_seed`).

    Returns
    -------
    dict of str to list or None
        Per policy, per document, a :func:`kvdiverge.engine.llm.prefill.prefill_shared`
        prefill (``None`` where the document was not shared: fewer than two presses allow it,
        a question after compression, or the shared forward failed and each pair prefills
        alone, where a failing press is named); ``None`` for the whole policy when no
        document's prefill was shared.
    """
    device = next(twin.parameters()).device
    got: dict[str, list] = {name: [None] * len(batch) for name in presses}
    for j, doc in enumerate(batch):
        names = [name for name in presses if presses[name][j] is not None and shares_prefill(presses[name][j])]
        if len(names) < 2 or doc.n_question:  # a question after compression: each pair prefills it
            continue
        ids = torch.as_tensor(list(doc.input_ids), dtype=torch.long, device=device)
        try:
            with torch.inference_mode(), seeded(prefill_seed(sampling.seed, sampling.model_name, doc.doc_id), device):
                done = prefill_shared(twin, ids, [presses[name][j] for name in names])
        except Exception as exc:  # each pair then prefills alone, where a failing press is named
            log.warning(
                "%s: shared prefill failed (%s: %s); each policy prefills it alone", doc.doc_id, type(exc).__name__, exc
            )
            done = None
        if done is not None:
            for name, one in zip(names, done):
                got[name][j] = one
    return {name: (None if all(p is None for p in ps) else ps) for name, ps in got.items()}


@dataclass
class PrefillCarry:
    """Prefills made in one runner call for the policies of a later call on the same documents.

    Give the same object to each :func:`kvdiverge.engine.runner.run_policies` call of one model, in
    order. A call prefills its documents also for the ``later`` policies that run on them (in the
    shared forward of its first group of policies), where the memory budget leaves room for them
    beside its batch; the later policy's call then takes those prefills and runs on its own batches.
    Only presses that evict at prefill alone are carried (a decode-time press keeps state after the
    prompt). The records are those of each call run without a carry, bit for bit.

    Parameters
    ----------
    later : dict of str to (PressSource, collection of str)
        Per policy of a later call: its source (``build_press(prompt_len)``) and the ``doc_id`` of
        the documents it runs on.

    Attributes
    ----------
    held : dict of (str, str) to (press, Prefill)
        Per (policy, ``doc_id``): the press built for the document and its prefill, until taken.
    """

    later: dict[str, tuple[Any, Collection[str]]] = field(default_factory=dict)
    held: dict[tuple[str, str], tuple[Any, Any]] = field(default_factory=dict)

    def begin(self, names: Collection[str], documents: Sequence[Document], bytes_left: int, token_bytes: int) -> None:
        """A call of policies ``names`` on ``documents`` begins: they are no longer prefilled ahead, and
        nothing is carried from this call when its later prefills would take more than ``bytes_left``
        (the budget beside the call's batch and shared prefills; each carried document holds its full
        cache and one evicted cache per later policy, at most its prompt's ``token_bytes`` each)."""
        for name in names:
            self.later.pop(name, None)
        need = sum(
            doc.prompt_len * token_bytes * (1 + n)
            for doc in documents
            if (n := sum(doc.doc_id in ids for _, ids in self.later.values()))
        )
        if need > bytes_left:
            log.info("the later policies' prefills (%d MiB) exceed the memory left: not carried", need >> 20)
            self.later = {}

    def wanted(self, batch: Sequence[Document]) -> dict[str, list]:
        """Per later policy that runs on a document of ``batch``: its press per document (``None`` where it
        does not run, its prefill is held already, or the press evicts while decoding)."""
        out = {}
        for name, (source, ids) in self.later.items():
            presses = [
                source.build_press(doc.context_len)
                if doc.doc_id in ids and (name, doc.doc_id) not in self.held
                else None
                for doc in batch
            ]
            presses = [p if p is not None and shares_prefill(p) and not is_decode_time(p) else None for p in presses]
            if any(p is not None for p in presses):
                out[name] = presses
        return out

    def keep(self, batch: Sequence[Document], presses: Mapping[str, list], bank: Mapping[str, list | None]) -> None:
        """Hold the prefills :func:`shared_prefills` made (``bank``) for the later policies' ``presses``."""
        for name, built in presses.items():
            for doc, press, done in zip(batch, built, bank.get(name) or [None] * len(batch)):
                if press is not None and done is not None:
                    self.held[(name, doc.doc_id)] = (press, done)

    def take(self, name: str, batch: Sequence[Document]) -> tuple[list, list] | None:
        """Policy ``name``'s held presses and prefills for ``batch`` (two lists, ``None`` where none is held),
        given up by the carry; None when none is held."""
        got = [self.held.pop((name, doc.doc_id), None) for doc in batch]
        if all(g is None for g in got):
            return None
        return [g and g[0] for g in got], [g and g[1] for g in got]
