"""What the front door reads and hands the engine: prompts, presses, a frontier, the model argument.

- :func:`prepare_documents`, :func:`prepare_presses`, :func:`check_lengths`: prompts as
  engine documents and presses as policies, checked before any generation
  (:func:`kvdiverge.measure`).
- :func:`frontier_presses`: every press at every ratio, the config frontier's points
  (:func:`kvdiverge.config.frontier.frontier_policy`), beside the noise floor.
- :func:`model_entry` turns a model argument (``embedded``, a directory, a ``.gguf`` file,
  a hub id) into a config model entry (:func:`kvdiverge.models.loading.load_model`). It raises
  :class:`InputError` (a ``ValueError``), one sentence naming the argument, as the prompt files'
  readers do (:mod:`kvdiverge.config.prompt_sources`; ``kvdiverge measure`` prints it; its
  argparse arguments are read in :mod:`kvdiverge.doors.cli`).

Only the doors import it (:mod:`kvdiverge.doors.measurement`, :mod:`kvdiverge.doors.screening`,
:mod:`kvdiverge.doors.cli` through :mod:`kvdiverge.doors.arguments`), so it imports the engine
(torch, kvpress) at the top.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvdiverge.config.frontier import (
    FrontierSpec,
    cache_settings,
    frontier_grid,
    frontier_policy,
    frontier_problems,
    spec_problems,
)
from kvdiverge.config.workflow import policy_entry_problems
from kvdiverge.data.prompts import render_ids, repeat_ids, text_ids
from kvdiverge.engine.core.errors import PressError
from kvdiverge.engine.forced import Continuation
from kvdiverge.engine.llm.pair_base import model_eos_ids
from kvdiverge.engine.presses.bases import press_problem
from kvdiverge.engine.presses.policies import Policy, PressPolicy, keeps_every_position
from kvdiverge.engine.presses.project import PermutationPress
from kvdiverge.engine.presses.registry import refusal
from kvdiverge.engine.refusals import PressSource, check_prompt_lengths
from kvdiverge.engine.runner import Document
from kvdiverge.estimation.frontier import FrontierPoint
from kvdiverge.models import embedded as embedded_models
from kvdiverge.models.embedded import embedded_choices
from kvdiverge.models.loading import context_length
from kvdiverge.settings.checks import eos_id_problems, model_problem, token_id_problems, vocab_size

__all__ = [
    "InputError",
    "NOISE_FLOOR_POLICY",
    "NOISE_FLOOR_PRESS",
    "check_context",
    "check_lengths",
    "describe_press",
    "frontier_presses",
    "is_noise_floor",
    "check_model_inputs",
    "model_entry",
    "model_eos",
    "model_label",
    "plan_presses",
    "prepare_documents",
    "prepare_presses",
    "prompt_items",
    "reconstruction_targets",
]


class InputError(ValueError):
    """Bad input: a prompts file, field or model argument that cannot be used."""


#: Class name of the project's noise-floor control press, for messages (a press is the noise floor
#: when it keeps every position: :func:`kvdiverge.engine.presses.policies.keeps_every_position`).
NOISE_FLOOR_PRESS = "PermutationPress"
#: Policy name of the noise-floor control in configs.
NOISE_FLOOR_POLICY = "noise-floor"


# --------------------------------------------------------------------------- inputs


def _as_ids(prompt: Any) -> list[int] | None:
    """Token ids of a prompt given as ids (list, tuple, numpy array, 1-d tensor); None for text."""
    if isinstance(prompt, str):
        return None
    if hasattr(prompt, "tolist"):
        prompt = prompt.tolist()
    if isinstance(prompt, Sequence) and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        return [int(i) for i in prompt]
    raise TypeError(f"a prompt must be a string or a sequence of token ids (int), got {type(prompt).__name__}")


def prepare_documents(
    prompts: Sequence[Any] | Mapping[str, Any],
    tokenizer=None,
    *,
    instruction: str | None = None,
    system: str | None = None,
) -> list[Document]:
    """Prompts as engine documents: text rendered with the chat template, ids kept as they are.

    Parameters
    ----------
    prompts : sequence or mapping
        Strings or token-id sequences. A mapping gives each prompt its id (``doc_id``,
        which enters the seeds); a sequence names them ``prompt-0``, ``prompt-1``, ...
    tokenizer : transformers tokenizer, optional
        Needed for text prompts: rendered as one user message (the text, then a blank line
        and ``instruction`` if given) with ``add_generation_prompt=True``, exactly as the
        workflow's prompts stage (:func:`kvdiverge.data.prompts.render_ids`).
    instruction, system : str, optional
        Appended instruction and system message of text prompts.

    Returns
    -------
    list of kvdiverge.engine.runner.Document

    Raises
    ------
    ValueError
        No prompts, an empty prompt, a duplicated id, or text prompts without a tokenizer.
    TypeError
        ``prompts`` that is not a string, sequence or mapping (None, a number), or a prompt
        that is neither text nor token ids.
    """
    _check_prompts_type(prompts)
    items = prompt_items(prompts)
    if not items:
        raise ValueError("no prompts given")
    docs, seen = [], set()
    for doc_id, prompt in items:
        doc_id = str(doc_id)
        if doc_id in seen:
            raise ValueError(f"prompt id {doc_id!r} appears twice")
        seen.add(doc_id)
        ids = _as_ids(prompt)
        if ids is None:
            if tokenizer is None:
                raise ValueError(f"prompt {doc_id!r} is text: pass the model's tokenizer to render it")
            if not prompt.strip():
                raise ValueError(f"prompt {doc_id!r} is empty")
            ids = render_ids(tokenizer, prompt, instruction, system)
        if not ids:
            raise ValueError(f"prompt {doc_id!r} has no tokens")
        docs.append(Document(doc_id, ids))
    return docs


def prompt_items(prompts: Sequence[Any] | Mapping[str, Any]) -> list[tuple[Any, Any]]:
    """``(id, prompt)`` pairs of prompts as :func:`prepare_documents` names them: a mapping's keys, else
    ``prompt-0``, ``prompt-1``, ... (one string is one prompt)."""
    if isinstance(prompts, Mapping):
        return list(prompts.items())
    return [(f"prompt-{i}", p) for i, p in enumerate([prompts] if isinstance(prompts, str) else prompts)]


def reconstruction_targets(prompts, tokenizer, instruction: str, name: str = "teacher_target") -> dict[str, Any]:
    """Each prompt's reconstruction target: the repeat instruction, then the prompt's own text.

    Parameters
    ----------
    prompts : sequence or mapping
        As :func:`prepare_documents`: text (its tokens without special tokens,
        :func:`kvdiverge.data.prompts.text_ids`) or token ids (repeated as given).
    tokenizer : transformers tokenizer
        Renders ``instruction`` with the model's chat template (:func:`kvdiverge.data.prompts.repeat_ids`).
    instruction : str
        The repeat instruction (config ``teacher_forced.repeat_instruction``).
    name : str
        How the door spells the target setting, for the error.

    Returns
    -------
    dict of str to kvdiverge.engine.forced.Continuation
        Per prompt id: ``prefix`` the instruction's tokens, ``tokens`` the text's, ``source`` ``"prompt"``.

    Raises
    ------
    ValueError
        Without a tokenizer, or for a prompt whose text has no tokens.
    """
    if tokenizer is None:
        raise ValueError(
            f"{name}: 'reconstruction' renders its repeat instruction with the model's chat template: "
            "pass the tokenizer"
        )
    prefix = tuple(repeat_ids(tokenizer, instruction))
    out = {}
    for doc_id, prompt in prompt_items(prompts):
        ids = _as_ids(prompt)
        tokens = tuple(text_ids(tokenizer, prompt) if ids is None else ids)
        if not tokens:
            raise ValueError(f"prompt {str(doc_id)!r} has no text to reconstruct")
        out[str(doc_id)] = Continuation(tokens, "prompt", prefix)
    return out


def _check_prompts_type(prompts: Any) -> None:
    """Refuse ``prompts`` that is neither text nor a collection of prompts (None, a number, bytes)."""
    if isinstance(prompts, (str, Mapping)) or (hasattr(prompts, "__iter__") and not isinstance(prompts, bytes)):
        return
    raise TypeError(
        "prompts must be a string, a sequence of strings or of token-id sequences, or a mapping of prompt "
        f"id to one of them, got {type(prompts).__name__}"
    )


def _is_source(obj: Any) -> bool:
    return all(hasattr(obj, a) for a in ("name", "build_press", "expected_kept"))


def prepare_presses(presses: Any, check: bool = True) -> dict[str, PressSource]:
    """Presses as policies (:class:`kvdiverge.engine.refusals.PressSource`), by name.

    Parameters
    ----------
    presses : mapping, sequence or press
        A mapping of name to a kvpress press object (any ``kvpress.BasePress``, the
        user's own classes included; wrapped in :class:`kvdiverge.engine.presses.policies.PressPolicy`),
        a policy entry as in the config (``{"press": "SnapKVPress", "compression_ratio":
        0.5, ...}`` or ``budget``; :class:`kvdiverge.engine.presses.policies.Policy`), or any
        ``PressSource``. A sequence or a single press is named by class name
        (``SnapKVPress``, ``SnapKVPress-2`` for a second one).
    check : bool
        Ask the registry whether kvdiverge measures each press (without the model);
        :func:`~kvdiverge.doors.measurement.measure` leaves it to :func:`kvdiverge.engine.runner.run_policies`, which
        asks once, with the model.

    Returns
    -------
    dict of str to PressSource
        In the given order.

    Raises
    ------
    ValueError
        No presses, or an invalid policy entry.
    kvdiverge.engine.core.errors.PressError
        (a ``ValueError``) A press kvdiverge refuses (the message says what it needs; see
        :mod:`kvdiverge.engine.presses.registry`), an unknown parameter, one kvpress rejects,
        a policy entry's value the config would refuse
        (:func:`kvdiverge.config.workflow.policy_entry_problems`), or a value that is not a press
        object (a class, an abstract base, any other callable:
        :func:`kvdiverge.engine.presses.bases.press_problem`).
    """
    if isinstance(presses, Mapping) and "press" in presses and isinstance(presses.get("press"), str):
        raise TypeError("presses must be keyed by name: {name: press or policy entry}")
    if not isinstance(presses, Mapping):
        seq = list(presses) if isinstance(presses, (list, tuple)) else [presses]
        named: dict[str, Any] = {}
        for p in seq:
            base = getattr(p, "name", None) if _is_source(p) else type(p).__name__
            name, k = base, 1
            while name in named:
                k += 1
                name = f"{base}-{k}"
            named[name] = p
        presses = named
    if not presses:
        raise ValueError("no presses given")
    out: dict[str, PressSource] = {}
    for name, value in presses.items():
        name = str(name)
        if _is_source(value) and not isinstance(value, Mapping):
            out[name] = value if getattr(value, "name", None) == name else _renamed(value, name)
        elif isinstance(value, Mapping):
            problems = policy_entry_problems(dict(value))  # the config's checks of a policy entry
            if problems:
                raise PressError(f"press {name!r}", problems[0])
            out[name] = Policy.from_config(name, dict(value), check=check)
        else:  # a press object: an instance of a kvpress.BasePress subclass that compresses
            reason = press_problem(value) or (refusal(value) if check else None)
            if reason:
                raise PressError(f"press {name!r}", reason)
            out[name] = PressPolicy(name, value)
    return out


def _renamed(source: Any, name: str) -> Any:

    if dataclasses.is_dataclass(source):
        return dataclasses.replace(source, name=name)
    raise ValueError(f"press {name!r}: its PressSource is named {source.name!r}; use that name as the key")


def check_lengths(
    documents: Sequence[Document], sources: Mapping[str, PressSource], max_new_tokens: int, context: int | None = None
) -> None:
    """Fail before any generation when a prompt cannot run under a press.

    The press minimums are ``kvdiverge.engine.refusals.check_prompt_lengths``, which
    :func:`kvdiverge.engine.runner.run_policies` asks again after its refusal check; pass
    no ``sources`` to check the context alone.

    Raises
    ------
    ValueError
        Naming the first prompt shorter than a press needs (the press and its minimum), or
        a prompt that with ``max_new_tokens`` exceeds the model ``context`` (tokens).
    """
    for doc in documents:
        if context is not None and doc.prompt_len + max_new_tokens > context:
            raise ValueError(
                f"prompt {doc.doc_id!r}: {doc.prompt_len} tokens + {max_new_tokens} new tokens "
                f"exceed the model context of {context} tokens"
            )
    check_prompt_lengths(documents, sources)


def is_noise_floor(name: str, source: PressSource) -> bool:
    """True for the noise-floor control: policy ``noise-floor`` or a press that keeps every position
    (``PermutationPress``; :func:`kvdiverge.engine.presses.policies.keeps_every_position`)."""
    if name == NOISE_FLOOR_POLICY:
        return True
    return keeps_every_position(source.press if isinstance(source, Policy) else getattr(source, "press", None))


def _floor_like(name: str, value: Any) -> bool:
    """True for a noise-floor press given to a frontier: named ``noise-floor``, a
    ``PermutationPress`` object, entry or policy."""
    if name == NOISE_FLOOR_POLICY:
        return True
    if isinstance(value, Mapping):
        return value.get("press") == NOISE_FLOOR_PRESS
    if _is_source(value):
        return is_noise_floor(name, value)
    return type(value).__name__ == NOISE_FLOOR_PRESS


def _frontier_caches(caches: Any) -> dict[str, dict[str, Any]]:
    """Quantized caches of a frontier by label, settings complete (:func:`kvdiverge.config.frontier.cache_settings`),
    checked as a policy of the cache alone is (:func:`kvdiverge.config.workflow.policy_entry_problems`)."""
    if not isinstance(caches, Mapping):
        raise ValueError(
            f"caches must map a label to a quantized cache's settings ({{'int4': {{'nbits': 4}}}}), "
            f"got {type(caches).__name__}"
        )
    out = {}
    for label, settings in caches.items():
        if not isinstance(settings, Mapping):
            raise ValueError(
                f"cache {label!r}: its settings must be a mapping (backend, nbits, q_group_size, "
                f"residual_length), got {type(settings).__name__}"
            )
        unknown = sorted(set(settings) - {"cache", "backend", "nbits", "q_group_size", "residual_length"})
        if unknown:
            raise ValueError(
                f"cache {label!r}: unknown setting {unknown[0]!r}; allowed: backend, nbits, "
                f"q_group_size, residual_length"
            )
        out[str(label)] = cache_settings(settings)
        entry = {"cache": "quantized", **out[str(label)]}
        problems = policy_entry_problems(entry)
        if problems:
            raise ValueError(f"cache {label!r}: {problems[0]}")
        try:
            Policy.from_config(str(label), entry, check=False)  # the backend's own checks (nbits it offers)
        except PressError as exc:
            raise ValueError(f"cache {label!r}: {exc.problem}") from None
    return out


def frontier_presses(presses: Any, spec: FrontierSpec) -> tuple[dict[str, Any], list[FrontierPoint]]:
    """Every press at every ratio (and budget), and each quantized cache alone and after each press,
    named as in the config: ``<press>@<ratio>``, ``<cache>``, ``<press>@<ratio>+<cache>``.

    The same grid and the same points as the config's ``frontier`` section
    (:func:`kvdiverge.config.frontier.frontier_grid`,
    :func:`kvdiverge.config.frontier.frontier_policy`). A noise-floor press
    (``PermutationPress``) is kept as it is, not expanded; when there is none, one is
    added as ``noise-floor``, so that the frontier has its floor beside it.

    Parameters
    ----------
    presses : mapping or sequence
        Name -> kvpress press object (its ``compression_ratio``, or that of the press it
        wraps, is replaced) or config policy entry without its ratio (``{"press":
        "SnapKVPress", "window_size": 16}``); a sequence is named by class name.
    spec : kvdiverge.config.frontier.FrontierSpec
        Compression ratios in ``[0, 1)``; fixed budgets (tokens kept; policy entries only);
        quantized caches by label, ``backend``, ``nbits``, ``q_group_size``,
        ``residual_length`` (the defaults of a policy's ``cache: quantized``; with a cache,
        the presses must be policy entries); the ratios of the press before each cache (0
        is the cache alone; None: 0 and every ratio).

    Returns
    -------
    presses : dict
        Name -> press object or policy entry, the floor last.
    grid : list of kvdiverge.estimation.frontier.FrontierPoint
        The frontier points.

    Raises
    ------
    ValueError
        A press that takes no compression ratio, a ratio outside ``[0, 1)`` (NaN included),
        no ratio, a budget or a cache for a press object, a bad cache setting, or a press
        or cache name with ``@`` or ``+`` (reserved for the frontier's names, as in the config).
    """
    if not spec.ratios and not spec.budgets:
        raise ValueError("a frontier needs ratios (or budgets)")
    if not isinstance(presses, Mapping):
        seq = list(presses) if isinstance(presses, (list, tuple)) else [presses]
        presses = {(p.get("press") if isinstance(p, Mapping) else type(p).__name__): p for p in seq}
    floors = {n: v for n, v in presses.items() if _floor_like(str(n), v)}
    scored = {str(n): v for n, v in presses.items() if n not in floors}
    if not scored:
        raise ValueError("a frontier needs at least one press besides the noise floor")
    problems = frontier_problems(scored, dataclasses.replace(spec, caches=dict.fromkeys(spec.caches)))
    if problems:  # the labels and values, before the caches' settings are completed and checked
        raise ValueError(problems[0])
    checked = FrontierSpec(
        [float(r) for r in spec.ratios],
        spec.budgets,
        _frontier_caches(spec.caches) if spec.caches else {},
        None if spec.cache_ratios is None else [float(r) for r in spec.cache_ratios],
    )
    grid = frontier_grid(list(scored), checked)
    out = {point.policy: frontier_policy(scored[point.press] if point.press else None, point) for point in grid}
    out.update(floors or {NOISE_FLOOR_POLICY: PermutationPress()})
    return out, grid


def describe_press(source: PressSource) -> str | dict[str, Any]:
    """A policy for the settings record: its config entry (a quantized cache's settings included), or the
    press object's repr."""
    if isinstance(source, PressPolicy):
        return repr(source.press)
    if isinstance(source, Policy):
        spec = {
            "press": source.press,
            "compression_ratio": source.compression_ratio,
            "budget": source.budget,
            **source.params,
            **(source.quantized.describe() if source.quantized is not None else {}),
        }
        return {k: v for k, v in spec.items() if v is not None}
    return repr(source)


def model_entry(model: str, dtype: str = "float32", device: str = "cpu") -> tuple[str, dict[str, Any]]:
    """``(name, config entry)`` of the model argument.

    An embedded model's argument names it (:data:`kvdiverge.models.embedded.EMBEDDED_MODELS`: ``embedded``
    the default model, ``gemma3-270m`` the second), under its config name; an existing
    directory or ``.gguf`` file loads locally; anything else that does not look like a path
    is a hub id (read from the local Hugging Face cache when present).

    Raises
    ------
    InputError
        A path that does not exist, or a file that is not GGUF.
    """
    extra = {"dtype": dtype, "device": device}
    for embedded in embedded_models.EMBEDDED_MODELS:  # read when called: a registered model counts
        if model == embedded.argument:
            return embedded.name, {**embedded.entry, **extra}
    p = Path(model).expanduser()
    if p.is_dir():
        return p.resolve().name, {"source": "local", "path": str(p), **extra}
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise InputError(
                f"model {model!r} is a file but not a GGUF file; give a model directory, "
                f"a .gguf file, a hub id, {embedded_choices()}"
            )
        return p.stem, {"source": "local", "path": str(p.parent), "gguf_file": p.name, **extra}
    looks_like_path = (
        model.startswith((".", "/", "~"))
        or model.lower().endswith(".gguf")
        or model.count("/") > 1
        or os.sep != "/"
        and os.sep in model
    )
    if looks_like_path:
        raise InputError(f"model not found: no directory or file {model!r} (and not a hub id 'org/name')")
    return model, {"source": "hub", "id": model, **extra}


# --------------------------------------------------------------------------- a measure() call's inputs


def plan_presses(documents: Sequence[Document], presses, T: int, frontier: FrontierSpec | None = None):
    """``(sources, grid)`` of a measurement, checked without the model: :func:`kvdiverge.plan`'s presses.

    The frontier's kinds (:func:`kvdiverge.config.frontier.spec_problems`), the presses expanded
    over its ratios, budgets and quantized caches at its cache ratios (:func:`frontier_presses`;
    ``grid`` is None without ratios or budgets), built as policies and asked whether kvdiverge
    measures them (:func:`prepare_presses`), and each document's length against the presses'
    minimums (:func:`check_lengths`; the model context: :func:`check_model_inputs`).

    Parameters
    ----------
    documents : sequence of kvdiverge.engine.runner.Document
        The prompts as documents (:func:`prepare_documents`).
    presses : mapping
        As :func:`prepare_presses` takes them.
    T : int
        Horizon in tokens.
    frontier : kvdiverge.config.frontier.FrontierSpec, optional

    Raises
    ------
    ValueError
        The first problem found, in one sentence (a
        :class:`~kvdiverge.engine.core.errors.PressError` naming a press).
    """
    grid, frontier = None, frontier or FrontierSpec()
    problems = spec_problems(frontier)
    if problems:
        raise ValueError(problems[0])
    if frontier.ratios or frontier.budgets:
        presses, grid = frontier_presses(presses, frontier)
    sources = prepare_presses(presses)
    check_lengths(documents, sources, T)
    return sources, grid


def check_model_inputs(model, documents: Sequence[Document], T: int) -> None:
    """Refuse, before any forward, a ``model`` that is not one (:func:`kvdiverge.settings.checks.model_problem`),
    documents' token ids outside its vocabulary, and a document that with ``T`` new tokens exceeds its
    context (:func:`check_lengths`); only ``model.config`` is read.

    Raises
    ------
    ValueError
        The first problem found, in one sentence.
    """
    problems = [q for q in (model_problem(model),) if q]
    vocab = None if problems else vocab_size(model)
    if vocab is not None:
        problems += [p for doc in documents for p in token_id_problems(doc.doc_id, doc.input_ids, vocab)]
    if problems:
        raise ValueError(problems[0])
    check_context(model, documents, T)


def check_context(model, documents: Sequence[Document], T: int) -> None:
    """Refuse a document that with ``T`` new tokens exceeds ``model``'s context (:func:`check_lengths`;
    no refusal where the config names no context); only ``model.config`` is read."""
    try:
        context = context_length(model)
    except (ValueError, AttributeError):
        context = None
    check_lengths(documents, {}, T, context)


def model_eos(model: Any, eos_ids: Any, name: str = "eos_ids") -> tuple[int, ...]:
    """The end-of-sequence ids a run stops at: ``eos_ids`` (spelled ``name``), else the model's own
    (:func:`kvdiverge.engine.llm.pair_base.model_eos_ids`); ``ValueError`` for ids that are not a list of
    token ids inside the model's vocabulary (:func:`kvdiverge.settings.checks.eos_id_problems`)."""
    if eos_ids is None:
        return tuple(int(e) for e in model_eos_ids(model))
    problems = eos_id_problems(name, eos_ids, vocab_size(model))
    if problems:
        raise ValueError(problems[0])
    return tuple(int(e) for e in (eos_ids.tolist() if hasattr(eos_ids, "tolist") else eos_ids))


def model_label(model: Any) -> str:
    """The ``model`` column of a model object: the basename of its ``config.name_or_path``, else ``"model"``."""
    path = str(getattr(getattr(model, "config", None), "name_or_path", "") or "model")
    return os.path.basename(path.rstrip("/")) or "model"
