"""The language-model kernel pair: one model's weights, two KV caches (estimators.md §1).

The reference side ``P`` holds the full prompt cache; the evicted side ``Q`` holds the
prompt cache compressed by a kvpress press. The press is entered on the model's twin
(:func:`kvdiverge.engine.llm.twin.evicted_twin`: the same tensors, its own module tree),
so no press hook or module state ever reaches the model. After the prefill both sides
decode as the rows of one cache, one forward per step (:class:`kvdiverge.engine.llm.side.JointSides`).
The pair implements :class:`kvdiverge.engine.core.pairs.KernelPair`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvdiverge.engine.core.errors import CompressionError
from kvdiverge.engine.core.sampling import Decoding
from kvdiverge.engine.llm.masks import HeadMasks, attention_modules, check_patched
from kvdiverge.engine.llm.pair_base import LLMPairBase, PairDocument, model_eos_ids
from kvdiverge.engine.llm.prefill import prefill, seeded
from kvdiverge.engine.llm.side import CacheSide, JointSides, SeparateSides, merge_caches
from kvdiverge.engine.llm.twin import evicted_twin
from kvdiverge.engine.presses.layer_types import full_layers
from kvdiverge.engine.presses.promises import KeptPromise, check_kept
from kvdiverge.engine.presses.registry import generation_start

__all__ = ["LLMKernelPair", "PairDocument", "merge_caches", "model_eos_ids"]


class LLMKernelPair(LLMPairBase):
    """One language model, two KV caches: full prompt cache (``P``) and evicted (``Q``).

    The evicted cache is the prompt prefilled under a kvpress press, which compresses
    each layer's cache once, during prefill (kvpress semantics: the prefill's own
    last-position logits use the full attention, so ``q_1 = p_1``; compression acts
    from the first generated token on). Generated tokens are appended to both caches
    and never evicted; their RoPE positions continue from the uncompressed prompt
    length on both sides. This is exactly what ``with press(model): model.generate(...)``
    and kvpress's pipeline do.

    The evicted side runs on the model's twin (:func:`kvdiverge.engine.llm.twin.evicted_twin`,
    built once per pair: new module objects over the same parameter tensors), so press
    hooks and module state (``masked_key_indices``) stay off the reference side. One
    prefill gives both caches where the press allows it (:mod:`kvdiverge.engine.llm.prefill`).
    A press may shorten each layer by its own count (PyramidKV) or mask keys per head
    (AdaKV): each row then attends, per layer and key-value head, to its own document's
    kept positions only (:class:`kvdiverge.engine.llm.masks.HeadMasks`, applied by kvpress's
    attention patch).

    Several documents (:meth:`from_documents`) share one pair: each is prefilled alone
    under its own press (kvpress compresses one sequence at a time, so no padding enters
    the compression), then the per-document caches are merged into one batched cache per
    side, left-padded to the longest with masked columns (:func:`merge_caches`). Rows are
    document-major: row ``d*R + r`` is replicate ``r`` of document ``d``.

    Both sides decode as the rows of one cache (:class:`kvdiverge.engine.llm.side.JointSides`):
    the reference rows, then the evicted rows in the same order (the caller's order: the
    cache may hold its rows in another, :class:`kvdiverge.engine.llm.side.CacheSide`), each
    evicted document left-padded to its reference width, one forward per step on the twin (its press has
    exited; its per-head masks name evicted rows only). The weights are read once per step
    instead of twice. Rows with equal inputs get equal outputs within a forward, so with
    ratio 0 the TV is exactly 0. The cache is written in place
    (:class:`kvdiverge.engine.llm.cache.CapacityLayer`, allocated once) and attended with the
    grouped attention (:mod:`kvdiverge.engine.llm.attention`, no ``repeat_kv``), so no step
    copies a cache. ``fast=False`` keeps the stock path for comparison: a forward per side,
    the reference side on the model, transformers' ``DynamicCache`` and the model's attention
    (``joint=False`` keeps a forward per side on the fast kernels).

    Logits are checked for NaN/±inf on every forward (:class:`~kvdiverge.engine.core.errors.NonFiniteLogitsError`).
    The decoding transform runs on the model's device in float64 (float32 where the
    device has no float64, :func:`~kvdiverge.engine.core.coupling.coupling_dtype`); returned log-distributions stay there.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A causal LM supported by kvpress, in eval mode, with no press entered.
    input_ids : sequence of int
        The chat-rendered prompt, length ``prompt_len`` (tokens).
    press : kvpress.BasePress or None
        The eviction press; ``None`` leaves the evicted cache equal to the full one.
    decoding : kvdiverge.engine.core.sampling.Decoding
        Decoding transform (:func:`kvdiverge.engine.core.decoding.decode_log_probs`) and
        end-of-sequence ids (``None``: ``model.generation_config.eos_token_id``).
    expected_kept : int, KeptPromise or None
        What the press promises to keep (:func:`kvdiverge.engine.presses.registry.kept_promise`);
        an int: that many prompt positions in every layer and head. Checked after
        prefill; ``None`` only checks that a compressing press evicted something.
    prefill_seed : int or None
        Seed of torch's global generator during the prefill (:func:`kvdiverge.engine.llm.prefill.seeded`),
        for presses that draw from it; ``None`` leaves the generator as it is.

    Attributes
    ----------
    kept_lens : list of int
        Per document after :meth:`start`: prompt positions kept per key-value head, the
        mean over layers and heads, rounded to the nearest integer (tokens).
    kept_per_layer : list of list of int
        Per document and layer: prompt positions kept, summed over the layer's key-value heads.
    kept_counts : list of torch.Tensor
        Per document: prompt positions kept per layer and key-value head, int64 (layers, kv_heads), on CPU.
    prefill_forwards : list of int
        Per document: prefill forwards run (1, or 2 for presses that change the forward).

    Raises
    ------
    CompressionError
        From :meth:`start`, when a layer's kept count breaks the press's promise (the
        message names the layer), or a layer holds more columns than the prompt.
    NonFiniteLogitsError
        From :meth:`start` and :meth:`advance`.
    """

    def __init__(
        self,
        model,
        input_ids: Sequence[int],
        press=None,
        *,
        decoding: Decoding,
        expected_kept: "int | KeptPromise | None" = None,
        prefill_seed: int | None = None,
    ):
        document = PairDocument(input_ids, press, expected_kept, prefill_seed)
        self._setup(model, [document], decoding)

    def _setup(
        self,
        model,
        documents: Sequence[PairDocument],
        decoding: Decoding,
        *,
        horizon: int | None = None,
        fast: bool | None = None,
        joint: bool | None = None,
    ) -> None:
        super()._setup(model, documents, decoding, horizon=horizon, fast=fast)
        self.twin = evicted_twin(model)
        self.kept_counts: list[torch.Tensor] = []
        self.prefill_forwards: list[int] = []
        self.joint = self.fast if joint is None else bool(joint)
        self._sides: JointSides | SeparateSides | CacheSide | None = None

    @classmethod
    def from_documents(
        cls,
        model,
        documents: Sequence[PairDocument],
        *,
        decoding: Decoding,
        horizon: int | None = None,
        fast: bool | None = None,
        joint: bool | None = None,
    ) -> "LLMKernelPair":
        """A pair over several documents, each with its own prompt, press, promise, prefill seed,
        prefill and question length (:class:`kvdiverge.engine.llm.pair_base.PairDocument`).

        Parameters
        ----------
        model : transformers.PreTrainedModel
            As the class.
        documents : sequence of PairDocument
            The documents, in row order. A document's ``prefilled`` (its prefill already run
            for its press, :func:`kvdiverge.engine.llm.prefill.prefill_shared`) is checked and
            merged by :meth:`start` as its own, and the pair drops it there; without one,
            :meth:`start` prefills the document under its press, torch's generator seeded
            with its ``prefill_seed``.
        decoding : kvdiverge.engine.core.sampling.Decoding
            As the class.
        horizon : int or None, optional
            ``T``, when known: each side's cache is allocated once for ``prompt + 2T - 2``
            columns (:func:`kvdiverge.engine.llm.planner.cache_columns`); ``None`` allocates
            a few columns more than the prompt and grows by half when full.
        fast : bool or None, optional
            ``True`` (the default, unless inside :func:`kvdiverge.engine.llm.pair_base.stock_kernels`): caches written in place and the grouped decoding
            attention (:mod:`kvdiverge.engine.llm.attention`); ``False``: transformers'
            ``DynamicCache`` and the model's own attention, for comparison. Both give the
            same distributions up to float rounding.
        joint : bool or None, optional
            Decode both sides as the rows of one forward per step
            (:class:`kvdiverge.engine.llm.side.JointSides`); ``None`` (the default): when ``fast``.

        Raises
        ------
        ValueError
            If ``documents`` is empty.
        """
        pair = cls.__new__(cls)
        pair._setup(model, documents, decoding, horizon=horizon, fast=fast, joint=joint)
        return pair

    def _prefill_document(self, ids: torch.Tensor, doc: PairDocument, given=None):
        """Prefill one document (torch's generator seeded with its ``prefill_seed``) unless ``given``;
        check its evicted cache (the context's part against the promise), record its kept counts
        (question included)."""
        n, press, n_question = int(ids.numel()), doc.press, doc.n_question
        if given is not None:
            done = given
        else:
            with seeded(doc.prefill_seed, self.device):
                done = prefill(self.model, self.twin, ids, press, n_question=n_question)
        for li, layer in enumerate(done.ev.layers):
            if layer.keys.shape[2] > n:
                raise CompressionError(
                    f"layer {li} of the evicted cache holds {layer.keys.shape[2]} positions, "
                    f"more than the {n} of the prompt: press {type(press).__name__} "
                    f"left extra positions in the cache"
                )
        kept = done.kept
        check_kept(kept - n_question, doc.expected_kept, self.twin.config, press, n - n_question)
        # the layers the press compresses: a sliding layer keeps its whole prompt (layer_types)
        self.kept_lens.append(int(torch.round(kept[full_layers(self.twin.config)].double().mean())))
        self.kept_per_layer.append([int(k) for k in kept.sum(1)])
        self.kept_counts.append(kept.cpu())
        self.prefill_forwards.append(done.forwards)
        return done

    @torch.inference_mode()
    def start(self, n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill both caches of every document, check the compression, merge to ``n_rows`` rows.

        ``n_rows`` must be a multiple of the number of documents B (``R = n_rows / B``
        rows per document). The sides are then decoded jointly (one forward of ``2 n_rows``
        rows per step) or separately (a forward per side): see the class.

        Returns
        -------
        (torch.Tensor, torch.Tensor)
            ``log p_1`` and ``log q_1``, float64 (float32 on mps), shape (n_rows, vocab_size),
            on the model's device.

        Raises
        ------
        ValueError
            If ``n_rows`` is not a multiple of B, or a press masks keys per head on an
            attention implementation kvpress does not patch (``eager``).
        """
        B = self.n_documents
        if n_rows % B:
            raise ValueError(f"n_rows = {n_rows} is not a multiple of the {B} documents of the pair")
        R = n_rows // B
        self._record("reset")
        self.kept_lens, self.kept_per_layer, self.kept_counts, self.prefill_forwards = [], [], [], []
        given, self._prefilled = self._prefilled, [None] * B  # merged below; hold no second reference
        done = [self._prefill_document(*doc) for doc in zip(self.prompts, self.documents, given)]
        widths = [max(layer.keys.shape[2] for layer in d.ev.layers) for d in done]
        starts = [generation_start(p, n, w) for p, n, w in zip(self.presses, self.prompt_lens, widths)]
        if self._greedy is not None:  # the evicted rows alone; the reference read from the greedy tokens
            self._sides = self._evicted_side(done, widths, starts, R)
            logq = self._transform(torch.cat([d.ev_logits for d in done]), "evicted")
            self.reference = self._greedy_reference(logq.shape[-1])
            self._record("begin", R)
            return self.reference.start(n_rows), logq.repeat_interleave(R, dim=0)
        self._sides = (self._joint_sides if self.joint else self._separate_sides)(done, widths, starts, R)
        logp = self._transform(torch.cat([d.ref_logits for d in done]), "reference")
        logq = self._transform(torch.cat([d.ev_logits for d in done]), "evicted")
        self._record("begin", R)
        if B == 1:
            return logp.expand(n_rows, -1), logq.expand(n_rows, -1)
        return logp.repeat_interleave(R, dim=0), logq.repeat_interleave(R, dim=0)

    def _evicted_side(self, done, widths, starts, R) -> CacheSide:
        """The evicted rows on the twin, with the press's per-head masks."""
        masks = HeadMasks.merge([d.keep for d in done], widths, R)
        if masks is not None:
            check_patched(self.twin)
        return self._side([d.ev for d in done], widths, starts, R, masks, attention_modules(self.twin))

    def _separate_sides(self, done, widths, starts, R) -> SeparateSides:
        """The reference rows on the model, the evicted rows on the twin, a forward each per step."""
        ev = self._evicted_side(done, widths, starts, R)
        ref = self._side([d.ref for d in done], self.prompt_lens, self.prompt_lens, R)
        return SeparateSides(ref, ev, self.model, self.twin)

    def _joint_sides(self, done, widths, starts, R) -> JointSides:
        """Both sides' rows in one cache on the twin (:class:`kvdiverge.engine.llm.side.JointSides`)."""
        full = [
            [
                torch.ones(lay.keys.shape[1], lay.keys.shape[2], dtype=torch.bool, device=self.device)
                for lay in d.ref.layers
            ]
            for d in done
        ]
        lengths = self.prompt_lens + widths
        masks = HeadMasks.merge(full + [d.keep for d in done], lengths, R)
        if masks is not None:
            check_patched(self.twin)
        side = self._side(
            [d.ref for d in done] + [d.ev for d in done],
            lengths,
            self.prompt_lens + starts,
            R,
            masks,
            attention_modules(self.twin),
        )
        return JointSides(side, self.twin)

    @torch.inference_mode()
    def advance(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``x`` (reference) and ``y`` (evicted), int64 shape (n_rows,); return next log-dists."""
        if self.reference is not None:
            ev_logits = self._sides.forward(self.twin, y.to(self.device))
            self._record("append", x, y)
            return self.reference.advance(x), self._transform(ev_logits, "evicted")
        ref_logits, ev_logits = self._sides.forward(x.to(self.device), y.to(self.device))
        self._record("append", x, y)
        return self._transform(ref_logits, "reference"), self._transform(ev_logits, "evicted")

    @torch.inference_mode()
    def advance_block(
        self, tokens: torch.Tensor, *, reference: bool = True
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Append the same ``tokens`` (int64 (n_rows, L)) to both sides, one forward; log-dists (n_rows, L, vocab) each.

        The teacher-forced pass (:mod:`kvdiverge.engine.llm.teacher`); rows then hold ``L``
        more generated tokens, as after ``L`` calls of :meth:`advance`. ``reference=False``
        runs the evicted side alone and returns ``None`` for the reference (the pass shares
        one reference side among a document's policies); it needs a pair whose sides decode
        apart (``joint=False``) and leaves the reference side behind, so the pair is done after it.

        Raises
        ------
        ValueError
            With a repetition penalty; with ``reference=False`` on a pair decoding its sides jointly.
        """
        if self._repeats is not None or self.reference is not None:
            raise ValueError(
                "advance_block decodes without a repetition penalty or greedy_tokens (the teacher-forced pass)"
            )
        tokens = tokens.to(self.device)
        if not reference:
            if not isinstance(self._sides, SeparateSides):
                raise ValueError("advance_block(reference=False) needs a pair built with joint=False")
            ev_logits = self._sides.ev.forward_block(self.twin, tokens)
            return None, self._transform(ev_logits.flatten(0, 1), "evicted").view(ev_logits.shape)
        ref_logits, ev_logits = self._sides.forward_block(tokens, tokens)
        shape = ref_logits.shape
        logp = self._transform(ref_logits.flatten(0, 1), "reference").view(shape)
        return logp, self._transform(ev_logits.flatten(0, 1), "evicted").view(shape)

    @property
    def block_forward(self) -> bool:
        """True when :meth:`advance_block` can run (after :meth:`start`): the evicted rows have no
        per-head masks, or they run on the grouped attention, which takes the masks as a boolean mask;
        False for a pair reading its reference from ``greedy_tokens``."""
        if self.reference is not None:
            return False
        if isinstance(self._sides, JointSides):
            return self._sides.side.block_masks(self.twin)
        return self._sides.ev.block_masks(self.twin)

    @torch.inference_mode()
    def rewind(self, length: torch.Tensor) -> None:
        """Keep each row's first ``length[r]`` generated tokens on both sides (int64, shape (n_rows,))."""
        self._sides.rewind(length.to(self.device))
        if self.reference is not None:
            self.reference.rewind(length)
        self._record("rewind", length)

    @torch.inference_mode()
    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (distinct int64 indices into the current rows) on both sides.

        Later calls see fewer rows, in this order.
        """
        self._sides.keep_rows(rows.to(self.device))
        if self.reference is not None:
            self.reference.keep_rows(rows)
        self._record("keep_rows", rows)
