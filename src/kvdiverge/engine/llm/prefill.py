"""One document's prefill: the full cache (``P``) and the evicted cache (``Q``), from one forward when it can.

kvpress's prefill presses compress each layer's cache in a forward hook after that layer's
attention, and the hidden states passed on are those of full attention. So the full
cache is the one the pressed prefill holds just before each compression, and ``p_1 = q_1``
come from the same forward: a hook registered on each attention module *before* the press
is entered runs before the press's hook and copies that layer's keys and values.

Presses that change the forward itself (their own context manager: extra forwards,
eager attention, a patched model forward, a hook on the embeddings) get two prefills:
the reference on the plain model, the evicted one on the twin (the press's row says which:
:func:`kvdiverge.engine.presses.registry.shares_prefill`).
The one-forward path also checks that each layer's attention ran exactly once, on the
whole prompt, and falls back to a plain reference prefill otherwise.

Presses that score with the attention weights (``ObservedAttentionPress``, kvpress asks
for ``attn_implementation="eager"`` for them) get the weights from the same hook,
computed from the layer's own queries and keys as eager attention computes them; the
forward itself stays on the model's attention implementation
(:func:`kvdiverge.engine.presses.registry.needs_attentions`).

Presses that draw from torch's global random generator (``CompactorPress``,
``LeverageScorePress``, ``RandomPress`` without a seed) draw, inside :func:`seeded`, from a
generator seeded per document (:func:`prefill_seed`), so a document keeps the same
positions alone or in any batch, and from run to run; the caller's generator state is
restored afterwards.

Several presses that share their prefill get their caches from one forward
(:func:`prefill_shared`): each press's hook is handed a cache of its own, so a document
is prefilled once for every such policy of a run.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from kvdiverge.engine.core.streams import _stable_int
from kvdiverge.engine.hf import DynamicCache, repeat_kv, rotate_half
from kvdiverge.engine.llm.masks import attention_modules, masked_keep
from kvdiverge.engine.presses.layer_types import on_full_layers
from kvdiverge.engine.presses.registry import draws_global_rng, needs_attentions, shares_prefill

__all__ = [
    "FullCache",
    "append_question",
    "Prefill",
    "attention_weights",
    "full_cache_hooks",
    "prefill",
    "prefill_seed",
    "prefill_shared",
    "seeded",
]


@dataclass
class Prefill:
    """Both caches of one document after its prefill (batch 1).

    Attributes
    ----------
    ref, ev : transformers.DynamicCache
        Full and evicted cache; each layer's keys (1, kv_heads, n, head_dim), values
        (1, kv_heads, n, v_head_dim). The evicted layers may differ in length ``n``.
    ref_logits, ev_logits : torch.Tensor
        Last-position logits, (1, vocab_size).
    keep : list of torch.Tensor
        Per layer, bool (kv_heads, n_l): the evicted cache's columns each head attends to.
    forwards : int
        Prefill forwards run (1 or 2).
    """

    ref: object
    ev: object
    ref_logits: torch.Tensor
    ev_logits: torch.Tensor
    keep: list
    forwards: int

    @property
    def kept(self) -> torch.Tensor:
        """Prompt positions kept per layer and key-value head, int64 (layers, kv_heads)."""
        return torch.stack([k.sum(-1) for k in self.keep]).long()


def prefill_seed(seed: int, model: str, doc_id: str) -> int:
    """The seed of torch's generator during one document's prefill, from (master seed, model, document id).

    ``SeedSequence(seed, spawn_key=(hash(model), hash(doc_id)))`` with the streams' stable
    BLAKE2b hash (:mod:`kvdiverge.engine.core.streams`), reduced to 63 bits; the policy does not
    enter, so policies compared on one document share it.
    """
    import numpy as np

    seq = np.random.SeedSequence(entropy=int(seed), spawn_key=(_stable_int(model), _stable_int(doc_id)))
    return int(seq.generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


@contextlib.contextmanager
def seeded(seed: int | None, device):
    """Run the block with torch's global generator (CPU, and ``device`` if CUDA) seeded with ``seed``.

    The generator states are restored on exit (``torch.random.fork_rng``); ``None`` leaves
    the generators as they are.
    """
    if seed is None:
        yield
        return
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(int(seed))
        yield


def attention_weights(module, hidden_states: torch.Tensor, keys: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """Causal attention weights of a prefill, as ``eager_attention_forward`` computes them.

    Parameters
    ----------
    module : torch.nn.Module
        The attention module (``q_proj``, ``scaling``, ``num_key_value_groups``).
    hidden_states : torch.Tensor
        The layer's input, (1, n, hidden).
    keys : torch.Tensor
        The layer's cached keys after RoPE, (1, kv_heads, n, head_dim).
    kwargs : dict
        The module's forward kwargs (``position_embeddings``).

    Returns
    -------
    torch.Tensor
        (1, heads, n, n), the dtype of the queries; rows sum to 1.
    """
    from kvpress.utils import get_prerope_query_states

    query = get_prerope_query_states(module, hidden_states)
    cos, sin = kwargs["position_embeddings"]
    query = query * cos.unsqueeze(1) + rotate_half(query) * sin.unsqueeze(1)
    scores = torch.matmul(query, repeat_kv(keys, module.num_key_value_groups).transpose(2, 3)) * module.scaling
    n = scores.shape[-1]
    causal = torch.full((n, n), float("-inf"), device=scores.device, dtype=scores.dtype).triu(1)
    return torch.softmax(scores + causal, dim=-1, dtype=torch.float32).to(query.dtype)


def _hook(full, seen: list, supply: bool):
    """Forward hook: copy the layer's full cache into ``full`` (if given); supply attention weights."""

    def hook(module, args, kwargs, output):
        layer = kwargs["past_key_values"].layers[module.layer_idx]
        hidden = kwargs["hidden_states"]
        seen.append((int(module.layer_idx), int(hidden.shape[1])))
        if full is not None:
            full.update(layer.keys, layer.values, module.layer_idx)  # a copy (concatenation onto nothing)
        if supply and output[1] is None:
            return (output[0], attention_weights(module, hidden, layer.keys, kwargs), *output[2:])
        return None

    return hook


@dataclass
class FullCache:
    """The full cache copied from a pressed prefill forward (:func:`full_cache_hooks`).

    Attributes
    ----------
    cache : transformers.DynamicCache or None
        Each layer's keys and values before the press's hook compressed them (batch as the
        forward's); ``None`` when not copied.
    seen : list of (int, int)
        ``(layer, tokens)`` of each attention call the hooks saw.
    hooks : list
        The registered hook handles (empty once removed).
    n_layers, n_tokens : int
        Attention modules watched, and the prompt length (tokens).
    complete : bool
        Set when the hooks come off: True when every layer's attention ran exactly once, on
        the whole prompt (then ``cache``, if copied, is the full prefill cache).
    """

    cache: object
    seen: list
    hooks: list
    n_layers: int
    n_tokens: int
    complete: bool = False

    def remove(self) -> None:
        """Take the hooks off (again: a no-op) and set :attr:`complete`."""
        if self.hooks:
            for h in self.hooks:
                h.remove()
            self.hooks = []
            self.complete = self.seen == [(i, self.n_tokens) for i in range(self.n_layers)]


@contextlib.contextmanager
def full_cache_hooks(modules, n_tokens: int, *, copy: bool = True, attentions: bool = False):
    """Watch each attention module of a prefill forward run in the block; copy its full cache.

    Registered before a press is entered on the same modules, the hooks run before the
    press's: each copies the layer's keys and values (with ``copy``) just before they are
    compressed, and with ``attentions`` supplies the attention weights eager attention would
    return (:func:`attention_weights`). Yields a :class:`FullCache`; the hooks come off at
    :meth:`FullCache.remove` or on exit.

    Parameters
    ----------
    modules : sequence of torch.nn.Module
        The attention modules, in layer order (:func:`kvdiverge.engine.llm.masks.attention_modules`).
    n_tokens : int
        Prompt length (tokens), for :attr:`FullCache.complete`.
    """
    full = FullCache(DynamicCache() if copy else None, [], [], len(modules), int(n_tokens))
    full.hooks = [m.register_forward_hook(_hook(full.cache, full.seen, attentions), with_kwargs=True) for m in modules]
    try:
        yield full
    finally:
        full.remove()


def _forward(model, ids: torch.Tensor, cache):
    return model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1, :]


def _copy(cache):
    out = DynamicCache()
    for li, layer in enumerate(cache.layers):
        out.update(layer.keys, layer.values, li)
    return out


def append_question(model, twin, done: Prefill, question: torch.Tensor, context_len: int) -> Prefill:
    """Prefill a question onto both caches of a compressed context: the question is never evicted.

    kvpress's pipeline (``KVPressTextGenerationPipeline``: the context prefilled under the
    press, then ``generate_answer``) does this: one forward of the question's tokens on the
    compressed cache, at RoPE positions ``context_len + i`` (the uncompressed context's
    length), with the press no longer entered. Here the same forward runs on both sides: the
    reference on ``model`` over the full cache, the evicted on ``twin`` over the compressed
    one, with a head-wise press's kept columns (``done.keep``) as ``masked_key_indices`` so
    kvpress's attention patch masks the same keys it masked at prefill. The question's
    columns are kept in every head.

    Parameters
    ----------
    model, twin : transformers.PreTrainedModel
        As :func:`prefill`.
    done : Prefill
        The context's prefill; its caches grow in place.
    question : torch.Tensor
        int64 (m,), the question's tokens (m >= 1).
    context_len : int
        Tokens of the uncompressed context.

    Returns
    -------
    Prefill
        The caches with the question appended, the logits of its last token, ``keep``
        extended by ``m`` columns of True, ``forwards`` plus 2.
    """
    ids = question.unsqueeze(0)
    m = int(ids.shape[1])
    pos = torch.arange(context_len, context_len + m, device=ids.device).unsqueeze(0)
    ref_logits = model(input_ids=ids, past_key_values=done.ref, position_ids=pos, use_cache=True, logits_to_keep=1)
    modules = attention_modules(twin)
    for mod, keep in zip(modules, done.keep):
        masked = (~keep).nonzero(as_tuple=True)
        if masked[0].numel():
            mod.masked_key_indices = (torch.zeros_like(masked[0]), masked[0], masked[1])
    try:
        ev_logits = twin(input_ids=ids, past_key_values=done.ev, position_ids=pos, use_cache=True, logits_to_keep=1)
    finally:
        for mod in modules:
            mod.masked_key_indices = None
    keep = [torch.cat([k, k.new_ones(k.shape[0], m)], dim=1) for k in done.keep]
    return Prefill(done.ref, done.ev, ref_logits.logits[:, -1, :], ev_logits.logits[:, -1, :], keep, done.forwards + 2)


def prefill(model, twin, ids: torch.Tensor, press, n_question: int = 0) -> Prefill:
    """Prefill one document: the full cache on ``model`` (or copied from the press's forward), the evicted on ``twin``.

    With ``n_question`` the last ``n_question`` tokens are the question, prefilled after
    compression onto both caches and never evicted (:func:`append_question`); the press
    sees only the tokens before them.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        The reference model; no press is ever entered on it.
    twin : transformers.PreTrainedModel
        :func:`kvdiverge.engine.llm.twin.evicted_twin` of ``model``; the press is entered on it.
    ids : torch.Tensor
        int64 (n,), the prompt.
    press : kvpress.BasePress or None
        ``None``: the evicted cache is a copy of the full one.
    n_question : int
        Trailing question tokens (0: the press sees the whole prompt).

    Returns
    -------
    Prefill
    """
    if n_question:
        n = int(ids.shape[0]) - int(n_question)
        return append_question(model, twin, prefill(model, twin, ids[:n], press), ids[n:], n)

    ids = ids.unsqueeze(0)
    n, modules = int(ids.shape[1]), attention_modules(twin)
    if press is None:
        ref = DynamicCache()
        logits = _forward(model, ids, ref)
        ev = _copy(ref)
        keep = [
            torch.ones(layer.keys.shape[1], layer.keys.shape[2], dtype=torch.bool, device=ids.device)
            for layer in ev.layers
        ]
        return Prefill(ref, ev, logits, logits, keep, 1)
    one = shares_prefill(press)
    ev = DynamicCache()
    with full_cache_hooks(modules, n, copy=one, attentions=needs_attentions(press)) as full:
        with on_full_layers(press, twin):
            ev_logits = _forward(twin, ids, ev)
            full.remove()  # before the press's exit, which may run forwards of its own (KVzip)
    keep = [
        masked_keep(getattr(m, "masked_key_indices", None), layer.keys.shape[1], layer.keys.shape[2], ids.device)
        for m, layer in zip(modules, ev.layers)
    ]
    for m in modules:
        m.masked_key_indices = None
    if one and full.complete:
        return Prefill(full.cache, ev, ev_logits, ev_logits, keep, 1)
    ref = DynamicCache()
    return Prefill(ref, ev, _forward(model, ids, ref), ev_logits, keep, 2)


def _rng_state(device) -> tuple:
    """torch's global generator state on the CPU (and ``device``, if CUDA)."""
    return (torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def _set_rng_state(state: tuple, device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _view(cache):
    """A cache object of its own over ``cache``'s tensors (no copy): callers may replace its layers' tensors."""
    import copy

    out = copy.copy(cache)
    out.layers = [copy.copy(layer) for layer in cache.layers]
    return out


@dataclass
class _Handover:
    """What the hooks of one shared prefill forward hand from press to press (:func:`prefill_shared`).

    ``caches[i]`` and ``masked[i]`` (per layer) are press ``i``'s; ``states[i]`` its generator
    state (``None`` when no press draws from the generator).
    """

    full: object
    caches: list
    masked: list
    states: list | None
    device: torch.device

    def hook(self, i: int):
        """The hook that runs after press ``i - 1``'s hooks and before press ``i``'s (``i == k``: after the last)."""
        k = len(self.caches)

        def hook(module, args, kwargs, output):
            li = int(module.layer_idx)
            if i > 0:
                self.masked[i - 1][li] = getattr(module, "masked_key_indices", None)
                module.masked_key_indices = None
                if self.states is not None:
                    self.states[i - 1] = _rng_state(self.device)
            if i == k:
                kwargs["past_key_values"] = self.full
                return None
            layer = self.full.layers[li]
            self.caches[i].update(layer.keys, layer.values, li)  # a copy (concatenation onto nothing)
            kwargs["past_key_values"] = self.caches[i]
            if self.states is not None:
                _set_rng_state(self.states[i], self.device)
            return None

        return hook


def prefill_shared(twin, ids: torch.Tensor, presses) -> list[Prefill] | None:
    """Prefill one document once for several presses: each press's evicted cache from the same forward.

    kvpress's prefill presses compress in a forward hook after each layer's attention and
    never change the hidden states passed on, so one forward of the prompt serves every press
    that enters by plain hooks (:func:`kvdiverge.engine.presses.registry.shares_prefill`). The
    presses are entered on ``twin`` one after the other, and before each press's hooks a hook
    of this function hands it, through the forward's keyword arguments, a cache of its own
    whose layer holds a copy of the full keys and values; it takes back the press's
    ``masked_key_indices`` (head-wise presses) and, for presses that draw from torch's global
    generator, the generator state. Each press so sees exactly what it sees in a prefill of
    its own (:func:`prefill`), from the same generator state, and the caches are equal bit
    for bit.

    Parameters
    ----------
    twin : transformers.PreTrainedModel
        :func:`kvdiverge.engine.llm.twin.evicted_twin` of the reference model, no press entered.
    ids : torch.Tensor
        int64 (n,), the prompt.
    presses : sequence of kvpress.BasePress
        Presses that share their prefill, each its own object.

    Returns
    -------
    list of Prefill or None
        One per press, in order: each its own cache objects (the full cache's tensors shared),
        ``forwards`` 1 for the first and 0 for the others. ``None`` when some layer's attention
        did not run exactly once on the whole prompt; the caller then prefills each press alone.

    Raises
    ------
    ValueError
        If a press does not share its prefill.
    """
    refused = [type(p).__name__ for p in presses if not shares_prefill(p)]
    if refused:
        raise ValueError(f"presses {refused} do not share their prefill forward")
    ids = ids.unsqueeze(0)
    n, modules, device = int(ids.shape[1]), attention_modules(twin), ids.device
    k = len(presses)
    hand = _Handover(
        DynamicCache(),
        [DynamicCache() for _ in presses],
        [[None] * len(modules) for _ in presses],
        [_rng_state(device)] * k if any(draws_global_rng(p) for p in presses) else None,
        device,
    )
    # first the watching hooks (each attention call; attention weights for presses that score with
    # them), then each press's hooks after the hand-over's; all come off at watch.remove()
    try:
        with full_cache_hooks(modules, n, copy=False, attentions=any(needs_attentions(p) for p in presses)) as watch:
            with contextlib.ExitStack() as stack:
                for i, press in enumerate(presses):
                    watch.hooks += [m.register_forward_hook(hand.hook(i), with_kwargs=True) for m in modules]
                    stack.enter_context(on_full_layers(press, twin))
                watch.hooks += [m.register_forward_hook(hand.hook(k), with_kwargs=True) for m in modules]
                logits = _forward(twin, ids, hand.full)
                watch.remove()
    finally:
        for m in modules:
            m.masked_key_indices = None
    if not watch.complete:
        return None
    if hand.states is not None:
        _set_rng_state(hand.states[-1], device)
    out = []
    for i, cache in enumerate(hand.caches):
        keep = [
            masked_keep(mk, layer.keys.shape[1], layer.keys.shape[2], device)
            for mk, layer in zip(hand.masked[i], cache.layers)
        ]
        out.append(Prefill(_view(hand.full), cache, logits, logits, keep, 1 if i == 0 else 0))
    return out
