"""The prediction study's inputs (:mod:`kvdiverge.estimation.prediction`): the fidelity side's measures
per point and document (:func:`~kvdiverge.estimation.prediction_inputs.fidelity_documents`) and the frontier's
points with the compression
ratio in KV bytes (:func:`~kvdiverge.estimation.prediction_inputs.frontier_points_table`), from the workflow's
tables; what is refused before
any statistic (:func:`~kvdiverge.estimation.prediction_inputs.prediction_problems`,
:func:`~kvdiverge.estimation.prediction_inputs.full_accuracy_problem`:
one sentence each, :class:`~kvdiverge.estimation.prediction_inputs.PredictionInputError`).
"""

from __future__ import annotations

from collections.abc import Sequence

import polars as pl

from kvdiverge.estimation.teacher_forced import document_table

__all__ = [
    "RECONSTRUCTION_PREFIX",
    "PredictionInputError",
    "fidelity_documents",
    "frontier_points_table",
    "full_accuracy_problem",
    "measure_problems",
    "prediction_problems",
    "survival_columns",
]


class PredictionInputError(ValueError):
    """Input the predictive analysis cannot use, in one sentence per problem."""


_KEYS = ["policy", "doc_id"]
#: The prefix of a measure of the reconstruction pass (``reconstruction_kld_mean``,
#: :func:`kvdiverge.jobs.prediction.reconstruction_config`).
RECONSTRUCTION_PREFIX = "reconstruction_"


def survival_columns(T: int) -> list[str]:
    """The survival columns of :func:`fidelity_documents` at horizon ``T``: ``S_1`` to ``S_<T>``."""
    return [f"S_{t}" for t in range(1, int(T) + 1)]


def measure_problems(measures: Sequence[str], T: int, key: str = "prediction.measures") -> list[str]:
    """One sentence per fidelity measure the coupled run at horizon ``T`` cannot give: a survival
    ``S_<t>`` past the horizon (:func:`~kvdiverge.estimation.prediction_inputs.survival_columns`), named by its
    config ``key``."""
    have = set(survival_columns(T))
    return [
        f"{key}: {m!r} is the agreement chain's survival after {m[2:]} steps, past the horizon "
        f"decoding.max_new_tokens = {T}; allowed: S_1 to S_{T} (or raise the horizon)"
        for m in measures
        if m.startswith("S_") and m not in have
    ]


def fidelity_documents(
    estimates: pl.DataFrame,
    teacher: pl.DataFrame | None = None,
    positions: pl.DataFrame | None = None,
    *,
    reconstruction: pl.DataFrame | None = None,
) -> pl.DataFrame:
    """The fidelity side's measures per (``point``, ``doc_id``), from the workflow's tables.

    Parameters
    ----------
    estimates : polars.DataFrame
        The coupled run's per-document estimates (``results/analysis/documents.parquet``): ``policy``,
        ``doc_id``, ``T``, ``E_M``, ``p_div``, ``E_tau_div`` and ``S`` (list of ``T`` floats, the
        agreement chain's survival after steps ``1..T``).
    teacher : polars.DataFrame, optional
        The teacher-forced documents (``teacher_forced_documents.parquet``): ``policy``, ``doc_id``
        and a float column per measure (``kld_mean``, ``kld_max``, ``same_top_p``, ``ppl_ratio``,
        ...); every float column is joined, so a measure added to the table reaches the analysis.
    positions : polars.DataFrame, optional
        The teacher-forced positions (``results/teacher_forced/...``): ``policy``, ``doc_id`` and
        ``kld`` per position, for ``kld_p99``, each document's 99th percentile of the per-position
        KL divergence (linear interpolation between order statistics; llama.cpp's ``--kl-divergence``
        reports the same percentile pooled over positions).
    reconstruction : polars.DataFrame, optional
        The positions of the reconstruction pass (``results/teacher_forced_reconstruction/...``,
        :func:`kvdiverge.jobs.prediction.reconstruction_config`), the teacher-forced positions'
        columns: their document means (:func:`kvdiverge.estimation.teacher_forced.document_table`) and
        ``kld_p99``, each named ``reconstruction_<measure>``.

    Returns
    -------
    polars.DataFrame
        ``point`` (the policy), ``doc_id``, ``E_M``, ``p_div``, ``tau_first = E_tau_div + (1 -
        p_div)(T + 1)`` (steps; ``T + 1`` when the sides never diverge), ``S_<t>`` for ``t = 1..T``,
        the teacher-forced float columns and the reconstruction's (left joins: null where a
        document has none).
    """
    T = int(estimates["T"].max())
    out = estimates.select(
        *_KEYS,
        "E_M",
        "p_div",
        (pl.col("E_tau_div") + (1 - pl.col("p_div")) * (pl.col("T") + 1)).alias("tau_first"),
        *(pl.col("S").list.get(t - 1, null_on_oob=True).alias(c) for t, c in enumerate(survival_columns(T), 1)),
    )
    if teacher is not None:
        cols = [c for c, dtype in teacher.schema.items() if dtype.is_float() and c not in out.columns]
        out = out.join(teacher.select(*_KEYS, *cols), on=_KEYS, how="left")
    if positions is not None:
        out = out.join(_kld_p99(positions), on=_KEYS, how="left")
    if reconstruction is not None:
        means = document_table(reconstruction)
        cols = [c for c, dtype in means.schema.items() if dtype.is_float()]
        measures = means.select(*_KEYS, *cols).join(_kld_p99(reconstruction), on=_KEYS, how="left")
        out = out.join(
            measures.rename({c: f"{RECONSTRUCTION_PREFIX}{c}" for c in [*cols, "kld_p99"]}), on=_KEYS, how="left"
        )
    return out.rename({"policy": "point"}).sort("point", "doc_id")


def _kld_p99(positions: pl.DataFrame) -> pl.DataFrame:
    """Per (policy, doc_id), ``kld_p99``: the 99th percentile of the per-position KL divergence."""
    return positions.group_by(_KEYS).agg(pl.col("kld").quantile(0.99, interpolation="linear").alias("kld_p99"))


def frontier_points_table(frontier: pl.DataFrame) -> pl.DataFrame:
    """The frontier's points with the press left out together and the compression ratio in KV bytes.

    Parameters
    ----------
    frontier : polars.DataFrame
        One model's frontier table (``POINT_SCHEMA`` of :mod:`kvdiverge.estimation.frontier`: ``policy``,
        ``press``, ``cache``, ``kv_bytes_per_token``, ``retention``).

    Returns
    -------
    polars.DataFrame
        ``point``, ``press`` (the press; a quantized cache alone is its own group, by its label)
        and ``ratio = 1 - kv_bytes_per_token / full`` (the fraction of the full cache's KV bytes per
        prompt token the point removes; ``full`` from the full-precision points, bytes / retention).

    Raises
    ------
    PredictionInputError
        Without a full-precision point, or without the bytes (a frontier table made without the
        model's KV sizes).
    """
    if frontier["kv_bytes_per_token"].null_count() or frontier.filter(pl.col("cache").is_null()).is_empty():
        raise PredictionInputError(
            "the frontier table has no KV bytes per token at full precision: the compression ratio in bytes needs them"
        )
    plain = frontier.filter(pl.col("cache").is_null())
    full = float((plain["kv_bytes_per_token"] / plain["retention"]).median())
    return frontier.select(
        pl.col("policy").alias("point"),
        pl.coalesce("press", "cache").alias("press"),
        (1 - pl.col("kv_bytes_per_token") / full).alias("ratio"),
    )


# --------------------------------------------------------------------------- input checks


def full_accuracy_problem(side: pl.DataFrame, min_full_accuracy: float = 0.7) -> str | None:
    """The sentence refusing one task side (``task``, ``placement``, ``doc_id``, ``correct_full``)
    whose full cache answers fewer than ``min_full_accuracy`` of its documents, else None."""
    full = side.unique("doc_id")["correct_full"].cast(pl.Float64).mean()
    if full is not None and full >= min_full_accuracy:
        return None
    name, placement = side["task"][0], side["placement"][0]
    return (
        f"task {name} ({placement}): the full cache answers {full or 0:.0%} of the documents, below "
        f"{min_full_accuracy:.0%}: too few right answers to measure a press's drop"
    )


def prediction_problems(
    fidelity: pl.DataFrame,
    task: pl.DataFrame,
    points: pl.DataFrame,
    *,
    min_full_accuracy: float = 0.7,
    min_presses: int = 3,
) -> list[str]:
    """One sentence per reason the analysis cannot run on these tables; empty when it can.

    Refused: fidelity and task documents that overlap (a fidelity measure would have seen a task
    prompt), fewer than ``min_presses`` presses among the points (the held-out analysis leaves
    one out and fits on the rest), a task and placement whose full-cache accuracy is below
    ``min_full_accuracy`` (too few right answers for a press to lose), a point on one side only.
    Columns as :func:`kvdiverge.estimation.prediction.prediction_tables`.
    """
    problems = []
    shared = set(fidelity["doc_id"].unique().to_list()) & set(task["doc_id"].unique().to_list())
    if shared:
        problems.append(
            f"the fidelity and task documents overlap in {len(shared)} documents (e.g. {sorted(shared)[0]!r}): "
            "a fidelity measure must not see a task prompt"
        )
    presses = points["press"].unique().to_list()
    if len(presses) < min_presses:
        problems.append(
            f"the frontier has {len(presses)} presses ({', '.join(map(str, sorted(presses)))}); "
            f"leaving one press out needs at least {min_presses}"
        )
    for _, part in task.group_by(["task", "placement"], maintain_order=True):
        problems += [p for p in [full_accuracy_problem(part, min_full_accuracy)] if p]
    known = set(points["point"].to_list())
    for side, frame in (("fidelity", fidelity), ("task", task)):
        missing = sorted(known - set(frame["point"].unique().to_list()))
        if missing:
            problems.append(f"the {side} side has no documents at point {missing[0]!r} ({len(missing)} points missing)")
    return problems
