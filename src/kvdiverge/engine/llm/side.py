"""One side of a kernel pair: a batched KV cache, its per-row bookkeeping, the merge of documents.

:class:`CacheSide` decodes the rows of one side (reference or evicted) one token per
forward. Its cache layers hold their keys and values in buffers with capacity
(:class:`kvdiverge.engine.llm.cache.CapacityLayer`, written in place) and its forwards
use the grouped decoding attention (:mod:`kvdiverge.engine.llm.attention`, no
``repeat_kv``); both can be switched off (``DynamicCache`` appends and the model's own
attention) for comparison.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from kvdiverge.engine.hf import Cache
from kvdiverge.engine.llm.attention import GROUPED_SDPA
from kvdiverge.engine.llm.cache import CapacityLayer, capacity_cache, stack_documents
from kvdiverge.engine.llm.masks import HeadMasks
from kvdiverge.engine.presses.layer_types import has_sliding_layers, layer_type_masks

__all__ = ["CacheSide", "JointSides", "SeparateSides", "fill_holes", "grouped_attention", "merge_caches"]

#: Columns a cache is allocated beyond its prompt when the horizon is not known.
DEFAULT_SPARE = 64


@contextlib.contextmanager
def grouped_attention(model, enabled: bool = True):
    """Run the block with ``model`` on :data:`~kvdiverge.engine.llm.attention.GROUPED_SDPA` if it is on ``sdpa``.

    The model's configured attention is restored on exit; a model on another
    implementation (``eager``, flash kernels) keeps it.
    """
    config = model.config
    name = getattr(config, "_attn_implementation", None)
    if not enabled or name != "sdpa":
        yield
        return
    config._attn_implementation = GROUPED_SDPA
    try:
        yield
    finally:
        config._attn_implementation = name


class CacheSide:
    """A batched KV cache plus per-row bookkeeping.

    ``valid`` (n_rows, cache_len) marks the cache columns each row attends to (padding
    of shorter prompts and rewound chain suffixes are ``False``); ``step`` (n_rows,
    cache_len) holds, for generated columns, the 0-based index of the generated token
    stored there (-1 for prompt and padding columns), so ``rewind`` can mask a row's
    abandoned suffix without touching other rows. ``prompt_len`` is the RoPE position of
    each row's first generated token (int64, (n_rows,), or an int for all rows): the
    uncompressed prompt length of its document, or the cache length for presses that
    re-rotate kept keys (:func:`kvdiverge.engine.presses.registry.generation_start`);
    the RoPE position of generated token ``i`` is ``prompt_len + i``. ``positions`` (int64,
    (n_rows, cache_len), kept up to date for a model with sliding-window layers only) holds
    each column's RoPE position, from which such a model gets its window (:func:`~kvdiverge.engine.presses.layer_types.layer_type_masks`:
    a rewound column stays in the cache, so a column's index is not its position). ``masks``
    (:class:`kvdiverge.engine.llm.masks.HeadMasks` or ``None``) masks prompt columns per layer
    and key-value head through ``modules``' ``masked_key_indices`` (kvpress's attention patch).

    Rows are addressed in the caller's order (``forward``'s tokens and logits, ``rewind``,
    ``keep_rows``, :meth:`logical`). A cache with capacity stores them in its own order:
    when rows are dropped, the kept rows past the new row count move into the holes the
    dropped ones leave (one copy per hole, :func:`fill_holes`) instead of every later row
    shifting up, and ``order`` (int64 (n_rows,), or ``None`` for the same order) maps each
    row to the cache row that holds it. ``valid``, ``step``, ``n_gen``, ``prompt_len`` and
    ``masks`` are in the cache's order.

    Parameters
    ----------
    cache : transformers.Cache
        The merged cache (:func:`merge_caches`). With ``capacity`` given, a cache of
        :class:`~kvdiverge.engine.llm.cache.CapacityLayer` layers (``merge_caches(...,
        capacity=)``) is used as it is and any other is copied into such layers
        (:func:`kvdiverge.engine.llm.cache.capacity_cache`); with ``None`` it is used as it is
        (a ``DynamicCache`` appends by concatenation).
    capacity : int or None
        Columns to allocate per layer when the cache is copied: the widest the cache gets
        (``prompt + 2T - 2``, :func:`kvdiverge.engine.llm.planner.cache_columns`). ``None``:
        the stock cache, appended to by concatenation.
    grouped : bool
        Decode with :func:`grouped_attention`.
    """

    def __init__(
        self,
        cache,
        valid: torch.Tensor,
        prompt_len,
        masks: HeadMasks | None = None,
        modules: Sequence = (),
        *,
        capacity: int | None = None,
        grouped: bool = True,
    ):
        written = all(isinstance(lay, CapacityLayer) for lay in cache.layers)  # merge_caches(..., capacity)
        self.cache = cache if capacity is None or written else capacity_cache(cache, capacity)
        self.in_place = capacity is not None
        self.masks, self.modules, self.grouped = masks, list(modules), bool(grouped)
        self.valid = valid
        self.step = torch.full(valid.shape, -1, dtype=torch.long, device=valid.device)
        self.n_gen = torch.zeros(valid.shape[0], dtype=torch.long, device=valid.device)
        self.prompt_len = prompt_len
        width = valid.shape[1]
        start = torch.as_tensor(prompt_len, device=valid.device).reshape(-1, 1)
        self.positions = (torch.arange(width, device=valid.device) - width + start).expand(valid.shape).clone()
        self._sliding: bool | None = None  # the model has sliding-window layers: known at the first forward
        self.all_valid = bool(valid.all())
        self.order: torch.Tensor | None = None
        self._inverse: torch.Tensor | None = None

    def logical(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (rows in the cache's order on dim 0) in the caller's row order."""
        return t if self.order is None else t[self.order]

    def _physical(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (rows in the caller's order on dim 0) in the cache's row order."""
        return t if self._inverse is None else t[self._inverse]

    def forward(self, model, tokens: torch.Tensor) -> torch.Tensor:
        """Append ``tokens`` (int64 (n_rows,)) to every row; the next-token logits (n_rows, vocab)."""
        n_rows = tokens.shape[0]
        tokens = self._physical(tokens)
        self.valid = torch.cat([self.valid, self.valid.new_ones(n_rows, 1)], dim=1)
        self.step = torch.cat([self.step, self.n_gen.unsqueeze(1)], dim=1)
        # RoPE positions continue from the *uncompressed* prompt length (estimators.md §1),
        # as kvpress's own pipeline does, whatever the cache length (for presses that
        # re-rotate kept keys, from the cache length: registry.generation_start).
        position_ids = (self.prompt_len + self.n_gen).unsqueeze(1)
        if self._tracks(model):
            self.positions = torch.cat([self.positions, position_ids.expand(n_rows, 1)], dim=1)
        if self.masks is not None:
            self.masks.apply(self.modules)
        with grouped_attention(model, self.grouped):
            out = model(
                input_ids=tokens.unsqueeze(1),
                past_key_values=self.cache,
                attention_mask=self._mask(model, 1),
                position_ids=position_ids,
                use_cache=True,
            )
        self.n_gen += 1
        return self.logical(out.logits[:, -1, :])

    def forward_block(self, model, tokens: torch.Tensor) -> torch.Tensor:
        """Append ``tokens`` (int64 (n_rows, L)) to every row in one forward; logits (n_rows, L, vocab).

        Token ``j`` of a row sits at RoPE position ``prompt_len + n_gen + j`` and attends,
        causally, to the row's valid columns and the block's earlier tokens: what ``L``
        calls of :meth:`forward` compute, up to float rounding. Per-head masks
        (:class:`~kvdiverge.engine.llm.masks.HeadMasks`) enter the grouped attention as a
        boolean mask (:meth:`~kvdiverge.engine.llm.masks.HeadMasks.block`: the masked keys
        weigh exactly 0, as kvpress's fake key makes them weigh in decoding); raises
        ``ValueError`` when the side has such masks but not the grouped attention
        (:meth:`block_masks`).
        """
        n_rows, L = tokens.shape
        if self.masks is not None and not self.block_masks(model):
            raise ValueError("a forward of several tokens with per-head masks needs the grouped sdpa attention")
        tokens = self._physical(tokens)
        offsets = torch.arange(L, device=tokens.device)
        self.valid = torch.cat([self.valid, self.valid.new_ones(n_rows, L)], dim=1)
        self.step = torch.cat([self.step, self.n_gen.unsqueeze(1) + offsets], dim=1)
        position_ids = (self.prompt_len + self.n_gen).unsqueeze(1) + offsets
        if self._tracks(model):
            self.positions = torch.cat([self.positions, position_ids.expand(n_rows, L)], dim=1)
        masked = self.masks.block(self.modules) if self.masks is not None else contextlib.nullcontext()
        with grouped_attention(model, self.grouped), masked:
            out = model(
                input_ids=tokens,
                past_key_values=self.cache,
                attention_mask=self._mask(model, L),
                position_ids=position_ids,
                use_cache=True,
            )
        self.n_gen += L
        return self.logical(out.logits)

    def _tracks(self, model) -> bool:
        """Whether ``positions`` is kept up to date: only for a model with sliding-window layers
        (decided at the first forward; a side is decoded by one model)."""
        if self._sliding is None:
            self._sliding = has_sliding_layers(model.config)
        return self._sliding

    def _mask(self, model, n_new: int):
        """The forward's attention mask: the 2-D ``valid`` (``None`` when every column is valid),
        or, for a model with sliding layers, the masks by layer type with the window applied by
        position (:func:`~kvdiverge.engine.presses.layer_types.layer_type_masks`)."""
        if self._tracks(model):
            return layer_type_masks(model, self.cache, self.valid, self.positions, n_new)
        return None if self.all_valid else self.valid.long()

    def block_masks(self, model) -> bool:
        """True when :meth:`forward_block` can run on ``model``: no per-head masks, or the grouped attention."""
        name = getattr(model.config, "_attn_implementation", None)
        return self.masks is None or (self.grouped and name in ("sdpa", GROUPED_SDPA))

    def rewind(self, length: torch.Tensor) -> None:
        """Mask each row's generated columns from its ``length[r]``-th on (int64 (n_rows,))."""
        length = self._physical(length)
        self.valid = self.valid & (self.step < length.unsqueeze(1))
        self.n_gen = length.clone()
        self.all_valid = bool(self.valid.all())

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (distinct int64 indices, in the new order).

        A cache with capacity keeps every column (those no kept row attends to stay masked)
        and fills the dropped rows' places with kept rows in place (:func:`fill_holes`); a
        ``DynamicCache`` selects its rows in the new order and drops those columns.
        """
        rows = rows if self.order is None else self.order[rows]  # the cache rows to keep
        src = fill_holes(rows, self.valid.shape[0]) if self.in_place else rows
        self.valid, self.step, self.n_gen = self.valid[src], self.step[src], self.n_gen[src]
        tracked = self._sliding is not False  # before the first forward it cannot tell: kept
        if tracked:
            self.positions = self.positions[src]
        if isinstance(self.prompt_len, torch.Tensor):
            self.prompt_len = self.prompt_len[src]
        cols = self.valid.any(0)
        # a capacity cache keeps columns no kept row attends to (they stay masked): no copy
        trim = not self.in_place and not bool(cols.all())
        if trim:
            cols = cols.nonzero().squeeze(1)
            self.valid, self.step = self.valid[:, cols], self.step[:, cols]
            if tracked:
                self.positions = self.positions[:, cols]
        if self.masks is not None:
            self.masks.keep_rows(src, cols if trim else None)
        for layer in self.cache.layers:
            if hasattr(layer, "select"):
                layer.select(src, cols if trim else None)
                continue
            keys, values = layer.keys[src], layer.values[src]
            if trim:
                keys, values = keys[:, :, cols], values[:, :, cols]
            layer.keys, layer.values = keys, values
        self.all_valid = bool(self.valid.all())
        self._reorder(rows, src)

    def _reorder(self, rows: torch.Tensor, src: torch.Tensor) -> None:
        """Set ``order`` after the cache rows ``rows`` (caller's order) were rearranged as ``src``."""
        where = torch.empty(int(src.max()) + 1 if src.numel() else 0, dtype=torch.long, device=src.device)
        where[src] = torch.arange(src.numel(), device=src.device)
        order = where[rows]
        if bool((order == torch.arange(order.numel(), device=order.device)).all()):
            self.order = self._inverse = None
        else:
            self.order, self._inverse = order, torch.argsort(order)


def fill_holes(rows: torch.Tensor, n_rows: int) -> torch.Tensor:
    """The cache rows to keep, placed so that as few rows as possible move.

    Parameters
    ----------
    rows : torch.Tensor
        int64 (n,), distinct cache rows to keep (any order), out of ``n_rows``.
    n_rows : int
        Rows the cache holds now.

    Returns
    -------
    torch.Tensor
        int64 (n,): the old row that new row ``j`` holds. A kept row below ``n`` stays
        where it is; the kept rows from ``n`` on fill, in ascending order, the rows below
        ``n`` that were dropped. Only those rows are copied (one copy per dropped row below
        ``n``), where keeping the caller's order would shift every row after the first
        dropped one.
    """
    n = rows.numel()
    kept = torch.zeros(n_rows, dtype=torch.bool, device=rows.device)
    kept[rows] = True
    src = torch.arange(n, device=rows.device)
    holes = (~kept[:n]).nonzero().squeeze(1)
    if holes.numel():
        src[holes] = rows[rows >= n].sort().values
    return src


class SeparateSides:
    """The two sides of a pair, each decoded by its own forward per step (the stock kernels, or ``joint=False``).

    Parameters
    ----------
    ref, ev : CacheSide
        The reference and evicted rows, ``n`` each, in the same order.
    ref_model, ev_model : torch.nn.Module
        The module trees each side runs on (the model, its twin).
    """

    def __init__(self, ref: CacheSide, ev: CacheSide, ref_model, ev_model):
        self.ref, self.ev, self.ref_model, self.ev_model = ref, ev, ref_model, ev_model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``x`` and ``y`` (int64 (n,)) to the reference and evicted rows; their next-token logits."""
        return self.ref.forward(self.ref_model, x), self.ev.forward(self.ev_model, y)

    def forward_block(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``x`` and ``y`` (int64 (n, L)) in one forward per side; logits (n, L, vocab) each."""
        return self.ref.forward_block(self.ref_model, x), self.ev.forward_block(self.ev_model, y)

    def rewind(self, length: torch.Tensor) -> None:
        """Rewind row ``r`` of both sides to ``length[r]`` generated tokens (int64 (n,))."""
        self.ref.rewind(length)
        self.ev.rewind(length)

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep ``rows`` (distinct int64 indices, new order) on both sides."""
        self.ref.keep_rows(rows)
        self.ev.keep_rows(rows)

    def prompt_len(self, evicted: bool):
        """RoPE position of the first generated token of one side's rows (int, or int64 (n,))."""
        side = self.ev if evicted else self.ref
        return side.logical(side.prompt_len) if isinstance(side.prompt_len, torch.Tensor) else side.prompt_len

    def valid(self, evicted: bool) -> torch.Tensor:
        """bool (n, columns): the cache columns each row of one side attends to."""
        side = self.ev if evicted else self.ref
        return side.logical(side.valid)


class JointSides:
    """The two sides of a pair as the rows of one cache: ``n`` reference rows, then ``n`` evicted rows.

    A decoding step is one forward over ``2n`` rows instead of two over ``n``: the weights
    are read once per step, not twice, and on a memory-bound device the weights dominate a
    forward at a few rows (measured in ``benchmarks/engine_speed.py``). The evicted
    documents' caches are left-padded to the reference width like any shorter document
    (:func:`merge_caches`), their padding and per-head masks masked
    (:class:`kvdiverge.engine.llm.masks.HeadMasks`, whose batch indices name evicted rows
    only), and each row has its own RoPE positions.

    Rows of one forward with equal inputs get equal outputs: a row's products and sums run
    in the same order wherever it sits in the batch (the ratio-0 tests assert a TV of
    exactly 0 through it). The forward runs on ``model`` (the pair's twin, whose press has
    exited: the only state it keeps is the per-head mask, applied per row).

    Parameters
    ----------
    side : CacheSide
        ``2n`` rows, in the side's row order (:meth:`CacheSide.logical`; the cache may hold
        them in another): reference rows ``0..n-1``, evicted rows ``n..2n-1`` (row ``n + r``
        is the evicted twin of reference row ``r``).
    model : torch.nn.Module
        The module tree the rows run on.
    """

    def __init__(self, side: CacheSide, model):
        self.side, self.model = side, model

    @property
    def n_rows(self) -> int:
        """Rows per side (``n``)."""
        return self.side.valid.shape[0] // 2

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``x`` and ``y`` (int64 (n,)) to the reference and evicted rows; their next-token logits."""
        n = x.shape[0]
        logits = self.side.forward(self.model, torch.cat([x, y]))
        return logits[:n], logits[n:]

    def forward_block(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``x`` and ``y`` (int64 (n, L)) to both sides' rows in one forward; logits (n, L, vocab) each."""
        n = x.shape[0]
        logits = self.side.forward_block(self.model, torch.cat([x, y]))
        return logits[:n], logits[n:]

    def rewind(self, length: torch.Tensor) -> None:
        """Rewind row ``r`` of both sides to ``length[r]`` generated tokens (int64 (n,))."""
        self.side.rewind(torch.cat([length, length]))

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep ``rows`` (distinct int64 indices, new order) on both sides."""
        self.side.keep_rows(torch.cat([rows, rows + self.n_rows]))

    def _half(self, evicted: bool) -> slice:
        n = self.n_rows
        return slice(n, 2 * n) if evicted else slice(0, n)

    def prompt_len(self, evicted: bool):
        """RoPE position of the first generated token of one side's rows (int, or int64 (n,))."""
        p = self.side.prompt_len
        return self.side.logical(p)[self._half(evicted)] if isinstance(p, torch.Tensor) else p

    def valid(self, evicted: bool) -> torch.Tensor:
        """bool (n, columns): the cache columns each row of one side attends to."""
        return self.side.logical(self.side.valid)[self._half(evicted)]


def merge_caches(
    caches: Sequence, lengths: Sequence[int], rows_each: int, device, capacity: int | None = None
) -> tuple[object, torch.Tensor]:
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
    capacity : int or None
        With a capacity (columns), each layer is a
        :class:`~kvdiverge.engine.llm.cache.CapacityLayer` of that many columns and the
        documents are written into its buffers directly (one copy); with ``None`` the
        merged keys and values replace the first cache's.

    Returns
    -------
    (transformers.Cache, torch.Tensor)
        The merged (B*R, kv_heads, max_len, head_dim) keys and (B*R, kv_heads, max_len,
        v_head_dim) values (padding columns hold zeros): the first cache with its layers
        replaced, or a cache of capacity layers. ``valid``, bool (B*R, max_len): ``False``
        on each document's left padding (a shorter layer's own padding is masked per layer,
        :class:`kvdiverge.engine.llm.masks.HeadMasks`). With one document whose layers all
        have its length and no capacity this is ``batch_repeat_interleave(R)``.

    Raises
    ------
    ValueError
        If a layer is longer than its document's length.
    """
    longest = max(lengths)
    for d, (cache, n) in enumerate(zip(caches, lengths)):
        for li, layer in enumerate(cache.layers):
            if layer.keys.shape[2] > n:
                raise ValueError(
                    f"document {d}, layer {li}: {layer.keys.shape[2]} cache columns, more than its length {n}"
                )
    valid = torch.zeros(len(caches) * rows_each, longest, dtype=torch.bool, device=device)
    for d, n in enumerate(lengths):
        valid[d * rows_each : (d + 1) * rows_each, longest - n :] = True
    if capacity is not None:
        layers = [
            CapacityLayer.stacked(
                [c.layers[li].keys for c in caches], [c.layers[li].values for c in caches], longest, rows_each, capacity
            )
            for li in range(len(caches[0].layers))
        ]
        return Cache(layers=layers), valid
    even = all(layer.keys.shape[2] == n for cache, n in zip(caches, lengths) for layer in cache.layers)
    if len(caches) == 1 and even:
        cache = caches[0]
        if rows_each > 1:
            cache.batch_repeat_interleave(rows_each)
        return cache, torch.ones(rows_each, lengths[0], dtype=torch.bool, device=device)
    merged = caches[0]
    for li, layer in enumerate(merged.layers):
        keys = stack_documents([c.layers[li].keys for c in caches], longest, rows_each, longest)
        values = stack_documents([c.layers[li].values for c in caches], longest, rows_each, longest)
        layer.keys, layer.values = keys, values
    return merged, valid
