"""What the runner takes as a policy, and what it refuses of one before any forward.

:class:`PressSource` is the protocol of a policy (a press per prompt length and the kept count);
:class:`kvdiverge.engine.presses.policies.Policy` and the front door's press objects implement it.
:func:`check_policy` refuses a press the model cannot run (the registry's refusal, a question
prefilled after compression on sliding-window layers, a cache that outgrows every layer's window),
:func:`question_after_problems` the policies that cannot take a question after compression, and
:func:`check_prompt_lengths` a document shorter than a policy can compress. The runner
(:func:`kvdiverge.engine.runner.run_policies`), the teacher-forced pass and the plan call them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from kvdiverge.engine.core.documents import Document
from kvdiverge.engine.core.errors import PressError
from kvdiverge.engine.presses.layer_types import question_after_refusal
from kvdiverge.engine.presses.layer_types import refusal as layer_refusal
from kvdiverge.engine.presses.policies import min_prompt_tokens
from kvdiverge.engine.presses.registry import is_decode_time, question_after_problem, refusal

__all__ = ["PressSource", "check_policy", "check_prompt_lengths", "question_after_problems"]


class PressSource(Protocol):
    """What the runner needs of a policy: a press per prompt length, and the kept count.

    The runner may prefill several prompts' presses before any of them decodes, so a press that
    keeps a prompt's state for decoding (a decode-time press: the sliding window's kept lengths)
    must be a new object for each call of ``build_press``.

    ``expected_kept`` returns an int (every layer and head keeps that many), a
    :class:`kvdiverge.engine.presses.promises.KeptPromise`, or ``None``.

    :class:`kvdiverge.engine.presses.policies.Policy` (a press built per call) and
    :class:`~kvdiverge.engine.presses.policies.PressPolicy` (its press, copied where it decodes) implement it.
    """

    name: str

    def build_press(self, prompt_len: int) -> Any: ...

    def expected_kept(self, prompt_len: int, press: Any) -> Any: ...


def check_policy(model, documents: Sequence[Document], policy: PressSource, owner: str, horizon: int = 0) -> bool:
    """Refuse a press ``model`` cannot run, before any forward; True for a decode-time policy.

    Builds the press of the longest document once and asks the registry
    (:func:`kvdiverge.engine.presses.registry.refusal`, with the model: the config
    attributes the press reads and its layer types) and
    :func:`kvdiverge.engine.presses.registry.is_decode_time`. ``horizon``: the cache columns a
    row spans beyond its prompt (``2T - 2`` for a coupled run, the continuation's length for a
    teacher-forced pass), for a model whose every layer slides
    (:func:`kvdiverge.engine.presses.layer_types.refusal`).

    Raises
    ------
    kvdiverge.engine.core.errors.PressError
        Naming ``owner`` and what the press needs.
    """
    # at a length the press accepts: whether it is refused does not depend on the length, and
    # a refused press is named before a document too short for it (check_prompt_lengths)
    press = policy.build_press(max(max(doc.prompt_len for doc in documents), min_prompt_tokens(policy)))
    reason = refusal(press, model) or _question_refusal(model, documents) or _window_refusal(model, documents, horizon)
    if reason:
        raise PressError(owner, reason)
    return is_decode_time(press)


def _window_refusal(model, documents: Sequence[Document], horizon: int) -> str | None:
    """What the model's layers tell against the documents, a row's cache spanning ``horizon``
    columns beyond the longest prompt (:func:`kvdiverge.engine.presses.layer_types.refusal`)."""
    config = getattr(model, "config", None)
    tokens = max(doc.prompt_len for doc in documents) + int(horizon)
    return None if config is None else layer_refusal(config, tokens)


def _question_refusal(model, documents: Sequence[Document]) -> str | None:
    """Why a question prefilled after compression cannot run on ``model`` (sliding-window layers), or None."""
    config = getattr(model, "config", None)
    if config is None or not any(doc.n_question for doc in documents):
        return None
    return question_after_refusal(config)


def question_after_problems(policies: Mapping[str, PressSource]) -> list[str]:
    """One sentence per policy that cannot take a question prefilled after compression (a quantized
    cache, a press that evicts while decoding:
    :func:`kvdiverge.engine.presses.registry.question_after_problem`), before any forward.

    A config policy's press is built once at a placeholder ratio, a press object is read as it
    is; another ``PressSource`` is checked when its pair is built."""
    out = []
    for name, policy in policies.items():
        press = getattr(policy, "probe_press", None) or getattr(policy, "press", None)
        problem = None if isinstance(press, str) or press is None else question_after_problem(press)
        if problem:
            out.append(f"policy {name!r}: {problem}")
    return out


def check_prompt_lengths(
    documents: Sequence[Document], policies: Mapping[str, PressSource], owner: str = "press"
) -> None:
    """Refuse, before any forward, a document shorter than a policy can compress.

    Parameters
    ----------
    documents : sequence of Document
    policies : mapping of str to PressSource
        Name -> policy; each one's minimum is
        :func:`kvdiverge.engine.presses.policies.min_prompt_tokens` (tokens).
    owner : str
        What a policy is called in the message: ``"policy"`` or ``"press"``.

    Raises
    ------
    ValueError
        Naming the first document shorter than a policy needs, the policy and its minimum.
    """
    for doc in documents:
        for name, source in policies.items():
            need = min_prompt_tokens(source)
            if doc.prompt_len < need:
                raise ValueError(
                    f"prompt {doc.doc_id!r} has {doc.prompt_len} tokens; {owner} {name!r} needs at least {need}"
                )
