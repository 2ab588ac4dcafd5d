"""The evicted side's lanes of a decode-time pair: a twin, a press entered on it, the cache of one document's rows.

A :class:`Lane` decodes on the model's own attention and a ``DynamicCache`` with a fresh deep copy of
the document's press entered on its own twin (:func:`kvdiverge.engine.llm.twin.evicted_twin`), so a
press's state (module masks, step counters) belongs to one lane. It prefills the prompt (or starts
from a copied one-row prefill), steps or feeds a block of tokens, merges with another lane of the
same document (``merge_lanes`` presses) and drops rows. :class:`kvdiverge.engine.llm.decode_pair.DecodeTimePair`
holds the lanes and decides when each runs.
"""

from __future__ import annotations

import copy
from contextlib import ExitStack

import torch

from kvdiverge.engine.hf import DynamicCache
from kvdiverge.engine.llm.masks import attention_modules
from kvdiverge.engine.llm.prefill import full_cache_hooks
from kvdiverge.engine.llm.twin import evicted_twin
from kvdiverge.engine.presses.adapters import walk
from kvdiverge.engine.presses.registry import adapter_of, shares_prefill

__all__ = ["Lane"]


def _has_row_state(twin, press) -> bool:
    """True when a prefill left state with a batch dimension (module masks, press tensors)."""
    if any(getattr(m, "masked_key_indices", None) is not None for m in twin.modules()):
        return True
    return any(adapter_of(p).row_state for p in walk(press))


class Lane:
    """One evicted-side lane: a twin, a fresh press entered on it, a cache of ``n`` rows of one document.

    A lane decodes on the model's own attention and a ``DynamicCache``: its rows carry no
    padding, so transformers' ``sdpa`` reads the unrepeated keys already (``enable_gqa``,
    no mask), and decode-time presses replace the layers' keys and values as they compress.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        The reference model (its twin is built here).
    ids : torch.Tensor
        int64 (prompt_len,), the document's prompt.
    press : kvpress.BasePress
        The document's pristine press; the lane enters a deep copy of it.
    n : int
        Rows of the lane.
    counts : dict
        The pair's counters (``DecodeTimePair.counts``), updated in place.
    start : tuple or None
        ``(press, cache, logits)`` just after a one-row prefill of this document (its
        ``snapshot``): the lane starts from copies of them instead of prefilling. The
        prefill is deterministic, so this is the state a fresh prefill reaches, bit for bit.

    Attributes
    ----------
    snapshot : tuple or None
        After a prefill, ``(press, cache, logits)`` copied at once (one row), or ``None``
        when the prefill left state with a batch dimension (module masks, ``DMSPress``).
    full : tuple or None
        ``(cache, logits)``: the full cache of the prompt, copied from the lane's own prefill
        forward before each layer's compression (as :func:`kvdiverge.engine.llm.prefill.prefill`
        does), and that forward's last logits; ``None`` for a press that changes the
        forward itself (its prefill is not shared), or a lane started from a snapshot.
    """

    def __init__(self, model, ids: torch.Tensor, press, n: int, counts: dict[str, int], start=None):
        self.prompt_len, self.n, self.counts = int(ids.numel()), int(n), counts
        self.snapshot = self.full = None
        if start is not None:
            self._enter(model, start[0])
            self.cache, logits = copy.deepcopy(start[1]), start[2]
            counts["prefills_restored"] += 1
        else:
            logits = self._open(model, ids, press, 1, capture=shares_prefill(press))
            if not _has_row_state(self.twin, self.press):
                self.snapshot = (copy.deepcopy(self.press), copy.deepcopy(self.cache), logits)
            elif n > 1:  # the prefill's state has a batch dimension: prefill every row
                self.close()
                logits = self._open(model, ids, press, n)[:1]
        if n > 1 and self.cache.layers[0].keys.shape[0] == 1:
            self.cache.batch_repeat_interleave(n)
        self.first_logits = logits
        self.chain_doc: int | None = None  # the document of a chain lane, None for a replay lane
        self.doc: int | None = None  # the lane's document (set by the pair)
        self.last = torch.zeros(n, dtype=torch.long, device=ids.device)
        self.position = torch.full((n,), self.prompt_len, dtype=torch.long, device=ids.device)  # next RoPE position

    def _enter(self, model, press, twin=None) -> None:
        """A fresh twin (or ``twin``), a deep copy of ``press`` entered on it for the lane's life."""
        self.twin = evicted_twin(model) if twin is None else twin
        self.press = copy.deepcopy(press)
        self.stack = ExitStack()
        self.stack.enter_context(self.press(self.twin))

    def _open(self, model, ids: torch.Tensor, press, rows: int, capture: bool = False) -> torch.Tensor:
        """Enter a fresh press on a fresh twin, prefill the prompt on ``rows`` rows; the last logits (rows, vocab).

        With ``capture`` the full cache is copied from the same forward (:attr:`full`).
        """
        twin = evicted_twin(model)
        with full_cache_hooks(attention_modules(twin) if capture else [], ids.numel(), copy=capture) as full:
            self._enter(model, press, twin)  # the press's hooks after the copying ones
            self.cache = DynamicCache()
            self.counts["prefill_forwards"] += 1
            self.counts["prefill_rows"] += rows
            out = self.twin(
                input_ids=ids.unsqueeze(0).expand(rows, -1),
                past_key_values=self.cache,
                use_cache=True,
                logits_to_keep=1,
            )
        logits = out.logits[:, -1, :]
        if full.complete:
            self.full = (full.cache, logits)
        return logits

    @property
    def cache_len(self) -> int:
        """Fewest positions any layer of the lane's cache holds (tokens)."""
        return min(layer.get_seq_length() for layer in self.cache.layers)  # a quantized layer's too

    @property
    def layer_lens(self) -> list[int]:
        """Positions each layer of the lane's cache holds (tokens)."""
        return [layer.get_seq_length() for layer in self.cache.layers]

    def forward(self, tokens: torch.Tensor, kind: str) -> torch.Tensor:
        """Append ``tokens`` (int64 (n,)), each at its row's next RoPE position; return the logits (n, vocab)."""
        out = self.twin(
            input_ids=tokens.unsqueeze(1),
            past_key_values=self.cache,
            position_ids=self.position.unsqueeze(1),
            use_cache=True,
        )
        self.position = self.position + 1
        self.last = tokens
        self.counts[f"{kind}_forwards"] += 1
        self.counts[f"{kind}_row_steps"] += self.n
        return out.logits[:, -1, :]

    def block_mask(self, length: int) -> torch.Tensor | None:
        """bool (length, cache + length): the keys each of ``length`` tokens fed in one forward attends to, as stepping
        would (the press's ``block_mask``); ``None`` when the press has none or the layers' lengths differ."""
        lens = set(self.layer_lens)
        make = getattr(self.press, "block_mask", None)
        if (
            make is None
            or len(lens) != 1
            or not all(type(lay) is type(self.cache.layers[0]) for lay in self.cache.layers)
        ):
            return None
        return make(lens.pop(), int(length))

    def forward_block(self, tokens: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """Append ``tokens`` (int64 (n, L)) in one forward, query ``i`` attending to the keys ``allowed[i]``
        (:meth:`block_mask`); the logits (n, L, vocab). The press's hook then holds its window, as after ``L`` steps."""
        n, L = tokens.shape
        mask = torch.zeros(allowed.shape, dtype=self.twin.dtype, device=tokens.device)
        mask.masked_fill_(~allowed.to(tokens.device), float("-inf"))  # additive: any attention kernel takes it
        out = self.twin(
            input_ids=tokens,
            past_key_values=self.cache,
            position_ids=self.position.unsqueeze(1) + torch.arange(L, device=tokens.device),
            attention_mask=mask.expand(n, 1, -1, -1),
            use_cache=True,
        )
        self.position = self.position + L
        self.last = tokens[:, -1]
        self.counts["lane_forwards"] += 1
        self.counts["lane_row_steps"] += self.n * L
        return out.logits

    def absorb(self, other: "Lane") -> int:
        """Append ``other``'s rows to this lane (caches concatenated per layer) and close ``other``.

        Only for presses with ``merge_lanes``, and lanes whose layers hold equal lengths.
        Returns the slot of ``other``'s first row here.
        """
        first = self.n
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.keys = torch.cat([mine.keys, theirs.keys])
            mine.values = torch.cat([mine.values, theirs.values])
        self.position = torch.cat([self.position, other.position])
        self.last = torch.cat([self.last, other.last])
        self.n += other.n
        other.close()
        return first

    def keep_slots(self, slots: list[int]) -> None:
        """Keep only the rows in ``slots`` (in that order): cut out of the cache, for ``merge_lanes`` presses."""
        idx = torch.tensor(slots, dtype=torch.long, device=self.last.device)
        self.cache.batch_select_indices(idx)
        self.position, self.last, self.n = self.position[idx], self.last[idx], len(slots)

    def close(self) -> None:
        """Leave the press's context (its hooks come off the twin) and drop the cache."""
        self.stack.close()
        self.cache = None
