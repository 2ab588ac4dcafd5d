"""The Gemma tokenizer of a GGUF file, rebuilt as Google's from the file's own vocabulary.

transformers 5.2 builds a wrong tokenizer from a Gemma GGUF file: its converter
(``GGUFGemmaConverter`` in ``transformers/integrations/ggml.py``) writes no merges
(``merges = ["dummy text"]``), so ``"Hello world"`` becomes four pieces without ``<bos>``, and
after ``save_pretrained`` and a reload single characters. :func:`gemma_tokenizer` builds the
tokenizer the way transformers' ``GemmaConverter`` (``transformers/convert_slow_tokenizer.py``)
builds Google's from the SentencePiece model: a BPE model with byte fallback whose merges
``generate_merges`` (``transformers/convert_slow_tokenizer.py``) derives from the pieces and
their scores, the control and user-defined pieces as added tokens, spaces normalized to
``"▁"``, and a ``<bos>`` in front of every text. On Gemma 3 270M's GGUF file it gives
``"Hello world"`` -> ``[2, 9259, 1902]`` (``<bos>``, ``Hello``, ``▁world``), Google's ids, and
the ids SentencePiece's own BPE encoder gives on the same pieces (checked on 110,000 tokens of
State of the Union text, code, whitespace runs, CJK and emoji).

The GGUF file holds the SentencePiece pieces as three parallel arrays of length ``V`` (the
vocabulary size; 262,144 for Gemma 3): ``tokenizer.ggml.tokens`` (str), ``tokenizer.ggml.scores``
(float32) and ``tokenizer.ggml.token_type`` (int32: 1 normal, 2 unknown, 3 control,
4 user-defined, 5 unused, 6 byte). llama.cpp's converter (``_create_vocab_sentencepiece`` in
``convert_hf_to_gguf.py``) rewrites every token of the tokenizer's ``added_tokens_decoder``:
its score becomes -1000 (SentencePiece has 0 for these pieces), its type control or
user-defined, and in a user-defined piece ``"▁"`` becomes a space. :func:`sentencepiece_pieces`
undoes both before the merges are generated (the merges of pieces with score 0 come first:
with -1000 they would rank among the normal pieces).

The vocabulary is read from the file's header by :func:`read_metadata` (about 0.1 s;
``gguf.GGUFReader`` takes about 8 s, as it maps every value of every array); :func:`read_header`
adds the tensor names, from which :mod:`kvdiverge.models.gguf_config` builds the model's config.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

#: ``general.architecture`` of the GGUF files whose tokenizer :func:`gemma_tokenizer` rebuilds.
GEMMA_ARCHITECTURES = frozenset({"gemma3"})
#: Version of the rebuild: enters the key of a kept conversion (``kvdiverge.models.loading.conversion_key``),
#: so that a conversion saved with another tokenizer is not reused.
TOKENIZER_VERSION = "gemma-bpe-1"

#: SentencePiece piece types as the GGUF file numbers them (``gguf.TokenType``).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
#: The score llama.cpp writes for the pieces of ``added_tokens_decoder`` (SentencePiece: 0).
LLAMA_CPP_ADDED_SCORE = -1000.0
#: Added pieces Google's converter marks special whatever their type (``GemmaConverter.special_tokens``).
TURN_TOKENS = ("<start_of_turn>", "<end_of_turn>")

# the GGUF metadata value types (gguf.GGUFValueType): struct formats of the scalar ones, 8 string, 9 array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def read_metadata(path: str | Path, stop_after: str | None = None) -> dict[str, Any]:
    """The metadata key-value pairs of the GGUF file ``path`` (format version 2 or 3, little-endian),
    in file order, up to the key ``stop_after`` where given; the tensors are not read.

    Returns
    -------
    dict
        ``{key: value}``: an array is a list, a string a ``str``, a float32 a Python float.

    Raises
    ------
    ValueError
        If ``path`` is not such a GGUF file.
    """
    with open(path, "rb") as fh:
        _, n_kv = _open_header(fh, path)
        return _read_pairs(fh, n_kv, stop_after)


def read_header(path: str | Path) -> tuple[dict[str, Any], list[str]]:
    """The metadata (as :func:`read_metadata`) and the tensor names, in file order, of the GGUF file
    ``path``: its header; no tensor data is read.

    Raises
    ------
    ValueError
        If ``path`` is not a GGUF file of version 2 or 3, little-endian.
    """
    with open(path, "rb") as fh:
        n_tensors, n_kv = _open_header(fh, path)
        meta = _read_pairs(fh, n_kv, None)
        names = []
        for _ in range(n_tensors):  # name, n_dims (uint32), the dims (uint64 each), type (uint32), offset (uint64)
            names.append(_read_string(fh))
            (n_dims,) = struct.unpack("<I", fh.read(4))
            fh.seek(8 * n_dims + 4 + 8, 1)
    return meta, names


def _open_header(fh, path) -> tuple[int, int]:
    """``(tensors, metadata pairs)`` of the GGUF file open as ``fh``, read past its fixed opening."""
    magic, version = fh.read(4), struct.unpack("<I", fh.read(4))[0]
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"{str(path)!r} is not a GGUF file (version 2 or 3, little-endian)")
    return struct.unpack("<QQ", fh.read(16))


def _read_pairs(fh, n_kv: int, stop_after: str | None) -> dict[str, Any]:
    """The next ``n_kv`` metadata pairs of ``fh``, up to the key ``stop_after`` where given."""
    out: dict[str, Any] = {}
    for _ in range(n_kv):
        key = _read_string(fh)
        out[key] = _read_value(fh, struct.unpack("<I", fh.read(4))[0])
        if key == stop_after:
            break
    return out


def _read_string(fh) -> str:
    (length,) = struct.unpack("<Q", fh.read(8))
    return fh.read(length).decode("utf-8")


def _read_value(fh, kind: int) -> Any:
    """One metadata value of GGUF type ``kind``."""
    if kind == _STRING:
        return _read_string(fh)
    if kind == _ARRAY:
        item, count = struct.unpack("<IQ", fh.read(12))
        if item in _SCALARS:
            fmt = f"<{count}{_SCALARS[item]}"
            return list(struct.unpack(fmt, fh.read(struct.calcsize(fmt))))
        return [_read_value(fh, item) for _ in range(count)]
    fmt = "<" + _SCALARS[kind]
    return struct.unpack(fmt, fh.read(struct.calcsize(fmt)))[0]


def gguf_architecture(path: str | Path) -> str | None:
    """``general.architecture`` of the GGUF file ``path`` (e.g. ``"gemma3"``, ``"llama"``), read from
    the start of its header; None when the file names none."""
    return read_metadata(path, stop_after="general.architecture").get("general.architecture")


def is_gemma(path: str | Path) -> bool:
    """True for a GGUF file of a Gemma architecture (:data:`GEMMA_ARCHITECTURES`), whose tokenizer
    transformers builds wrong; False for any other file, an unreadable header included (transformers
    then says what is wrong with it)."""
    try:
        return gguf_architecture(str(path)) in GEMMA_ARCHITECTURES
    except (ValueError, struct.error):
        return False


def read_vocabulary(path: str | Path) -> dict[str, Any]:
    """The tokenizer fields of a GGUF file (:func:`read_metadata`).

    Returns
    -------
    dict
        ``tokens`` (list of ``V`` str), ``scores`` (list of ``V`` float), ``types`` (list of ``V``
        int, :data:`NORMAL` ...), and where the file has them the ids ``bos``, ``eos``, ``unk``,
        ``pad`` and the flags ``add_bos``, ``add_eos`` (``tokenizer.ggml.bos_token_id`` ...).

    Raises
    ------
    KeyError
        If the file has no SentencePiece vocabulary (tokens, scores, token types).
    """
    meta = read_metadata(path)
    names = {"tokens": "tokens", "scores": "scores", "types": "token_type", "bos": "bos_token_id"}
    names.update(eos="eos_token_id", unk="unknown_token_id", pad="padding_token_id")
    names.update(add_bos="add_bos_token", add_eos="add_eos_token")
    out = {key: meta[f"tokenizer.ggml.{field}"] for key, field in names.items() if f"tokenizer.ggml.{field}" in meta}
    missing = {"tokens", "scores", "types"} - set(out)
    if missing:
        raise KeyError(f"{str(path)!r} has no tokenizer.ggml {sorted(names[k] for k in missing)}")
    return out


def sentencepiece_pieces(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, float]]:
    """The SentencePiece ``(piece, score)`` of each id, as Google's converter reads them from the model.

    Undoes llama.cpp's rewriting of the added pieces (control and user-defined): score -1000 back to
    0, and a space in a user-defined piece back to ``"▁"`` (the whitespace runs, ids 138-167 of
    Gemma 3). As in ``GemmaConverter.vocab``, the byte piece ``<0x09>`` stands for a tab when the
    vocabulary has no tab piece of its own (Gemma 3 has one, id 255968).

    Parameters
    ----------
    tokens, scores, types : list
        The GGUF file's ``tokenizer.ggml.tokens``, ``scores`` and ``token_type``, ``V`` each.

    Returns
    -------
    list of (str, float)
        ``V`` pairs, by id.
    """
    pieces = []
    for token, score, kind in zip(tokens, scores, types, strict=True):
        if kind in (CONTROL, USER_DEFINED) and score == LLAMA_CPP_ADDED_SCORE:
            score = 0.0
        if kind == USER_DEFINED:
            token = token.replace(" ", "▁")
        pieces.append((token, score))
    if "\t" not in {piece for piece, _ in pieces}:
        pieces = [("\t", score) if piece == "<0x09>" else (piece, score) for piece, score in pieces]
    return pieces


def build_backend(vocabulary: dict[str, Any]):
    """The ``tokenizers.Tokenizer`` of a Gemma vocabulary, as ``GemmaConverter`` builds it.

    BPE with byte fallback over the ``V`` pieces (ids as in the file) and the merges
    ``generate_merges`` derives from their scores (514,906 for Gemma 3); the control and
    user-defined pieces as added tokens (special: the control ones and the turn markers);
    normalizer ``" " -> "▁"``; pre-tokenizer split on spaces merged with the previous piece;
    decoder ``"▁" -> " "``, byte fallback, fuse. No post-processor: :func:`gemma_tokenizer`'s
    transformers tokenizer adds ``<bos>``.

    Parameters
    ----------
    vocabulary : dict
        :func:`read_vocabulary` of the file.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    # lazy: torch and transformers load with a model; the torch-free workflow scripts import this module
    from kvdiverge.engine.hf import generate_merges

    pieces = sentencepiece_pieces(vocabulary["tokens"], vocabulary["scores"], vocabulary["types"])
    vocab = {piece: i for i, (piece, _) in enumerate(pieces)}
    unk = pieces[vocabulary.get("unk", 3)][0]
    bpe = BPE(vocab, generate_merges(vocab, pieces), unk_token=unk, fuse_unk=True, byte_fallback=True, dropout=None)
    backend = Tokenizer(bpe)
    added = [
        AddedToken(piece, normalized=False, special=kind == CONTROL or piece in TURN_TOKENS)
        for (piece, _), kind in zip(pieces, vocabulary["types"])
        if kind in (CONTROL, USER_DEFINED)
    ]
    backend.add_tokens(added)
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend


def gemma_tokenizer(path: str | Path):
    """The tokenizer of the Gemma GGUF file ``path``, rebuilt (module docstring).

    Returns
    -------
    transformers.PreTrainedTokenizerFast
        ``<bos>`` (id 2) in front of every text (the file's ``add_bos_token``), ``<eos>`` (1),
        ``<pad>`` (0), ``<unk>`` (3): the ids the file names; no chat template (the file has
        none). ``save_pretrained`` writes it as a ``tokenizer.json`` that ``AutoTokenizer`` loads
        back as it was. About 4 s for Gemma 3's 262,144 pieces (mostly the BPE model's build).
    """
    from transformers import PreTrainedTokenizerFast

    vocabulary = read_vocabulary(path)
    tokens = vocabulary["tokens"]
    return PreTrainedTokenizerFast(
        tokenizer_object=build_backend(vocabulary),
        bos_token=tokens[vocabulary.get("bos", 2)],
        eos_token=tokens[vocabulary.get("eos", 1)],
        pad_token=tokens[vocabulary.get("pad", 0)],
        unk_token=tokens[vocabulary.get("unk", 3)],
        add_bos_token=bool(vocabulary.get("add_bos", True)),
        add_eos_token=bool(vocabulary.get("add_eos", False)),
        padding_side="left",
    )
