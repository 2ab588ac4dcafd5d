"""What a press promises to keep of a prompt, and the check of the evicted cache against it.

A kvpress press keeps, after prefill, some prompt positions per layer and key-value head.
Ordinary score-based presses keep the same count in every layer and head
(``kvpress.utils.compute_n_kept``); head-wise presses (AdaKV, CriticalAdaKV) keep
``compute_n_kept * heads`` positions in each layer in all, spread unevenly over its heads;
per-layer presses (PyramidKV, ``PerLayerCompressionPress``) keep their own count in each
layer. Each press's adapter (:mod:`kvdiverge.engine.presses.adapters`) names its promise
among the functions here (:func:`kvdiverge.engine.presses.registry.kept_promise` asks it), and :meth:`KeptPromise.check` compares it with the
kept counts measured on the evicted cache, naming the first layer that breaks it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from kvdiverge.engine.core.errors import CompressionError
from kvdiverge.engine.presses.layer_types import SLIDING, full_layers, layer_types

__all__ = [
    "KeptPromise",
    "check_kept",
    "composed",
    "every_position",
    "head_wise",
    "per_layer",
    "pyramid",
    "scorer",
    "sim_layer",
]

#: How a promise counts: every head of a layer (``head``), the layer's heads together
#: (``layer``, as a mean per head), or every layer and head together (``model``, per head
#: summed over layers).
SCOPES = ("head", "layer", "model")


@dataclass(frozen=True)
class KeptPromise:
    """Prompt positions a press promises to keep (tokens), resolved on the model's config.

    Parameters
    ----------
    press : str
        Name of the press (for messages).
    rule : str
        How the counts are computed, e.g. ``"compute_n_kept(196, 0.5)"`` (for messages).
    scope : str
        ``"head"``: every key-value head of layer ``l`` keeps ``counts[l]`` positions;
        ``"layer"``: the heads of layer ``l`` keep ``counts[l] * heads`` positions in all;
        ``"model"``: all layers and heads keep ``counts[0] * heads`` positions in all.
    counts : callable
        ``counts(config) -> tuple[int, ...]``: one count per layer (``head``, ``layer``)
        or one count (``model``); ``config`` is the model's ``transformers`` config.
    at_least : bool
        The counts are lower bounds (a press that floors small layers).
    """

    press: str
    rule: str
    scope: str
    counts: Callable[[Any], tuple[int, ...]]
    at_least: bool = False

    def check(self, kept: torch.Tensor, config, layers: list[int] | None = None) -> None:
        """Raise :class:`~kvdiverge.engine.core.errors.CompressionError` when ``kept`` (int64, (layers, kv_heads))
        breaks the promise on ``layers`` (the indices of the layers the press compresses; default all)."""
        want = tuple(int(c) for c in self.counts(config))
        heads = kept.shape[1]
        layers = list(range(kept.shape[0])) if layers is None else list(layers)
        if self.scope == "model":
            got, total = int(kept[layers].sum()), want[0] * heads
            if got != total and not (self.at_least and got > total):
                raise CompressionError(
                    f"evicted cache keeps {got} prompt positions over its {len(layers)} compressed layers and {heads} heads, "
                    f"{self.press} promises {total} ({self.rule}): the press did not compress as configured"
                )
            return
        for layer in layers:
            row = kept[layer]
            if self.scope == "head":
                bad = [int(h) for h in (row != want[layer]).nonzero().flatten()]
                if not bad or (self.at_least and bool((row >= want[layer]).all())):
                    continue
                raise CompressionError(
                    f"layer {layer} of the evicted cache keeps {row.tolist()} prompt positions per head, "
                    f"{self.press} promises {want[layer]} in every head ({self.rule}): "
                    f"the press did not compress as configured"
                )
            got, total = int(row.sum()), want[layer] * heads
            if got != total and not (self.at_least and got > total):
                raise CompressionError(
                    f"layer {layer} of the evicted cache keeps {got} prompt positions over its {heads} heads "
                    f"{row.tolist()}, {self.press} promises {total} ({self.rule}): "
                    f"the press did not compress as configured"
                )


def check_kept(kept: torch.Tensor, promise: "KeptPromise | int | None", config, press, prompt_len: int) -> None:
    """Check a document's kept counts against its promise.

    Parameters
    ----------
    kept : torch.Tensor
        int64, (layers, kv_heads): prompt positions each layer and head keeps.
    promise : KeptPromise, int or None
        An int promises that every layer and head keeps exactly that many; ``None``
        only checks that a press with a positive ``compression_ratio`` evicted something.
    config : transformers.PretrainedConfig
        The model's config (resolves per-layer promises).
    press : kvpress.BasePress or None
        The press (for the ``None`` check and messages).
    prompt_len : int
        Uncompressed prompt length (tokens).

    Raises
    ------
    CompressionError
        When a layer breaks the promise (the message names the layer), or a press with a
        positive ratio left every layer and head at the full prompt.
    """
    for li, kind in enumerate(layer_types(config)):
        if kind == SLIDING and bool((kept[li] != prompt_len).any()):
            raise CompressionError(
                f"layer {li} attends through a sliding window and must keep all {prompt_len} prompt positions, "
                f"it keeps {kept[li].tolist()} per head: press {type(press).__name__} compressed a sliding layer"
            )
    layers = full_layers(config)
    if isinstance(promise, int):
        n = int(promise)
        promise = KeptPromise(type(press).__name__, f"{n} positions", "head", lambda _c: (n,) * kept.shape[0])
    if promise is not None:
        promise.check(kept, config, layers)
        return
    ratio = _ratio(press)
    if ratio > 0 and bool((kept[layers] >= prompt_len).all()):
        raise CompressionError(
            f"press {type(press).__name__} (compression_ratio={ratio}) left the cache "
            f"at the full {prompt_len} positions in every layer and head"
        )


def _ratio(press) -> float:
    try:
        return float(getattr(press, "compression_ratio", 0.0) or 0.0)
    except (AssertionError, AttributeError, TypeError):  # presses whose ratio exists only after a forward
        return 0.0


def _n_kept(prompt_len: int, compression_ratio: float) -> int:
    from kvpress.utils import compute_n_kept

    return int(compute_n_kept(int(prompt_len), float(compression_ratio)))


def _layers(config) -> int:
    return int(config.num_hidden_layers)


def scorer(press, n: int) -> int:
    """A score-based press: ``compute_n_kept(n, compression_ratio)`` in every head (``kvpress.utils``)."""
    return _n_kept(n, press.compression_ratio)


def every_position(press, n: int) -> int:
    """A press that keeps every position (``ThinKPress`` prunes key channels): ``n`` in every head."""
    return int(n)


def pyramid(press, n: int) -> KeptPromise:
    """``PyramidKVPress``: ``get_layer_budget`` of each layer in every head (``n`` at ratio 0)."""
    name = type(press).__name__
    if press.compression_ratio == 0:
        return KeptPromise(name, "compression_ratio 0", "head", lambda c: (n,) * _layers(c))

    def counts(config):
        return tuple(
            int(press.get_layer_budget(SimpleNamespace(config=config, layer_idx=i), n)) for i in range(_layers(config))
        )

    return KeptPromise(name, f"get_layer_budget(layer, {n})", "head", counts)


def head_wise(press, n: int) -> KeptPromise:
    """``AdaKVPress`` / ``CriticalAdaKVPress``: ``compute_n_kept(n, ratio) * heads`` in each layer in all."""
    ratio = float(press.compression_ratio)
    k = _n_kept(n, ratio) if ratio > 0 else n
    return KeptPromise(
        type(press).__name__, f"compute_n_kept({n}, {ratio}) x heads", "layer", lambda c: (k,) * _layers(c)
    )


def per_layer(press, n: int) -> KeptPromise:
    """``PerLayerCompressionPress``: ``compute_n_kept(n, compression_ratios[l])`` in every head of layer ``l``."""
    ks = tuple(_n_kept(n, float(r)) if float(r) > 0 else n for r in press.compression_ratios)
    return KeptPromise(type(press).__name__, f"compute_n_kept({n}, compression_ratios[layer])", "head", lambda c: ks)


def composed(press, n: int) -> KeptPromise | None:
    """``KVComposePress``, structured: at least ``compute_n_kept(layers * n, ratio)`` over all layers
    (kvpress floors every layer at one position); unstructured: ``None``."""
    if not press.structured:
        return None
    ratio = float(press.compression_ratio)

    def counts(config):
        return (_n_kept(_layers(config) * n, ratio) if ratio > 0 else _layers(config) * n,)

    return KeptPromise(type(press).__name__, f"compute_n_kept(layers x {n}, {ratio})", "model", counts, at_least=True)


def sim_layer(press, n: int) -> KeptPromise:
    """``SimLayerKVPress``: in every head of layer ``l``, ``n_initial + n_recent - n_last`` if the press
    judged the layer lazy during this prefill (its ``compression_ratios[l] > 0``), else ``n``; read
    from the press when the promise is checked, after the prefill."""
    name = type(press).__name__
    lazy = press.n_initial + press.n_recent - press.n_last

    def counts(config):
        ratios = list(press.compression_ratios)
        if len(ratios) != _layers(config):
            raise CompressionError(
                f"{name} recorded {len(ratios)} per-layer decisions for a model of "
                f"{_layers(config)} layers: its prefill did not run once per layer"
            )
        return tuple(lazy if r > 0 else n for r in ratios)

    return KeptPromise(name, f"n_initial + n_recent - n_last = {lazy} in lazy layers, {n} in others", "head", counts)
