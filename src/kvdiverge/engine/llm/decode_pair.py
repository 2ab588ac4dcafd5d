"""The kernel pair of a decode-time policy: eviction along the history, branches replayed exactly.

For a decode-time policy (estimators.md §1) the evicted kernel ``Q(. | h)`` is the model's
next-token distribution after generating ``h`` one token per forward from a fresh prefill
under the press, press state (step counters, buffered hidden states, module masks)
included. A compressed cache cannot be cut back, so the evicted side runs in **lanes**:

- A lane is one module tree (:func:`kvdiverge.engine.llm.twin.evicted_twin`: the reference
  model's tensors, its own modules), one fresh copy of the document's press entered on
  it for the lane's whole life, and one batched KV cache with no padding. Its rows all
  started from one prefill of one document and each receives one token per forward, so
  the press's per-layer counters agree for every row, and a row's state is what a
  single-row run of its own history would reach (presses score and keep positions per
  row).
- At :meth:`DecodeTimePair.start` each document's ``R`` rows form one **chain lane**.
- When :meth:`DecodeTimePair.rewind` cuts a row back to ``L`` tokens (the branch start,
  ``t* = L + 1``), the row leaves its lane for a **replay lane**: a fresh twin with the
  document's prefill state, then the row's first ``L`` evicted-side tokens fed one per
  forward; the branch continues there. Rows of one document rewound to one ``L`` in the
  same call share a replay lane. The prefill state is the chain lane's one-row prefill
  (press object, cache, last logits), copied once at :meth:`DecodeTimePair.start`; each
  replay lane enters a deep copy of that press object and starts from a copy of that
  cache (``prefills_restored``). A press whose prefill leaves state with a batch
  dimension (module masks, or a row's ``row_state``, ``DMSPress``) has no such copy: its
  replay lane enters a fresh copy of the document's press and prefills the prompt anew,
  on one row, then on the lane's rows if it has more than one.
- :meth:`DecodeTimePair.keep_rows` drops rows from the pair; a dropped row rides along
  in its lane (fed its last token again; its outputs are discarded) until every row of
  the lane has left, when the lane is closed. So no press buffer with a batch dimension
  is ever sliced.
- A press whose adapter sets ``merge_lanes`` (its decode-time state is fixed at prefill and
  equal in every lane of a document, and each row's cache keeps one length per layer,
  ``SlidingWindowPress``) needs none of this separation. A replay lane joins a lane of
  its document whose layers hold as many positions as its own, once its history is
  replayed: the rows of a document then decode in one forward, each at its own RoPE
  position. Rows that leave are cut out of the cache at once instead of riding along.
  What a row computes is unchanged but for the rounding of a larger batch.

The reference side ``P`` is the full cache of :class:`kvdiverge.engine.llm.llm_pair.LLMKernelPair`
(rewound by masking) and never sees a press. Where a document's prefill keeps every
prompt position (a press that starts evicting while generating, or ratio 0), its reference
runs one forward per document, unpadded, with the lanes' kernels (a ``DynamicCache`` and
the model's own attention): a left-padded batch, or other attention kernels, would compute
the same attention with other roundings, so steps before the first compression, where
``Q = P`` exactly, would record a TV of rounding (1e-7 on the embedded model) and a branch
that a batch of one document does not have. Where every document's prefill evicted (in
some layer), no step has ``Q = P``, and the reference side is the batched one of
:class:`kvdiverge.engine.llm.llm_pair.LLMKernelPair`: all documents' rows in one forward
per step, left-padded, on the decoding kernels of :mod:`kvdiverge.engine.llm.side` (caches
written in place, grouped attention). Its rounding then differs from the lanes' by the
float32 noise floor (about 1e-6 in TV per step), against TVs that eviction makes orders
of magnitude larger.

The extra work is counted in ``DecodeTimePair.counts`` (forwards and row-steps of
prefills, lane steps and replays); :mod:`kvdiverge.planning.cost` bounds it from the config.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvdiverge.engine.core.errors import CompressionError, check_logits_finite
from kvdiverge.engine.core.sampling import Decoding
from kvdiverge.engine.hf import DynamicCache
from kvdiverge.engine.llm.lanes import Lane
from kvdiverge.engine.llm.pair_base import LLMPairBase, PairDocument
from kvdiverge.engine.llm.prefill import seeded
from kvdiverge.engine.llm.side import CacheSide, merge_caches
from kvdiverge.engine.presses.adapters import walk
from kvdiverge.engine.presses.registry import adapter_of, refusal, shares_prefill

__all__ = ["DecodeTimePair", "takes_prefill"]


def _merges_lanes(press) -> bool:
    """True when every press in ``press`` lets the lanes of a document decode as one (``merge_lanes``)."""
    return all(adapter_of(p).merge_lanes for p in walk(press))


def takes_prefill(press) -> bool:
    """True when a decode-time pair can start ``press``'s lanes from a shared prefill
    (:func:`kvdiverge.engine.llm.prefill.prefill_shared`): its decode-time state is fixed at prefill
    and equal in every lane (``merge_lanes``) and it shares its prefill forward."""
    return press is not None and _merges_lanes(press) and shares_prefill(press)


def _new_counts() -> dict[str, int]:
    return {
        k: 0
        for k in (
            "prefill_forwards",
            "prefill_rows",
            "prefills_restored",
            "lane_forwards",
            "lane_row_steps",
            "replay_forwards",
            "replay_row_steps",
            "reference_prefills",
            "reference_forwards",
            "reference_row_steps",
        )
    }


class DecodeTimePair(LLMPairBase):
    """One language model; full cache on the reference side, press-driven lanes on the evicted side.

    Implements :class:`kvdiverge.engine.core.pairs.KernelPair` (module docstring for the
    mechanism). Rows are document-major as in :class:`kvdiverge.engine.llm.llm_pair.LLMKernelPair`:
    row ``d*R + r`` is replicate ``r`` of document ``d``. Generated tokens take RoPE
    position ``prompt_len + t`` on both sides, whatever the cache length.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A causal LM supported by kvpress, in eval mode, with no press entered.
    documents : sequence of kvdiverge.engine.llm.pair_base.PairDocument
        The documents, in row order. Each lane enters its own deep copy of its document's
        ``press``, so the press objects are never entered themselves; ``expected_kept``
        (an int or ``None``) is the positions every layer must hold after the prefill
        (``None``: not checked); ``prefill_seed`` seeds torch's generator during each of the
        document's prefills. ``n_question`` must be left unset (a question after compression
        is refused), and ``prefilled`` too (each lane prefills its own press state) unless the
        press :func:`takes_prefill`: then ``prefilled`` is the document's
        :func:`~kvdiverge.engine.llm.prefill.prefill_shared` prefill and ``press`` the object
        that ran in it, and the chain lane starts from them (no prefill forward of its own).
    decoding : kvdiverge.engine.core.sampling.Decoding
        Decoding transform (:func:`kvdiverge.engine.core.decoding.decode_log_probs`) and
        end-of-sequence ids (``None``: ``model.generation_config.eos_token_id``).
    horizon, fast
        As :meth:`kvdiverge.engine.llm.llm_pair.LLMKernelPair.from_documents` (the
        reference side's cache and attention; the lanes keep the stock ones, see ``Lane``).

    Attributes
    ----------
    kept_lens : list of int
        Per document, the fewest positions a layer of its chain lane held along the chain
        (tokens): the prefill's kept count, then every decode-time compression.
    kept_per_layer : list of list of int
        Per document, the fewest positions each layer of its chain lane held along the chain
        (tokens), layer by layer (the shards' ``kept_per_layer``).
    counts : dict of str to int
        Forwards and row-steps so far: ``prefill_forwards`` / ``prefill_rows`` (evicted
        side, chain and replay lanes), ``prefills_restored`` (replay lanes started from the
        copied prefill instead), ``lane_forwards`` / ``lane_row_steps`` (one per lane
        per engine step, riding rows included), ``replay_forwards`` / ``replay_row_steps``
        (history fed to replay lanes), ``reference_prefills`` (prefills of the plain model: 0 where
        the chain lane's prefill forward gave the full cache), ``reference_forwards`` /
        ``reference_row_steps``.

    Raises
    ------
    ValueError
        If ``documents`` is empty, a document has a ``prefilled`` or an ``n_question``, or
        kvdiverge refuses a press (:func:`kvdiverge.engine.presses.registry.refusal`;
        ``CAMPress`` cannot be replayed).
    CompressionError
        From :meth:`start`, when a prefill does not keep ``expected_kept`` positions.
    NonFiniteLogitsError
        From :meth:`start`, :meth:`advance` and :meth:`rewind`.
    """

    def __init__(
        self,
        model,
        documents: Sequence[PairDocument],
        *,
        decoding: Decoding,
        horizon: int | None = None,
        fast: bool | None = None,
    ):
        for d, doc in enumerate(documents):
            if (doc.prefilled is not None and not takes_prefill(doc.press)) or doc.n_question:
                raise ValueError(
                    f"document {d}: a decode-time pair prefills each lane itself and takes no "
                    "shared prefill (but for a press whose state is fixed at prefill) or question after compression"
                )
            why = refusal(doc.press)
            if why:
                raise ValueError(f"press {type(doc.press).__name__}: {why}")
        self._setup(model, documents, decoding, horizon=horizon, fast=fast)
        self.counts = _new_counts()
        self._lanes: list[Lane] = []
        self._merges = [_merges_lanes(doc.press) for doc in documents]
        self._fresh = False  # rows in their chain lanes, in order: started, not rewound, none dropped

    @classmethod
    def from_documents(cls, model, documents: Sequence[PairDocument], **options) -> "DecodeTimePair":
        """The constructor, under :meth:`kvdiverge.engine.llm.llm_pair.LLMKernelPair.from_documents`'s name."""
        return cls(model, documents, **options)

    def _reference_prefill(self, ids: torch.Tensor):
        self.counts["reference_prefills"] += 1
        cache = DynamicCache()
        out = self.model(input_ids=ids.unsqueeze(0), past_key_values=cache, use_cache=True, logits_to_keep=1)
        return cache, out.logits[:, -1, :]

    @torch.inference_mode()
    def start(self, n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill the reference caches and one chain lane per document; return ``log p_1``, ``log q_1``.

        Both float64 (float32 on mps), shape (n_rows, vocab_size). ``n_rows`` must be a
        multiple of the number of documents B (``R = n_rows / B``).

        Raises
        ------
        ValueError
            If ``n_rows`` is not a multiple of B.
        """
        B = len(self.prompts)
        if n_rows % B:
            raise ValueError(f"n_rows = {n_rows} is not a multiple of the {B} documents of the pair")
        R = n_rows // B
        self.close()
        self._record("reset")
        self.counts = _new_counts()
        self._lanes, self.kept_lens, self.kept_per_layer, self._starts, ref = [], [], [], [], []
        shared, self._prefilled = self._prefilled, [None] * B  # used once; hold no second reference
        for d, (ids, doc, given) in enumerate(zip(self.prompts, self.documents, shared)):
            # a shared prefill: the press's state after it, its cut cache, the full cache
            start = None if given is None else (doc.press, given.ev, given.ev_logits)
            with seeded(doc.prefill_seed, self.device):
                lane = Lane(self.model, ids, doc.press, R, self.counts, start)
            self._starts.append(lane.snapshot if start is None else start)
            self._check_prefill(d, lane)
            lane.chain_doc = lane.doc = d
            self._lanes.append(lane)
            # the full cache from the chain lane's own prefill forward where the press allows it (none
            # needed with greedy tokens: the reference side is read from them)
            if given is not None:
                ref.append((given.ref, given.ref_logits))
            elif self._greedy is None:
                ref.append(lane.full if lane.full is not None else self._reference_prefill(ids))
            lane.full = None
        self._refs, self._ref_rows = [], []
        logp = self._reference_sides(ref, R) if self._greedy is None else None
        logq = self._transform(torch.cat([lane.first_logits for lane in self._lanes]), "evicted")
        self.reference = self._greedy_reference(logq.shape[-1])
        if self.reference is not None:
            logp = self.reference.start(n_rows)
        # per current row: its lane, its slot there, its document, its evicted-side history
        self._where = [(self._lanes[g // R], g % R) for g in range(n_rows)]
        self._doc = [g // R for g in range(n_rows)]
        self._hist: list[list[int]] = [[] for _ in range(n_rows)]
        self._record("begin", R)
        self._fresh = True
        return logp, logq.repeat_interleave(R, dim=0)

    def _reference_sides(self, ref: list, R: int) -> torch.Tensor:
        """The reference sides from each document's full cache and logits ``ref``; ``log p_1`` (B * R, vocab)."""
        n_rows = R * len(self.prompts)
        if all(min(kept) < n for kept, n in zip(self.kept_per_layer, self.prompt_lens)):
            # every prefill evicted: Q != P from the first step, one batched reference (module docstring)
            self._refs = [self._side([c for c, _ in ref], self.prompt_lens, self.prompt_lens, R)]
            self._ref_rows = [list(range(n_rows))]
        else:  # one unpadded reference side per document, on the lanes' kernels
            self._refs = [
                CacheSide(*merge_caches([c], [n], R, self.device), n, grouped=False)
                for (c, _), n in zip(ref, self.prompt_lens)
            ]
            self._ref_rows = [list(range(d * R, (d + 1) * R)) for d in range(len(self.prompts))]
        return self._transform(torch.cat([lg for _, lg in ref]), "reference").repeat_interleave(R, dim=0)

    def _check_prefill(self, d: int, lane: Lane) -> None:
        lengths = {layer.keys.shape[-2] for layer in lane.cache.layers}
        kept = min(lengths)
        expected = self.documents[d].expected_kept
        if expected is not None and lengths != {int(expected)}:
            raise CompressionError(
                f"evicted cache keeps {sorted(lengths)} of {self.prompt_lens[d]} prompt positions per layer, "
                f"the policy promises {expected}: the press did not compress as configured"
            )
        self.kept_lens.append(kept)
        self.kept_per_layer.append([layer.keys.shape[-2] for layer in lane.cache.layers])

    @torch.inference_mode()
    def advance(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``x`` (reference) and ``y`` (evicted), int64 shape (n_rows,); return next log-dists."""
        x, y = x.to(self.device), y.to(self.device)
        ref_logits = ev_logits = None
        for side, rows in zip(self._refs, self._ref_rows):
            if not rows:
                continue
            rows_t = torch.tensor(rows, dtype=torch.long, device=self.device)
            logits = side.forward(self.model, x[rows_t])
            if ref_logits is None:
                ref_logits = logits.new_empty((x.numel(), logits.shape[-1]))
            ref_logits[rows_t] = logits
            self.counts["reference_forwards"] += 1
            self.counts["reference_row_steps"] += len(rows)
        for lane in self._lanes:
            rows = [r for r, (ln, _) in enumerate(self._where) if ln is lane]
            slots = torch.tensor([self._where[r][1] for r in rows], dtype=torch.long, device=self.device)
            rows_t = torch.tensor(rows, dtype=torch.long, device=self.device)
            tokens = lane.last.clone()
            tokens[slots] = y[rows_t]
            logits = lane.forward(tokens, "lane")
            if ev_logits is None:
                ev_logits = logits.new_empty((y.numel(), logits.shape[-1]))
            ev_logits[rows_t] = logits[slots]
            if lane.chain_doc is not None:
                d = lane.chain_doc
                self.kept_lens[d] = min(self.kept_lens[d], lane.cache_len)
                self.kept_per_layer[d] = [
                    min(k, layer.get_seq_length()) for k, layer in zip(self.kept_per_layer[d], lane.cache.layers)
                ]
        for r, tok in enumerate(y.tolist()):
            self._hist[r].append(tok)
        self._record("append", x, y)
        logp = self.reference.advance(x) if self.reference is not None else self._transform(ref_logits, "reference")
        return logp, self._transform(ev_logits, "evicted")

    @property
    def block_forward(self) -> bool:
        """True when :meth:`advance_block` can run: after :meth:`start` and before any :meth:`rewind` or
        :meth:`keep_rows`, on one document whose press says which keys a block of tokens attends to
        (``block_mask``: :class:`kvdiverge.engine.presses.window.SlidingWindowPress`, a window that only
        drops its oldest positions). Other decode-time presses and quantized caches step token by token."""
        if not self._fresh or len(self._lanes) != 1 or len(self.prompts) != 1:
            return False
        lane = self._lanes[0]
        return lane.chain_doc == 0 and lane.block_mask(2) is not None

    @torch.inference_mode()
    def advance_block(
        self, tokens: torch.Tensor, *, reference: bool = True
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Append the same ``tokens`` (int64 (n_rows, L)) to both sides in one forward each; log-dists (n_rows, L, vocab).

        The teacher-forced pass (:mod:`kvdiverge.engine.llm.teacher`). The evicted side's
        forward takes the press's band mask (:attr:`block_forward`), so each token sees
        the keys it would see stepped, and the press then holds its window as after ``L``
        calls of :meth:`advance`: equal to stepping up to float rounding. ``reference=False``
        leaves the reference side behind (``None``), so the pair is done after it.

        Raises
        ------
        ValueError
            When :attr:`block_forward` is false.
        """
        if not self.block_forward or self.reference is not None:
            raise ValueError(
                "advance_block needs one document whose press gives a block mask, before any rewind, "
                "and no greedy_tokens"
            )
        tokens = tokens.to(self.device)
        lane = self._lanes[0]
        ev_logits = lane.forward_block(tokens, lane.block_mask(tokens.shape[1]))
        check_logits_finite(ev_logits.flatten(0, 1), "evicted")
        self.kept_lens[0] = min(self.kept_lens[0], lane.cache_len)
        logq = self._transform(ev_logits.flatten(0, 1), "evicted").view(ev_logits.shape)
        for r in range(tokens.shape[0]):
            self._hist[r].extend(tokens[r].tolist())
        if not reference:
            return None, logq
        ref_logits = self._refs[0].forward_block(self.model, tokens)
        return self._transform(ref_logits.flatten(0, 1), "reference").view(ref_logits.shape), logq

    @torch.inference_mode()
    def rewind(self, length: torch.Tensor) -> None:
        """Keep each row's first ``length[r]`` tokens; a row cut back is replayed in a fresh lane."""
        length = length.to(self.device)
        self._record("rewind", length)
        self._fresh = False
        if self.reference is not None:
            self.reference.rewind(length)
        for side, rows in zip(self._refs, self._ref_rows):
            if rows:
                side.rewind(length[torch.tensor(rows, dtype=torch.long, device=self.device)])
        groups: dict[tuple[int, int], list[int]] = {}
        for r, n in enumerate(length.tolist()):
            if n < len(self._hist[r]):
                groups.setdefault((self._doc[r], int(n)), []).append(r)
                del self._hist[r][n:]
        for r in (r for rows in groups.values() for r in rows):
            self._where[r] = (None, -1)
        self._close_empty()
        for (d, n), rows in groups.items():
            doc = self.documents[d]
            with seeded(doc.prefill_seed, self.device):
                lane = Lane(self.model, self.prompts[d], doc.press, len(rows), self.counts, self._starts[d])
            lane.doc = d
            for i in range(n):
                tokens = torch.tensor([self._hist[r][i] for r in rows], dtype=torch.long, device=self.device)
                check_logits_finite(lane.forward(tokens, "replay"), "evicted")
            first, lane = self._join(lane)
            for j, r in enumerate(rows):
                self._where[r] = (lane, first + j)

    def _join(self, lane: Lane) -> tuple[int, Lane]:
        """``(first slot, lane)`` where a replayed lane's rows now sit: a lane of its document
        with equal layer lengths when its press merges lanes (:meth:`Lane.absorb`), else its own."""
        if self._merges[lane.doc]:
            lens = lane.layer_lens
            for other in self._lanes:
                if other.doc == lane.doc and other.layer_lens == lens:
                    return other.absorb(lane), other
        self._lanes.append(lane)
        return 0, lane

    @torch.inference_mode()
    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (int64 indices into the current rows); dropped rows ride along in their lanes
        (a ``merge_lanes`` press's lanes cut them out)."""
        idx = rows.tolist()
        self._fresh = False
        if self.reference is not None:
            self.reference.keep_rows(rows)
        for d, old in enumerate(self._ref_rows):  # each document's reference side keeps its rows
            slot = {g: j for j, g in enumerate(old)}
            kept = [i for i, g in enumerate(idx) if g in slot]  # their new row numbers
            local = [slot[idx[i]] for i in kept]
            if not kept:
                self._refs[d] = None
            elif local != list(range(len(old))):
                self._refs[d].keep_rows(torch.tensor(local, dtype=torch.long, device=self.device))
            self._ref_rows[d] = kept
        self._where = [self._where[i] for i in idx]
        self._doc = [self._doc[i] for i in idx]
        self._hist = [self._hist[i] for i in idx]
        self._record("keep_rows", rows)
        self._close_empty()

    def _close_empty(self) -> None:
        """Close the lanes no current row sits in; cut the rows that left out of merging lanes."""
        used = {id(ln) for ln, _ in self._where if ln is not None}
        for lane in self._lanes:
            if id(lane) not in used:
                lane.close()
        self._lanes = [lane for lane in self._lanes if id(lane) in used]
        for lane in self._lanes:
            if not self._merges[lane.doc]:
                continue
            mine = [(r, slot) for r, (ln, slot) in enumerate(self._where) if ln is lane]
            slots = sorted(slot for _, slot in mine)
            if slots != list(range(lane.n)):
                lane.keep_slots(slots)
                new = {slot: j for j, slot in enumerate(slots)}
                for r, slot in mine:
                    self._where[r] = (lane, new[slot])

    def close(self) -> None:
        """Close every lane (their presses' hooks come off their twins)."""
        for lane in self._lanes:
            lane.close()
        self._lanes = []
