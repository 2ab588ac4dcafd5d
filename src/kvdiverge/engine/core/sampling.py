"""The generation settings of one coupled run, as frozen objects.

Each door (``kvdiverge.measure``, ``kvdiverge measure``, the workflow's shard job) builds one
:class:`Sampling` and passes it down: the runner and the coupled run read their generation
settings from it, and the kernel pairs read its decoding transform (:attr:`Sampling.decoding`,
a :class:`Decoding`), from nowhere else.

Every decoding setting is a :class:`Decoding` field whose metadata carries its help text, its
doors' default and its range as a JSON-schema fragment (:func:`decoding_options`). The range is
checked here only: :class:`Decoding` checks it, and the config schema's ``decoding.<name>``
entry takes it from the field (:func:`kvdiverge.settings.schema.load_schema`), so the doors
(``kvdiverge.measure(..., <name>=...)``, the command line's ``--<name>``, the config) refuse the
same values. The doors, the recorded settings and the teacher-forced pass's neutral transform
loop over :func:`decoding_options`. A new setting is then its field here and the transform that
uses it (:func:`kvdiverge.engine.core.decoding.decode_log_probs`, or the pairs for one that reads
the context), with its tests and its line in ``docs/configs.md``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

__all__ = ["Decoding", "Sampling", "decoding_options", "range_problem"]


def _option(neutral: Any, *, help: str, metavar: str, schema: dict, default: Any = None, stage: str = "transform"):
    """A :class:`Decoding` field: ``neutral`` changes nothing; ``default`` is the doors' default (None: the
    neutral value, and the setting is recorded only when set); ``schema`` the allowed values (JSON schema);
    ``stage``: ``transform`` (a keyword of :func:`~kvdiverge.engine.core.decoding.decode_log_probs`) or
    ``context`` (applied by the pair that holds each row's context)."""
    meta = {"help": help, "metavar": metavar, "schema": schema, "default": default, "stage": stage}
    return field(default=neutral, metadata=meta)


@dataclass(frozen=True, kw_only=True)
class Decoding:
    """The decoding transform of both kernels: what a kernel pair needs of the settings.

    Applied in ``model.generate``'s order: the repetition penalty on the raw logits, then
    temperature, top-k, top-p and min-p (``transformers``' warpers).

    Parameters
    ----------
    temperature : float
        Softmax temperature (>= 0); 0 means greedy decoding (a point mass on the arg-max).
    top_k : int
        Top-k truncation (Fan et al., 2018), as ``transformers``' ``TopKLogitsWarper``: the ``top_k``
        most likely tokens are kept (ties with the ``top_k``-th kept too). ``>= 0``; 0 (the default)
        keeps all.
    top_p : float
        Nucleus mass in (0, 1]; 1 keeps the whole distribution (Holtzman et al., 2020).
    repetition_penalty : float
        CTRL's repetition penalty (Keskar et al., 2019), as ``transformers``'
        ``RepetitionPenaltyLogitsProcessor``: before temperature and top-p, the raw logit of
        every token already in a row's context (prompt and the tokens that side generated)
        is divided by it when positive and multiplied by it when negative. In [1e-4, 1e4];
        1 (the default) changes nothing.
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
        A setting outside its range, named with its value and what is allowed (:func:`range_problem`).
    """

    temperature: float = _option(
        1.0,
        help="sampling temperature of both generations; 0 means greedy (default: 0.7, or 0 with --task)",
        metavar="TEMP",
        schema={"type": "number", "minimum": 0},
        default=0.7,
    )
    top_k: int = _option(
        0,
        help="top-k truncation after temperature, as model.generate's: keep the TOP_K most likely "
        "tokens (default: 0, none)",
        metavar="TOP_K",
        schema={"type": "integer", "minimum": 0},
    )
    top_p: float = _option(
        1.0,
        help="nucleus mass of both generations, in (0, 1] (default: 0.95)",
        metavar="TOP_P",
        schema={"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        default=0.95,
    )
    repetition_penalty: float = _option(
        1.0,
        help="CTRL's repetition penalty on both generations, as model.generate's (default: 1, none)",
        metavar="THETA",
        schema={"type": "number", "minimum": 0.0001, "maximum": 10000},
        stage="context",
    )
    min_p: float = _option(
        0.0,
        help="min-p truncation after top-p, as model.generate's: keep tokens with at least "
        "MIN_P times the top token's probability (default: 0, none)",
        metavar="MIN_P",
        schema={"type": "number", "minimum": 0, "maximum": 1},
    )
    eos_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name, option in decoding_options().items():
            problem = range_problem(getattr(self, name), option["schema"])
            if problem:
                raise ValueError(f"{name} must be {problem}, got {getattr(self, name)!r}")
        if self.eos_ids is not None:
            if not isinstance(self.eos_ids, Sequence) or isinstance(self.eos_ids, str):
                raise ValueError(f"eos_ids must be a sequence of token ids or None, got {self.eos_ids!r}")
            object.__setattr__(self, "eos_ids", tuple(int(i) for i in self.eos_ids))

    @property
    def greedy(self) -> bool:
        """Whether decoding is greedy (temperature 0)."""
        return self.temperature == 0

    @property
    def point_masses(self) -> bool:
        """Whether every kernel is a point mass on one token (greedy, or top-k 1, ties aside): TV is then 0 or 1,
        and TV 0 shows only that both sides' arg-maxes agree, not that their distributions do."""
        return self.greedy or self.top_k == 1

    def replace(self, **changes) -> Decoding:
        """A copy with ``changes`` applied (and checked)."""
        return replace(self, **changes)

    def untransformed(self) -> Decoding:
        """A copy whose transform is off: every setting of :func:`decoding_options` at its neutral value,
        so the pairs return the raw logits' log-softmax (the teacher-forced pass, as llama.cpp scores)."""
        return replace(self, **{name: option["neutral"] for name, option in decoding_options().items()})

    def log_probs(self, logits, dtype):
        """The transformed next-token log-distributions of raw ``logits`` (B, V): the ``transform`` settings
        (:func:`kvdiverge.engine.core.decoding.decode_log_probs`), in ``dtype``. A setting that reads each
        row's context (the repetition penalty) is applied before, by the pair that holds the context."""
        from kvdiverge.engine.core.decoding import decode_log_probs  # torch: this module stays torch-free

        return decode_log_probs(logits, dtype=dtype, **{name: getattr(self, name) for name in _transform_settings()})


@functools.cache
def _transform_settings() -> tuple[str, ...]:
    """The names of the settings :func:`kvdiverge.engine.core.decoding.decode_log_probs` applies (stage
    ``transform``), read once: :meth:`Decoding.log_probs` runs at every decoding step."""
    return tuple(name for name, option in decoding_options().items() if option["stage"] == "transform")


def decoding_options() -> dict[str, dict]:
    """Every decoding setting the doors take by name: :class:`Decoding`'s fields with a ``help`` in their metadata.

    Returns
    -------
    dict of str to dict
        Name -> ``{"default", "neutral", "recorded", "help", "metavar", "schema", "type", "stage"}``, in field
        order: ``neutral`` changes nothing; ``default`` is the doors' (the config's and ``kvdiverge.measure``'s)
        default; ``recorded`` is True for a setting always recorded in a run's settings (one with a default
        of its own), False for one recorded only away from neutral, so an unset setting leaves a config's
        settings hash as it was; ``schema`` is the JSON-schema fragment of the allowed values; ``type``
        ``int`` or ``float``.
    """
    return {
        f.name: {
            "neutral": f.default,
            "default": f.default if f.metadata["default"] is None else f.metadata["default"],
            "recorded": f.metadata["default"] is not None,
            "help": f.metadata["help"],
            "metavar": f.metadata["metavar"],
            "schema": dict(f.metadata["schema"]),
            "type": int if f.metadata["schema"]["type"] == "integer" else float,
            "stage": f.metadata["stage"],
        }
        for f in fields(Decoding)
        if "help" in f.metadata
    }


def range_problem(value: Any, schema: dict) -> str | None:
    """What a decoding setting allows, in words, when ``value`` is outside ``schema`` (a JSON-schema fragment
    with ``type`` ``number`` or ``integer`` and optional bounds); None when it is inside. Booleans, NaN and
    infinities are outside; an integer is a number."""
    kinds = (int,) if schema["type"] == "integer" else (int, float)
    bounds = [
        (key, op, schema[key])
        for key, op in (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="), ("exclusiveMaximum", "<"))
        if key in schema
    ]
    words = ("an integer" if schema["type"] == "integer" else "a finite number") + "".join(
        f"{' and' if i else ''} {op} {bound:g}" for i, (_, op, bound) in enumerate(bounds)
    )
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value):
        return words
    inside = {
        "minimum": lambda b: value >= b,
        "exclusiveMinimum": lambda b: value > b,
        "maximum": lambda b: value <= b,
        "exclusiveMaximum": lambda b: value < b,
    }
    return None if all(inside[key](bound) for key, _, bound in bounds) else words


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """Generation settings shared by both sides of a coupled run (estimators.md §1, §5).

    Parameters
    ----------
    T : int
        Generation horizon: new tokens per replicate, steps (>= 1).
    replicates : int
        Coupled replicates R per document (>= 1).
    decoding : Decoding
        The decoding transform of both sides (default: temperature 1 on the raw logits, nothing else).
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
    decoding: Decoding = field(default_factory=Decoding)
    seed: int = 0
    model_name: str = "model"

    def __post_init__(self) -> None:
        if isinstance(self.T, bool) or not isinstance(self.T, int) or self.T < 1:
            raise ValueError(f"T (new tokens) must be an integer >= 1, got {self.T!r}")
        if isinstance(self.replicates, bool) or not isinstance(self.replicates, int) or self.replicates < 1:
            raise ValueError(f"replicates must be an integer >= 1, got {self.replicates!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.decoding, Decoding):
            raise ValueError(f"decoding must be a Decoding, got {self.decoding!r}")

    @property
    def greedy(self) -> bool:
        """Whether decoding is greedy (temperature 0)."""
        return self.decoding.greedy

    @property
    def eos_ids(self) -> tuple[int, ...] | None:
        """The decoding's end-of-sequence ids (None: the model's)."""
        return self.decoding.eos_ids

    def replace(self, **changes) -> Sampling:
        """A copy with ``changes`` applied (and checked); a :class:`Decoding` field's name changes the decoding."""
        names = {f.name for f in fields(Decoding)}
        inner = {k: changes.pop(k) for k in list(changes) if k in names}
        if inner:
            changes["decoding"] = changes.get("decoding", self.decoding).replace(**inner)
        return replace(self, **changes)

    def untransformed(self) -> Sampling:
        """A copy whose decoding transform is off (:meth:`Decoding.untransformed`)."""
        return replace(self, decoding=self.decoding.untransformed())
