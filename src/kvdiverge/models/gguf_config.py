"""The model config of a GGUF file, read from its header without its weights.

transformers builds a GGUF file's config (``AutoConfig.from_pretrained(dir, gguf_file=...)``,
``load_gguf_checkpoint`` in ``transformers/modeling_gguf_pytorch_utils.py``) through
``gguf.GGUFReader``, which maps every value of every array of the header: 15-20 s for Gemma 3
270M, whose vocabulary has 262,144 pieces. :func:`gguf_config` builds the same config from the
header as :func:`kvdiverge.models.gguf_tokenizer.read_header` reads it (a fraction of a second),
renamed by transformers' own tables (``GGUF_CONFIG_MAPPING``, ``GGUF_CONFIG_DEFAULTS_MAPPING``),
for the architectures of :data:`HEADER_ARCHITECTURES`, where transformers does nothing besides
(``tests/test_models.py`` holds the two equal on both embedded models). It lets the doors read
what a model's config decides (its context length, its layer types) before the weights load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvdiverge.models.gguf_tokenizer import read_header

__all__ = ["HEADER_ARCHITECTURES", "gguf_config"]

#: GGUF architectures (``general.architecture``) whose config :func:`gguf_config` builds from the header;
#: transformers renames others or reads their tensors (Mistral under ``llama``, T5, the MoE models, StableLM,
#: LFM2), and for them :func:`gguf_config` gives None.
HEADER_ARCHITECTURES = ("llama", "gemma3")
#: The transformers ``model_type`` of a GGUF architecture that differs from it (a Gemma 3 GGUF file holds the text model).
_MODEL_TYPES = {"gemma3": "gemma3_text"}


def gguf_config(path: str | Path, **kwargs: Any):
    """The ``PretrainedConfig`` that transformers builds from the GGUF file ``path``, from its header alone.

    Parameters
    ----------
    path : str or Path
        A GGUF file (version 2 or 3).
    **kwargs
        Passed to the config class's ``from_dict``, as ``from_pretrained`` passes them
        (``attn_implementation="sdpa"``).

    Returns
    -------
    transformers.PretrainedConfig or None
        None for a file whose architecture is not one of :data:`HEADER_ARCHITECTURES`, or a
        ``llama`` file named ``mistral`` (transformers reads it as Mistral): read it with
        ``AutoConfig.from_pretrained``.

    Raises
    ------
    ValueError
        If ``path`` is not a GGUF file.
    """
    # lazy: transformers loads with a model; the torch-free workflow scripts import kvdiverge.models.loading
    # transformers' internals only through kvdiverge.engine.hf
    from kvdiverge.engine.hf import CONFIG_MAPPING, GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    meta, tensors = read_header(path)
    architecture = meta.get("general.architecture")
    if architecture not in HEADER_ARCHITECTURES or (architecture == "llama" and meta.get("general.name") == "mistral"):
        return None
    config: dict[str, Any] = {
        "tie_word_embeddings": "output.weight" not in tensors,  # no output matrix: the embeddings' transpose
        **GGUF_CONFIG_DEFAULTS_MAPPING.get(architecture, {}),
    }
    for key, value in meta.items():
        prefix, _, rest = key.partition(".")
        renamed = GGUF_CONFIG_MAPPING.get(prefix, {}).get(rest)
        if renamed is not None and renamed != -1:
            config[renamed] = value[0] if isinstance(value, list) and len(value) == 1 else value
    config["model_type"] = _MODEL_TYPES.get(architecture, architecture)
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in meta:
        config["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
    out = CONFIG_MAPPING[config["model_type"]].from_dict({**config, "_commit_hash": None}, **kwargs)
    out.name_or_path = str(Path(path).parent)  # as from_pretrained(directory, gguf_file=...) names it
    return out
