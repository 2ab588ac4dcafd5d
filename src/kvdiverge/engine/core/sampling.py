"""The generation settings of one coupled run, as one frozen object.

Each door (``kvdiverge.measure``, ``kvdiverge measure``, the workflow's shard job) builds one
:class:`Sampling` and passes it down: the runner, the kernel pairs and the coupled run read
their generation settings from it and from nowhere else, so a new decoding setting is one
field here, one schema entry, the place that uses it, and a test.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

__all__ = ["Sampling"]


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """Generation settings shared by both sides of a coupled run (estimators.md §1, §5).

    Parameters
    ----------
    T : int
        Generation horizon: new tokens per replicate, steps (>= 1).
    replicates : int
        Coupled replicates R per document (>= 1).
    temperature : float
        Softmax temperature (>= 0); 0 means greedy decoding (a point mass on the arg-max).
    top_p : float
        Nucleus mass in (0, 1]; 1 keeps the whole distribution (Holtzman et al., 2020).
    seed : int
        Master seed of the uniform streams (:func:`kvdiverge.engine.core.streams.uniform_streams`).
    model_name : str
        The model's name in the seed derivation and the tables (not a path).
    eos_ids : tuple of int
        End-of-sequence token ids; empty means generation never stops early.

    Raises
    ------
    ValueError
        A setting outside its range, named with its value.
    """

    T: int
    replicates: int
    temperature: float
    top_p: float = 1.0
    seed: int = 0
    model_name: str = "model"
    eos_ids: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        _check(self)
        object.__setattr__(self, "eos_ids", tuple(int(i) for i in self.eos_ids))

    @property
    def greedy(self) -> bool:
        """Whether decoding is greedy (temperature 0)."""
        return self.temperature == 0

    def replace(self, **changes) -> Sampling:
        """A copy with ``changes`` applied (and checked)."""
        return replace(self, **changes)


def _check(s: Sampling) -> None:
    """Raise ``ValueError`` naming the first setting outside its range."""
    if isinstance(s.T, bool) or not isinstance(s.T, int) or s.T < 1:
        raise ValueError(f"T (new tokens) must be an integer >= 1, got {s.T!r}")
    if isinstance(s.replicates, bool) or not isinstance(s.replicates, int) or s.replicates < 1:
        raise ValueError(f"replicates must be an integer >= 1, got {s.replicates!r}")
    if not (isinstance(s.temperature, (int, float)) and math.isfinite(s.temperature) and s.temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {s.temperature!r}")
    if not (isinstance(s.top_p, (int, float)) and 0 < s.top_p <= 1):
        raise ValueError(f"top_p must lie in (0, 1], got {s.top_p!r}")
    if not isinstance(s.eos_ids, Sequence) or isinstance(s.eos_ids, str):
        raise ValueError(f"eos_ids must be a sequence of token ids, got {s.eos_ids!r}")
