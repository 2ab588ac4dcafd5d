"""The evicted side's own module tree: every parameter and buffer shared with the reference model.

A kvpress press acts through forward hooks on the modules it is entered on, and several
presses keep state on those modules (``masked_key_indices``, step counters, buffered
hidden states) that kvpress's attention patch reads on every later forward. The reference
kernel ``P`` must never see any of it (estimators.md §1). :func:`evicted_twin` gives the
evicted side ``Q`` a second module tree whose parameters and buffers *are* the reference
model's tensors (no weight memory is copied), so a press entered on the twin registers its
hooks and leaves its state there only.
"""

from __future__ import annotations

import copy

import torch

from kvdiverge.engine.llm.masks import clear_key_masks
from kvdiverge.engine.presses.bases import is_press_hook

__all__ = ["evicted_twin", "shares_weights"]


def evicted_twin(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model``'s module tree that shares every parameter and buffer with it.

    Parameters
    ----------
    model : torch.nn.Module
        The reference model (e.g. a ``transformers`` causal LM), with no press entered.

    Returns
    -------
    torch.nn.Module
        A new module tree: new module objects (own hook tables, own attributes), the same
        ``torch.nn.Parameter`` and buffer tensors (``twin.p is model.p`` for each). Hooks
        already on ``model`` that belong to no press (a profiler, a recorder) are on the
        twin too, as the same function objects; hooks registered later on either tree stay
        on that tree. Per-head key masks a finished press left on ``model``
        (``masked_key_indices``, :func:`kvdiverge.engine.llm.masks.clear_key_masks`) are dropped
        from it first.

    Raises
    ------
    ValueError
        If ``model`` carries a kvpress press's forward hook (a press is entered on it).
    """
    memo = {id(t): t for t in model.parameters()}
    memo.update({id(t): t for t in model.buffers()})
    for name, module in model.named_modules():
        for hooks in (module._forward_hooks, module._forward_pre_hooks):
            for hook in hooks.values():
                if is_press_hook(hook):
                    raise ValueError(
                        f"module {name or type(module).__name__!r} has forward hooks of a press "
                        f"(a press is active on the reference model); build the twin before "
                        f"entering any press"
                    )
                memo[id(hook)] = hook
    clear_key_masks(model)  # a finished press's leftover per-head masks reach neither tree
    return copy.deepcopy(model, memo)


def shares_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """True when ``a`` and ``b`` hold the very same parameter and buffer tensors, name by name."""
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    ba, bb = dict(a.named_buffers()), dict(b.named_buffers())
    return (
        pa.keys() == pb.keys()
        and ba.keys() == bb.keys()
        and all(pa[k] is pb[k] for k in pa)
        and all(ba[k] is bb[k] for k in ba)
    )
