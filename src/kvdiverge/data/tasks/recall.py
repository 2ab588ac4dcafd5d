"""Quote recall: a question about the document's own content, answered by copying from it.

The document is shown whole; after it, the opening words of one of its sentences are quoted
and the model continues the quote. The answer is right when it holds the sentence's next
``answer_words`` words, in order (case and punctuation ignored: :func:`score_answer`). Unlike
the needle (:mod:`kvdiverge.data.tasks.niah`), nothing is inserted: the asked text is the
document's own, so a press is scored on what it keeps of ordinary prose. It is the cloze form of
the copy and associative-recall probes of long-context evaluation (the model must find the quoted
words in its context and read on), and the kind of question RULER's needle does not ask.

Depth ``d`` (percent) picks the sentence whose first word is nearest to ``d / 100`` of the
document's words, among the sentences that can be asked: at least ``phrase_words +
answer_words + 1`` words long (the answer ends inside the sentence, so the model is not asked to
guess across a full stop) and whose opening ``phrase_words`` words occur once in the document (the
quote names one place). A document without such a sentence is refused (:class:`kvdiverge.data.tasks.niah.TaskError`).

With the embedded model (SmolLM2-135M-Instruct) and its full cache, greedy, 8-word quotes and
3-word answers, 45 of 60 State of the Union excerpts of 300-450 words are answered (75 %;
``docs/task.md``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvdiverge.data.tasks.niah import Needle, TaskError, TaskPrompt, TaskSettings, render_question

__all__ = [
    "ANSWER_PREFIX",
    "PREAMBLE",
    "QUESTION",
    "RecallSettings",
    "check_budget",
    "make_needle",
    "quoted_sentence",
    "score_answer",
    "task_prompt",
]

#: Before the document.
PREAMBLE = "Read the text below. I will ask you to continue a quote from it."
#: After the document: the quote's opening words.
QUESTION = 'Continue this quote from the text above, word for word: "{key}'
#: The assistant turn starts by repeating the quote, so its next words are the answer.
ANSWER_PREFIX = ' "{key}'

_SENTENCE_END = (".", "?", "!")


@dataclass(frozen=True)
class RecallSettings(TaskSettings):
    """Settings of the quote-recall task (``name: recall``): :class:`kvdiverge.data.tasks.niah.TaskSettings`
    (``depths``: where the quoted sentence starts; ``seed`` is not read, the sentence is fixed by
    the depth) and these.

    Parameters
    ----------
    phrase_words : int
        Words quoted (the key).
    answer_words : int
        Words the answer must continue with (the value).
    """

    phrase_words: int = 8
    answer_words: int = 3


def _words(text: str) -> list[str]:
    return text.split()


def quoted_sentence(
    document: str, depth: float, settings: RecallSettings, doc_id: str = "document"
) -> tuple[int, float]:
    """The first word of the sentence asked at ``depth``, and its depth (percent of the words before it).

    Raises
    ------
    TaskError
        When no sentence of the document can be asked (see the module docstring).
    """
    words = _words(document)
    starts = [0] + [i + 1 for i, w in enumerate(words[:-1]) if w.endswith(_SENTENCE_END)]
    ends = starts[1:] + [len(words)]
    need = settings.phrase_words + settings.answer_words + 1
    usable = [
        a
        for a, b in zip(starts, ends)
        if b - a >= need and document.count(" ".join(words[a : a + settings.phrase_words])) == 1
    ]
    if not usable:
        raise TaskError(
            f"document {doc_id!r} has no sentence of {need} words or more whose first {settings.phrase_words} "
            f"words occur once: nothing to quote; use longer documents or fewer task.phrase_words"
        )
    target = len(words) * depth / 100.0
    best = min(usable, key=lambda a: (abs(a - target), a))
    return best, 100.0 * best / len(words)


def make_needle(settings: RecallSettings, doc_id: str, index: int, document: str) -> Needle:
    """What document ``doc_id`` (the ``index``-th of its split) is asked: the quote (``key``), its next
    ``answer_words`` words (``value``) and the depth asked for (``depths[index % len(depths)]``).

    Raises
    ------
    TaskError
        As :func:`quoted_sentence`.
    """
    depth = settings.depths[index % len(settings.depths)]
    start, _ = quoted_sentence(document, depth, settings, doc_id)
    words = _words(document)
    cut = start + settings.phrase_words
    key, value = " ".join(words[start:cut]), " ".join(words[cut : cut + settings.answer_words])
    return Needle(key, value, depth)


def task_prompt(tokenizer, document: str, needle: Needle, settings: RecallSettings, **render) -> TaskPrompt:
    """The task prompt of one document: the preamble, the document whole, the quote; ``render`` as
    :func:`kvdiverge.data.tasks.niah.task_prompt`'s."""
    _, depth = quoted_sentence(document, needle.depth, settings, render.get("doc_id", "document"))
    text = PREAMBLE + "\n" + document
    ids, n_question = render_question(
        tokenizer, text, QUESTION.format(key=needle.key), ANSWER_PREFIX.format(key=needle.key), render
    )
    return TaskPrompt(ids, n_question, depth)


def _normal(text: str) -> list[str]:
    return re.sub(r"[^0-9a-z]+", " ", text.lower()).split()


def score_answer(answer: str, value: str) -> bool:
    """Whether the answer holds the value's words in order, next to each other: case and punctuation
    ignored (``"families: We will"`` matches ``"Families, we will always"``), no other word between them."""
    got, want = _normal(answer), _normal(value)
    return bool(want) and any(got[i : i + len(want)] == want for i in range(len(got) - len(want) + 1))


def check_budget(tokenizer, value: str, max_new_tokens: int) -> None:
    """Refuse an answer the budget cannot hold.

    Raises
    ------
    TaskError
        When the value's words take more tokens than ``max_new_tokens`` (decoding.max_new_tokens).
    """
    n = len(tokenizer(" " + value, add_special_tokens=False)["input_ids"])
    if n > max_new_tokens:
        raise TaskError(
            f"the answer {value!r} takes {n} tokens, more than the answer budget decoding.max_new_tokens = "
            f"{max_new_tokens}; raise decoding.max_new_tokens or lower task.answer_words"
        )
