"""Greedy generation by transformers and kvpress alone, and the engine's greedy sides read off its
records: what the greedy equality tests compare."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvdiverge.engine.hf import DynamicCache
from kvdiverge.engine.presses.layer_types import on_full_layers

__all__ = ["greedy_generate", "greedy_sides", "until_eos"]


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


def greedy_sides(record) -> tuple[list[int], list[int]]:
    """The (reference, evicted) token sequences of one greedy replicate of the coupled run: the
    chain up to the first divergence, then each side's token there and its branch (the chain
    alone when the sides never part).

    Parameters
    ----------
    record : mapping
        One trajectory record (``chain_token``, ``t_star``, ``x_star``, ``y_star``, ``branch_x``,
        ``branch_y``).
    """
    ts = record["t_star"]
    if ts is None:
        return record["chain_token"], record["chain_token"]
    head = record["chain_token"][: ts - 1]
    return head + [record["x_star"]] + record["branch_x"], head + [record["y_star"]] + record["branch_y"]


def until_eos(tokens: Sequence[int], eos) -> list[int]:
    """Tokens up to and including the first EOS (what ``generate`` returns)."""
    tokens = list(tokens)
    return next((tokens[: i + 1] for i, t in enumerate(tokens) if t in eos), tokens)
