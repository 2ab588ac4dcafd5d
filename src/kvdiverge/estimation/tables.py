"""The table stages as functions: trajectory rows -> estimates -> pooled tables and gaps.

One path for both doors: the workflow's scripts (``workflow/scripts/estimate.py``,
``pool.py``, ``gaps.py``) and :func:`kvdiverge.measure` call these functions, so the
tables under ``results/estimates`` and ``results/analysis`` and those of a
:class:`kvdiverge.doors.results.Measurement` cannot drift apart.

- :func:`estimate` — per replicate and per document (estimators.md §3–§6).
- :func:`pool` — pooled estimates, timing, survival, branch TV and variance tables (§7).
- :func:`gaps` — the §7 gap decomposition of each requested pair of policies.
- :func:`press_gap`, :func:`pairwise_gaps`, :func:`summary_table` — the gaps and summary of a
  :class:`kvdiverge.doors.results.Measurement`.

Column names and units: :mod:`kvdiverge.estimation.estimators`, :mod:`kvdiverge.estimation.timing`,
:mod:`kvdiverge.estimation.gap`, :mod:`kvdiverge.estimation.floor`, ``docs/internals.md``.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence

import polars as pl
from tqdm.auto import tqdm

from kvdiverge.estimation.bootstrap import Bootstrap, interval_columns
from kvdiverge.estimation.estimators import document_estimates, replicate_estimates
from kvdiverge.estimation.floor import floor_differences
from kvdiverge.estimation.gap import GAP_SCHEMA, gap_decomposition
from kvdiverge.estimation.pooling import branch_tv_curve, pooled_estimates, survival_curve
from kvdiverge.estimation.timing import timing_table, variance_table

__all__ = [
    "POOL_TABLES",
    "compression_table",
    "estimate",
    "gaps",
    "pairwise_gaps",
    "pool",
    "press_gap",
    "press_summary",
    "summary_table",
]

log = logging.getLogger(__name__)

#: Tables :func:`pool` returns, by name (``results/analysis/{name}.parquet``).
POOL_TABLES = ("pooled", "timing", "survival", "branch_tv", "variance")


def estimate(
    trajectories: pl.DataFrame, window: int, windows: Mapping[str, Sequence[int]] | None = None, progress: bool = False
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Per-replicate and per-document estimates of trajectory rows.

    Parameters
    ----------
    trajectories : polars.DataFrame
        Rows in the shard schema (:data:`kvdiverge.estimation.schema.TRAJECTORY_SCHEMA`), any
        number of runs ``(model, policy, split)`` and documents.
    window : int
        ``W``, the divergence-aligned window width (lags, steps); config ``window``.
    windows : mapping of str to (a, b), optional
        Named lag windows of the §6 branch-aligned TV (the workflow passes the
        confirmatory ``early`` and ``late``); each adds ``btv_<name>`` columns.
    progress : bool
        tqdm bar over replicate rows (stderr).

    Returns
    -------
    replicates : polars.DataFrame
        :func:`kvdiverge.estimation.estimators.replicate_estimates`, one row per (run, document, replicate).
    documents : polars.DataFrame
        :func:`kvdiverge.estimation.estimators.document_estimates`, one row per (run, document).

    Raises
    ------
    ValueError
        If the rows break the shard contract, or ``window < 0``.
    kvdiverge.estimation.decomposition.DecompositionError
        If the §3 identity fails for a document (a bug, never noise).
    """
    reps = replicate_estimates(trajectories, int(window), progress=progress)
    docs = document_estimates(reps, dict(windows or {}))
    return reps, docs


def pool(documents: pl.DataFrame, boot: Bootstrap) -> dict[str, pl.DataFrame]:
    """Pooled tables of per-document estimates, with document-bootstrap intervals.

    Parameters
    ----------
    documents : polars.DataFrame
        Per-document estimates (:func:`estimate`), any number of runs.
    boot : kvdiverge.estimation.bootstrap.Bootstrap
        Resamples (config ``analysis.bootstrap``), coverage (``analysis.confidence``) and
        master seed (``seed``); each run's resamples derive from (seed, table, model, policy, split).

    Returns
    -------
    dict of str to polars.DataFrame
        Keys :data:`POOL_TABLES`: ``pooled``
        (:func:`kvdiverge.estimation.pooling.pooled_estimates`, one row per run), ``timing``
        (:func:`kvdiverge.estimation.timing.timing_table`), ``survival`` (steps ``t = 0..T``),
        ``branch_tv`` (lags ``1..T``), ``variance``.

    Raises
    ------
    kvdiverge.estimation.decomposition.DecompositionError
        If the pooled §3 identity fails.
    """
    pooled = pooled_estimates(documents, boot)
    survival = survival_curve(documents, boot)
    branch = branch_tv_curve(documents, boot)
    return {
        "pooled": pooled,
        "timing": timing_table(pooled, survival),
        "survival": survival,
        "branch_tv": branch,
        "variance": variance_table(pooled),
    }


def gaps(
    documents: pl.DataFrame | None,
    pairs: Iterable[Sequence[str]],
    boot: Bootstrap,
    split: str = "exploratory",
    models: Iterable[str] | None = None,
    progress: bool = False,
) -> pl.DataFrame:
    """Gap decompositions ``A - B`` of each pair of policies, per model (§7).

    A pair whose two policies were not both run on ``split`` for a model is skipped with
    a warning (logged), never an error: configs may list gaps of policies run elsewhere.

    Parameters
    ----------
    documents : polars.DataFrame or None
        Per-document estimates (:func:`estimate`); None or empty gives an empty table.
    pairs : iterable of (str, str)
        Policy pairs ``(A, B)``.
    boot : kvdiverge.estimation.bootstrap.Bootstrap
        As in :func:`pool`; resamples are paired by document.
    split : str
        The split both policies ran on.
    models : iterable of str, optional
        Models to decompose for; default every model in ``documents``.
    progress : bool
        tqdm bar over (model, pair) jobs.

    Returns
    -------
    polars.DataFrame
        :func:`kvdiverge.estimation.gap.gap_decomposition` rows (4 per gap: ``delta``,
        ``first_mismatch``, ``exposure``, ``rate``; values in tokens), schema
        ``kvdiverge.estimation.gap.GAP_SCHEMA`` when empty.
    """
    have = documents is not None and documents.height > 0
    if models is None:
        models = documents["model"].unique(maintain_order=True).to_list() if have else []
    jobs = [(m, a, b) for m in models for a, b in pairs]
    frames = []
    for model, a, b in tqdm(jobs, desc="gaps", disable=not progress):
        ran = (
            set()
            if not have
            else set(
                documents.filter((pl.col("model") == model) & (pl.col("split") == split))["policy"].unique().to_list()
            )
        )
        if not {a, b} <= ran:
            log.warning("gap %s - %s skipped for %s: policy not run on the %s split", a, b, model, split)
            continue
        g = gap_decomposition(documents, model, a, b, split, boot)
        log.info("%s: %s - %s\n%s", model, a, b, g.select("term", "value", "value_lo", "value_hi", "share"))
        frames.append(g)
    return pl.concat(frames) if frames else pl.DataFrame(schema=GAP_SCHEMA)


def compression_table(documents: pl.DataFrame, trajectories: pl.DataFrame, point_masses: bool = False) -> pl.DataFrame:
    """Per policy and document: ``prompt_len``, ``kept_len`` (tokens), ``kept_fraction``, ``untouched``
    and ``no_divergence``.

    ``untouched``: the press left the cache as the full cache's, as far as the run can show it: it
    kept every prompt position and the evicted side's kernel equalled the reference side's, TV
    exactly 0 at every step of every replicate's chain, under a decoding whose kernels are not
    point masses. A press that keeps every prompt position but changes the cache (key channels),
    or that evicts while decoding, parts the chains and is not untouched. ``no_divergence``: TV
    exactly 0 at every step, yet not untouched: the press compressed, or the decoding is greedy,
    where TV 0 shows only that both arg-maxes agreed; the chains never parted under this decoding,
    which does not show that the cache was left as it was.

    Parameters
    ----------
    documents : polars.DataFrame
        Per-document estimates (:func:`estimate`).
    trajectories : polars.DataFrame
        The trajectory shards the estimates come from (their ``tv`` lists).
    point_masses : bool
        The decoding's kernels are point masses (greedy or top-k 1:
        :attr:`kvdiverge.engine.core.sampling.Decoding.point_masses`), so TV is 0 or 1.
    """
    same = trajectories.group_by("policy", "doc_id").agg(
        pl.col("tv").list.eval(pl.element() == 0.0).list.all().all().alias("tv_zero")
    )
    untouched = pl.col("tv_zero") & (pl.col("kept_len") == pl.col("prompt_len")) & pl.lit(not point_masses)
    return (
        documents.select("policy", "doc_id", "prompt_len", "kept_len")
        .with_columns(
            (pl.col("kept_len") / pl.col("prompt_len")).alias("kept_fraction"),
        )
        .join(same, on=["policy", "doc_id"], how="left", maintain_order="left")
        .with_columns(untouched.alias("untouched"))
        .with_columns((pl.col("tv_zero") & ~pl.col("untouched")).alias("no_divergence"))
        .drop("tv_zero")
    )


def press_summary(
    pooled: pl.DataFrame,
    documents: pl.DataFrame,
    policies: Sequence[str],
    trajectories: pl.DataFrame,
    point_masses: bool = False,
) -> pl.DataFrame:
    """One row per policy, in the order of ``policies``: occurrence, timing, token loss, its
    decomposition and how much of the prompt cache the press kept.

    Parameters
    ----------
    pooled : polars.DataFrame
        The pooled table (:func:`pool`).
    documents : polars.DataFrame
        Per-document estimates (:func:`estimate`).
    policies : sequence of str
        Every policy of ``pooled``, in the order wanted.
    trajectories : polars.DataFrame
        The trajectory shards (for ``untouched``: :func:`compression_table`).
    point_masses : bool
        The decoding's kernels are point masses (:func:`compression_table`).

    Returns
    -------
    polars.DataFrame
        ``policy``, ``n_docs``, ``T``, ``R``, ``kept_fraction`` (mean over documents),
        ``untouched`` (on every document: :func:`compression_table`), ``no_divergence`` (TV exactly
        0 at every step on every document, yet not untouched), then ``p_div``, ``tau_mean``,
        ``E_L``, ``E_M`` each with ``_lo``/``_hi``, ``rho``, ``first_mismatch_term``,
        ``exposure_rate_term``, ``exposure_share``.
    """
    comp = (
        compression_table(documents, trajectories, point_masses)
        .group_by("policy")
        .agg(
            pl.col("kept_fraction").mean(),
            pl.col("untouched").all(),
            (pl.col("untouched") | pl.col("no_divergence")).all().alias("tv_zero"),
        )
        .with_columns((pl.col("tv_zero") & ~pl.col("untouched")).alias("no_divergence"))
    )
    stats = [c for m in ("p_div", "tau_mean", "E_L", "E_M") for c in interval_columns(m)]
    rest = [*stats, "rho", "first_mismatch_term", "exposure_rate_term", "exposure_share"]
    out = pooled.select(["policy", "n_docs", "T", "R", *rest]).join(comp, on="policy", how="left")
    order = {p: i for i, p in enumerate(policies)}
    out = out.sort(pl.col("policy").replace_strict(order, return_dtype=pl.Int64))
    return out.select(["policy", "n_docs", "T", "R", "kept_fraction", "untouched", "no_divergence", *rest])


def press_gap(
    documents: pl.DataFrame, presses: Sequence[str], a: str, b: str, boot: Bootstrap, split: str, model: str
) -> pl.DataFrame:
    """Gap decomposition ``A - B`` of the expected token loss of two measured presses, paired by prompt (§7).

    Parameters
    ----------
    documents : polars.DataFrame
        Per-document estimates (:func:`estimate`) of one model.
    presses : sequence of str
        The measured press names.
    a, b : str
        The two presses.
    boot : kvdiverge.estimation.bootstrap.Bootstrap
        The measurement's document bootstrap.
    split, model : str
        The measurement's split and model name.

    Returns
    -------
    polars.DataFrame
        Four rows (``term``: ``delta``, ``first_mismatch``, ``exposure``, ``rate``):
        ``value`` in tokens with its paired-bootstrap interval, ``share`` of the gap,
        ``value_M = value / T`` (:func:`kvdiverge.estimation.gap.gap_decomposition`).

    Raises
    ------
    ValueError
        If ``a`` or ``b`` is not a measured press, or ``a == b``.
    """
    for p in (a, b):
        if p not in presses:
            raise ValueError(f"unknown press {p!r}; measured: {list(presses)}")
    if a == b:
        raise ValueError("a gap needs two different presses")
    return gaps(documents, [(a, b)], boot, split=split, models=[model])


def pairwise_gaps(gap: Callable[[str, str], pl.DataFrame], presses: Sequence[str]) -> pl.DataFrame:
    """``gap(a, b)`` of every pair of ``presses``, ``a`` before ``b`` in their order, concatenated
    (an empty ``kvdiverge.estimation.gap.GAP_SCHEMA`` table for fewer than two)."""
    frames = [gap(a, b) for a, b in itertools.combinations(presses, 2)]
    return pl.concat(frames) if frames else pl.DataFrame(schema=GAP_SCHEMA)


def summary_table(
    pooled: pl.DataFrame,
    documents: pl.DataFrame,
    presses: Sequence[str],
    trajectories: pl.DataFrame,
    noise_floor: str | None = None,
    gap: Callable[[str, str], pl.DataFrame] | None = None,
    point_masses: bool = False,
) -> pl.DataFrame:
    """:func:`press_summary`, with each press's paired difference from the noise floor when one is measured.

    ``point_masses``: the decoding's kernels are point masses (greedy), so TV 0 calls no press
    untouched (:func:`compression_table`).

    With ``noise_floor`` (and ``gap(a, b)``, the gap of two presses: :func:`press_gap`), joins
    ``E_M_minus_floor`` and ``p_div_minus_floor`` (each with ``_lo``/``_hi``;
    ``kvdiverge.estimation.floor.floor_differences``), null on the floor's own row.
    """
    out = press_summary(pooled, documents, presses, trajectories, point_masses)
    if noise_floor is None:
        return out
    floor = floor_differences({p: None if p == noise_floor else gap(p, noise_floor) for p in presses})
    return out.join(floor, on="policy", how="left")
