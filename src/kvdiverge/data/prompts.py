"""Prompts stage: render each document with the model's chat template, record exclusions.

The prompt is one user message, the document followed by a blank line and the
configured instruction, rendered with ``tokenizer.apply_chat_template(...,
add_generation_prompt=True)``. The token ids are exactly what the template
produces (no extra BOS is added on top of it).

A model without a chat template (a base model, e.g. Gemma 3 270M) gets the plain prompt
(:func:`plain_text`): the system message if any, the document and the instruction, separated
by blank lines, after the special tokens its tokenizer puts before a text (Gemma: ``<bos>``),
written out as a chat template writes them; its ids are that text's tokens.

Chat templates that read the clock (``strftime_now``, e.g. Llama 3.2 and 3.3, which put
"Today Date: ..." in the system header) would make the prompts, and every result,
change from one day to the next. The template sees the configured ``prompt.date``
instead (:func:`template_clock`): ``strftime_now`` formats that date (at 00:00:00) and
``date_string``, the variable Llama templates read first, is that date as
``"%d %b %Y"`` (e.g. ``"01 Jan 2026"``).

A document is excluded, with the reason recorded, when

- the corpus stage dropped it (an empty or whitespace-only document, one without an excerpt
  in the word range, a duplicate: its ``exclusion_reason`` is carried over, with no tokens),
- its prompt plus ``max_new_tokens`` exceeds the model's context, or
- it is shorter than what a policy scheduled on its split needs
  (``kvdiverge.engine.presses.catalogue.min_prompt_tokens``), so that every policy of a split sees
  the same documents.

Output table (``docs/internals.md``): ``doc_id``, ``split``, ``n_prompt_tokens``
(int32), ``input_ids`` (list[int32]), ``exclusion_reason`` (null when usable).
"""

from __future__ import annotations

import datetime
from typing import Any

import polars as pl

from kvdiverge.engine.llamacpp.caches import is_cache_entry
from kvdiverge.engine.presses import catalogue

#: The date chat templates see when the config names none (``prompt.date``, ISO 8601).
DEFAULT_DATE = "2026-01-01"
#: Instruction appended to the command line's ``--sotu`` excerpts (the workflow's default, config/config.yaml).
SOTU_INSTRUCTION = "Summarize the document above in three sentences."
#: The reconstruction target's instruction by default (config ``teacher_forced.repeat_instruction``): KVzip's
#: (Kim et al. 2025, "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction"; kvpress's KVzipPress).
REPEAT_INSTRUCTION = "Repeat the previous context exactly."

SCHEMA = {
    "doc_id": pl.String,
    "split": pl.String,
    "n_prompt_tokens": pl.Int32,
    "input_ids": pl.List(pl.Int32),
    "exclusion_reason": pl.String,
}


def messages(document: str, instruction: str | None, system: str | None = None) -> list[dict[str, str]]:
    """Chat messages of a prompt: optional system message, then document + instruction.

    Without an instruction (``None`` or empty) the user message is the document alone.
    """
    out = []
    if system:
        out.append({"role": "system", "content": system})
    out.append({"role": "user", "content": f"{document}\n\n{instruction}" if instruction else document})
    return out


def has_chat_template(tokenizer) -> bool:
    """False for a tokenizer whose ``chat_template`` is None or empty (a base model's); an object
    without that attribute is taken to render with its own ``apply_chat_template``."""
    return getattr(tokenizer, "chat_template", True) not in (None, "")


def plain_text(tokenizer, document: str, instruction: str | None, system: str | None = None) -> str:
    """The prompt of a model without a chat template (a base model): the system message (if any),
    the document and the instruction (if any), separated by blank lines, after the special tokens the
    tokenizer puts before a text (:func:`leading_special_text`; Gemma: ``"<bos>"``)."""
    body = messages(document, instruction)[-1]["content"]
    return leading_special_text(tokenizer) + (f"{system}\n\n{body}" if system else body)


def leading_special_text(tokenizer) -> str:
    """The special tokens the tokenizer adds before a text (its BOS, e.g. ``"<bos>"``), as text; empty
    for a tokenizer that adds none. Read off the tokens of a probe with and without special tokens."""
    marked = list(tokenizer("x")["input_ids"])
    bare = list(tokenizer("x", add_special_tokens=False)["input_ids"])
    start = next((i for i in range(len(marked) - len(bare) + 1) if marked[i : i + len(bare)] == bare), 0)
    return "".join(tokenizer.convert_ids_to_tokens(marked[:start]))


def parse_date(date: str | datetime.date, key: str = "prompt.date") -> datetime.date:
    """The prompt date as a :class:`datetime.date`.

    Parameters
    ----------
    date : str or datetime.date
        An ISO 8601 calendar date, ``"YYYY-MM-DD"`` (or a date object, as YAML reads an
        unquoted date).
    key : str
        Config key named in the error.

    Raises
    ------
    ValueError
        If ``date`` is not a valid ISO calendar date; the message names ``key``.
    """
    if isinstance(date, datetime.datetime):
        return date.date()
    if isinstance(date, datetime.date):
        return date
    try:
        return datetime.date.fromisoformat(str(date))
    except ValueError:
        raise ValueError(f'{key}: {date!r} is not a date; write it as "YYYY-MM-DD", e.g. "{DEFAULT_DATE}"') from None


def template_clock(date: str | datetime.date = DEFAULT_DATE) -> dict[str, Any]:
    """Template variables that pin the chat template's idea of "today" to ``date``.

    ``apply_chat_template`` passes extra keyword arguments to the template as variables,
    and a template variable shadows the Jinja global of the same name, so the returned
    ``strftime_now`` replaces transformers' clock-reading one.

    Parameters
    ----------
    date : str or datetime.date
        ISO date (``prompt.date``).

    Returns
    -------
    dict
        ``strftime_now`` (``format -> str``: ``date`` at 00:00:00 formatted with
        ``datetime.strftime``) and ``date_string`` (``date`` as ``"%d %b %Y"``, the
        variable Llama 3.x templates read before calling ``strftime_now``).
    """
    moment = datetime.datetime.combine(parse_date(date), datetime.time())

    def strftime_now(fmt: str) -> str:
        return moment.strftime(fmt)

    return {"strftime_now": strftime_now, "date_string": moment.strftime("%d %b %Y")}


def render_text(
    tokenizer,
    document: str,
    instruction: str | None,
    system: str | None = None,
    date: str | datetime.date = DEFAULT_DATE,
) -> str:
    """The chat-rendered prompt as a string (generation prompt included), dated ``date``; the
    plain prompt for a tokenizer without a chat template (:func:`plain_text`)."""
    if not has_chat_template(tokenizer):
        return plain_text(tokenizer, document, instruction, system)
    return tokenizer.apply_chat_template(
        messages(document, instruction, system),
        add_generation_prompt=True,
        tokenize=False,
        **template_clock(date),
    )


def render_ids(
    tokenizer,
    document: str,
    instruction: str | None,
    system: str | None = None,
    date: str | datetime.date = DEFAULT_DATE,
) -> list[int]:
    """The chat-rendered prompt as token ids (generation prompt included), dated ``date``.

    See :func:`template_clock` for how the date reaches the template. A tokenizer without a chat
    template: the tokens of :func:`plain_text`.
    """
    if not has_chat_template(tokenizer):
        text = plain_text(tokenizer, document, instruction, system)
        return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
    out = tokenizer.apply_chat_template(
        messages(document, instruction, system),
        add_generation_prompt=True,
        return_dict=True,
        **template_clock(date),
    )
    return [int(i) for i in out["input_ids"]]


def repeat_text(tokenizer, instruction: str, date: str | datetime.date = DEFAULT_DATE) -> str:
    r"""What the reconstruction target feeds between a rendered prompt and the prompt's text repeated.

    With a chat template: the text the template adds to a conversation that ends at the assistant's
    turn (the rendered prompt) for an empty assistant turn, a user turn ``instruction`` and the next
    assistant turn (``<|im_end|>\n<|im_start|>user\nRepeat the previous context exactly.<|im_end|>\n
    <|im_start|>assistant\n`` in ChatML). Without one (a base model): ``"\n\n" + instruction + "\n"``,
    as KVzip words it for a model without a template.

    Raises
    ------
    ValueError
        If the template's rendering of the longer conversation does not extend the shorter one's.
    """
    if not has_chat_template(tokenizer):
        return f"\n\n{instruction}\n"
    clock = template_clock(date)
    asked = [{"role": "user", "content": "x"}]
    again = [*asked, {"role": "assistant", "content": ""}, {"role": "user", "content": instruction}]
    first, second = (
        tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False, **clock) for m in (asked, again)
    )
    if not second.startswith(first):
        raise ValueError(
            "teacher_forced.target: 'reconstruction' needs a chat template that extends a conversation "
            "turn by turn; this tokenizer's rewrites the earlier turns"
        )
    return second[len(first) :]


def repeat_ids(tokenizer, instruction: str, date: str | datetime.date = DEFAULT_DATE) -> list[int]:
    """The tokens of :func:`repeat_text` (no special tokens added: the template's are in the text)."""
    return [int(i) for i in tokenizer(repeat_text(tokenizer, instruction, date), add_special_tokens=False)["input_ids"]]


def text_ids(tokenizer, text: str) -> list[int]:
    """A prompt's own text as the reconstruction target repeats it: its tokens without special tokens."""
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]


def split_policies(config: dict[str, Any]) -> dict[str, list[str]]:
    """Policy names scheduled on each split, the control included where it runs."""
    runs = config.get("runs", {})
    out = {split: list(runs.get(split, [])) for split in ("exploratory", "confirmatory")}
    control = runs.get("control")
    if control:
        names = out.setdefault(control["split"], [])
        if control["policy"] not in names:
            names.append(control["policy"])
    return out


def policy_minimums(config: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Per split: ``{policy: minimum prompt tokens}`` for the policies run on it
    (:func:`kvdiverge.engine.presses.catalogue.min_prompt_tokens`; 1 for a llama.cpp cache, which keeps
    every position)."""
    return {
        split: {name: _min_prompt_tokens(config["policies"][name]) for name in names}
        for split, names in split_policies(config).items()
    }


def _min_prompt_tokens(entry: dict[str, Any]) -> int:
    return 1 if is_cache_entry(entry) else int(catalogue.min_prompt_tokens(entry))


def exclusion_reason(n_tokens: int, minimums: dict[str, int], context: int, max_new_tokens: int) -> str | None:
    """Why a prompt of ``n_tokens`` cannot be used, or ``None`` when it can.

    Parameters
    ----------
    n_tokens : int
        Prompt length in tokens.
    minimums : dict
        ``{policy: minimum prompt tokens}`` of the policies run on the document's split.
    context : int
        Model context length in tokens.
    max_new_tokens : int
        Horizon T; the prompt plus T generated tokens must fit in the context.
    """
    if n_tokens + max_new_tokens > context:
        return (
            f"too long: prompt of {n_tokens} tokens + {max_new_tokens} new tokens "
            f"exceeds the model context of {context} tokens"
        )
    short = sorted((need, name) for name, need in minimums.items() if n_tokens < need)
    if short:
        need, name = short[-1]
        others = [n for _, n in short[:-1]]
        also = f" (also too short for {', '.join(others)})" if others else ""
        return f"too short for policy {name}: prompt of {n_tokens} tokens, policy needs at least {need}{also}"
    return None


def prompt_settings(config: dict[str, Any]) -> dict[str, Any]:
    """Everything of the config that decides a prompts table, and nothing else.

    The prompts rule passes it as ``params``, so Snakemake reruns the stage exactly when
    one of these changes: ``instruction``, ``system``, ``date`` (the ISO date the chat
    template sees, :func:`template_clock`), ``minimums`` (per split, the minimum prompt
    tokens of each scheduled policy) and ``max_new_tokens``; with a ``task`` block also
    ``task`` and ``seed`` (the task's prompts, :func:`kvdiverge.data.tasks.build_task_prompts`).
    """
    prompt = config.get("prompt", {})
    task = {"task": dict(config["task"]), "seed": int(config["seed"])} if config.get("task") else {}
    return {
        **task,
        "instruction": prompt["instruction"],
        "system": prompt.get("system"),
        "date": parse_date(prompt.get("date", DEFAULT_DATE)).isoformat(),
        "minimums": policy_minimums(config),
        "max_new_tokens": int(config["decoding"]["max_new_tokens"]),
    }


def build_prompts(documents: pl.DataFrame, tokenizer, settings: dict[str, Any], context: int) -> pl.DataFrame:
    """The prompts table of one model.

    Parameters
    ----------
    documents : polars.DataFrame
        The corpus table (``doc_id``, ``split``, ``text``; rows with an ``exclusion_reason``,
        dropped by the corpus stage, keep it and get no tokens).
    tokenizer
        The model's tokenizer (with a chat template).
    settings : dict
        :func:`prompt_settings` of the validated config.
    context : int
        The model's context length in tokens.
    """
    rows = []
    dropped = documents["exclusion_reason"] if "exclusion_reason" in documents.columns else None
    for i, (doc_id, split, text) in enumerate(documents.select(["doc_id", "split", "text"]).iter_rows()):
        if dropped is not None and dropped[i] is not None:  # dropped by the corpus stage: carried, not rendered
            rows.append(_excluded_row(doc_id, split, dropped[i]))
            continue
        ids = render_ids(
            tokenizer, text, settings["instruction"], settings.get("system"), settings.get("date", DEFAULT_DATE)
        )
        reason = exclusion_reason(len(ids), settings["minimums"].get(split, {}), context, settings["max_new_tokens"])
        rows.append(
            {
                "doc_id": doc_id,
                "split": split,
                "n_prompt_tokens": len(ids),
                "input_ids": ids,
                "exclusion_reason": reason,
            }
        )
    return pl.DataFrame(rows, schema=SCHEMA)


def _excluded_row(doc_id: str, split: str, reason: str) -> dict[str, Any]:
    """A prompts-table row of a document the corpus stage dropped: no tokens, its reason."""
    return {"doc_id": doc_id, "split": split, "n_prompt_tokens": 0, "input_ids": [], "exclusion_reason": reason}


class NoUsableDocumentsError(ValueError):
    """A split that has policies scheduled has no usable document left."""


def check_usable(prompts: pl.DataFrame, settings: dict[str, Any]) -> None:
    """Stop when a split with scheduled policies has no usable document.

    Some exclusions are expected and reported; none left would only fail stages later
    with a less telling error.

    Raises
    ------
    NoUsableDocumentsError
        Naming the split, the most frequent exclusion reason and what to change.
    """
    for split, minimums in settings["minimums"].items():
        if not minimums:
            continue
        part = prompts.filter(pl.col("split") == split)
        if usable(part).height:
            continue
        reasons = part["exclusion_reason"].drop_nulls()
        ranked = reasons.value_counts(sort=True)[:, 0].to_list() if reasons.len() else []
        top = ranked[0] if ranked else "no documents in this split"
        before = sum(reason.startswith(CORPUS_REASONS) for reason in reasons.to_list())
        also = f" ({before} more dropped before selection)" if before else ""
        raise NoUsableDocumentsError(
            f"split {split!r}: none of its {part.height - before} documents{also} is usable for the policies "
            f"scheduled on it ({', '.join(sorted(minimums))}); most frequent reason: {top}. "
            f"{remedy(ranked, split)}"
        )


#: How the reasons of rows the corpus stage dropped before selection start (they reach the prompts
#: table with their reason and no tokens: :func:`kvdiverge.data.corpus.build_corpus`).
CORPUS_REASONS = ("empty document", "whitespace-only document", "no excerpt", "duplicate of")


#: What to change for each kind of exclusion reason (a phrase of the reason), ``{split}`` filled in.
REMEDIES = {
    "too long": "Shorten the prompts (a lower corpus.max_words) or decoding.max_new_tokens, or use a model "
    "with a longer context",
    "too short for policy": "Widen corpus.min_words/max_words (longer prompts), or drop the policy from "
    "runs.{split} (and analysis.gaps / confirmatory)",
    "duplicate of": "Add distinct documents to the corpus source (duplicates are dropped)",
    "empty document": "Add documents with text to the corpus source",
    "whitespace-only document": "Add documents with text to the corpus source",
    "no excerpt": "Widen corpus.min_words/max_words to the documents' paragraph lengths",
    "has no paragraph break": "Use excerpts of several paragraphs (a higher corpus.min_words) from a source "
    "that separates paragraphs by blank lines: the task's needle goes between paragraphs",
    "is too short for needle depth": "Use longer excerpts with more paragraphs (a higher corpus.min_words), "
    "or a larger task.depth_tolerance",
}


def remedy(reasons: list[str], split: str) -> str:
    """What to change, following from the exclusion ``reasons`` (most frequent first): one sentence
    per kind of reason (:data:`REMEDIES`), in that order, joined by "; or"; for no reason, request
    documents."""
    out: list[str] = []
    for reason in reasons:
        fix = next((v for k, v in REMEDIES.items() if k in reason), None)
        if fix is not None and fix.format(split=split) not in out:
            out.append(fix.format(split=split))
    if not out:
        out.append(f"Request documents for the split in corpus.documents.{split}, or use a larger source")
    return "; or ".join([out[0], *(fix[0].lower() + fix[1:] for fix in out[1:])]) + "."


def usable(prompts: pl.DataFrame) -> pl.DataFrame:
    """Rows without an exclusion reason."""
    return prompts.filter(pl.col("exclusion_reason").is_null())


def summary(prompts: pl.DataFrame) -> str:
    """One line per split: usable / total and the range of prompt tokens, then one line per excluded
    document: its id and reason."""
    lines = []
    for split in sorted(prompts["split"].unique().to_list()):
        part = prompts.filter(pl.col("split") == split)
        ok = usable(part).height
        tokens = part.filter(pl.col("input_ids").list.len() > 0)["n_prompt_tokens"]
        lines.append(f"{split}: {ok}/{part.height} usable; prompt tokens {tokens.min()}-{tokens.max()}")
        for doc_id, reason in (
            part.filter(pl.col("exclusion_reason").is_not_null()).select("doc_id", "exclusion_reason").iter_rows()
        ):
            lines.append(f"  excluded {doc_id}: {reason}")
    return "\n".join(lines)
