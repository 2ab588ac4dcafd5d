"""Presses of the project, in kvpress's own style (a dataclass press, parameters as fields).

:class:`ValueNormPress` is a score-based press (a ``kvpress.ScorerPress``): it keeps the
positions whose value vectors have the largest L2 norm.

:class:`PermutationPress` is the numerical noise-floor control: it keeps every prompt
position and only changes their order in each layer's cache. Attention is a sum over
cache positions, so the full kernel and the permuted kernel are equal in exact
arithmetic; whatever total variation remains between them is floating-point rounding
(another order of every attention reduction). A real eviction press changes the order
too (kvpress keeps the top-scored positions in score order), so this is the share of a
measured divergence that arithmetic alone produces.

Like every kvpress press it acts once, after each attention layer's prefill forward
(``kvpress.presses.base_press.BasePress.forward_hook``), on keys of shape
(batch, num_kv_heads, seq_len, head_dim) that already carry their RoPE rotation, so
reordering them leaves every query-key product unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from kvpress import BasePress, ScorerPress

from kvdiverge.engine.presses.window import SlidingWindowPress

__all__ = ["PermutationPress", "PROJECT_PRESSES", "ValueNormPress"]


@dataclass
class PermutationPress(BasePress):
    """Keep every prompt position; permute their order per layer and key-value head.

    Parameters
    ----------
    seed : int, default 0
        Seed of the permutations. Layer ``l`` draws its permutations from a CPU
        ``torch.Generator`` seeded with ``seed * 1_000_003 + l``; each key-value head
        gets its own permutation (as kvpress's per-head top-k order does), the same for
        every batch row.

    Notes
    -----
    The cache keeps ``seq_len`` positions: :meth:`kept_tokens` is the identity.
    The prefill's own last-position logits use the unpermuted attention (the hook
    runs after it), so the first step's two distributions are bit-identical.
    """

    seed: int = 0

    #: Keeps every prompt position (a policy gives it neither a ratio nor a budget; the
    #: noise-floor control of the configs must be such a press).
    keeps_every_position: ClassVar[bool] = True

    def kept_tokens(self, prompt_len: int) -> int:
        """Prompt positions each layer keeps: all ``prompt_len`` of them (tokens)."""
        return int(prompt_len)

    def permutation(self, layer_idx: int, n_heads: int, seq_len: int) -> torch.Tensor:
        """The permutation of one layer, int64 shape (n_heads, seq_len), on the CPU."""
        gen = torch.Generator(device="cpu").manual_seed(int(self.seed) * 1_000_003 + int(layer_idx))
        return torch.argsort(torch.rand(n_heads, seq_len, generator=gen), dim=-1)

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        """Return ``keys`` and ``values`` with their positions (dim 2) permuted.

        Parameters
        ----------
        module : torch.nn.Module
            The attention layer (``layer_idx`` enters the permutation's seed).
        keys, values : torch.Tensor
            Shape (batch, num_kv_heads, seq_len, head_dim).

        Returns
        -------
        (torch.Tensor, torch.Tensor)
            Same shapes and dtypes as the inputs, positions reordered.
        """
        batch, heads, seq_len, head_dim = keys.shape
        perm = self.permutation(getattr(module, "layer_idx", 0), heads, seq_len).to(keys.device)
        index = perm[None, :, :, None]
        keys = keys.gather(2, index.expand(batch, heads, seq_len, head_dim)).contiguous()
        values = values.gather(2, index.expand(*values.shape)).contiguous()
        return keys, values


@dataclass
class ValueNormPress(ScorerPress):
    """Keep the prompt positions whose value vectors have the largest L2 norm, per layer and head.

    A position's contribution to an attention output is its attention weight times its value
    vector, so a position with a small value norm contributes little whatever its weight.
    Guo et al. (2024), "Attention Score is not All You Need for Token Importance Indicator in
    KV Cache Reduction: Value Also Matters" (VATP, https://arxiv.org/abs/2406.12335), score
    positions by accumulated attention times the value's L1 norm; this press keeps the value
    term alone (the L2 norm), needing no attention weights, as ``kvpress.KnormPress`` scores
    by the key norm alone. kvpress's ``ScorerPress`` keeps the
    ``compute_n_kept(seq_len, compression_ratio)`` top-scored positions in every head.

    Parameters
    ----------
    compression_ratio : float, default 0.0
        Fraction of prompt positions evicted, in [0, 1).
    """

    def score(self, module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
        """Scores of shape (batch, num_kv_heads, seq_len): the L2 norm of each value vector.

        Parameters
        ----------
        values : torch.Tensor
            Shape (batch, num_kv_heads, seq_len, head_dim).

        Returns
        -------
        torch.Tensor
            At least float32 (a low-precision norm ties the scores of distinct positions).
        """
        return torch.linalg.vector_norm(values, dim=-1, dtype=torch.promote_types(values.dtype, torch.float32))


#: Presses of the project that a policy can name beside kvpress's (``policies.press_class``).
PROJECT_PRESSES: dict[str, type[BasePress]] = {
    "PermutationPress": PermutationPress,
    "SlidingWindowPress": SlidingWindowPress,
    "ValueNormPress": ValueNormPress,
}
