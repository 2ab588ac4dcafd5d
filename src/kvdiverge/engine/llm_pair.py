"""The language-model kernel pair: one model, two KV caches (estimators.md §1).

The reference side ``P`` holds the full prompt cache; the evicted side ``Q`` the prompt
cache compressed by a kvpress press. Both implement :class:`kvdiverge.engine.pairs.KernelPair`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvdiverge.engine.coupling import coupling_dtype
from kvdiverge.engine.decoding import decode_log_probs
from kvdiverge.engine.errors import CompressionError, NonFiniteLogitsError, check_logits_finite

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
    abandoned suffix without touching other rows. ``prompt_len`` is the uncompressed
    prompt length of each row's document (int64, (n_rows,), or an int for all rows):
    the RoPE position of generated token ``i`` is ``prompt_len + i``.
    """

    def __init__(self, cache, valid: torch.Tensor, prompt_len):
        self.cache = cache
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
        # as kvpress's own pipeline does, whatever the cache length.
        position_ids = (self.prompt_len + self.n_gen).unsqueeze(1)
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
        One per document, batch size 1, each layer's keys/values of shape
        (1, kv_heads, length_d, head_dim); all documents' layers have equal length
        within a cache (checked by the caller).
    lengths : sequence of int
        Cache length of each document (tokens).
    rows_each : int
        Rows per document (replicates ``R``): document ``d`` fills rows ``d*R .. d*R+R-1``.
    device : torch.device
        Device of the ``valid`` mask.

    Returns
    -------
    (DynamicCache, torch.Tensor)
        The first cache, its layers replaced by the merged (B*R, kv_heads, max_len,
        head_dim) tensors (padding columns hold zeros), and ``valid``, bool
        (B*R, max_len): ``False`` on padding columns. With one document this is
        ``batch_repeat_interleave(R)``, exactly the old single-document path.
    """
    if len(caches) == 1:
        cache = caches[0]
        if rows_each > 1:
            cache.batch_repeat_interleave(rows_each)
        return cache, torch.ones(rows_each, lengths[0], dtype=torch.bool, device=device)
    longest = max(lengths)
    merged = caches[0]
    for li, layer in enumerate(merged.layers):
        parts_k, parts_v = [], []
        for cache, n in zip(caches, lengths):
            k, v = cache.layers[li].keys, cache.layers[li].values
            if n < longest:
                pad = k.new_zeros(k.shape[0], k.shape[1], longest - n, k.shape[3])
                k, v = torch.cat([pad, k], dim=2), torch.cat([pad.to(v.dtype), v], dim=2)
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
        A causal LM supported by kvpress, in eval mode.
    input_ids : sequence of int
        The chat-rendered prompt, length ``prompt_len`` (tokens).
    press : kvpress.BasePress or None
        The eviction press; ``None`` leaves the evicted cache equal to the full one.
    temperature, top_p : float
        Decoding transform (:func:`kvdiverge.engine.decoding.decode_log_probs`).
    expected_kept : int or None
        Prompt positions every layer must keep after compression (tokens). Checked
        after prefill; ``None`` only checks that a compressing press shortened the cache.
    eos_ids : sequence of int or None
        End-of-sequence ids; defaults to ``model.generation_config.eos_token_id``.

    Raises
    ------
    CompressionError
        From :meth:`start`, when a layer's evicted cache length is not the policy's
        kept count (a silently skipped compression).
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
        expected_kept: int | None = None,
        eos_ids: Sequence[int] | None = None,
    ):
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = coupling_dtype(self.device)
        self.prompts = [torch.as_tensor(list(input_ids), dtype=torch.long, device=self.device)]
        self.presses = [press]
        self.expected = [expected_kept]
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        if eos_ids is None:
            eos_ids = model_eos_ids(model)
        self.eos_ids = tuple(int(e) for e in eos_ids)
        self.vocab_size = int(model.config.vocab_size)
        self.kept_lens: list[int] = []
        self._ref: _CacheSide | None = None
        self._ev: _CacheSide | None = None

    @classmethod
    def from_documents(cls, model, prompts: Sequence[Sequence[int]], presses: Sequence,
                       expected_kept: Sequence[int | None], *, temperature: float, top_p: float = 1.0,
                       eos_ids: Sequence[int] | None = None) -> "LLMKernelPair":
        """A pair over several documents, each with its own press and kept count.

        Parameters
        ----------
        prompts : sequence of sequence of int
            The documents' prompt token ids.
        presses, expected_kept : sequence
            One press (or ``None``) and one kept count (or ``None``) per document.

        Raises
        ------
        ValueError
            If the three sequences differ in length or are empty.
        """
        if not len(prompts) == len(presses) == len(expected_kept) or not prompts:
            raise ValueError(f"prompts, presses and expected_kept must be non-empty and of one length, got "
                             f"{len(prompts)}, {len(presses)}, {len(expected_kept)}")
        pair = cls(model, prompts[0], presses[0], temperature=temperature, top_p=top_p,
                   expected_kept=expected_kept[0], eos_ids=eos_ids)
        pair.prompts = [torch.as_tensor(list(p), dtype=torch.long, device=pair.device) for p in prompts]
        pair.presses = list(presses)
        pair.expected = list(expected_kept)
        return pair

    @property
    def n_documents(self) -> int:
        """Documents in the pair (B)."""
        return len(self.prompts)

    @property
    def prompt_lens(self) -> list[int]:
        """Uncompressed prompt length of each document (tokens)."""
        return [int(p.numel()) for p in self.prompts]

    @property
    def prompt_len(self) -> int:
        """Prompt length of the first (or only) document (tokens)."""
        return self.prompt_lens[0]

    @property
    def press(self):
        """Press of the first (or only) document."""
        return self.presses[0]

    @property
    def kept_len(self) -> int | None:
        """Evicted cache length of the first (or only) document, known after :meth:`start`."""
        return self.kept_lens[0] if self.kept_lens else None

    def _transform(self, logits: torch.Tensor, side: str) -> torch.Tensor:
        check_logits_finite(logits, side)
        return decode_log_probs(logits, self.temperature, self.top_p, dtype=self.dtype)

    def _prefill(self, ids: torch.Tensor, press) -> tuple[object, torch.Tensor]:
        from transformers import DynamicCache

        cache = DynamicCache()
        ids = ids.unsqueeze(0)
        if press is None:
            out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        else:
            with press(self.model):
                out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return cache, out.logits[:, -1, :]

    @staticmethod
    def _check_compression(cache, press, prompt_len: int, expected_kept: int | None) -> int:
        lengths = {layer.keys.shape[-2] for layer in cache.layers}
        if len(lengths) != 1:
            raise CompressionError(f"evicted cache layers differ in length: {sorted(lengths)}")
        kept = lengths.pop()
        if expected_kept is not None and kept != expected_kept:
            raise CompressionError(
                f"evicted cache keeps {kept} of {prompt_len} prompt positions per layer, "
                f"the policy promises {expected_kept}: the press did not compress as configured"
            )
        ratio = getattr(press, "compression_ratio", 0.0) or 0.0
        if expected_kept is None and ratio > 0 and kept >= prompt_len:
            raise CompressionError(
                f"press {type(press).__name__} (compression_ratio={ratio}) left the cache "
                f"at the full {prompt_len} positions"
            )
        return kept

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
            If ``n_rows`` is not a multiple of B.
        """
        B = self.n_documents
        if n_rows % B:
            raise ValueError(f"n_rows = {n_rows} is not a multiple of the {B} documents of the pair")
        R = n_rows // B
        ref_caches, ev_caches, ref_logits, ev_logits = [], [], [], []
        self.kept_lens = []
        for ids, press, expected in zip(self.prompts, self.presses, self.expected):
            cache, logits = self._prefill(ids, None)
            ref_caches.append(cache)
            ref_logits.append(logits)
            cache, logits = self._prefill(ids, press)
            self.kept_lens.append(self._check_compression(cache, press, int(ids.numel()), expected))
            ev_caches.append(cache)
            ev_logits.append(logits)
        ref_cache, ref_valid = merge_caches(ref_caches, self.prompt_lens, R, self.device)
        ev_cache, ev_valid = merge_caches(ev_caches, self.kept_lens, R, self.device)
        prompt_len = torch.tensor(self.prompt_lens, device=self.device).repeat_interleave(R) if B > 1 else self.prompt_len
        self._ref = _CacheSide(ref_cache, ref_valid, prompt_len)
        self._ev = _CacheSide(ev_cache, ev_valid, prompt_len)
        logp = self._transform(torch.cat(ref_logits), "reference")
        logq = self._transform(torch.cat(ev_logits), "evicted")
        if B == 1:
            return logp.expand(n_rows, -1), logq.expand(n_rows, -1)
        return logp.repeat_interleave(R, dim=0), logq.repeat_interleave(R, dim=0)

    @torch.inference_mode()
    def advance(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``x`` (reference) and ``y`` (evicted), int64 shape (n_rows,); return next log-dists."""
        ref_logits = self._ref.forward(self.model, x.to(self.device))
        ev_logits = self._ev.forward(self.model, y.to(self.device))
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
