"""Per row, per layer and per key-value head: the prompt columns of the evicted cache a row attends to.

Head-wise presses (AdaKV, CriticalAdaKV, DMS, DuoAttention, unstructured KVCompose) keep
every prompt position in the cache and mask some per head; kvpress's attention patch
(``kvpress.attention_patch``) reads ``module.masked_key_indices = (batch, head, seq)`` on
each attention module and replaces those keys by a key whose attention weight underflows
to zero. Per-layer presses (PyramidKV, ``PerLayerCompressionPress``) leave each layer its own
length; the merged cache pads every layer to the longest and masks the padding of each
layer the same way (transformers passes one attention mask to all layers).

:class:`HeadMasks` holds one boolean tensor per layer over the prompt columns of the
merged cache (columns after them, the generated tokens, are attended by every head) and
follows the pair's row removal and column trimming. The 2-D attention mask of
:class:`kvdiverge.engine.llm.side.CacheSide` still masks what all layers share (a row's
left padding, rewound columns).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from kvdiverge.engine.hf import ALL_ATTENTION_FUNCTIONS

__all__ = ["HeadMasks", "attention_modules", "clear_key_masks", "masked_keep", "check_patched"]


def attention_modules(model) -> list:
    """The attention module of every decoder layer, as kvpress enters them (``layer.self_attn``)."""
    inner = model.model.language_model if hasattr(model.model, "language_model") else model.model
    return [layer.self_attn for layer in inner.layers]


def clear_key_masks(model) -> None:
    """Drop the per-head key masks a press left on ``model``'s attention modules.

    kvpress's head-wise presses set ``module.masked_key_indices`` during their prefill and leave
    it after their own ``generate``; its attention patch then masks those keys in every later
    forward of that module. The reference model must attend to its whole cache, so a pair drops
    any such leftover before it starts (the evicted twin's are set and cleared by the engine).
    """
    for module in attention_modules(model):
        if getattr(module, "masked_key_indices", None) is not None:
            module.masked_key_indices = None


def masked_keep(indices, kv_heads: int, length: int, device) -> torch.Tensor:
    """The columns each head attends to after a batch-1 prefill, from ``masked_key_indices``.

    Parameters
    ----------
    indices : tuple of torch.Tensor or None
        ``(batch, head, seq)`` int64 index tensors set by a press (``None``: nothing masked).
    kv_heads, length : int
        Key-value heads and columns of the layer's cache.

    Returns
    -------
    torch.Tensor
        bool (kv_heads, length): ``False`` where a key is masked.

    Raises
    ------
    ValueError
        If an index names a batch row other than 0 (the document was prefilled alone).
    """
    keep = torch.ones(kv_heads, length, dtype=torch.bool, device=device)
    if indices is None:
        return keep
    batch, head, seq = (torch.as_tensor(i, device=device) for i in indices)
    if batch.numel() and bool((batch != 0).any()):
        raise ValueError("masked_key_indices name batch rows other than 0 after a one-document prefill")
    keep[head, seq] = False
    return keep


def check_patched(model) -> None:
    """Raise ``ValueError`` unless ``model``'s attention implementation carries kvpress's patch.

    Head-wise masks act only through ``kvpress.attention_patch``, which kvpress applies to
    the functions registered in ``transformers``' ``ALL_ATTENTION_FUNCTIONS`` (``sdpa``,
    ``flash_attention_2``, ...), not to the built-in ``eager`` path.
    """
    name = model.config._attn_implementation
    fn = ALL_ATTENTION_FUNCTIONS.get(name) if name in ALL_ATTENTION_FUNCTIONS else None
    if fn is None or "attention_patch" not in getattr(fn, "__qualname__", ""):
        raise ValueError(
            f"attention implementation {name!r} does not apply kvpress's per-head key masks; "
            f"load the model with attn_implementation='sdpa'"
        )


class HeadMasks:
    """The prompt columns each row attends to, per layer and key-value head.

    Parameters
    ----------
    keep : list of torch.Tensor or None
        One entry per layer: bool (n_rows, kv_heads, width), ``False`` on masked columns,
        or ``None`` (every head attends to every column of that layer).
    width : int
        Prompt columns of the merged cache covered by ``keep``; later columns are attended.
    """

    def __init__(self, keep: list[torch.Tensor | None], width: int):
        self.keep = keep
        self.width = int(width)
        self._indices: list | None = None

    @classmethod
    def merge(
        cls, doc_keeps: Sequence[Sequence[torch.Tensor]], lengths: Sequence[int], rows_each: int
    ) -> "HeadMasks | None":
        """Masks of the merged cache from each document's per-layer masks, left-padded like the cache.

        Parameters
        ----------
        doc_keeps : sequence of sequence of torch.Tensor
            ``doc_keeps[d][l]``: bool (kv_heads, n_dl), the columns of document ``d``'s layer
            ``l`` each head attends to (``n_dl`` = that layer's cache length).
        lengths : sequence of int
            Each document's cache width: its longest layer (tokens).
        rows_each : int
            Rows per document (``R``); document ``d`` fills rows ``d*R .. d*R+R-1``.

        Returns
        -------
        HeadMasks or None
            ``None`` when no document masks anything and every layer of each document
            has the document's width (the 2-D attention mask says it all).
        """
        width = max(lengths)
        keep = []
        for li in range(len(doc_keeps[0])):
            parts = []
            for keeps, n in zip(doc_keeps, lengths):
                k = keeps[li]
                full = k.new_ones(k.shape[0], width)
                full[:, width - n : width - k.shape[1]] = False  # this layer's own left padding
                full[:, width - k.shape[1] :] = k
                parts.append(full.expand(rows_each, -1, -1))
            layer = torch.cat(parts)
            keep.append(None if bool(layer.all()) else layer)
        return None if all(k is None for k in keep) else cls(keep, width)

    def keep_rows(self, rows: torch.Tensor, cols: torch.Tensor | None) -> None:
        """Keep ``rows`` (int64, new order) and, if given, the cache columns ``cols`` (sorted int64)."""
        prompt = None if cols is None else cols[cols < self.width]
        for li, k in enumerate(self.keep):
            if k is None:
                continue
            k = k[rows]
            self.keep[li] = k if prompt is None else k[:, :, prompt]
        if prompt is not None:
            self.width = int(prompt.numel())
        self._indices = None

    def indices(self) -> list:
        """Per layer, ``(batch, head, seq)`` of the masked keys (``masked_key_indices``), or ``None``."""
        if self._indices is None:
            self._indices = [
                None if k is None or bool(k.all()) else tuple((~k).nonzero(as_tuple=True)) for k in self.keep
            ]
        return self._indices

    def apply(self, modules: Sequence) -> None:
        """Set each attention module's ``masked_key_indices`` for the next decoding forward."""
        for module, idx in zip(modules, self.indices()):
            module.masked_key_indices = idx

    @contextlib.contextmanager
    def block(self, modules: Sequence):
        """Mask per head by a boolean attention mask during a forward of several query positions.

        Inside the block each attention module holds ``block_keep = (keep, width)`` (its
        layer's mask, or ``None``) and no ``masked_key_indices``, so kvpress's attention
        patch leaves the keys alone and :func:`kvdiverge.engine.llm.attention.grouped_sdpa`
        masks the keys itself (exactly 0 weight). kvpress's fake key is searched for all the
        forward's queries at once, and for many queries that search can fail; decoding
        (one query position) keeps :meth:`apply`. Only for a model on the grouped
        attention: another implementation would ignore ``block_keep``.
        """
        for module, keep in zip(modules, self.keep):
            module.masked_key_indices = None
            module.block_keep = None if keep is None else (keep, self.width)
        try:
            yield
        finally:
            for module in modules:
                module.block_keep = None
