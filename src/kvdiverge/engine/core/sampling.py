"""The generation settings of one coupled run, as frozen objects.

Each door (``kvdiverge.measure``, ``kvdiverge measure``, the workflow's shard job) builds one
:class:`Sampling` and passes it down: the runner and the coupled run read their generation
settings from it, and the kernel pairs read the decoding transform's part of it
(:attr:`Sampling.decoding`, a :class:`Decoding`), from nowhere else.

A decoding setting beyond temperature and top-p is a :class:`Decoding` field whose metadata
carries its help text (:func:`decoding_options`): the doors take every such field by name,
with nothing of their own to edit (the config's ``decoding.<name>``, ``kvdiverge.measure(...,
<name>=...)``, the command line's ``--<name>``, the recorded settings, the teacher-forced
pass's neutral transform). A new one is then its field here (in both classes, with its
check), the transform that uses it (:mod:`kvdiverge.engine.core.decoding`, or the pairs for
one that reads the context), one schema entry, and its tests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

__all__ = ["Decoding", "Sampling", "decoding_options"]


@dataclass(frozen=True, kw_only=True)
class Decoding:
    """The decoding transform of both kernels: what a kernel pair needs of the settings.

    Parameters
    ----------
    temperature : float
        Softmax temperature (>= 0); 0 means greedy decoding (a point mass on the arg-max).
    top_p : float
        Nucleus mass in (0, 1]; 1 keeps the whole distribution (Holtzman et al., 2020).
    repetition_penalty : float
        CTRL's repetition penalty (Keskar et al., 2019), as ``transformers``'
        ``RepetitionPenaltyLogitsProcessor``: before temperature and top-p, the raw logit of
        every token already in a row's context (prompt and the tokens that side generated)
        is divided by it when positive and multiplied by it when negative. ``> 0`` (the
        config and the doors allow 1e-4 to 1e4); 1 (the default) changes nothing.
    min_p : float
        Min-p truncation (Nguyen et al., 2024), as ``transformers``' ``MinPLogitsWarper``,
        after top-p: tokens below ``min_p`` times the most likely token's probability are
        dropped. In [0, 1]; 0 (the default) changes nothing.
    eos_ids : tuple of int or None
        End-of-sequence token ids; ``None`` (the default) takes the model's
        (:func:`kvdiverge.engine.llm.pair_base.model_eos_ids`); empty means generation never
        stops early.

    Raises
    ------
    ValueError
        A setting outside its range, named with its value.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    repetition_penalty: float = field(
        default=1.0,
        metadata={
            "help": "CTRL's repetition penalty on both generations, as model.generate's (default: 1, none)",
            "metavar": "THETA",
        },
    )
    min_p: float = field(
        default=0.0,
        metadata={
            "help": "min-p truncation after top-p, as model.generate's: keep tokens with at least "
            "MIN_P times the top token's probability (default: 0, none)",
            "metavar": "MIN_P",
        },
    )
    eos_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        _check_decoding(self)
        if self.eos_ids is not None:
            object.__setattr__(self, "eos_ids", tuple(int(i) for i in self.eos_ids))

    @property
    def greedy(self) -> bool:
        """Whether decoding is greedy (temperature 0)."""
        return self.temperature == 0

    def log_probs(self, logits, dtype):
        """The transformed next-token log-distributions of raw ``logits`` (B, V): temperature, top-p and
        min-p (:func:`kvdiverge.engine.core.decoding.decode_log_probs`), in ``dtype``. A setting that reads
        each row's context (the repetition penalty) is applied before, by the pair that holds the context."""
        from kvdiverge.engine.core.decoding import decode_log_probs

        return decode_log_probs(logits, self.temperature, self.top_p, dtype=dtype, min_p=self.min_p)


def decoding_options() -> dict[str, dict]:
    """The decoding settings the doors take by name: :class:`Decoding`'s fields with a ``help`` in their metadata.

    Returns
    -------
    dict of str to dict
        Name -> ``{"default": ..., "help": str, "metavar": str}``, in field order. The
        default changes nothing, so an unset setting leaves a config's settings hash as it was.
    """
    return {
        f.name: {"default": f.default, "help": f.metadata["help"], "metavar": f.metadata.get("metavar", "X")}
        for f in fields(Decoding)
        if "help" in f.metadata
    }


#: The fields a :class:`Sampling` shares with its :class:`Decoding`: every field of :class:`Decoding`.
_SHARED = tuple(f.name for f in fields(Decoding))


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """Generation settings shared by both sides of a coupled run (estimators.md §1, §5).

    Parameters
    ----------
    T : int
        Generation horizon: new tokens per replicate, steps (>= 1).
    replicates : int
        Coupled replicates R per document (>= 1).
    temperature, top_p, repetition_penalty, min_p, eos_ids
        The decoding transform, as :class:`Decoding` (:attr:`decoding`).
    seed : int
        Master seed of the uniform streams (:func:`kvdiverge.engine.core.streams.uniform_streams`).
    model_name : str
        The model's name in the seed derivation and the tables (not a path).

    Raises
    ------
    ValueError
        A setting outside its range, named with its value.
    """

    T: int
    replicates: int
    temperature: float
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    model_name: str = "model"
    eos_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        _check(self)
        object.__setattr__(self, "eos_ids", self.decoding.eos_ids)

    @property
    def decoding(self) -> Decoding:
        """The decoding transform's settings (what the kernel pairs read)."""
        return Decoding(**{name: getattr(self, name) for name in _SHARED})

    @property
    def greedy(self) -> bool:
        """Whether decoding is greedy (temperature 0)."""
        return self.temperature == 0

    def replace(self, **changes) -> Sampling:
        """A copy with ``changes`` applied (and checked)."""
        return replace(self, **changes)

    def untransformed(self) -> Sampling:
        """A copy whose decoding transform is off: temperature 1, top-p 1 and every setting of
        :func:`decoding_options` at its default, so the pairs return the raw logits' log-softmax
        (the teacher-forced pass, as llama.cpp scores)."""
        neutral = {name: option["default"] for name, option in decoding_options().items()}
        return replace(self, temperature=1.0, top_p=1.0, **neutral)


def _check_decoding(d: Decoding) -> None:
    """Raise ``ValueError`` naming the first decoding setting outside its range."""
    if isinstance(d.temperature, bool) or not (
        isinstance(d.temperature, (int, float)) and math.isfinite(d.temperature) and d.temperature >= 0
    ):
        raise ValueError(f"temperature must be a finite number >= 0, got {d.temperature!r}")
    if isinstance(d.top_p, bool) or not (isinstance(d.top_p, (int, float)) and 0 < d.top_p <= 1):
        raise ValueError(f"top_p must lie in (0, 1], got {d.top_p!r}")
    penalty = d.repetition_penalty
    if isinstance(penalty, bool) or not (isinstance(penalty, (int, float)) and math.isfinite(penalty) and penalty > 0):
        raise ValueError(f"repetition_penalty must be a finite number > 0, got {penalty!r}")
    if isinstance(d.min_p, bool) or not (isinstance(d.min_p, (int, float)) and 0 <= d.min_p <= 1):
        raise ValueError(f"min_p must lie in [0, 1], got {d.min_p!r}")
    if d.eos_ids is not None and (not isinstance(d.eos_ids, Sequence) or isinstance(d.eos_ids, str)):
        raise ValueError(f"eos_ids must be a sequence of token ids or None, got {d.eos_ids!r}")


def _check(s: Sampling) -> None:
    """Raise ``ValueError`` naming the first setting outside its range."""
    if isinstance(s.T, bool) or not isinstance(s.T, int) or s.T < 1:
        raise ValueError(f"T (new tokens) must be an integer >= 1, got {s.T!r}")
    if isinstance(s.replicates, bool) or not isinstance(s.replicates, int) or s.replicates < 1:
        raise ValueError(f"replicates must be an integer >= 1, got {s.replicates!r}")
    if isinstance(s.seed, bool) or not isinstance(s.seed, int):
        raise ValueError(f"seed must be an integer, got {s.seed!r}")
    _check_decoding(s.decoding)
