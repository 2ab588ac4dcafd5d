"""KV-cache layers with capacity: each step's keys and values are written in place.

transformers' ``DynamicLayer`` appends a step by concatenation, so every decoding step
copies every layer's whole cache. :class:`CapacityLayer` holds its keys and values in
buffers allocated once for the widest the cache gets (``prompt + 2T - 2`` columns,
:func:`kvdiverge.engine.llm.planner.cache_columns`) and writes each step into the next
free columns; ``keys`` and ``values`` are views of the filled columns, so attention reads
exactly what a ``DynamicLayer`` would hold. A layer that runs out of columns grows its
buffers by half (one copy), so a capacity that is too small costs time, never results.

:meth:`CapacityLayer.stacked` writes several documents' caches, each repeated to its
rows and left-padded, straight into one layer's buffers
(:func:`kvdiverge.engine.llm.side.merge_caches` with a capacity); :func:`capacity_cache`
copies any cache's layers into such layers.
"""

from __future__ import annotations

import torch

from kvdiverge.engine.hf import Cache, CacheLayerMixin

__all__ = ["CapacityLayer", "capacity_cache", "stack_documents"]


class CapacityLayer(CacheLayerMixin):
    """One layer's keys and values in preallocated buffers, written in place.

    Parameters
    ----------
    keys, values : torch.Tensor
        The layer's cache so far, (B, kv_heads, n, D) and (B, kv_heads, n, Dv); copied.
    capacity : int
        Columns to allocate (at least ``n``).

    Attributes
    ----------
    keys, values : torch.Tensor
        Views of the ``length`` filled columns, (B, kv_heads, length, D) and
        (B, kv_heads, length, Dv); writes into them reach the buffers (kvpress's
        attention patch overwrites masked keys this way, as it does a ``DynamicLayer``'s).
    length, capacity : int
        Filled and allocated columns.
    """

    is_compileable = False
    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int):
        self.is_initialized = True
        self.dtype, self.device = keys.dtype, keys.device
        self._fill(keys, values, max(int(capacity), keys.shape[2]))

    @classmethod
    def stacked(
        cls, keys: list[torch.Tensor], values: list[torch.Tensor], width: int, rows_each: int, capacity: int
    ) -> "CapacityLayer":
        """One layer holding several documents' caches, each repeated and left-padded, written once.

        Parameters
        ----------
        keys, values : list of torch.Tensor
            Per document, (1, kv_heads, n_d, D) and (1, kv_heads, n_d, Dv), ``n_d <= width``.
        width : int
            Columns of the merged cache; document ``d`` fills its last ``n_d`` (the rest are zeros).
        rows_each : int
            Rows per document: document ``d`` fills rows ``d * rows_each`` to ``(d + 1) * rows_each - 1``.
        capacity : int
            Columns to allocate (at least ``width``).
        """
        layer = cls.__new__(cls)
        layer.is_initialized = True
        layer.dtype, layer.device = keys[0].dtype, keys[0].device
        capacity = max(int(capacity), int(width))
        layer._k = stack_documents(keys, width, rows_each, capacity)
        layer._v = stack_documents(values, width, rows_each, capacity)
        layer.length, layer.capacity = int(width), capacity
        return layer

    def _fill(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
        b, h, n = keys.shape[:3]
        self._k = keys.new_empty(b, h, capacity, keys.shape[3])
        self._v = values.new_empty(b, h, capacity, values.shape[3])
        self._k[:, :, :n].copy_(keys)
        self._v[:, :, :n].copy_(values)
        self.length, self.capacity = int(n), int(capacity)

    @property
    def keys(self) -> torch.Tensor:
        return self._k[:, :, : self.length]

    @property
    def values(self) -> torch.Tensor:
        return self._v[:, :, : self.length]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Never needed: a layer is built from its keys and values."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs=None):
        """Write ``key_states`` / ``value_states`` (B, kv_heads, m, D) into the next ``m`` columns; return all."""
        m = key_states.shape[2]
        if self.length + m > self.capacity:
            self._fill(self.keys, self.values, max(self.length + m, self.capacity + self.capacity // 2))
        self._k[:, :, self.length : self.length + m].copy_(key_states)
        self._v[:, :, self.length : self.length + m].copy_(value_states)
        self.length += m
        return self.keys, self.values

    def select(self, rows: torch.Tensor, cols: torch.Tensor | None = None) -> None:
        """Keep ``rows`` (distinct int64, new order) and, if given, the columns ``cols`` (sorted int64).

        Distinct ``rows`` without ``cols`` (the engine dropping finished rows) rearrange the
        buffers in place: only the rows whose position changes are copied, once, through a
        temporary of those rows. Other selections (``cols``, repeated rows) copy the kept
        part into new buffers.
        """
        if cols is None and rows.numel() <= self._k.shape[0] and rows.unique().numel() == rows.numel():
            self._move(rows)
            return
        keys, values = self.keys.index_select(0, rows), self.values.index_select(0, rows)
        if cols is not None:
            keys, values = keys.index_select(2, cols), values.index_select(2, cols)
        self._fill(keys, values, self.capacity)

    def _move(self, rows: torch.Tensor) -> None:
        """Row ``j`` of the buffers becomes old row ``rows[j]``; rows past ``len(rows)`` are dropped (views)."""
        n = rows.numel()
        moved = (rows != torch.arange(n, device=rows.device)).nonzero().squeeze(1)
        if moved.numel():
            filled = self.length
            # the moved rows are read (into a temporary) before any is written
            self._k[moved, :, :filled] = self._k[rows[moved], :, :filled]
            self._v[moved, :, :filled] = self._v[rows[moved], :, :filled]
        self._k, self._v = self._k[:n], self._v[:n]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.select(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._fill(self.keys.repeat_interleave(repeats, 0), self.values.repeat_interleave(repeats, 0), self.capacity)

    def crop(self, max_length: int) -> None:
        self.length = min(self.length, max_length if max_length >= 0 else self.length + max_length)

    def get_mask_sizes(self, cache_position: torch.Tensor) -> tuple[int, int]:
        return self.length + cache_position.shape[0], 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_cache_shape(self) -> int:
        return -1


def stack_documents(parts: list[torch.Tensor], width: int, rows_each: int, columns: int) -> torch.Tensor:
    """Several documents' keys (or values), each repeated to its rows and left-padded, in one new tensor.

    Parameters
    ----------
    parts : list of torch.Tensor
        Per document, (1, kv_heads, n_d, D), ``n_d <= width``.
    width : int
        Filled columns: document ``d`` fills the last ``n_d`` of the first ``width``, zeros before.
    rows_each : int
        Rows per document: document ``d`` fills rows ``d * rows_each`` to ``(d + 1) * rows_each - 1``.
    columns : int
        Columns to allocate (at least ``width``); those past ``width`` are left unwritten.

    Returns
    -------
    torch.Tensor
        (len(parts) * rows_each, kv_heads, columns, D), ``parts[0]``'s dtype and device.
    """
    p0 = parts[0]
    out = p0.new_empty(rows_each * len(parts), p0.shape[1], columns, p0.shape[3])
    for d, part in enumerate(parts):
        rows, pad = slice(d * rows_each, (d + 1) * rows_each), width - part.shape[2]
        out[rows, :, :pad].zero_()
        out[rows, :, pad:width].copy_(part.expand(rows_each, -1, -1, -1))
    return out


def capacity_cache(cache, capacity: int) -> Cache:
    """A cache of :class:`CapacityLayer` layers holding a copy of ``cache``'s keys and values.

    Parameters
    ----------
    cache : transformers.Cache
        Any cache whose layers have ``keys`` and ``values``.
    capacity : int
        Columns per layer (the widest the decoding needs; a layer's own length if larger).
    """
    return Cache(layers=[CapacityLayer(lay.keys, lay.values, capacity) for lay in cache.layers])
