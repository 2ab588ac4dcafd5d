"""RULER's multi-key needle (``niah_multikey_1``): the asked needle among distractor needles.

RULER (Hsieh et al., 2024, ``scripts/synthetic.yaml`` of github.com/NVIDIA/RULER, task
``niah_multikey_1``: ``num_needle_k: 4``) inserts several needle sentences of the single needle's
form, ``"One of the special magic numbers for {key} is: {value}."``, each with its own key and
value, and asks for one key's number. A press must keep the asked needle *and* the key that
tells it from the others; the distractors give a wrong number to copy. Template, question,
answer prefix and metric are the single needle's (:mod:`kvdiverge.data.tasks.niah`).

The asked needle goes to the paragraph boundary nearest its depth (as the single needle, refused
beyond ``depth_tolerance``); each distractor goes to a boundary drawn from a SHA-256 hash of
(seed, ``doc_id``, its index) among the others, so a document keeps its needles whatever else
the corpus holds. Keys differ from each other, and no distractor's value is the asked needle's
(answering a distractor's number never scores); values are drawn as the single needle's.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdiverge.data.tasks import niah
from kvdiverge.data.tasks.niah import NEEDLE, Needle, NiahSettings, TaskPrompt, check_budget, score_answer

__all__ = ["MultikeySettings", "check_budget", "distractors", "make_needle", "score_answer", "task_prompt"]


@dataclass(frozen=True)
class MultikeySettings(NiahSettings):
    """Settings of the multi-key needle (``name: multikey``): :class:`kvdiverge.data.tasks.niah.NiahSettings`
    and this.

    Parameters
    ----------
    distractors : int
        Needles with other keys beside the asked one (RULER's ``niah_multikey_1``: 3, four keys in all).
    """

    distractors: int = 3


make_needle = niah.make_needle


def distractors(settings: MultikeySettings, doc_id: str, needle: Needle) -> list[Needle]:
    """The distractor needles of document ``doc_id``: ``settings.distractors`` keys unlike
    ``needle.key`` and each other, values of ``settings.digits`` digits unlike ``needle.value``
    (depth ``nan``: drawn at insertion).

    Candidates are drawn in turn from the seeded hash (:func:`kvdiverge.data.tasks.niah.make_needle`
    of ``doc_id`` and the draw's index); one whose key is taken or whose value is the asked
    needle's is passed over, so a document keeps its distractors whatever else the corpus holds.
    """
    out: list[Needle] = []
    keys = {needle.key}
    draw = 0
    while len(out) < settings.distractors:
        other = niah.make_needle(settings, f"{doc_id}\x1fdistractor-{draw}", 0)
        draw += 1
        if other.key not in keys and other.value != needle.value:
            keys.add(other.key)
            out.append(Needle(other.key, other.value, float("nan")))
    return out


def _haystack(document: str, needle: Needle, settings: MultikeySettings, doc_id: str) -> tuple[str, float]:
    at, depth = niah.needle_depth(document, needle.depth, settings.depth_tolerance, doc_id)
    paras = niah.paragraphs(document)
    others = [b for b in range(len(paras) + 1) if b != at]
    placed = [(at, needle)] + [
        (others[niah.digest(settings.seed, "distractor-at", doc_id, i) % len(others)], d)
        for i, d in enumerate(distractors(settings, doc_id, needle))
    ]
    for boundary, n in sorted(placed, key=lambda p: p[0], reverse=True):
        paras.insert(boundary, NEEDLE.format(key=n.key, value=n.value))
    return "\n\n".join(paras), depth


def task_prompt(tokenizer, document: str, needle: Needle, settings: MultikeySettings, **render) -> TaskPrompt:
    """The task prompt of one document: the asked needle at its depth, the distractors at other
    paragraph boundaries, then the single needle's template and question (``render`` as
    :func:`kvdiverge.data.tasks.niah.task_prompt`).

    Raises
    ------
    kvdiverge.data.tasks.niah.TaskError
        As :func:`kvdiverge.data.tasks.niah.needle_depth`.
    """
    haystack, depth = _haystack(document, needle, settings, render.get("doc_id", "document"))
    return niah.haystack_prompt(tokenizer, haystack, needle, depth, render)
