"""Quantized KV caches as policies: ``transformers``' ``QuantizedCache`` layers, alone or after a press.

A quantized-cache policy stores the evicted side's cache in a few bits per element
(KIVI-style, ``transformers.cache_utils.QuantizedLayer``): the cache is quantized in
groups of ``q_group_size`` elements, the newest ``residual_length`` tokens stay in full
precision, and every time the residual fills up the whole cache is quantized again (a
flush). The reference side keeps the full-precision cache.

Exact semantics (estimators.md §1): the prefill runs on unquantized states, so its logits
are full precision and ``q_1 = p_1`` (with a press: the pressed prefill's, as for any
prefill press); the prompt cache the prefill leaves (the positions the press kept) is then
quantized, before the first generated token is appended, exactly as ``QuantizedCache``
quantizes it on its first update. ``Q(. | h)`` is the distribution after generating ``h``
one token per forward from that fresh prefill: the flushes depend on the history's length,
so a quantized cache is a **decode-time** policy and runs in
:class:`kvdiverge.engine.llm.decode_pair.DecodeTimePair`'s lanes, each branch replayed
from the prefill.

:class:`QuantizedCachePress` is the policy's press: a context manager like a kvpress press
(entered on the evicted side's module tree for a lane's life). It enters the press it wraps,
if any, and a forward pre-hook that replaces each layer of the prompt cache by a
``QuantizedLayer`` holding it quantized, on the first forward after the prefill. Deferring
the quantization to that forward lets a lane repeat the prefill's one-row cache over its
rows first (``batch_repeat_interleave`` of a ``QuantizedLayer`` would repeat only its
residual part). Groups never span two tokens (``q_group_size`` must divide the head
dimension, and each backend groups along the last dimension), so a row's quantized cache is
the one its document gets alone.

Backends: ``quanto`` (``optimum-quanto``; 2 or 4 bits; the default: min-max scales, one
pass, each group on its own) and ``hqq`` (1, 2, 3, 4 or 8 bits; its half-quadratic optimiser
iterates until the error of the whole tensor stops falling, so it is run one batch row at a
time here, which keeps a row's result its own, at a cost of one optimisation per row). :func:`refusal` says in one sentence why a policy cannot run (backend missing,
a model whose head dimension the group size does not divide, a decode-time press inside).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from kvpress import BasePress

from kvdiverge.engine.hf import DynamicLayer, HQQQuantizedLayer, QuantizedLayer, QuantoQuantizedLayer

# the settings and their arithmetic live in the torch-free cache_facts (the config check reads them); re-exported here
from kvdiverge.engine.presses.cache_facts import BACKENDS, QuantizedCacheSpec, backend_refusal, kv_bits_per_element

__all__ = [
    "BACKENDS",
    "QuantizedCacheSpec",
    "QuantizedCachePress",
    "kv_bits_per_element",
    "quantize_cache_layers",
    "refusal",
]


def _head_dim(config) -> int | None:
    text = getattr(config, "get_text_config", lambda: config)()
    hd = getattr(text, "head_dim", None)
    if hd is None and getattr(text, "hidden_size", None) and getattr(text, "num_attention_heads", None):
        hd = text.hidden_size // text.num_attention_heads
    return int(hd) if hd else None


def refusal(spec: QuantizedCacheSpec, model=None) -> str | None:
    """Why a quantized-cache policy cannot run (one sentence), or ``None`` when it can.

    (A decode-time press inside is refused by :func:`kvdiverge.engine.presses.registry.refusal`.)

    Parameters
    ----------
    spec : QuantizedCacheSpec
    model : transformers model, optional
        With it, also whether the group size divides the model's head dimension.
    """
    reason = backend_refusal(spec)
    if reason:
        return reason
    hd = _head_dim(getattr(model, "config", None)) if model is not None else None
    if hd is not None and hd % spec.q_group_size:
        return (
            f"the quantized cache's q_group_size {spec.q_group_size} does not divide the model's head "
            f"dimension {hd}, so a group would span two tokens"
        )
    return None


def _layer_class(spec: QuantizedCacheSpec):
    if spec.backend == "quanto":
        return QuantoQuantizedLayer

    class RowwiseHQQLayer(HQQQuantizedLayer):
        """HQQ, one row at a time: its optimiser stops on the error of the whole tensor, so
        quantizing a batch at once would make a row's result depend on the other rows."""

        def _quantize(self, tensor, axis):
            return [
                super(RowwiseHQQLayer, self)._quantize(tensor[i : i + 1].contiguous(), axis)
                for i in range(tensor.shape[0])
            ]

        def _dequantize(self, qtensor):
            import torch

            return torch.cat([super(RowwiseHQQLayer, self)._dequantize(q) for q in qtensor], dim=0)

    return RowwiseHQQLayer


def quantize_cache_layers(cache, spec: QuantizedCacheSpec) -> int:
    """Replace each full-precision layer of ``cache`` by a ``QuantizedLayer`` holding it quantized.

    The layer's keys and values (rows, kv_heads, n, head_dim) enter the new layer as its
    first update: quantized at once, an empty full-precision residual, ``n`` positions.
    Layers already quantized are left alone.

    Parameters
    ----------
    cache : transformers.DynamicCache
        Modified in place.
    spec : QuantizedCacheSpec

    Returns
    -------
    int
        Layers replaced.

    Raises
    ------
    TypeError
        If a layer is neither a plain ``DynamicLayer`` nor a ``QuantizedLayer`` (a sliding-window
        or static layer): the quantized cache is defined for full dynamic layers only.
    """
    cls = _layer_class(spec)
    done = 0
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, QuantizedLayer):
            continue
        if type(layer) is not DynamicLayer:
            raise TypeError(
                f"layer {i} of the cache is a {type(layer).__name__}; a quantized cache needs DynamicLayer layers"
            )
        q = cls(
            nbits=spec.nbits,
            axis_key=spec.axis,
            axis_value=spec.axis,
            q_group_size=spec.q_group_size,
            residual_length=spec.residual_length,
        )
        q.update(layer.keys, layer.values)
        cache.layers[i] = q
        done += 1
    return done


@dataclass
class QuantizedCachePress(BasePress):
    """The press of a quantized-cache policy: evict with ``press`` (if any), then quantize what is kept.

    Used as a kvpress press is: ``with QuantizedCachePress(spec, press)(model): model(...)``.
    Entered on a model, it enters ``press`` on it and adds a forward pre-hook that quantizes
    the cache passed as ``past_key_values`` (:func:`quantize_cache_layers`) on the first
    forward that finds it non-empty: the first token generated after the prefill.

    Parameters
    ----------
    spec : QuantizedCacheSpec
    press : kvpress press, optional
        A prefill press evicting first (``None``: quantization alone).
    """

    spec: QuantizedCacheSpec = field(default_factory=QuantizedCacheSpec)
    press: Any = None

    def _hook(self, module, args, kwargs):
        cache = kwargs.get("past_key_values")
        if cache is not None and getattr(cache, "layers", None) and cache.get_seq_length() > 0:
            quantize_cache_layers(cache, self.spec)
        return None

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        return keys, values

    @contextlib.contextmanager
    def __call__(self, model):
        with contextlib.ExitStack() as stack:
            if self.press is not None:
                stack.enter_context(self.press(model))
            handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)
            stack.callback(handle.remove)
            yield
