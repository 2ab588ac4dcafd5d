"""A model entry's attention layers, read from its files without its weights or torch, and what they refuse.

Gemma 2 and 3 keep most decoder layers on a sliding window (:mod:`kvdiverge.engine.presses.layer_types`).
A generation job refuses, before its first forward, what the engine cannot run there: eager attention, a
press that evicts while decoding, a quantized cache, a press that re-rotates kept keys
(:func:`kvdiverge.engine.presses.registry.sliding_refusal`), and a question prefilled after compression
(:func:`kvdiverge.engine.presses.cache_facts.question_after_refusal`). The config check asks the same
before any job (:func:`layer_problems`), of the press catalogue
(:func:`kvdiverge.engine.presses.catalogue.sliding_refusal`, the engine's sentences), and of the layers
:func:`entry_layers` reads from where the entry points:

- a GGUF file (``gguf_package``; ``gguf_chunks``, whose first chunk holds the header; ``local`` with
  ``gguf_file``): the header's block count and sliding window
  (:func:`kvdiverge.models.gguf_tokenizer.read_metadata`). The file names no layer types: an architecture
  of :data:`GGUF_SLIDING_PATTERN` takes the ones transformers gives it when it loads the file;
- a directory (``local``) or the Hugging Face cache (``hub``, when the model is there): the
  ``layer_types`` of its ``config.json`` (of its ``text_config`` for a multimodal model);
- a miniature: its values (:func:`kvdiverge.models.loading.miniature_values`).

No weights are read, nothing is fetched, and neither torch, transformers nor kvpress is imported; an entry
whose files are not on this machine, or whose layer types cannot be read so, is left to the job's own check.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kvdiverge.config.backends import runs_on_llama_cpp
from kvdiverge.config.frontier import frontier_points
from kvdiverge.engine.presses import catalogue
from kvdiverge.engine.presses.cache_facts import FULL, SLIDING, question_after_refusal
from kvdiverge.models.gguf_tokenizer import gguf_architecture, read_metadata
from kvdiverge.models.loading import ModelNotFoundError, chunk_paths, miniature_values, resolve

__all__ = ["GGUF_SLIDING_PATTERN", "entry_layers", "gguf_kv_sizes", "gguf_layer_values", "layer_problems"]


#: GGUF architectures (``general.architecture``) with sliding-window layers: every ``n``-th decoder
#: layer attends to the whole context, the others to ``<arch>.attention.sliding_window`` tokens, as
#: transformers builds the config of such a file (``Gemma3TextConfig``'s ``sliding_window_pattern`` 6,
#: ``Gemma2Config``'s alternation); ``tests/test_config.py`` holds the table equal to transformers.
GGUF_SLIDING_PATTERN: dict[str, int] = {"gemma2": 2, "gemma3": 6}


def gguf_layer_values(path: str | Path) -> dict[str, Any] | None:
    """``layer_types`` and ``sliding_window`` of the model in the GGUF file ``path``, from its header.

    Returns
    -------
    dict or None
        ``{"layer_types": [...], "sliding_window": tokens}`` for an architecture of
        :data:`GGUF_SLIDING_PATTERN`; None for any other (its layers are not read here).

    Raises
    ------
    ValueError
        If ``path`` is not a GGUF file (:func:`kvdiverge.models.gguf_tokenizer.read_metadata`).
    """
    arch = gguf_architecture(path)
    every = GGUF_SLIDING_PATTERN.get(arch or "")
    if every is None:
        return None
    meta = read_metadata(path, stop_after=f"{arch}.attention.sliding_window")  # before the vocabulary, as a rule
    if f"{arch}.block_count" not in meta:
        meta = read_metadata(path)
    n = int(meta[f"{arch}.block_count"])
    return {
        "layer_types": [FULL if (i + 1) % every == 0 else SLIDING for i in range(n)],
        "sliding_window": int(meta[f"{arch}.attention.sliding_window"]),
    }


def gguf_kv_sizes(path: str | Path) -> dict[str, int]:
    """The KV sizes a frontier counts llama.cpp's cache of the GGUF file ``path`` with, from its header.

    Per token and layer, ``head_count_kv * (key_length + value_length)`` elements (``key_length`` and
    ``value_length`` default to ``embedding_length / head_count``, as llama.cpp reads them). The
    full-attention layers' are ``elements_per_token``; where layers slide (:func:`gguf_layer_values`),
    theirs are ``sliding_elements_per_token`` over ``sliding_window`` tokens, as llama.cpp's SWA cache
    keeps them (its padding of a batch's tokens aside). ``element_bytes`` is 2: llama.cpp's f16 cache,
    the full cache a cache type is measured against.

    Returns
    -------
    dict
        ``{"elements_per_token", "element_bytes"}``, with ``sliding_elements_per_token`` and
        ``sliding_window`` (tokens) where layers slide.

    Raises
    ------
    ValueError
        If ``path`` is not a GGUF file, or its header lacks the attention sizes.
    """
    meta = read_metadata(path, stop_after="tokenizer.ggml.model")  # the model's keys come first, as a rule
    arch = meta.get("general.architecture")
    if f"{arch}.block_count" not in meta:
        meta = read_metadata(path)
    try:
        layers, heads = int(meta[f"{arch}.block_count"]), int(meta[f"{arch}.attention.head_count"])
        kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
        head = int(meta[f"{arch}.embedding_length"]) // heads
    except KeyError as err:
        raise ValueError(f"GGUF file {str(path)!r} lacks the attention size {err.args[0]!r}") from None
    per_layer = kv_heads * (
        int(meta.get(f"{arch}.attention.key_length", head)) + int(meta.get(f"{arch}.attention.value_length", head))
    )
    values = gguf_layer_values(path)
    if values is None:
        return {"elements_per_token": layers * per_layer, "element_bytes": 2}
    full = values["layer_types"].count(FULL)
    return {"elements_per_token": full * per_layer, "sliding_elements_per_token": (layers - full) * per_layer,
            "sliding_window": values["sliding_window"], "element_bytes": 2}  # fmt: skip


def _json(path: Path | None) -> dict[str, Any] | None:
    return json.loads(path.read_text(encoding="utf-8")) if path is not None and path.is_file() else None


def _hub_config(spec: Mapping[str, Any]) -> Path | None:
    """The ``config.json`` of a hub entry in the local Hugging Face cache, or None (never fetched)."""
    # lazy: huggingface_hub loads for a hub entry only
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(str(spec["id"]), "config.json", revision=spec.get("revision"))
    return Path(found) if isinstance(found, str) else None


def _layer_values(spec: Mapping[str, Any], name: str | None) -> dict[str, Any] | None:
    """The config values of an entry that hold its layers (a config.json's, or :func:`gguf_layer_values`)."""
    source = spec.get("source")
    if source == "miniature":
        return miniature_values(dict(spec), name)
    if source == "gguf_chunks":
        return gguf_layer_values(chunk_paths(dict(spec), name)[0])
    if source == "hub":
        return _json(_hub_config(spec))
    where, kwargs = resolve(dict(spec), name)
    if kwargs.get("gguf_file"):
        return gguf_layer_values(Path(where) / kwargs["gguf_file"])
    return _json(Path(where) / "config.json")


def entry_layers(spec: Mapping[str, Any], name: str | None = None) -> SimpleNamespace | None:
    """The attention layers of a model entry (``models.<name>``), read without loading the model.

    Parameters
    ----------
    spec : mapping
        A ``models.<name>`` config entry.
    name : str, optional
        The entry's name.

    Returns
    -------
    types.SimpleNamespace or None
        What the engine's layer checks read of a model config: ``layer_types`` (per decoder layer,
        ``"full_attention"``, ``"sliding_attention"``, ...), ``num_hidden_layers``, ``sliding_window``
        (tokens, or None) and ``_attn_implementation`` (the entry's, default ``"sdpa"``). None when
        the entry's files are not on this machine or name no layer types.
    """
    try:
        values = _layer_values(spec, name)
    except (ModelNotFoundError, OSError, ValueError, KeyError, struct.error):
        return None  # the job names what is missing or wrong
    values = (values or {}).get("text_config") or values or {}
    types = values.get("layer_types")
    if not types:
        return None
    return SimpleNamespace(
        layer_types=list(types),
        num_hidden_layers=len(types),
        sliding_window=values.get("sliding_window"),
        _attn_implementation=spec.get("attn_implementation", "sdpa"),
    )


def layer_problems(config: Mapping[str, Any], scheduled: Sequence[str]) -> list[str]:
    """One sentence per refusal a generation job would meet on a model of ``config`` with sliding-window layers.

    Each is the engine's own sentence, named by the key that decides it: the model alone
    (``models.<name>.attn_implementation: ...`` for eager attention), a scheduled policy the engine
    cannot run there (``policies.<name> on models.<model>: ...``; a frontier point by its
    ``frontier.presses.<name>`` or ``frontier.caches.<name>``, once), a task block whose question comes
    after compression (``task.question``, ``prediction.tasks[i].question``).

    Parameters
    ----------
    config : mapping
        A config that passed the schema, its frontier expanded (``kvdiverge.config.workflow.expand_frontier``).
    scheduled : sequence of str
        The policies every model runs (the runs, the controls, the frontier's points).

    Returns
    -------
    list of str
        Empty when no model has sliding-window layers or nothing scheduled is refused there. A model of
        ``backend: llama_cpp`` is left out: llama.cpp caches its sliding-window layers itself.
    """
    out: list[str] = []
    for model, spec in config.get("models", {}).items():
        if runs_on_llama_cpp(spec):  # llama.cpp keeps the sliding-window layers' cache itself, in every cache type
            continue
        layers = entry_layers(spec, model)
        if layers is not None and SLIDING in layers.layer_types:
            out += _sliding_problems(config, model, layers, _by_key(config, scheduled))
    return out


def _by_key(config: Mapping[str, Any], scheduled: Sequence[str]) -> dict[str, str]:
    """The scheduled policies by the key that defines them, one each: ``policies.<name>``, or a frontier
    point's cache (``frontier.caches.<name>``) or else press (``frontier.presses.<name>``)."""
    keys: dict[str, str] = {}
    for point in frontier_points(dict(config)):
        keys[point.policy] = f"frontier.caches.{point.cache}" if point.cache else f"frontier.presses.{point.press}"
    out: dict[str, str] = {}
    for name in scheduled:
        if name in config.get("policies", {}):  # one not defined is named by the config check
            out.setdefault(keys.get(name, f"policies.{name}"), name)
    return out


def _sliding_problems(
    config: Mapping[str, Any], model: str, layers: SimpleNamespace, policies: Mapping[str, str]
) -> list[str]:
    """:func:`layer_problems` of one model with sliding-window layers."""
    where = f"models.{model}"
    reason = catalogue.sliding_refusal(None, layers)  # the model alone: its layer types and its attention
    if reason:
        attn = config["models"][model].get("attn_implementation")
        return [
            f"{where}.attn_implementation: {attn!r} is refused: {reason}" if attn == "eager" else f"{where}: {reason}"
        ]
    out = []
    for key, name in policies.items():
        entry = config["policies"][name]
        try:
            if catalogue.build_problem(entry):
                continue  # named by the config check of the policies
        except LookupError:
            continue  # a press of a user's module the catalogue was not given: the job asks the engine
        reason = catalogue.sliding_refusal(entry, layers)
        if reason:
            out.append(f"{key} on {where}: {reason}")
    prediction = (config.get("prediction") or {}).get("tasks", [])
    tasks = [("task", config.get("task") or {}), *((f"prediction.tasks[{i}]", t) for i, t in enumerate(prediction))]
    for key, task in tasks:
        if task.get("question") == "after":
            out.append(f"{key}.question: 'after' cannot run on {where}: {question_after_refusal(layers)}")
    return out
