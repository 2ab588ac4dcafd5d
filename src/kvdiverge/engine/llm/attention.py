"""Decoding attention for grouped-query models without repeating keys and values.

transformers' ``sdpa`` attention repeats every key-value head ``n_heads / n_kv_heads``
times (``repeat_kv``) whenever an attention mask is passed (``use_gqa_in_sdpa``), and the
pair always passes one where rows differ in their valid columns: at every decoding step
every layer's whole cache is copied that many times. :func:`grouped_sdpa` computes the
same attention for a single query position without the copy: the ``G`` query heads that
share a key-value head become ``G`` query positions of that head,

    (B, kv_heads * G, 1, D) -> (B, kv_heads, G, D),

so one ``scaled_dot_product_attention`` call over (B, kv_heads, S, D) keys and values
gives every head's output, the (B, 1, 1, S) mask broadcasting over heads and positions.
Forwards with several query positions (prefill, replays of several tokens) take the stock
``sdpa_attention_forward`` unchanged.

The function is registered as :data:`GROUPED_SDPA` in transformers' ``AttentionInterface``,
wrapped in kvpress's ``attention_patch`` (so head-wise presses' ``masked_key_indices``
still replace masked keys before the call), and ``sdpa_mask`` is registered for the same
name in ``AttentionMaskInterface`` (transformers builds no padding mask for a name it has
no mask function for). :func:`decoding_model` switches a module tree (a twin,
:mod:`kvdiverge.engine.llm.twin`) to it.
"""

from __future__ import annotations

import torch

from kvdiverge.engine.hf import AttentionInterface, AttentionMaskInterface, sdpa_attention_forward, sdpa_mask

__all__ = ["GROUPED_SDPA", "grouped_sdpa", "decoding_model", "uses_grouped_sdpa"]

#: Name of the grouped decoding attention in transformers' attention and mask interfaces.
GROUPED_SDPA = "kvdiverge_grouped_sdpa"


def grouped_sdpa(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of one query position per row over an unrepeated grouped-query cache.

    Parameters
    ----------
    module : torch.nn.Module
        The attention module (``num_key_value_groups``, ``is_causal``).
    query : torch.Tensor
        (B, heads, L, D) queries after RoPE.
    key, value : torch.Tensor
        (B, kv_heads, S, D) and (B, kv_heads, S, Dv), the whole cache of the layer.
    attention_mask : torch.Tensor or None
        bool (B, 1, L, S), ``True`` where a key is attended (``sdpa_mask``), or ``None``.
    dropout, scaling, is_causal
        As ``transformers.integrations.sdpa_attention.sdpa_attention_forward``.

    Returns
    -------
    (torch.Tensor, None)
        The attention output, (B, L, heads, Dv), and no weights. With ``L > 1`` this is
        ``sdpa_attention_forward``'s result.
    """
    B, heads, L, D = query.shape
    kv_heads = key.shape[1]
    block_keep = getattr(module, "block_keep", None)
    if L > 1 and block_keep is not None:
        return _head_masked_block(query, key, value, attention_mask, block_keep, dropout=dropout, scaling=scaling)
    if L != 1 or heads == kv_heads or kwargs.get("output_attentions", False):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    q = query.reshape(B, kv_heads, heads // kv_heads, D)  # the group's heads as query positions
    out = torch.nn.functional.scaled_dot_product_attention(
        q, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling
    )
    return out.reshape(B, 1, heads, value.shape[-1]), None


def _head_masked_block(query, key, value, attention_mask, block_keep, *, dropout: float, scaling) -> tuple:
    """Attention of ``L > 1`` query positions with per-head key masks given as a boolean mask.

    ``block_keep`` is ``(keep, width)``: ``keep`` bool (B, kv_heads, width), ``False`` on the
    prompt columns a row's key-value head does not attend to
    (:meth:`kvdiverge.engine.llm.masks.HeadMasks.block`); columns from ``width`` on are
    attended by every head. The per-head mask is combined with ``attention_mask`` (bool
    (B, 1, L, S); ``None``: causal, the ``L`` queries being the last ``L`` columns) and the
    keys and values are repeated per query head (``repeat_kv``), so a masked key's weight is
    exactly 0, where kvpress's fake key gives a weight that underflows to 0 in decoding.
    Returns ``(output (B, L, heads, Dv), None)`` as ``sdpa_attention_forward``.
    """
    B, heads, L, _ = query.shape
    kv_heads, S = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    keep, width = block_keep
    cols = torch.ones(B, kv_heads, 1, S, dtype=torch.bool, device=key.device)
    cols[:, :, 0, :width] = keep
    if attention_mask is None:
        attention_mask = torch.ones(L, S, dtype=torch.bool, device=key.device).tril(S - L)
    mask = (cols & attention_mask.to(torch.bool)).repeat_interleave(groups, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key.repeat_interleave(groups, dim=1),
        value.repeat_interleave(groups, dim=1),
        attn_mask=mask,
        dropout_p=dropout,
        scale=scaling,
    )
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    import kvpress  # noqa: F401  (patches the attention functions registered so far; ours is patched here)
    from kvpress.attention_patch import attention_patch

    AttentionInterface.register(GROUPED_SDPA, attention_patch(grouped_sdpa))
    AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)


_register()


def uses_grouped_sdpa(model) -> bool:
    """True when ``model``'s configured attention is :data:`GROUPED_SDPA`."""
    return getattr(model.config, "_attn_implementation", None) == GROUPED_SDPA


def decoding_model(model, enabled: bool = True):
    """Switch ``model`` (a twin: its config is its own) to :data:`GROUPED_SDPA` where that computes sdpa's attention.

    Only a model on ``sdpa`` is switched (``eager`` keeps the weights kvpress's eager
    presses read; other kernels keep their own). Returns ``model``.
    """
    if enabled and getattr(model.config, "_attn_implementation", None) == "sdpa":
        model.config._attn_implementation = GROUPED_SDPA
    return model
