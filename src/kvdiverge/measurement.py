"""Measure presses in one call: the Python front door, ``kvdiverge.measure``.

:func:`measure` runs prompts through the same engine (:func:`kvdiverge.engine.runner.run_documents`),
estimators and analyses (:mod:`kvdiverge.estimation.tables`) as the workflow, for one model and any
number of presses on the same prompts, with common random numbers (the seeds derive from
(seed, model name, prompt id, replicate), never from the press). It returns a
:class:`Measurement` holding the same tables as ``results/trajectories``,
``results/estimates`` and ``results/analysis``.

Example (a notebook)::

    import kvdiverge, kvpress
    from kvdiverge.study.models import EMBEDDED_MODEL, load_model
    model, tokenizer = load_model(EMBEDDED_MODEL)
    m = kvdiverge.measure(model, tokenizer, ["Explain KV caches to a child."] * 2,
                          {"snapkv": kvpress.SnapKVPress(compression_ratio=0.5, window_size=8)},
                          max_new_tokens=8, replicates=2)
    m.summary

The mathematics and column names: ``docs/estimators.md``; the tables: ``docs/internals.md``.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import polars as pl

from kvdiverge.engine.presses.policies import Policy, PressPolicy
from kvdiverge.engine.runner import Document, PressSource
from kvdiverge.report.formatting import number, with_interval

__all__ = ["Measurement", "NOISE_FLOOR_PRESS", "frontier_presses", "measure", "prepare_documents",
           "prepare_presses"]

log = logging.getLogger(__name__)

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


def prepare_documents(prompts: Sequence[Any] | Mapping[str, Any], tokenizer=None, *,
                      instruction: str | None = None, system: str | None = None) -> list[Document]:
    """Prompts as engine documents: text rendered with the chat template, ids kept as they are.

    Parameters
    ----------
    prompts : sequence or mapping
        Strings or token-id sequences. A mapping gives each prompt its id (``doc_id``,
        which enters the seeds); a sequence names them ``prompt-0``, ``prompt-1``, ...
    tokenizer : transformers tokenizer, optional
        Needed for text prompts: rendered as one user message (the text, then a blank line
        and ``instruction`` if given) with ``add_generation_prompt=True``, exactly as the
        workflow's prompts stage (:func:`kvdiverge.study.prompts.render_ids`).
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
        A prompt that is neither text nor token ids.
    """
    from kvdiverge.study.prompts import render_ids

    items = list(prompts.items()) if isinstance(prompts, Mapping) else [
        (f"prompt-{i}", p) for i, p in enumerate([prompts] if isinstance(prompts, str) else prompts)]
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


def _is_source(obj: Any) -> bool:
    return all(hasattr(obj, a) for a in ("name", "build_press", "expected_kept"))


def prepare_presses(presses: Any) -> dict[str, PressSource]:
    """Presses as policies (:class:`kvdiverge.engine.runner.PressSource`), by name.

    Parameters
    ----------
    presses : mapping, sequence or press
        A mapping of name to a kvpress press object (any ``kvpress.BasePress``, the
        user's own classes included; wrapped in :class:`kvdiverge.engine.presses.policies.PressPolicy`),
        a policy entry as in the config (``{"press": "SnapKVPress", "compression_ratio":
        0.5, ...}`` or ``budget``; :class:`kvdiverge.engine.presses.policies.Policy`), or any
        ``PressSource``. A sequence or a single press is named by class name
        (``SnapKVPress``, ``SnapKVPress-2`` for a second one).

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
        :mod:`kvdiverge.engine.presses.registry`), an unknown parameter, or one kvpress rejects.
    TypeError
        A value that is neither a press, a policy entry nor a PressSource.
    """
    from kvdiverge.engine.core.errors import PressError
    from kvdiverge.engine.presses.registry import refusal

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
            out[name] = Policy.from_config(name, dict(value))  # builds and checks its press once
        elif callable(value):  # a press is a context manager factory: press(model)
            reason = refusal(value)
            if reason:
                raise PressError(f"press {name!r}", reason)
            out[name] = PressPolicy(name, value)
        else:
            raise TypeError(f"press {name!r}: expected a kvpress press, a policy entry or a PressSource, "
                            f"got {type(value).__name__}")
    return out


def _renamed(source: Any, name: str) -> Any:
    import dataclasses

    if dataclasses.is_dataclass(source):
        return dataclasses.replace(source, name=name)
    raise ValueError(f"press {name!r}: its PressSource is named {source.name!r}; use that name as the key")


def check_lengths(documents: Sequence[Document], sources: Mapping[str, PressSource], max_new_tokens: int,
                  context: int | None = None) -> None:
    """Fail before any generation when a prompt cannot run under a press.

    Raises
    ------
    ValueError
        Naming the first prompt shorter than a press needs (the press and its minimum), or
        a prompt that with ``max_new_tokens`` exceeds the model ``context`` (tokens).
    """
    from kvdiverge.engine.presses.policies import min_prompt_tokens

    for doc in documents:
        if context is not None and doc.prompt_len + max_new_tokens > context:
            raise ValueError(f"prompt {doc.doc_id!r}: {doc.prompt_len} tokens + {max_new_tokens} new tokens "
                             f"exceed the model context of {context} tokens")
        for name, source in sources.items():
            need = min_prompt_tokens(source)
            if doc.prompt_len < need:
                raise ValueError(f"prompt {doc.doc_id!r} has {doc.prompt_len} tokens; press {name!r} "
                                 f"needs at least {need}")


def refuse_on(model, sources: Mapping[str, PressSource]) -> None:
    """Refuse, before any work, a press that ``model`` cannot run (a config attribute it reads).

    Raises
    ------
    kvdiverge.engine.core.errors.PressError
        Naming the press and what it needs (:func:`kvdiverge.engine.presses.registry.refusal`).
    """
    from kvdiverge.engine.core.errors import PressError
    from kvdiverge.engine.presses.registry import refusal

    for name, source in sources.items():
        press = getattr(source, "_probe", None) if isinstance(source, Policy) else getattr(source, "press", None)
        reason = refusal(press, model) if press is not None else None
        if reason:
            raise PressError(f"press {name!r}", reason)


def is_noise_floor(name: str, source: PressSource) -> bool:
    """True for the noise-floor control: policy ``noise-floor`` or a press that keeps every position
    (``PermutationPress``; :func:`kvdiverge.engine.presses.policies.keeps_every_position`)."""
    from kvdiverge.engine.presses.policies import keeps_every_position

    if name == NOISE_FLOOR_POLICY:
        return True
    return keeps_every_position(source.press if isinstance(source, Policy) else getattr(source, "press", None))


# --------------------------------------------------------------------------- frontier


def _at_ratio(press: Any, ratio: float, name: str) -> Any:
    """A copy of the press object with ``compression_ratio = ratio`` set on the press that
    takes it (the press itself, else the press it wraps, ``.press``)."""
    import dataclasses

    if dataclasses.is_dataclass(press) and not isinstance(press, type):
        fields = {f.name for f in dataclasses.fields(press) if f.init}
        if "compression_ratio" in fields:
            return dataclasses.replace(press, compression_ratio=float(ratio))
        if "press" in fields and getattr(press, "press", None) is not None:
            return dataclasses.replace(press, press=_at_ratio(press.press, ratio, name))
    raise ValueError(f"press {name!r}: {type(press).__name__} takes no compression_ratio (nor does a press "
                     f"it wraps), so a frontier cannot vary it")


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


def frontier_presses(presses: Any, ratios: Sequence[float] = (),
                     budgets: Sequence[int] = ()) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Every press at every ratio (and budget), named as in the config: ``<press>@<ratio>``.

    The same grid as the config's ``frontier`` section
    (:func:`kvdiverge.estimation.frontier.frontier_grid`). A noise-floor press
    (``PermutationPress``) is kept as it is, not expanded; when there is none, one is
    added as ``noise-floor``, so that the frontier has its floor beside it.

    Parameters
    ----------
    presses : mapping or sequence
        Name -> kvpress press object (its ``compression_ratio``, or that of the press it
        wraps, is replaced) or config policy entry without its ratio (``{"press":
        "SnapKVPress", "window_size": 16}``); a sequence is named by class name.
    ratios : sequence of float
        Compression ratios in ``[0, 1)``.
    budgets : sequence of int
        Fixed budgets (tokens kept); policy entries only.

    Returns
    -------
    presses : dict
        Name -> press object or policy entry, the floor last.
    grid : list of dict
        The frontier points (``policy``, ``press``, ``compression_ratio``, ``budget``).

    Raises
    ------
    ValueError
        A press that takes no compression ratio, a ratio outside ``[0, 1)``, no ratio, or
        a budget for a press object.
    """
    from kvdiverge.estimation.frontier import frontier_grid
    from kvdiverge.engine.presses.project import PermutationPress

    if not ratios and not budgets:
        raise ValueError("a frontier needs ratios (or budgets)")
    if not isinstance(presses, Mapping):
        seq = list(presses) if isinstance(presses, (list, tuple)) else [presses]
        presses = {(p.get("press") if isinstance(p, Mapping) else type(p).__name__): p for p in seq}
    floors = {n: v for n, v in presses.items() if _floor_like(str(n), v)}
    scored = {str(n): v for n, v in presses.items() if n not in floors}
    if not scored:
        raise ValueError("a frontier needs at least one press besides the noise floor")
    grid = frontier_grid(list(scored), list(ratios), list(budgets))
    out: dict[str, Any] = {}
    for point in grid:
        name, value = point["policy"], scored[point["press"]]
        if isinstance(value, Mapping):
            for key in ("compression_ratio", "budget"):
                if value.get(key) is not None:
                    raise ValueError(f"press {point['press']!r}: give it without {key}; the frontier sets it")
            extra = {"compression_ratio": point["compression_ratio"]} if point["budget"] is None \
                else {"budget": point["budget"]}
            out[name] = {**value, **extra}
        elif point["budget"] is not None:
            raise ValueError(f"press {point['press']!r}: a fixed budget needs a policy entry "
                             f"({{'press': 'SnapKVPress', ...}}), not a press object")
        else:
            out[name] = _at_ratio(value, point["compression_ratio"], point["press"])
    out.update(floors or {NOISE_FLOOR_POLICY: PermutationPress()})
    return out, grid


# --------------------------------------------------------------------------- result


@dataclass
class Measurement:
    """Everything :func:`measure` measured: the workflow's tables, for one model.

    Attributes
    ----------
    trajectories : polars.DataFrame
        One row per (press, prompt, replicate), shard schema
        (:data:`kvdiverge.estimation.schema.TRAJECTORY_SCHEMA`); ``policy`` is the press name.
    replicates, documents : polars.DataFrame
        Per-replicate and per-prompt estimates (``results/estimates``;
        :func:`kvdiverge.estimation.tables.estimate`).
    pooled, timing, survival, branch_tv, variance : polars.DataFrame
        Pooled over prompts with document-bootstrap intervals (``results/analysis``;
        :func:`kvdiverge.estimation.tables.pool`).
    settings : dict
        model, split, T, R, temperature, top_p, seed, window, bootstrap, confidence,
        presses (name -> description).
    noise_floor : str or None
        Name of the noise-floor press among the presses, if any.
    batch_documents : int or None
        Documents per batched forward ``B`` every press ran with (planned once per
        :func:`measure` call); not a setting, since results depend on it only by rounding.
    """

    trajectories: pl.DataFrame
    replicates: pl.DataFrame
    documents: pl.DataFrame
    pooled: pl.DataFrame
    timing: pl.DataFrame
    survival: pl.DataFrame
    branch_tv: pl.DataFrame
    variance: pl.DataFrame
    settings: dict[str, Any]
    noise_floor: str | None = None
    batch_documents: int | None = None
    _gaps: dict[tuple[str, str], pl.DataFrame] = field(default_factory=dict, repr=False)
    _cache: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def presses(self) -> list[str]:
        """Press names, in the order given."""
        return list(self.settings["presses"])

    def gap(self, a: str, b: str) -> pl.DataFrame:
        """Gap decomposition ``A - B`` of the expected token loss, paired by prompt (§7).

        Parameters
        ----------
        a, b : str
            Press names.

        Returns
        -------
        polars.DataFrame
            Four rows (``term``: ``delta``, ``first_mismatch``, ``exposure``, ``rate``):
            ``value`` in tokens with its paired-bootstrap interval, ``share`` of the gap,
            ``value_M = value / T`` (:func:`kvdiverge.estimation.analysis.gap_decomposition`).

        Raises
        ------
        ValueError
            If ``a`` or ``b`` is not a measured press, or ``a == b``.
        """
        from kvdiverge.estimation.tables import gaps

        for p in (a, b):
            if p not in self.presses:
                raise ValueError(f"unknown press {p!r}; measured: {self.presses}")
        if a == b:
            raise ValueError("a gap needs two different presses")
        if (a, b) not in self._gaps:
            s = self.settings
            self._gaps[(a, b)] = gaps(self.documents, [(a, b)], s["bootstrap"], s["confidence"], s["seed"],
                                      split=s["split"], models=[s["model"]])
        return self._gaps[(a, b)]

    @property
    def gaps(self) -> pl.DataFrame:
        """Gap decompositions of every pair ``(A, B)`` of presses, A before B in the given order."""
        frames = [self.gap(a, b) for a, b in itertools.combinations(self.presses, 2)]
        if not frames:
            from kvdiverge.estimation.analysis import GAP_SCHEMA

            return pl.DataFrame(schema=GAP_SCHEMA)
        return pl.concat(frames)

    @property
    def speculative(self) -> pl.DataFrame:
        """The self-speculative reading: accepted tokens of a first draft block, per press.

        With the press's cache as the draft and the full cache as the target, the expected
        number of accepted tokens of the first block of ``k`` drafted tokens is
        ``A_k = sum_{j<=k} S_j`` (exact for the block drafted from the prompt; later blocks
        start from other histories). Rows ``k = 1..min(8, T)`` per press with
        document-bootstrap intervals: ``A``, ``tokens_per_forward = A + 1``, the mean
        per-step acceptance ``alpha`` along the chain and the i.i.d. formula
        ``(1 - alpha^{k+1}) / (1 - alpha)`` (:func:`kvdiverge.estimation.speculative.speculative_table`).
        """
        from kvdiverge.estimation.speculative import speculative_table

        if "speculative" not in self._cache:
            s = self.settings
            self._cache["speculative"] = speculative_table(self.documents, s["bootstrap"], s["confidence"], s["seed"])
        return self._cache["speculative"]

    @property
    def compression(self) -> pl.DataFrame:
        """Per press and prompt: ``prompt_len``, ``kept_len`` (tokens), ``kept_fraction`` and
        ``untouched`` (the press left the cache whole: ``kept_len == prompt_len``)."""
        return self.documents.select("policy", "doc_id", "prompt_len", "kept_len").with_columns(
            (pl.col("kept_len") / pl.col("prompt_len")).alias("kept_fraction"),
            (pl.col("kept_len") == pl.col("prompt_len")).alias("untouched"),
        )

    @property
    def summary(self) -> pl.DataFrame:
        """One row per press: occurrence, timing, token loss and its decomposition.

        Columns: ``policy``, ``n_docs``, ``T``, ``R``, ``kept_fraction`` (mean over
        prompts), ``untouched`` (True when the press kept every prompt position on every
        prompt: it did not compress), ``p_div``, ``tau_mean`` (mean first-divergence step
        given divergence, steps), ``E_L`` (steps), ``rho``, ``E_M`` (mismatch fraction),
        each of ``p_div``, ``tau_mean``, ``E_L``, ``E_M`` with ``_lo``/``_hi`` bootstrap
        bounds; ``first_mismatch_term = p_div / T`` and ``exposure_rate_term = (E_L / T) rho``
        (they sum to ``E_M``), ``exposure_share``. With a noise-floor press measured:
        ``E_M_minus_floor``, ``p_div_minus_floor`` (each with ``_lo``/``_hi``, paired
        bootstrap), null on the floor's own row.
        """
        comp = self.compression.group_by("policy").agg(
            pl.col("kept_fraction").mean(), pl.col("untouched").all())
        cols = ["policy", "n_docs", "T", "R"]
        stats = ["p_div", "tau_mean", "E_L", "E_M"]
        cols += [c + s for c in stats for s in ("", "_lo", "_hi")]
        cols += ["rho", "first_mismatch_term", "exposure_rate_term", "exposure_share"]
        out = self.pooled.select(cols).join(comp, on="policy", how="left")
        order = {p: i for i, p in enumerate(self.presses)}
        out = out.sort(pl.col("policy").replace_strict(order, return_dtype=pl.Int64))
        out = out.select(["policy", "n_docs", "T", "R", "kept_fraction", "untouched",
                          *[c for c in cols if c not in ("policy", "n_docs", "T", "R")]])
        if self.noise_floor is None:
            return out
        rows = []
        for p in self.presses:
            r = {"policy": p}
            if p != self.noise_floor:
                t = {row["term"]: row for row in self.gap(p, self.noise_floor).iter_rows(named=True)}
                T = t["delta"]["T"]
                r.update({"E_M_minus_floor": t["delta"]["value"] / T, "E_M_minus_floor_lo": t["delta"]["value_lo"] / T,
                          "E_M_minus_floor_hi": t["delta"]["value_hi"] / T,
                          "p_div_minus_floor": t["first_mismatch"]["value"],
                          "p_div_minus_floor_lo": t["first_mismatch"]["value_lo"],
                          "p_div_minus_floor_hi": t["first_mismatch"]["value_hi"]})
            rows.append(r)
        floor_cols = ["E_M_minus_floor", "E_M_minus_floor_lo", "E_M_minus_floor_hi", "p_div_minus_floor",
                      "p_div_minus_floor_lo", "p_div_minus_floor_hi"]
        floor = pl.DataFrame(rows, schema={"policy": pl.String, **{c: pl.Float64 for c in floor_cols}})
        return out.join(floor, on="policy", how="left")

    def format_summary(self) -> str:
        """The summary as a plain-text table (what ``kvdiverge measure`` prints)."""
        return format_summary(self)

    def __repr__(self) -> str:  # noqa: D105
        return self.format_summary()

    def save(self, directory: str | os.PathLike) -> list[Path]:
        """Write every table as parquet (and the scalar columns as CSV), atomically.

        Files: ``trajectories``, ``replicates``, ``documents``, ``pooled``, ``timing``,
        ``survival``, ``branch_tv``, ``variance``, ``gaps``, ``summary``, ``speculative``, for a frontier
        ``frontier`` and ``frontier_areas`` (``.parquet``; ``.csv`` too except for
        trajectories and replicates), ``measure.json`` (the settings) and
        ``provenance.json``: ``settings_hash``
        (:func:`kvdiverge.study.provenance.settings_hash` of the settings), ``versions``
        (:func:`kvdiverge.study.provenance.library_versions`) and ``batch_documents``
        (the ``B`` used).

        Returns
        -------
        list of pathlib.Path
            The files written.
        """
        from kvdiverge.estimation.analysis import save_table
        from kvdiverge.estimation.io import write_text_atomic
        from kvdiverge.study.provenance import library_versions, settings_hash

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        written = []
        tables = {"trajectories": self.trajectories, "replicates": self.replicates, "documents": self.documents,
                  "pooled": self.pooled, "timing": self.timing, "survival": self.survival,
                  "branch_tv": self.branch_tv, "variance": self.variance, "gaps": self.gaps,
                  "summary": self.summary, "speculative": self.speculative}
        if self.settings.get("frontier"):
            tables["frontier"], tables["frontier_areas"] = self._frontier()
        for name, frame in tables.items():
            csv = None if name in ("trajectories", "replicates") else out / f"{name}.csv"
            save_table(frame, out / f"{name}.parquet", csv)
            written += [out / f"{name}.parquet"] + ([csv] if csv else [])
        write_text_atomic(json.dumps(self.settings, indent=2, default=str) + "\n", out / "measure.json")
        written.append(out / "measure.json")
        provenance = {"settings_hash": settings_hash(self.settings), "versions": library_versions(),
                      "batch_documents": self.batch_documents}
        write_text_atomic(json.dumps(provenance, indent=2) + "\n", out / "provenance.json")
        written.append(out / "provenance.json")
        return written

    def plot_survival(self, target=None):
        """Draw the survival figure ``S_t`` per press (:func:`kvdiverge.report.figures.survival_figure`).

        Parameters
        ----------
        target : matplotlib Axes, path or None
            Axes: draw into it and return it. Path: write the figure (format from the
            suffix: ``.png``, ``.pdf``, ``.svg``), return the path. None: return a new figure.
        """
        from kvdiverge.report import figures as plots

        if hasattr(target, "plot") and hasattr(target, "figure"):
            plots.draw_survival(target, self.survival, title=self.settings["model"])
            return target
        fig = plots.survival_figure(self.survival)
        if target is None:
            return fig
        plots.save_figure(fig, target)
        return Path(target)

    def _frontier(self) -> tuple[pl.DataFrame, pl.DataFrame]:
        from kvdiverge.estimation.frontier import frontier_tables

        grid = self.settings.get("frontier")
        if not grid:
            raise ValueError("not a frontier: measure with ratios=[...] (kvdiverge measure --ratios ...)")
        if "frontier" not in self._cache:
            s = self.settings
            self._cache["frontier"] = frontier_tables(self.documents, grid, self.noise_floor, s["bootstrap"],
                                                      s["confidence"], s["seed"], split=s["split"])
        return self._cache["frontier"]

    def frontier(self) -> pl.DataFrame:
        """The frontier: every press at every ratio, ranked by press
        (:func:`kvdiverge.estimation.frontier.frontier_tables`, the workflow's ``analysis/frontier``).

        Returns
        -------
        polars.DataFrame
            One row per (press, ratio): ``p_div``, ``tau_mean``, ``tau_median``, ``E_M``,
            ``first_mismatch_term``, ``exposure_rate_term``, ``rho`` with intervals, the floor's
            values, ``above_floor``, ``rank``.

        Raises
        ------
        ValueError
            If the measurement was not made with ``ratios``.
        """
        return self._frontier()[0]

    def frontier_areas(self) -> pl.DataFrame:
        """The frontier ranking: per press, the areas under its ``E[M]`` and ``p_div`` curves
        over the ratios, with paired intervals, best first (``analysis/frontier_areas``)."""
        return self._frontier()[1]

    def format_frontier(self) -> str:
        """The frontier ranking as plain text (what ``kvdiverge measure --ratios`` prints)."""
        from kvdiverge.estimation.frontier import format_frontier

        points, areas = self._frontier()
        return format_frontier(points, areas, self.settings["confidence"])

    def plot_frontier(self, target=None):
        """Draw the frontier figure (:func:`kvdiverge.report.figures.frontier_figure`).

        Parameters
        ----------
        target : sequence of 3 matplotlib Axes, path or None
            Axes: draw into them and return them. Path: write the figure (format from the
            suffix), return the path. None: return a new figure.
        """
        from kvdiverge.report import figures as plots

        points = self.frontier()
        if isinstance(target, (list, tuple)) or hasattr(target, "flat"):
            plots.draw_frontier(list(getattr(target, "flat", target)), points, title=self.settings["model"])
            return target
        fig = plots.frontier_figure(points)
        if target is None:
            return fig
        plots.save_figure(fig, target)
        return Path(target)


def format_summary(m: Measurement) -> str:
    """The summary of a measurement as a plain-text table, with notes.

    One row per press: prompts, kept fraction of the prompt cache, ``p_div``, mean
    first-divergence step, ``E[M]`` and its decomposition ``p_div/T + (E[L]/T) rho``,
    and, when a noise-floor press was measured, each press's ``E[M]`` minus the floor's.
    Notes flag presses that left the cache untouched; one line gives the self-speculative
    reading (tokens per target forward of a first draft block of 4, :attr:`Measurement.speculative`).
    """
    num = partial(number, missing="-")  # plain text: an ASCII dash for a missing value
    ci = partial(with_interval, missing="-")
    s = m.settings
    summ = m.summary
    floor = m.noise_floor
    header = ["press", "prompts", "kept", "p_div [CI]", "first-div. step [CI]", "E[M] [CI]",
              "= p_div/T", "+ (E[L]/T)*rho", "E[L]", "rho"]
    if floor is not None:
        header.append(f"E[M] - {floor} [CI]")
    rows = []
    for r in summ.iter_rows(named=True):
        flag = "*" if r["untouched"] and r["policy"] != floor else ""
        row = [r["policy"], str(r["n_docs"]), f"{r['kept_fraction']:.0%}{flag}",
               ci(r, "p_div"), ci(r, "tau_mean"), ci(r, "E_M"),
               num(r["first_mismatch_term"]), num(r["exposure_rate_term"]), num(r["E_L"]), num(r["rho"])]
        if floor is not None:
            row.append("(floor)" if r["policy"] == floor else ci(r, "E_M_minus_floor"))
        rows.append(row)
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    out = [f"{s['model']}: {summ['n_docs'].max()} prompts, T={s['T']}, R={s['R']}, temperature {s['temperature']}, "
           f"top-p {s['top_p']}, seed {s['seed']}; [CI]: {s['confidence']:.0%} document bootstrap",
           line(header), line(["-" * w for w in widths]), *map(line, rows)]
    untouched = [p for p in summ.filter(pl.col("untouched"))["policy"].to_list() if p != floor]
    if untouched:
        out.append(f"* left the cache untouched (kept every prompt position): {', '.join(untouched)}")
    from kvdiverge.estimation.speculative import format_speculative_line

    out.append(format_speculative_line(m.speculative, m.presses))
    if floor is None:
        out.append(f"noise floor: not measured (add a {NOISE_FLOOR_PRESS} to compare each press with it)")
    return "\n".join(out)


# --------------------------------------------------------------------------- the call


def measure(model, tokenizer, prompts, presses, *, max_new_tokens: int = 32, replicates: int = 4,
            temperature: float = 0.7, top_p: float = 0.95, seed: int = 0, window: int = 8,
            instruction: str | None = None, system: str | None = None,
            windows: Mapping[str, Sequence[int]] | None = None, bootstrap: int = 2000,
            confidence: float = 0.95, model_name: str | None = None, split: str = "measure",
            eos_ids: Sequence[int] | None = None, progress: bool = True,
            batch_documents: int | None = None, memory_budget_gb: float | None = None,
            ratios: Sequence[float] | None = None, budgets: Sequence[int] | None = None) -> Measurement:
    """Measure how each press changes what ``model`` generates on ``prompts``.

    Every press runs on the same prompts with common random numbers, through the
    workflow's engine (:func:`kvdiverge.engine.runner.run_documents`) and table functions
    (:mod:`kvdiverge.estimation.tables`): per prompt and replicate, an agreement chain of the
    full-cache and the compressed-cache generation under a stepwise maximal coupling,
    and one residual branch after their first divergence (``docs/estimators.md``).

    Parameters
    ----------
    model : transformers.PreTrainedModel
        Causal LM in eval mode that kvpress supports (any that transformers loads).
    tokenizer : transformers tokenizer or None
        Renders text prompts with the chat template; may be None for token-id prompts.
    prompts : sequence or mapping
        Strings (rendered as the workflow does: :func:`prepare_documents`) or token-id
        sequences (used as they are); a mapping names them (ids enter the seeds).
    presses : mapping of str to press, policy entry or PressSource
        kvpress press objects (the user's own ``BasePress`` subclasses too), config policy
        entries (``{"press": "SnapKVPress", "compression_ratio": 0.5}``), or policies;
        see :func:`prepare_presses`.
    max_new_tokens : int
        Horizon ``T`` (tokens = steps).
    replicates : int
        ``R`` coupled replicates per prompt (>= 2 for standard errors and variances).
    temperature, top_p : float
        Decoding transform of both generations.
    seed : int
        Master seed.
    window : int
        ``W``, divergence-aligned window width (lags) of the §4 interval.
    instruction, system : str, optional
        Appended instruction and system message of text prompts.
    windows : mapping of str to (a, b), optional
        Named lag windows of the §6 branch-aligned TV (adds ``btv_<name>`` columns).
    bootstrap : int
        Document-bootstrap resamples of the pooled intervals.
    confidence : float
        Interval coverage.
    model_name : str, optional
        ``model`` column, enters the seeds; default the model's ``name_or_path`` basename.
    split : str
        ``split`` column (enters the bootstrap seeds).
    eos_ids : sequence of int, optional
        End-of-sequence ids; default from ``model.generation_config``.
    progress : bool
        A tqdm bar per press on stderr.
    batch_documents : int or None
        Documents decoded together per forward (rows = documents x ``replicates``);
        None lets the memory planner choose (:func:`kvdiverge.engine.runner.plan_documents`,
        once per call, for every press).
        Grouping changes results only by rounding; 1 reproduces a workflow shard that
        holds one document exactly.
    memory_budget_gb : float or None
        Memory budget of the planner (GiB); None: 80% of free CUDA memory, 4 GiB on CPU.
    ratios, budgets : sequence, optional
        Measure a frontier: every press at every compression ratio (and fixed budget),
        named ``<press>@<ratio>`` (``<press>@b<budget>``), beside the noise floor (one is
        added when no ``PermutationPress`` is given); :func:`frontier_presses`. Then
        :meth:`Measurement.frontier` and :meth:`Measurement.plot_frontier` draw it.

    Returns
    -------
    Measurement

    Raises
    ------
    ValueError
        Bad prompts or presses (see :func:`prepare_documents`, :func:`prepare_presses`),
        a prompt shorter than a press needs or too long for the model context, ``T < 1``,
        ``replicates < 1``.
    kvdiverge.engine.core.errors.CompressionError
        A press that promises compression (``compression_ratio > 0``) but does not keep
        the promised number of positions. A press that promises nothing and leaves the
        cache whole runs and is reported (``summary['untouched']``, and a warning).
    """
    from tqdm.auto import tqdm

    from kvdiverge.estimation import tables
    from kvdiverge.engine.runner import plan_documents, run_documents
    from kvdiverge.engine.core.coupled import to_frame

    T, R = int(max_new_tokens), int(replicates)
    if T < 1 or R < 1:
        raise ValueError(f"max_new_tokens and replicates must be >= 1, got {T} and {R}")
    documents = prepare_documents(prompts, tokenizer, instruction=instruction, system=system)
    grid = None
    if ratios or budgets:
        presses, grid = frontier_presses(presses, list(ratios or ()), list(budgets or ()))
    sources = prepare_presses(presses)
    try:
        from kvdiverge.study.models import context_length

        context = context_length(model)
    except (ValueError, AttributeError):
        context = None
    check_lengths(documents, sources, T, context)
    refuse_on(model, sources)
    if model_name is None:
        path = str(getattr(getattr(model, "config", None), "name_or_path", "") or "model")
        model_name = os.path.basename(path.rstrip("/")) or "model"
    floors = [n for n, s in sources.items() if is_noise_floor(n, s)]

    # one plan for every press: the free memory is read once, so B does not depend on a press's place
    B = plan_documents(model, documents, T=T, replicates=R, batch_documents=batch_documents,
                       memory_budget_gb=memory_budget_gb)
    records = []
    for name, source in sources.items():
        with tqdm(total=len(documents) * (2 * T - 1), desc=name, unit="step", disable=not progress,
                  mininterval=1.0) as bar:
            recs = run_documents(model, documents, source, T=T, replicates=R, temperature=float(temperature),
                                 top_p=float(top_p), seed=int(seed), model_name=model_name, eos_ids=eos_ids,
                                 progress=bar, batch_documents=B)
        records += [{"model": model_name, "policy": name, "split": split, **r} for r in recs]
    trajectories = to_frame(records)
    reps, docs = tables.estimate(trajectories, int(window), windows)
    pooled = tables.pool(docs, int(bootstrap), float(confidence), int(seed))
    settings = {"model": model_name, "split": split, "T": T, "R": R, "temperature": float(temperature),
                "top_p": float(top_p), "seed": int(seed), "window": int(window), "bootstrap": int(bootstrap),
                "confidence": float(confidence), "instruction": instruction, "system": system,
                "presses": {n: _describe(s) for n, s in sources.items()}}
    if grid is not None:
        settings["frontier"] = grid
    result = Measurement(trajectories=trajectories, replicates=reps, documents=docs, settings=settings,
                         noise_floor=floors[0] if floors else None, batch_documents=B, **pooled)
    untouched = result.summary.filter(pl.col("untouched"))["policy"].to_list()
    for name in (n for n in untouched if n not in floors):  # the floor keeps every position by design
        warnings.warn(f"press {name!r} left the cache untouched (kept every prompt position on every prompt)",
                      stacklevel=2)
    return result


def _describe(source: PressSource) -> str | dict[str, Any]:
    """A policy for the settings record: its config entry, or the press object's repr."""
    if isinstance(source, PressPolicy):
        return repr(source.press)
    if isinstance(source, Policy):
        spec = {"press": source.press, "compression_ratio": source.compression_ratio, "budget": source.budget,
                **source.params}
        return {k: v for k, v in spec.items() if v is not None}
    return repr(source)
