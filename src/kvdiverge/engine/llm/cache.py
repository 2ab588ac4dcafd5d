"""KV-cache layers with capacity: each step's keys and values are written in place.

transformers' ``DynamicLayer`` appends a step by concatenation, so every decoding step
copies every layer's whole cache. :class:`CapacityLayer` holds its keys and values in
buffers allocated once for the widest the cache gets (``prompt + 2T - 2`` columns,
:func:`kvdiverge.engine.llm.planner.cache_columns`) and writes each step into the next
free columns; ``keys`` and ``values`` are views of the filled columns, so attention reads
exactly what a ``DynamicLayer`` would hold. A layer that runs out of columns grows its
buffers by half (one copy), so a capacity that is too small costs time, never results.

:func:`capacity_cache` builds a ``transformers.Cache`` of such layers from the merged
per-document caches (:func:`kvdiverge.engine.llm.llm_pair.merge_caches`). The layer type is
an argument (:data:`LayerFactory`), so another layer (a quantized one) can take its place
as long as it offers ``update``, ``keys``/``values`` and :meth:`CapacityLayer.select`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

__all__ = ["CapacityLayer", "LayerFactory", "capacity_cache"]

#: Builds one layer from its (B, kv_heads, n, D) keys and (B, kv_heads, n, Dv) values and a capacity (columns).
LayerFactory = Callable[[torch.Tensor, torch.Tensor, int], CacheLayerMixin]


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

    def _fill(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
        b, h, n = keys.shape[:3]
        self._k = keys.new_empty(b, h, capacity, keys.shape[3])
        self._v = values.new_empty(b, h, capacity, values.shape[3])
        self._k[:, :, :n].copy_(keys)
        self._v[:, :, :n].copy_(values)
        self.length, self.capacity = int(n), int(capacity)

    @property
    def keys(self) -> torch.Tensor:
        return self._k[:, :, :self.length]

    @property
    def values(self) -> torch.Tensor:
        return self._v[:, :, :self.length]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Never needed: a layer is built from its keys and values."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs=None):
        """Write ``key_states`` / ``value_states`` (B, kv_heads, m, D) into the next ``m`` columns; return all."""
        m = key_states.shape[2]
        if self.length + m > self.capacity:
            self._fill(self.keys, self.values, max(self.length + m, self.capacity + self.capacity // 2))
        self._k[:, :, self.length:self.length + m].copy_(key_states)
        self._v[:, :, self.length:self.length + m].copy_(value_states)
        self.length += m
        return self.keys, self.values

    def select(self, rows: torch.Tensor, cols: torch.Tensor | None = None) -> None:
        """Keep ``rows`` (int64, new order) and, if given, the columns ``cols`` (sorted int64).

        Ascending ``rows`` without ``cols`` (the engine dropping finished rows) compact the
        buffers in place: only the rows that move are copied, once, into the first
        ``len(rows)`` rows, and nothing is allocated. Other selections copy into new buffers.
        """
        if cols is None and (rows.numel() < 2 or bool((rows[1:] > rows[:-1]).all())):
            self._compact(rows)
            return
        keys, values = self.keys.index_select(0, rows), self.values.index_select(0, rows)
        if cols is not None:
            keys, values = keys.index_select(2, cols), values.index_select(2, cols)
        self._fill(keys, values, self.capacity)

    def _compact(self, rows: torch.Tensor) -> None:
        """Move ascending ``rows`` to the front of the buffers; drop the rest (views, no allocation)."""
        n = rows.numel()
        moved = (rows != torch.arange(n, device=rows.device)).nonzero()
        if moved.numel():
            start, n_filled = int(moved[0, 0]), self.length
            src = rows[start:]
            self._k[start:n, :, :n_filled] = self._k[src, :, :n_filled]
            self._v[start:n, :, :n_filled] = self._v[src, :, :n_filled]
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


def capacity_cache(cache, capacity: int, layer: LayerFactory = CapacityLayer) -> Cache:
    """A cache of ``layer`` layers holding ``cache``'s keys and values, each with ``capacity`` columns.

    Parameters
    ----------
    cache : transformers.Cache
        Any cache whose layers have ``keys`` and ``values``.
    capacity : int
        Columns per layer (the widest the decoding needs; a layer's own length if larger).
    layer : LayerFactory
        The layer type (default :class:`CapacityLayer`).
    """
    return Cache(layers=[layer(lay.keys, lay.values, capacity) for lay in cache.layers])
