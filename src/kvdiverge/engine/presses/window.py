"""A rolling-window press: attention sinks plus the most recent tokens, at every step.

:class:`SlidingWindowPress` is StreamingLLM's cache policy (Xiao et al. 2023,
https://arxiv.org/abs/2309.17453) applied while generating, in kvpress's style (a
dataclass press, parameters as fields). At prefill it keeps the first ``n_sink`` prompt
positions and the most recent ones, ``K = max(1, int(prompt_len * (1 - compression_ratio)))``
in all (``kvpress.utils.compute_n_kept``), as ``kvpress.StreamingLLMPress`` does; after every
decoding forward it evicts the oldest non-sink position, so each layer's cache holds
``K`` positions for the whole generation. kvpress's ``StreamingLLMPress`` acts at prefill only.

Keys keep the RoPE rotation of their original positions (kvpress's convention; the
paper's re-rotation is ``kvpress.KeyRerotationPress``'s business). Positions stay in
chronological order in the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from kvpress import BasePress
from kvpress.presses.base_press import is_prefilling
from kvpress.utils import compute_n_kept, extract_keys_and_values

__all__ = ["SlidingWindowPress"]


@dataclass
class SlidingWindowPress(BasePress):
    """Keep ``n_sink`` sink positions and the most recent ones, at prefill and at every decoding step.

    Parameters
    ----------
    compression_ratio : float, default 0.0
        Fraction of the prompt evicted at prefill, in [0, 1); the window then holds
        ``K = compute_n_kept(prompt_len, compression_ratio)`` positions per layer
        (sinks included) for the rest of the generation. 0 evicts nothing, at prefill or
        later (the no-eviction control, as for every press at ratio 0).
    n_sink : int, default 4
        Initial positions never evicted (attention sinks).

    Raises
    ------
    ValueError
        If ``compression_ratio`` is outside [0, 1) or ``n_sink`` is negative; from the
        hook, if a prompt has no more than ``n_sink`` tokens.
    """

    compression_ratio: float = 0.0
    n_sink: int = 4
    window: dict[int, int] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self):
        if not 0 <= self.compression_ratio < 1:
            raise ValueError(f"SlidingWindowPress: compression_ratio must be in [0, 1), got {self.compression_ratio}")
        if self.n_sink < 0:
            raise ValueError(f"SlidingWindowPress: n_sink must be >= 0, got {self.n_sink}")

    def kept_tokens(self, prompt_len: int) -> int:
        """Positions each layer keeps after prefill, and holds during decoding (tokens)."""
        return compute_n_kept(int(prompt_len), float(self.compression_ratio))

    def _keep(self, keys: torch.Tensor, values: torch.Tensor, kept: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sinks plus the last ``kept - n_sink`` positions of keys/values (batch, heads, seq, dim)."""
        seq = keys.shape[2]
        if seq <= kept:
            return keys, values
        sinks = min(self.n_sink, kept)
        idx = torch.cat([torch.arange(sinks), torch.arange(seq - (kept - sinks), seq)]).to(keys.device)
        return keys.index_select(2, idx).contiguous(), values.index_select(2, idx).contiguous()

    def block_mask(self, cached: int, length: int) -> torch.Tensor | None:
        """Which keys each of ``length`` tokens fed in one forward would attend to, stepped one at a time.

        Once the prefill has fixed the window ``K`` (the same in every layer), feeding a
        token attends to the sinks and the ``K - n_sink`` positions before it, then evicts the
        oldest non-sink one: the token at sequence index ``i`` attends to the indices ``j <=
        i`` with ``j < n_sink`` or ``j >= i - (K - n_sink)``. That band, over the ``cached``
        positions the cache holds now followed by the block, is what one forward with this
        mask computes (:meth:`kvdiverge.engine.llm.decode_pair.DecodeTimePair.advance_block`).

        Parameters
        ----------
        cached : int
            Positions each layer's cache holds before the block (tokens; at most ``K``).
        length : int
            Tokens in the block.

        Returns
        -------
        torch.Tensor or None
            bool (length, cached + length), ``True`` where a query attends to a key; ``None``
            when the window is not fixed yet (no prefill under this press) or differs between
            layers.
        """
        if self.compression_ratio == 0:
            kept = int(cached) + int(length)  # nothing is ever evicted: the causal mask
        elif len(set(self.window.values())) == 1:
            kept = next(iter(self.window.values()))
        else:
            return None
        sinks = min(self.n_sink, kept)
        query = torch.arange(int(length)).unsqueeze(1) + int(cached)
        key = torch.arange(int(cached) + int(length)).unsqueeze(0)
        return (key <= query) & ((key < sinks) | (key >= query - (kept - sinks)))

    def forward_hook(self, module, input, kwargs, output):
        """After each attention forward: at prefill fix the window ``K`` and cut to it, later hold it."""
        if self.compression_ratio == 0:
            return output
        hidden_states = kwargs["hidden_states"]
        cache = kwargs["past_key_values"]
        layer = int(module.layer_idx)
        keys, values = extract_keys_and_values(cache, layer)
        if is_prefilling(kwargs["cache_position"], hidden_states.shape[1]):
            if keys.shape[2] <= self.n_sink:
                raise ValueError(
                    f"SlidingWindowPress: a prompt of {keys.shape[2]} tokens has no more than "
                    f"n_sink={self.n_sink} positions"
                )
            self.window[layer] = self.kept_tokens(keys.shape[2])
        elif layer not in self.window:
            return output  # entered after the prefill: nothing to hold
        keys, values = self._keep(keys, values, self.window[layer])
        cache.layers[layer].keys, cache.layers[layer].values = keys, values
        return output
