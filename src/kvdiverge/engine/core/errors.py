"""Errors of the engine: a press kvdiverge refuses or kvpress fails on, a cache that breaks its
policy's promise, non-finite logits.

Importing it loads no torch (the tensors arrive as arguments, and torch's out-of-memory error is
looked up where torch is already loaded), so the study's checks and the command line raise and
catch these errors without loading the model libraries.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = [
    "CompressionError",
    "NonFiniteLogitsError",
    "PressError",
    "PressExpressionError",
    "check_logits_finite",
    "raise_kvpress_error",
]


class PressError(ValueError):
    """A press kvdiverge refuses, or one that kvpress fails to build or run.

    Parameters
    ----------
    owner : str
        Who named the press, e.g. ``"policy 'snapkv-50'"`` or ``"press 'AdaKVPress(...)'"``.
    problem : str
        One sentence: what the press needs, or the cause kvpress gave.
    """

    def __init__(self, owner: str, problem: str):
        super().__init__(f"{owner}: {problem}")
        self.owner, self.problem = owner, problem


class PressExpressionError(ValueError):
    """A press expression (``NAME[:param=value,...]`` or ``Name(...)``) that does not parse; the
    message names the expression (:mod:`kvdiverge.engine.presses.expressions`)."""


def raise_kvpress_error(exc: BaseException, owner: str, stage: str, press_files: Sequence[str] = ()) -> None:
    """Re-raise ``exc`` as a :class:`PressError` naming ``owner`` when a press raised it.

    kvpress reports a press's unmet needs with bare ``ImportError``, ``AssertionError`` or
    ``TypeError``, and a user's own press may raise anything from its ``score`` or
    ``compress``; this names the press, the phase (``stage``: ``"during the prefill"``,
    ``"while decoding ..."``) and the cause. An exception raised elsewhere, and running out of
    memory anywhere (host ``MemoryError``, ``torch.OutOfMemoryError``: a failure at run time,
    not a fault of the press), is re-raised unchanged.

    Parameters
    ----------
    press_files : sequence of str
        Source files of the press classes that are not kvpress's (the user's own): a
        frame there counts as the press's too.

    Raises
    ------
    PressError
        When a frame of ``exc``'s traceback is inside the ``kvpress`` package or one of
        ``press_files``.
    """
    if _out_of_memory(exc):
        raise exc
    frames = [f.filename.replace("\\", "/") for f in traceback.extract_tb(exc.__traceback__)]
    own = {str(f).replace("\\", "/") for f in press_files}
    in_kvpress = any("/kvpress/" in f for f in frames)
    if in_kvpress or any(f in own for f in frames):
        cause = str(exc).strip().splitlines()[0] if str(exc).strip() else "no message"
        who = "kvpress" if in_kvpress and not any(f in own for f in frames) else "the press"
        raise PressError(owner, f"{who} failed {stage} with {type(exc).__name__}: {cause}") from exc
    raise exc


def _out_of_memory(exc: BaseException) -> bool:
    """Host ``MemoryError``, or ``torch.OutOfMemoryError`` (torch is loaded whenever it raised one)."""
    torch = sys.modules.get("torch")
    return isinstance(exc, MemoryError) or (torch is not None and isinstance(exc, torch.OutOfMemoryError))


class CompressionError(RuntimeError):
    """The evicted cache does not have the length the policy promises."""


class NonFiniteLogitsError(FloatingPointError):
    """A language model returned NaN or infinite logits.

    Raised by :class:`~kvdiverge.engine.llm.llm_pair.LLMKernelPair` with ``side`` and the pair's ``rows`` set; the engine
    (:func:`kvdiverge.engine.core.coupled.run_batch`) re-raises it with the model, document,
    replicate and step of the first bad row filled in, so the message names them all.

    Attributes
    ----------
    side : str
        ``"reference"`` (full cache, ``P``) or ``"evicted"`` (``Q``).
    rows : list of int
        Rows of the pair (in its current row order) whose logits are not all finite.
    kind : str
        ``"NaN"``, ``"+inf"`` or ``"-inf"``: what the first bad row holds.
    model, doc_id, replicate, step : optional
        Filled in by the engine; ``step`` is 1-based (the token step ``t`` of the
        agreement chain, or ``t* + k`` on the residual branch).
    phase : str or None
        ``"chain"`` or ``"branch"``.
    """

    def __init__(
        self,
        side: str,
        rows: Sequence[int],
        kind: str,
        *,
        model: str | None = None,
        doc_id: str | None = None,
        replicate: int | None = None,
        step: int | None = None,
        phase: str | None = None,
    ):
        self.side, self.rows, self.kind = side, list(rows), kind
        self.model, self.doc_id, self.replicate, self.step, self.phase = model, doc_id, replicate, step, phase
        if doc_id is None:
            msg = f"{kind} logits on the {side} side (pair rows {self.rows})"
        else:
            msg = (
                f"{kind} logits from model {model!r}, document {doc_id!r}, replicate {replicate}, "
                f"step {step} ({phase}), {side} side: the shard is not written; check the model's "
                f"dtype (float16 overflows) and weights, then rerun"
            )
        super().__init__(msg)


def check_logits_finite(logits: torch.Tensor, side: str) -> None:
    """Raise :class:`NonFiniteLogitsError` when any row of ``logits`` (rows, V) holds NaN or ±inf."""
    finite = logits.isfinite().all(-1)
    if bool(finite.all()):
        return
    rows = (~finite).nonzero().squeeze(1).tolist()
    bad = logits[rows[0]]
    kind = "NaN" if bool(bad.isnan().any()) else ("+inf" if bool((bad == float("inf")).any()) else "-inf")
    raise NonFiniteLogitsError(side, rows, kind)
