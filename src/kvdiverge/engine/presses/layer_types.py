"""Attention layer types: which decoder layers attend to the whole context, which to a sliding window.

Gemma 2 and 3 and other mixed-attention models keep most layers on a local window and a
few on the whole context (transformers' ``config.layer_types``: ``"full_attention"`` or
``"sliding_attention"``, the window ``config.sliding_window`` tokens, the query included).
The engine honours them this way:

- **Only full-attention layers are compressed.** A press is entered on the model and then
  taken off its sliding layers (:func:`on_full_layers`), as kvpress does for
  ``Gemma3ForConditionalGeneration`` (``BasePress.__call__``). A sliding layer's cache is
  the model's own on both sides: nothing beyond its window is ever attended.
- **The window is applied by RoPE position, not by cache column.** The engine's batched
  caches keep every column of a sliding layer and mark columns it no longer attends to
  (a document's left padding, a rewound branch), so a column's index is not its position;
  :func:`layer_type_masks` builds the sliding layers' mask from each column's position,
  ``q_pos - k_pos < sliding_window`` (transformers' ``sliding_window_overlay`` on positions),
  which is the attention of the model's own ``DynamicSlidingWindowLayer``.
- **What the engine cannot honour is refused** (:func:`refusal`): a layer type other than
  these two, or a sliding window that a sequence reaches past on a model whose config names no
  layer types; and on sliding-window layers a question prefilled after compression
  (:func:`kvdiverge.engine.presses.cache_facts.question_after_refusal`).
"""

from __future__ import annotations

import contextlib

import torch

from kvdiverge.engine.hf import create_causal_mask
from kvdiverge.engine.presses.bases import is_press_hook

# what the config check asks too, torch-free in cache_facts; re-exported here for the engine
from kvdiverge.engine.presses.cache_facts import (
    FULL,
    SLIDING,
    describe,
    full_layers,
    has_sliding_layers,
    layer_types,
    layers_refusal,
    question_after_refusal,
    sliding_window,
)

__all__ = [
    "FULL",
    "SLIDING",
    "describe",
    "full_layers",
    "has_sliding_layers",
    "layer_type_masks",
    "layer_types",
    "layers_of",
    "on_full_layers",
    "question_after_refusal",
    "refusal",
    "sliding_window",
]


def refusal(config, tokens: int | None = None) -> str | None:
    """Why the engine cannot run this model's layers, in one sentence; ``None`` when it can
    (:func:`kvdiverge.engine.presses.cache_facts.layers_refusal`, which the config check asks too)."""
    return layers_refusal(config, tokens)


def layers_of(config) -> dict:
    """The layers a press compresses on this model, as provenance records them:
    ``{"compressed": [layer indices], "layers": n, "sliding_window": tokens or None}``."""
    return {
        "compressed": full_layers(config),
        "layers": len(layer_types(config)),
        "sliding_window": sliding_window(config),
    }


@contextlib.contextmanager
def on_full_layers(press, model):
    """Enter ``press`` on ``model`` with its hooks on the full-attention layers only.

    kvpress's ``BasePress.__call__`` hooks every decoder layer except, for
    ``Gemma3ForConditionalGeneration`` only, the sliding ones; this drops the press's hooks
    from the sliding layers of any model right after it enters, so those layers keep their
    whole cache (their own window applies). A model without sliding layers enters the press
    as it is.

    Yields
    ------
    list of int
        The layers the press compresses.
    """
    config = model.config
    with press(model):
        if has_sliding_layers(config):
            inner = model.model.language_model if hasattr(model.model, "language_model") else model.model
            for layer, kind in zip(inner.layers, layer_types(config)):
                if kind == SLIDING:
                    _drop_press_hooks(layer)
        yield full_layers(config)


def _drop_press_hooks(layer) -> None:
    """Remove every kvpress press's forward (pre-)hook from ``layer`` and its submodules."""
    for module in layer.modules():
        for hooks in (module._forward_hooks, module._forward_pre_hooks):
            for key, hook in list(hooks.items()):
                if is_press_hook(hook):
                    del hooks[key]
                    module._forward_hooks_with_kwargs.pop(key, None)


def layer_type_masks(model, cache, valid: torch.Tensor, positions: torch.Tensor, n_new: int) -> dict:
    """The attention masks of one forward by layer type, the sliding window applied by position.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A model with sliding layers; its configured attention implementation picks the
        mask's form (transformers' ``create_causal_mask``).
    cache : transformers.Cache
        The cache before the forward (its length gives the queries' cache columns).
    valid : torch.Tensor
        bool (B, S): the columns each row attends to, the forward's ``n_new`` included.
    positions : torch.Tensor
        int64 (B, S): each column's RoPE position (padding: any value; it is masked).
    n_new : int
        Tokens the forward appends (the last ``n_new`` columns).

    Returns
    -------
    dict
        ``{"full_attention": mask, "sliding_attention": mask}``, as the model's text
        forward takes it in place of a 2-D mask.
    """
    window = sliding_window(model.config)
    past = cache.get_seq_length()
    cache_position = torch.arange(past, past + n_new, device=valid.device)
    embeds = torch.empty(valid.shape[0], n_new, 0, dtype=model.dtype, device=valid.device)
    args = {
        "config": model.config,
        "inputs_embeds": embeds,
        "attention_mask": valid.long(),
        "cache_position": cache_position,
        "past_key_values": cache,
        "position_ids": positions[:, -n_new:],
    }

    def in_window(batch_idx, head_idx, q_idx, kv_idx):
        return positions[batch_idx, q_idx] - positions[batch_idx, kv_idx] < window

    return {FULL: create_causal_mask(**args), SLIDING: create_causal_mask(**args, and_mask_function=in_window)}
