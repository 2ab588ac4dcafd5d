"""The language-model kernel pair: one model's weights, two KV caches (estimators.md §1).

The reference side ``P`` holds the full prompt cache and runs on the plain model; the
evicted side ``Q`` holds the prompt cache compressed by a kvpress press and runs on the
model's twin (:func:`kvdiverge.engine.llm.twin.evicted_twin`: the same tensors, its own module
tree), so no press hook or module state ever reaches ``P``. The pair implements
:class:`kvdiverge.engine.core.pairs.KernelPair`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvdiverge.engine.core.coupling import coupling_dtype
from kvdiverge.engine.core.decoding import decode_log_probs
from kvdiverge.engine.core.errors import CompressionError, NonFiniteLogitsError, check_logits_finite
from kvdiverge.engine.llm.masks import HeadMasks, attention_modules, check_patched
from kvdiverge.engine.llm.prefill import prefill, seeded
from kvdiverge.engine.presses.promises import KeptPromise, check_kept
from kvdiverge.engine.presses.registry import generation_start
from kvdiverge.engine.llm.twin import evicted_twin

__all__ = ["LLMKernelPair", "merge_caches", "model_eos_ids"]


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


class _CacheSide:
    """A batched KV cache plus per-row bookkeeping.

    ``valid`` (n_rows, cache_len) marks the cache columns each row attends to (padding
    of shorter prompts and rewound chain suffixes are ``False``); ``step`` (n_rows,
    cache_len) holds, for generated columns, the 0-based index of the generated token
    stored there (-1 for prompt and padding columns), so ``rewind`` can mask a row's
    abandoned suffix without touching other rows. ``prompt_len`` is the RoPE position of
    each row's first generated token (int64, (n_rows,), or an int for all rows): the
    uncompressed prompt length of its document, or the cache length for presses that
    re-rotate kept keys (:func:`kvdiverge.engine.presses.registry.generation_start`);
    the RoPE position of generated token ``i`` is ``prompt_len + i``. ``masks``
    (:class:`kvdiverge.engine.llm.masks.HeadMasks` or ``None``) masks prompt columns per layer
    and key-value head through ``modules``' ``masked_key_indices`` (kvpress's attention patch).
    """

    def __init__(self, cache, valid: torch.Tensor, prompt_len, masks: HeadMasks | None = None,
                 modules: Sequence = ()):
        self.cache = cache
        self.masks, self.modules = masks, list(modules)
        self.valid = valid
        self.step = torch.full(valid.shape, -1, dtype=torch.long, device=valid.device)
        self.n_gen = torch.zeros(valid.shape[0], dtype=torch.long, device=valid.device)
        self.prompt_len = prompt_len
        self.all_valid = bool(valid.all())

    def forward(self, model, tokens: torch.Tensor) -> torch.Tensor:
        n_rows = tokens.shape[0]
        self.valid = torch.cat([self.valid, self.valid.new_ones(n_rows, 1)], dim=1)
        self.step = torch.cat([self.step, self.n_gen.unsqueeze(1)], dim=1)
        # RoPE positions continue from the *uncompressed* prompt length (estimators.md §1),
        # as kvpress's own pipeline does, whatever the cache length (for presses that
        # re-rotate kept keys, from the cache length: registry.generation_start).
        position_ids = (self.prompt_len + self.n_gen).unsqueeze(1)
        if self.masks is not None:
            self.masks.apply(self.modules)
        out = model(
            input_ids=tokens.unsqueeze(1),
            past_key_values=self.cache,
            attention_mask=None if self.all_valid else self.valid.long(),
            position_ids=position_ids,
            use_cache=True,
        )
        self.n_gen += 1
        return out.logits[:, -1, :]

    def rewind(self, length: torch.Tensor) -> None:
        self.valid = self.valid & (self.step < length.unsqueeze(1))
        self.n_gen = length.clone()
        self.all_valid = bool(self.valid.all())

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (int64 indices, in the new order); drop columns no kept row attends to."""
        self.valid, self.step, self.n_gen = self.valid[rows], self.step[rows], self.n_gen[rows]
        if isinstance(self.prompt_len, torch.Tensor):
            self.prompt_len = self.prompt_len[rows]
        cols = self.valid.any(0)
        trim = not bool(cols.all())
        if trim:
            cols = cols.nonzero().squeeze(1)
            self.valid, self.step = self.valid[:, cols], self.step[:, cols]
        if self.masks is not None:
            self.masks.keep_rows(rows, cols if trim else None)
        for layer in self.cache.layers:
            keys, values = layer.keys[rows], layer.values[rows]
            if trim:
                keys, values = keys[:, :, cols], values[:, :, cols]
            layer.keys, layer.values = keys, values
        self.all_valid = bool(self.valid.all())


def merge_caches(caches: Sequence, lengths: Sequence[int], rows_each: int, device) -> tuple[object, torch.Tensor]:
    """One batched cache from per-document caches, left-padded to the longest.

    Parameters
    ----------
    caches : sequence of transformers.DynamicCache
        One per document, batch size 1, each layer's keys of shape (1, kv_heads, n, head_dim)
        and values of shape (1, kv_heads, n, v_head_dim); a layer may be shorter than its
        document's ``lengths[d]`` (per-layer budgets): it is padded on the left too.
    lengths : sequence of int
        Cache width of each document (tokens): its longest layer.
    rows_each : int
        Rows per document (replicates ``R``): document ``d`` fills rows ``d*R .. d*R+R-1``.
    device : torch.device
        Device of the ``valid`` mask.

    Returns
    -------
    (DynamicCache, torch.Tensor)
        The first cache, its layers replaced by the merged (B*R, kv_heads, max_len,
        head_dim) keys and (B*R, kv_heads, max_len, v_head_dim) values (padding columns
        hold zeros), and ``valid``, bool (B*R, max_len): ``False`` on each document's left
        padding (a shorter layer's own padding is masked per layer,
        :class:`kvdiverge.engine.llm.masks.HeadMasks`). With one document whose layers all have
        its length this is ``batch_repeat_interleave(R)``.

    Raises
    ------
    ValueError
        If a layer is longer than its document's length.
    """
    longest = max(lengths)
    even = all(layer.keys.shape[2] == n for cache, n in zip(caches, lengths) for layer in cache.layers)
    if len(caches) == 1 and even:
        cache = caches[0]
        if rows_each > 1:
            cache.batch_repeat_interleave(rows_each)
        return cache, torch.ones(rows_each, lengths[0], dtype=torch.bool, device=device)
    merged = caches[0]
    for li, layer in enumerate(merged.layers):
        parts_k, parts_v = [], []
        for d, cache in enumerate(caches):
            k, v = cache.layers[li].keys, cache.layers[li].values
            if k.shape[2] > lengths[d]:
                raise ValueError(f"document {d}, layer {li}: {k.shape[2]} cache columns, more than its length "
                                 f"{lengths[d]}")
            pad = longest - k.shape[2]
            if pad:
                k = torch.cat([k.new_zeros(k.shape[0], k.shape[1], pad, k.shape[3]), k], dim=2)
                v = torch.cat([v.new_zeros(v.shape[0], v.shape[1], pad, v.shape[3]), v], dim=2)
            parts_k.append(k.expand(rows_each, -1, -1, -1))
            parts_v.append(v.expand(rows_each, -1, -1, -1))
        layer.keys, layer.values = torch.cat(parts_k), torch.cat(parts_v)
    valid = torch.zeros(len(caches) * rows_each, longest, dtype=torch.bool, device=device)
    for d, n in enumerate(lengths):
        valid[d * rows_each:(d + 1) * rows_each, longest - n:] = True
    return merged, valid


class LLMKernelPair:
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
    document-major: row ``d*R + r`` is replicate ``r`` of document ``d``. Each side is
    decoded by its own forward pass per step, on the same rows in the same order, and
    with ratio 0 the two sides' caches and padding are identical, so the TV is exactly 0.

    Logits are checked for NaN/±inf on every forward (:class:`NonFiniteLogitsError`).
    The decoding transform runs on the model's device in float64 (float32 where the
    device has no float64, :func:`coupling_dtype`); returned log-distributions stay there.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A causal LM supported by kvpress, in eval mode, with no press entered.
    input_ids : sequence of int
        The chat-rendered prompt, length ``prompt_len`` (tokens).
    press : kvpress.BasePress or None
        The eviction press; ``None`` leaves the evicted cache equal to the full one.
    temperature, top_p : float
        Decoding transform (:func:`kvdiverge.engine.core.decoding.decode_log_probs`).
    expected_kept : int, KeptPromise or None
        What the press promises to keep (:func:`kvdiverge.engine.presses.promises.kept_promise`);
        an int: that many prompt positions in every layer and head. Checked after
        prefill; ``None`` only checks that a compressing press evicted something.
    eos_ids : sequence of int or None
        End-of-sequence ids; defaults to ``model.generation_config.eos_token_id``.
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
        temperature: float,
        top_p: float = 1.0,
        expected_kept: "int | KeptPromise | None" = None,
        eos_ids: Sequence[int] | None = None,
        prefill_seed: int | None = None,
    ):
        self._setup(model, [input_ids], [press], [expected_kept], temperature, top_p, eos_ids, [prefill_seed])

    def _setup(self, model, prompts, presses, expected, temperature, top_p, eos_ids, seeds=None) -> None:
        self.model = model
        self.twin = evicted_twin(model)
        self.device = next(model.parameters()).device
        self.dtype = coupling_dtype(self.device)
        self.prompts = [torch.as_tensor(list(p), dtype=torch.long, device=self.device) for p in prompts]
        self.presses = list(presses)
        self.expected = list(expected)
        self.prefill_seeds = list(seeds) if seeds is not None else [None] * len(self.prompts)
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        if eos_ids is None:
            eos_ids = model_eos_ids(model)
        self.eos_ids = tuple(int(e) for e in eos_ids)
        self.vocab_size = int(model.config.vocab_size)
        self.kept_lens: list[int] = []
        self.kept_per_layer: list[list[int]] = []
        self.kept_counts: list[torch.Tensor] = []
        self.prefill_forwards: list[int] = []
        self._ref: _CacheSide | None = None
        self._ev: _CacheSide | None = None

    @classmethod
    def from_documents(cls, model, prompts: Sequence[Sequence[int]], presses: Sequence,
                       expected_kept: Sequence, *, temperature: float, top_p: float = 1.0,
                       eos_ids: Sequence[int] | None = None,
                       prefill_seeds: Sequence[int | None] | None = None) -> "LLMKernelPair":
        """A pair over several documents, each with its own press and kept count.

        Parameters
        ----------
        prompts : sequence of sequence of int
            The documents' prompt token ids.
        presses, expected_kept : sequence
            One press (or ``None``) and one promise (int, KeptPromise or ``None``) per document.
        prefill_seeds : sequence of int or None, optional
            Per document, the seed of torch's global generator during its prefill
            (:func:`kvdiverge.engine.llm.prefill.prefill_seed`), for presses that draw from it;
            ``None`` (the default) leaves the generator as it is.

        Raises
        ------
        ValueError
            If the three sequences differ in length or are empty.
        """
        seeds = [None] * len(prompts) if prefill_seeds is None else list(prefill_seeds)
        if not len(prompts) == len(presses) == len(expected_kept) == len(seeds) or not prompts:
            raise ValueError(f"prompts, presses, expected_kept and prefill_seeds must be non-empty and of one "
                             f"length, got {len(prompts)}, {len(presses)}, {len(expected_kept)}, {len(seeds)}")
        pair = cls.__new__(cls)
        pair._setup(model, prompts, presses, expected_kept, temperature, top_p, eos_ids, seeds)
        return pair

    @property
    def n_documents(self) -> int:
        """Documents in the pair (B)."""
        return len(self.prompts)

    @property
    def prompt_lens(self) -> list[int]:
        """Uncompressed prompt length of each document (tokens)."""
        return [int(p.numel()) for p in self.prompts]

    def _transform(self, logits: torch.Tensor, side: str) -> torch.Tensor:
        check_logits_finite(logits, side)
        return decode_log_probs(logits, self.temperature, self.top_p, dtype=self.dtype)

    def _prefill_document(self, ids: torch.Tensor, press, expected, seed):
        """Prefill one document (torch's generator seeded with ``seed``), check its evicted cache, record its kept counts."""
        n = int(ids.numel())
        with seeded(seed, self.device):
            done = prefill(self.model, self.twin, ids, press)
        for li, layer in enumerate(done.ev.layers):
            if layer.keys.shape[2] > n:
                raise CompressionError(f"layer {li} of the evicted cache holds {layer.keys.shape[2]} positions, "
                                       f"more than the {n} of the prompt: press {type(press).__name__} "
                                       f"left extra positions in the cache")
        kept = done.kept
        check_kept(kept, expected, self.twin.config, press, n)
        self.kept_lens.append(int(torch.round(kept.double().mean())))
        self.kept_per_layer.append([int(k) for k in kept.sum(1)])
        self.kept_counts.append(kept.cpu())
        self.prefill_forwards.append(done.forwards)
        return done

    def _positions(self, starts: Sequence[int], R: int):
        """RoPE position of each row's first generated token: an int for one document, else int64 (B * R,)."""
        if len(starts) == 1:
            return int(starts[0])
        return torch.tensor(list(starts), device=self.device).repeat_interleave(R)

    @torch.inference_mode()
    def start(self, n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill both caches of every document, check the compression, merge to ``n_rows`` rows.

        ``n_rows`` must be a multiple of the number of documents B (``R = n_rows / B``
        rows per document). The two sides stay separate, each decoded by its own forward
        pass per step: batching them into one pass would let the rows' batch positions
        perturb the logits (~1e-6 on CPU), and ratio 0 must give a TV of exactly 0.

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
        self.kept_lens, self.kept_per_layer, self.kept_counts, self.prefill_forwards = [], [], [], []
        done = [self._prefill_document(*doc) for doc in zip(self.prompts, self.presses, self.expected,
                                                            self.prefill_seeds)]
        widths = [max(layer.keys.shape[2] for layer in d.ev.layers) for d in done]
        starts = [generation_start(p, n, w) for p, n, w in zip(self.presses, self.prompt_lens, widths)]
        masks = HeadMasks.merge([d.keep for d in done], widths, R)
        if masks is not None:
            check_patched(self.twin)
        ref_cache, ref_valid = merge_caches([d.ref for d in done], self.prompt_lens, R, self.device)
        ev_cache, ev_valid = merge_caches([d.ev for d in done], widths, R, self.device)
        self._ref = _CacheSide(ref_cache, ref_valid, self._positions(self.prompt_lens, R))
        self._ev = _CacheSide(ev_cache, ev_valid, self._positions(starts, R), masks, attention_modules(self.twin))
        logp = self._transform(torch.cat([d.ref_logits for d in done]), "reference")
        logq = self._transform(torch.cat([d.ev_logits for d in done]), "evicted")
        if B == 1:
            return logp.expand(n_rows, -1), logq.expand(n_rows, -1)
        return logp.repeat_interleave(R, dim=0), logq.repeat_interleave(R, dim=0)

    @torch.inference_mode()
    def advance(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``x`` (reference) and ``y`` (evicted), int64 shape (n_rows,); return next log-dists."""
        ref_logits = self._ref.forward(self.model, x.to(self.device))
        ev_logits = self._ev.forward(self.twin, y.to(self.device))
        return self._transform(ref_logits, "reference"), self._transform(ev_logits, "evicted")

    @torch.inference_mode()
    def rewind(self, length: torch.Tensor) -> None:
        """Keep each row's first ``length[r]`` generated tokens on both sides (int64, shape (n_rows,))."""
        length = length.to(self.device)
        self._ref.rewind(length)
        self._ev.rewind(length)

    @torch.inference_mode()
    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (int64 indices into the current rows) on both sides; later calls see fewer rows."""
        rows = rows.to(self.device)
        self._ref.keep_rows(rows)
        self._ev.keep_rows(rows)
