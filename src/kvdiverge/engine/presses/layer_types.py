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
  (:func:`question_after_refusal`).
"""

from __future__ import annotations

import contextlib

import torch

from kvdiverge.engine.hf import create_causal_mask
from kvdiverge.engine.presses.bases import is_press_hook

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

FULL = "full_attention"
SLIDING = "sliding_attention"


def _text(config):
    return getattr(config, "get_text_config", lambda: config)()


def layer_types(config) -> list[str]:
    """Each decoder layer's attention type (``config.layer_types``; all ``"full_attention"``
    when the config names none)."""
    config = _text(config)
    types = getattr(config, "layer_types", None)
    return list(types) if types else [FULL] * int(config.num_hidden_layers)


def sliding_window(config) -> int | None:
    """Tokens a sliding layer attends to, the query included (``config.sliding_window``);
    ``None`` when no layer slides."""
    config = _text(config)
    return int(config.sliding_window) if SLIDING in layer_types(config) else None


def has_sliding_layers(config) -> bool:
    """True when some decoder layer attends to a sliding window."""
    return SLIDING in layer_types(config)


def full_layers(config) -> list[int]:
    """Indices of the full-attention layers, the ones a press compresses."""
    return [i for i, kind in enumerate(layer_types(config)) if kind == FULL]


def describe(config) -> str:
    """The model's layers in words, the opening of every refusal about them: "the model has 3
    full-attention and 15 sliding-window layers (512 tokens)"."""
    kinds = layer_types(config)
    return (
        f"the model has {kinds.count(FULL)} full-attention and {kinds.count(SLIDING)} sliding-window layers "
        f"({sliding_window(config)} tokens)"
    )


def layers_of(config) -> dict:
    """The layers a press compresses on this model, as provenance records them:
    ``{"compressed": [layer indices], "layers": n, "sliding_window": tokens or None}``."""
    return {
        "compressed": full_layers(config),
        "layers": len(layer_types(config)),
        "sliding_window": sliding_window(config),
    }


def question_after_refusal(config) -> str | None:
    """Why a question prefilled after compression cannot run on this model's layers, in one sentence;
    ``None`` when it can: on sliding-window layers, whose caches hold different lengths, it cannot."""
    if not has_sliding_layers(config):
        return None
    return (
        f"{describe(config)}: a question prefilled after compression is not supported there (its layers hold "
        f"caches of different lengths)"
    )


def refusal(config, tokens: int | None = None) -> str | None:
    """Why the engine cannot run this model's layers, in one sentence; ``None`` when it can.

    Refused: a layer type other than full and sliding attention (chunked, linear); a
    ``sliding_window`` in force on every layer of a config that names no layer types
    (Mistral-style, Phi-3) once a row's cache spans more than the window, ``tokens`` columns
    (the longest prompt and the columns decoding adds, rewound ones included): transformers
    then counts the window in cache columns, which after a rewind are not positions. With
    ``tokens`` None only the layer types are checked.
    """
    config = _text(config)
    kinds = sorted(set(layer_types(config)))
    other = [k for k in kinds if k not in (FULL, SLIDING)]
    if other:
        return f"the model's layer types are {kinds}; the engine honours only {FULL!r} and {SLIDING!r} layers"
    window = getattr(config, "sliding_window", None)
    uses = getattr(config, "use_sliding_window", True)
    if window and uses and not getattr(config, "layer_types", None) and tokens is not None and tokens > window:
        return (
            f"the model attends through a sliding window of {window} tokens on every layer and its config "
            f"names no layer types, and a row's cache reaches {tokens} columns; the engine honours sliding windows "
            f"only on configs with layer_types"
        )
    return None


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
