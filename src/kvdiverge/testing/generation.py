"""Greedy generation by transformers and kvpress alone: what the engine's greedy sides must equal."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvdiverge.engine.hf import DynamicCache
from kvdiverge.engine.presses.layer_types import on_full_layers

__all__ = ["greedy_generate"]


def greedy_generate(model, ids: Sequence[int], press=None, max_new_tokens: int = 8) -> list[int]:
    """``model.generate(do_sample=False)`` continuation of ``ids`` (stops at the model's EOS).

    On the model's own cache (``DynamicCache(config=...)``: a sliding-window layer keeps its
    window); with ``press``, entered on the full-attention layers only, kvpress's policy for
    Gemma 3 (:func:`kvdiverge.engine.presses.layer_types.on_full_layers`; ``press(model)`` on a
    model without sliding layers).

    Returns
    -------
    list of int
        The generated token ids, at most ``max_new_tokens``.
    """
    x = torch.tensor([list(ids)])
    kw = dict(max_new_tokens=max_new_tokens, do_sample=False, attention_mask=torch.ones_like(x))
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        if press is None:
            out = model.generate(x, past_key_values=cache, **kw)
        else:
            with on_full_layers(press, model):
                out = model.generate(x, past_key_values=cache, **kw)
    return out[0, x.shape[1] :].tolist()
