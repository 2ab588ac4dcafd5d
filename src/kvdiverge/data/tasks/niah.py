"""RULER's single needle in a haystack (``niah_single``), built from any corpus the workflow reads.

The task follows RULER (Hsieh et al., 2024, "RULER: What's the Real Context Size of Your
Long-Context Language Models?", ``scripts/data/synthetic/niah.py`` and
``scripts/eval/synthetic/constants.py`` of github.com/NVIDIA/RULER): a *needle* sentence
``"One of the special magic numbers for {key} is: {value}."`` with a seeded 7-digit value
is inserted into a document (the *haystack*), the document is wrapped in RULER's template
(``"Some special magic numbers are hidden within the following text. ..."``, the document,
then the question ``"What are all the special magic numbers for {key} mentioned in the
provided text?"``), rendered with the model's chat template, and followed by RULER's answer
prefix in the assistant turn. The answer is scored by :func:`string_match_all`.

RULER's generator is not published on the package index (the repository is a set of
scripts with its own data downloads), so the template wording and the metric are written
out here; the haystack is the workflow's corpus, and the needle goes *between paragraphs*
(RULER inserts between sentences of Paul Graham's essays), so the document's own text stays
whole.

Depth ``d`` (percent) places the needle at the paragraph boundary whose share of the
document's words before it is nearest to ``d / 100``; a document whose nearest boundary is
further than ``depth_tolerance`` percentage points from ``d`` is refused as too short for
that depth (:class:`TaskError`).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

from kvdiverge.data.prompts import render_text

__all__ = [
    "ANSWER_PREFIX",
    "NEEDLE",
    "QUESTION",
    "TEMPLATE",
    "Needle",
    "NiahSettings",
    "TaskError",
    "TaskPrompt",
    "TaskSettings",
    "insert_needle",
    "make_needle",
    "needle_depth",
    "render_question",
    "score_answer",
    "string_match_all",
    "task_prompt",
    "check_budget",
    "digest",
    "haystack_prompt",
    "paragraphs",
]

#: RULER's needle sentence (``niah.py``), ``type_needle_v = "numbers"``.
NEEDLE = "One of the special magic numbers for {key} is: {value}."
#: RULER's ``niah`` template (``constants.py``): the instruction before the document.
PREAMBLE = (
    "Some special magic numbers are hidden within the following text. "
    "Make sure to memorize it. I will quiz you about the numbers afterwards."
)
#: RULER's ``niah`` question, after the document.
QUESTION = "What are all the special magic numbers for {key} mentioned in the provided text?"
#: RULER's ``niah`` template as one string: preamble, document, question.
TEMPLATE = PREAMBLE + "\n{context}\n" + QUESTION
#: RULER's answer prefix, appended after the chat template's generation prompt.
ANSWER_PREFIX = " The special magic numbers for {key} mentioned in the provided text are"

# Keys: adjective-noun pairs as RULER's (drawn there from wonderwords' word lists).
_ADJECTIVES = (
    "ancient amber brave calm clever crimson curious dusty eager elegant fierce gentle golden "
    "hollow humble icy jolly lively lucky mellow misty noble odd pale proud quiet rapid rustic "
    "silent silver steady sunny tender tidy vivid wary witty"
).split()
_NOUNS = (
    "anchor badger beacon canyon cedar comet falcon fiddle garden glacier harbor helmet island "
    "lantern marble meadow needle orchard otter pebble pepper quarry raven river saddle salmon "
    "spindle thistle tiger tunnel valley walnut willow window zephyr"
).split()


class TaskError(ValueError):
    """The task cannot be built for a document or setting as configured."""


@dataclass(frozen=True)
class TaskSettings:
    """The settings every task takes (config block ``task``); each task's settings add their own.

    Parameters
    ----------
    depths : tuple of float
        Where the asked text sits, percent of the document's words; documents take them in
        turn, by ``doc_id``.
    seed : int
        Seed of what a task draws (with each document's id).
    question : {"inside", "after"}
        Where the question sits: inside the compressed prompt (the press sees it) or after
        compression (prefilled onto the compressed cache, never evicted; kvpress's pipeline).
    """

    depths: tuple[float, ...] = (0.0, 25.0, 50.0, 75.0, 100.0)
    seed: int = 0
    question: str = "inside"

    def __post_init__(self) -> None:  # the ranges: the config schema's task entry (task_settings)
        object.__setattr__(self, "depths", tuple(float(d) for d in self.depths))


@dataclass(frozen=True)
class NiahSettings(TaskSettings):
    """Settings of the needle task: :class:`TaskSettings` and these.

    Parameters
    ----------
    digits : int
        Digits of the needle's value (RULER: 7).
    depth_tolerance : float
        Largest distance, percentage points, between a depth and the paragraph boundary
        the needle goes to.
    """

    digits: int = 7
    depth_tolerance: float = 15.0


@dataclass(frozen=True)
class Needle:
    """One document's needle: its key, value and the depth it goes to (percent)."""

    key: str
    value: str
    depth: float


def digest(*parts: object) -> int:
    """The first 8 bytes of the SHA-256 of ``parts`` (joined by ``\\x1f``), as an unsigned integer."""
    return int.from_bytes(hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()[:8], "big")


def make_needle(settings: NiahSettings, doc_id: str, index: int, document: str | None = None) -> Needle:
    """The needle of document ``doc_id``, the ``index``-th of its split by ``doc_id``.

    Key and value come from a SHA-256 hash of (seed, purpose, ``doc_id``), so a document
    keeps its needle whatever else the corpus holds (``document``, the registry's argument, is
    not read: a needle does not depend on its haystack); the value has exactly ``digits``
    digits (first digit 1-9, RULER's ``randint(10**(d-1), 10**d - 1)``). The depth is
    ``depths[index % len(depths)]``.
    """
    d = int(settings.digits)
    value = 10 ** (d - 1) + digest(settings.seed, "value", doc_id) % (9 * 10 ** (d - 1))
    h = digest(settings.seed, "key", doc_id)
    key = f"{_ADJECTIVES[h % len(_ADJECTIVES)]}-{_NOUNS[(h // len(_ADJECTIVES)) % len(_NOUNS)]}"
    return Needle(key, str(value), settings.depths[index % len(settings.depths)])


def paragraphs(document: str) -> list[str]:
    """The document's paragraphs (split at blank lines), stripped, empty ones dropped."""
    return [p.strip() for p in re.split(r"\n\s*\n", document) if p.strip()]


def needle_depth(document: str, depth: float, tolerance: float, doc_id: str = "document") -> tuple[int, float]:
    """The paragraph boundary nearest to ``depth`` percent of the document's words.

    Parameters
    ----------
    document : str
        Paragraphs separated by blank lines.
    depth : float
        Requested depth, percent (0-100).
    tolerance : float
        Largest accepted distance from ``depth``, percentage points.
    doc_id : str
        The document's name in errors.

    Returns
    -------
    (int, float)
        The boundary (0: before the first paragraph, ``n``: after the last of ``n``) and its
        depth, percent of the words before it.

    Raises
    ------
    TaskError
        A document without a paragraph break, or one whose nearest boundary lies further
        than ``tolerance`` from ``depth``.
    """
    paras = paragraphs(document)
    if len(paras) < 2:
        raise TaskError(
            f"document {doc_id!r} has no paragraph break (no blank line): the needle goes between "
            f"paragraphs, so the corpus must separate paragraphs by blank lines"
        )
    words = [len(p.split()) for p in paras]
    total = sum(words)
    cuts = [100.0 * sum(words[:i]) / total for i in range(len(paras) + 1)]
    best = min(range(len(cuts)), key=lambda i: (abs(cuts[i] - depth), i))
    if abs(cuts[best] - depth) > tolerance:
        raise TaskError(
            f"document {doc_id!r} is too short for needle depth {depth:g}%: its {len(paras)} paragraphs "
            f"allow depths {', '.join(f'{c:.0f}' for c in cuts)}%, none within task.depth_tolerance "
            f"= {tolerance:g} points; use longer documents with more paragraphs, or a larger tolerance"
        )
    return best, cuts[best]


def insert_needle(document: str, needle: Needle, tolerance: float, doc_id: str = "document") -> tuple[str, float]:
    """The document with the needle sentence as a paragraph of its own at the needle's depth.

    Returns
    -------
    (str, float)
        The haystack with the needle, and the depth it went to (percent of the words before it).

    Raises
    ------
    TaskError
        As :func:`needle_depth`.
    """
    at, depth = needle_depth(document, needle.depth, tolerance, doc_id)
    paras = paragraphs(document)
    paras.insert(at, NEEDLE.format(key=needle.key, value=needle.value))
    return "\n\n".join(paras), depth


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """RULER's ``string_match_all`` for one answer: the share of references found in it.

    A reference counts when it occurs in the prediction as a substring, ignoring case
    (RULER's ``r.lower() in pred.lower()``), so the score of one prediction is in [0, 1];
    RULER averages it over samples and reports percent.
    """
    if not references:
        raise TaskError("string_match_all needs at least one reference")
    text = prediction.lower()
    return sum(ref.lower() in text for ref in references) / len(references)


def score_answer(answer: str, value: str) -> bool:
    """Whether a greedy answer contains the needle's value: RULER's exact match.

    Accepts any answer in which the value occurs as written, as a substring: ``"The
    special magic number is 7311."`` and ``"7311"`` score for ``"7311"``. Rejects ``"7,311"``
    (a digit-group separator is not the value's string; RULER does not normalise numbers,
    and a model that copies the needle copies its digits) and an answer without the value.
    ``"73110"`` *contains* ``"7311"`` and scores, exactly as in RULER, whose metric is a
    substring test; with RULER's 7-digit values a chance superstring is rare, and the test
    stays RULER's so that scores compare with its tables.

    Parameters
    ----------
    answer : str
        The decoded answer (special tokens removed).
    value : str
        The needle's value.

    Returns
    -------
    bool
    """
    return string_match_all(answer, [value]) == 1.0


@dataclass(frozen=True)
class TaskPrompt:
    """One document's task prompt.

    Attributes
    ----------
    input_ids : list of int
        The chat-rendered prompt: RULER's template around the haystack as the user message,
        the generation prompt, then RULER's answer prefix (no extra BOS).
    n_question : int
        Trailing tokens from the question on (question, end of the user turn, generation
        prompt, answer prefix): what a press never sees when the question sits after
        compression.
    depth : float
        The depth the needle went to, percent of the document's words before it.
    """

    input_ids: list[int]
    n_question: int
    depth: float


def render_question(tokenizer, context: str, question: str, answer_prefix: str, render) -> tuple[list[int], int]:
    """Token ids of a task prompt and the number of trailing question tokens (see :class:`TaskPrompt`).

    The user message is ``context``, a line break and ``question``, rendered with the chat template
    (``render``'s ``system`` and ``date``), then ``answer_prefix`` opens the assistant turn.

    Raises
    ------
    TaskError
        When the tokens of the text before the question are not a prefix of the prompt's
        tokens (a tokenizer merging across the document's end and the question).
    """
    content = context + "\n" + question
    system, date = render.get("system"), render.get("date", "2026-01-01")
    text = render_text(tokenizer, content, None, system, date) + answer_prefix
    ids = [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
    head = tokenizer(text[: text.rindex(question)], add_special_tokens=False)["input_ids"]
    if list(ids[: len(head)]) != [int(i) for i in head]:
        raise TaskError("the tokenizer merges the document's last tokens with the question; cannot split them")
    return ids, len(ids) - len(head)


def task_prompt(tokenizer, document: str, needle: Needle, settings: NiahSettings, **render) -> TaskPrompt:
    """The task prompt of one document (:func:`insert_needle`, then :func:`render_question`).

    ``render`` passes ``system``, ``date`` (the chat template's, ``prompt.date``) and
    ``doc_id`` (named in errors).
    """
    haystack, depth = insert_needle(document, needle, settings.depth_tolerance, render.get("doc_id", "document"))
    return haystack_prompt(tokenizer, haystack, needle, depth, render)


def haystack_prompt(tokenizer, haystack: str, needle: Needle, depth: float, render) -> TaskPrompt:
    """RULER's template around a haystack that holds the needle, asking for ``needle.key``
    (:func:`render_question` with RULER's preamble, question and answer prefix)."""
    question, prefix = QUESTION.format(key=needle.key), ANSWER_PREFIX.format(key=needle.key)
    ids, n_question = render_question(tokenizer, PREAMBLE + "\n" + haystack, question, prefix, render)
    return TaskPrompt(ids, n_question, depth)


def check_budget(tokenizer, value: str, max_new_tokens: int) -> None:
    """Refuse a needle value the answer budget cannot hold.

    Raises
    ------
    TaskError
        When the value takes more tokens than ``max_new_tokens`` (decoding.max_new_tokens).
    """
    n = len(tokenizer(" " + value, add_special_tokens=False)["input_ids"])
    if n > max_new_tokens:
        raise TaskError(
            f"the needle's value {value!r} takes {n} tokens, more than the answer budget "
            f"decoding.max_new_tokens = {max_new_tokens}; raise decoding.max_new_tokens or lower task.digits"
        )
