"""What counts as a press: an instance of a ``kvpress.BasePress`` subclass that compresses.

kvpress exports its abstract bases beside the presses: ``BasePress`` (whose ``compress``
raises ``NotImplementedError``) and ``ScorerPress`` (whose ``score`` does). Built and
entered on a model, they fail at the first forward, after the model has loaded; a class
passed where an instance belongs, or any other callable, fails later still or is
"measured" as a press that changed nothing. :func:`press_problem` names each of these
before any work, in one sentence.
"""

from __future__ import annotations

from typing import Any

__all__ = ["abstract_reason", "is_press_hook", "press_problem"]


def is_press_hook(hook) -> bool:
    """True when the forward (pre-)hook ``hook`` is a method of a ``kvpress.BasePress`` (a press's hook)."""
    import kvpress

    owner = getattr(getattr(hook, "func", hook), "__self__", None)
    return isinstance(owner, kvpress.BasePress)


def abstract_reason(cls: type) -> str | None:
    """Why the press class ``cls`` cannot compress (an abstract kvpress base), or ``None``.

    A press overrides ``compress``, ``forward_hook`` or ``__call__`` of
    ``kvpress.BasePress``; a ``kvpress.ScorerPress`` overrides ``score`` (or ``compress``).
    """
    import kvpress

    base, scorer = kvpress.BasePress, kvpress.ScorerPress
    if not (isinstance(cls, type) and issubclass(cls, base)):
        return None
    if (
        issubclass(cls, scorer)
        and cls.score is scorer.score
        and cls.compress is scorer.compress
        and cls.forward_hook is base.forward_hook
        and cls.__call__ is base.__call__
    ):
        return (
            f"{cls.__name__} is an abstract press (kvpress.ScorerPress: its score raises "
            f"NotImplementedError); name a press that scores, such as SnapKVPress, or subclass it "
            f"and override score"
        )
    if cls.compress is base.compress and cls.forward_hook is base.forward_hook and cls.__call__ is base.__call__:
        return (
            f"{cls.__name__} is an abstract press (kvpress.BasePress: its compress raises "
            f"NotImplementedError); name a press, such as KnormPress, or subclass it and override compress"
        )
    return None


def press_problem(value: Any) -> str | None:
    """Why ``value`` is not a press object kvdiverge can run, in one sentence; ``None`` when it is.

    Refused: a press class instead of an instance (``SnapKVPress`` for ``SnapKVPress()``),
    an instance of an abstract base (:func:`abstract_reason`), and anything that is not a
    ``kvpress.BasePress`` (a function, ``print``, a model).
    """
    import kvpress

    if isinstance(value, type):
        if issubclass(value, kvpress.BasePress):
            return f"{value.__name__} is a press class, not a press: pass an instance, {value.__name__}(...)"
        return f"{value.__name__} is a class, not a press; allowed: a kvpress.BasePress instance or a policy entry"
    if not isinstance(value, kvpress.BasePress):
        what = repr(getattr(value, "__name__", None) or value)
        what = what if len(what) <= 60 else what[:57] + "..."
        return (
            f"{what} ({type(value).__name__}) is not a press; allowed: a kvpress.BasePress instance "
            f"(your own subclasses too) or a policy entry such as {{'press': 'SnapKVPress', "
            f"'compression_ratio': 0.5}}"
        )
    return abstract_reason(type(value))
