"""One llama.cpp context over a loaded model, with multi-sequence decoding and the memory's sequence ops.

:class:`LlamaContext` holds a context whose KV cache has a :class:`~kvdiverge.engine.llamacpp.caches.LlamaCache`
type and one cache stream per sequence (``kv_unified`` off): a copied sequence gets a copy of the
prompt's cells (``llama_memory_seq_cp``) and a rewind removes a sequence's last cells
(``llama_memory_seq_rm``), so a sequence's cells stay contiguous. Both are exact: a token's logits
equal a fresh evaluation of its prefix bit for bit (tests/test_llamacpp.py). In one unified cache
they are not: with an f16 V cache, llama.cpp's CPU flash attention gives a sequence other logits
(a log-probability apart by 0.6 on SmolLM2) once another sequence's rewound tokens sit in freed
cells between its own. :func:`load_model` loads a GGUF file once; several contexts
share it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from kvdiverge.engine.llamacpp.caches import LlamaCache, require_llama_cpp

__all__ = ["LlamaContext", "LoadedModel", "build_info", "load_model"]


@dataclass(frozen=True)
class LoadedModel:
    """A llama.cpp model: ``pointer`` (``llama_model_p``), its ``path``, ``vocab`` and ``n_vocab``.

    ``owner`` keeps alive whatever owns the pointer (a ``llama_cpp.Llama`` given by the user).
    """

    pointer: object
    path: str
    vocab: object
    n_vocab: int
    owner: object = None

    @property
    def context(self) -> int:
        """The model's training context, tokens (GGUF metadata)."""
        return int(require_llama_cpp().llama_model_n_ctx_train(self.pointer))

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """The vocabulary's end-of-sequence and end-of-turn ids (distinct, present)."""
        L = require_llama_cpp()
        ids = (L.llama_vocab_eos(self.vocab), L.llama_vocab_eot(self.vocab))
        return tuple(dict.fromkeys(int(i) for i in ids if int(i) >= 0))


def _quiet(L) -> None:
    """llama.cpp's log to errors only, through llama-cpp-python's own callback and its logger's level (as
    ``Llama(verbose=False)`` sets it). A callback of ours would be freed at the interpreter's exit before a
    user's ``Llama`` frees its model and logs, a crash at exit."""
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)


def load_model(model) -> LoadedModel:
    """A GGUF path or a ``llama_cpp.Llama`` as a :class:`LoadedModel` (weights on the CPU); a
    :class:`LoadedModel` as it is.

    Raises
    ------
    FileNotFoundError
        A path that is not a file.
    """
    if isinstance(model, LoadedModel):
        return model
    L = require_llama_cpp()
    _quiet(L)
    if isinstance(model, L.Llama):
        pointer, path, owner = model.model, model.model_path, model
    else:
        path = os.fspath(model)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"model GGUF file {path!r} does not exist")
        params = L.llama_model_default_params()
        params.n_gpu_layers = 0
        pointer, owner = L.llama_model_load_from_file(path.encode(), params), None
    vocab = L.llama_model_get_vocab(pointer)
    return LoadedModel(pointer, path, vocab, int(L.llama_vocab_n_tokens(vocab)), owner)


def build_info() -> dict[str, str]:
    """What identifies the llama.cpp build: the binding's version and llama.cpp's system info."""
    L = require_llama_cpp()
    return {"llama_cpp_python": L.__version__, "system_info": L.llama_print_system_info().decode().strip()}


@contextlib.contextmanager
def _rotation(on: bool) -> Iterator[None]:
    """``LLAMA_ATTN_ROT_DISABLE`` set (rotation off) or unset while a context's cache is built."""
    key, before = "LLAMA_ATTN_ROT_DISABLE", os.environ.get("LLAMA_ATTN_ROT_DISABLE")
    if on:
        os.environ.pop(key, None)
    else:
        os.environ[key] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


class LlamaContext:
    """A llama.cpp context with ``n_seq`` sequences, each its own KV cache stream of ``n_ctx / n_seq`` cells.

    Parameters
    ----------
    model : LoadedModel
    cache : LlamaCache
        Cache types, rotation; flash attention is on when V is quantized (llama.cpp needs it), off otherwise.
    n_ctx : int
        Cells of all streams together (``n_seq`` times a sequence's prompt and own tokens).
    n_seq : int
        Sequences (rows).
    threads : int
        CPU threads of decoding and prefill.
    """

    def __init__(self, model: LoadedModel, cache: LlamaCache, n_ctx: int, n_seq: int, threads: int):
        L = self._L = require_llama_cpp()
        p = L.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx, n_ctx, min(n_ctx, 512), n_seq
        p.n_threads = p.n_threads_batch = threads
        p.type_k = getattr(L, f"GGML_TYPE_{cache.type_k.upper()}")
        p.type_v = getattr(L, f"GGML_TYPE_{cache.type_v.upper()}")
        fa = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if cache.flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        p.flash_attn_type, p.kv_unified, p.no_perf = fa, False, True
        with _rotation(cache.rotation):
            self.ctx = L.llama_init_from_model(model.pointer, p)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context with the {cache.name} cache")
        self.model, self.n_ctx, self.n_vocab = model, n_ctx, model.n_vocab
        self.memory = L.llama_get_memory(self.ctx)
        self._batch = L.llama_batch_init(n_ctx, 0, n_seq)

    def close(self) -> None:
        """Free the batch and the context."""
        if getattr(self, "ctx", None):
            self._L.llama_batch_free(self._batch)
            self._L.llama_free(self.ctx)
            self.ctx = None

    def __del__(self):
        with contextlib.suppress(Exception):  # at interpreter exit the binding may be gone
            self.close()

    def decode(self, tokens: Sequence[int], seqs: Sequence[int], pos: Sequence[int], outputs: Sequence[bool]):
        """Decode one batch: token ``i`` of sequence ``seqs[i]`` at position ``pos[i]``.

        Returns
        -------
        numpy.ndarray
            float32 ``(sum(outputs), n_vocab)``: the logits of the tokens with an output, in order.

        Raises
        ------
        RuntimeError
            When ``llama_decode`` fails (its return code named).
        """
        b, n = self._batch, len(tokens)
        for i, (tok, seq, p, out) in enumerate(zip(tokens, seqs, pos, outputs)):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = int(tok), int(p), 1, bool(out)
            b.seq_id[i][0] = int(seq)
        b.n_tokens = n
        rc = self._L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with code {rc} on a batch of {n} tokens")
        n_out = int(sum(bool(o) for o in outputs))
        ptr = self._L.llama_get_logits(self.ctx)
        flat = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(n_out * self.n_vocab,))
        return flat.reshape(n_out, self.n_vocab).copy()

    def prefill(self, tokens: Sequence[int], seq: int = 0, all_logits: bool = False) -> np.ndarray:
        """Feed ``tokens`` to sequence ``seq`` from position 0; the last position's logits ``(1, V)``
        (every position's ``(len, V)`` with ``all_logits``)."""
        n = len(tokens)
        outs = [all_logits or i == n - 1 for i in range(n)]
        return self.decode(tokens, [seq] * n, range(n), outs)

    def copy_sequence(self, src: int, dst: int) -> None:
        """Sequence ``dst`` gets a copy of every cell of ``src`` (``llama_memory_seq_cp``)."""
        self._L.llama_memory_seq_cp(self.memory, src, dst, -1, -1)

    def cut(self, seq: int, start: int) -> None:
        """Remove sequence ``seq`` from every cell at position ``>= start`` (``llama_memory_seq_rm``)."""
        self._L.llama_memory_seq_rm(self.memory, seq, start, -1)
