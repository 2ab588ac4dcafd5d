"""The generation settings of one coupled run, as frozen objects.

Each door (``kvdiverge.measure``, ``kvdiverge measure``, the workflow's shard job) builds one
:class:`Sampling` and passes it down: the runner and the coupled run read their generation
settings from it, and the kernel pairs read the decoding transform's part of it
(:attr:`Sampling.decoding`, a :class:`Decoding`), from nowhere else. A new decoding setting
is then one field of each here, one schema entry, the place that uses it, and a test.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

__all__ = ["Decoding", "Sampling"]


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
        is divided by it when positive and multiplied by it when negative. ``> 0``; 1 (the
        default) changes nothing.
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
    repetition_penalty: float = 1.0
    eos_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        _check_decoding(self)
        if self.eos_ids is not None:
            object.__setattr__(self, "eos_ids", tuple(int(i) for i in self.eos_ids))

    @property
    def greedy(self) -> bool:
        """Whether decoding is greedy (temperature 0)."""
        return self.temperature == 0


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """Generation settings shared by both sides of a coupled run (estimators.md §1, §5).

    Parameters
    ----------
    T : int
        Generation horizon: new tokens per replicate, steps (>= 1).
    replicates : int
        Coupled replicates R per document (>= 1).
    temperature, top_p, repetition_penalty, eos_ids
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
    seed: int = 0
    model_name: str = "model"
    eos_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        _check(self)
        object.__setattr__(self, "eos_ids", self.decoding.eos_ids)

    @property
    def decoding(self) -> Decoding:
        """The decoding transform's settings (what the kernel pairs read)."""
        return Decoding(
            temperature=self.temperature,
            top_p=self.top_p,
            repetition_penalty=self.repetition_penalty,
            eos_ids=self.eos_ids,
        )

    @property
    def greedy(self) -> bool:
        """Whether decoding is greedy (temperature 0)."""
        return self.temperature == 0

    def replace(self, **changes) -> Sampling:
        """A copy with ``changes`` applied (and checked)."""
        return replace(self, **changes)


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
