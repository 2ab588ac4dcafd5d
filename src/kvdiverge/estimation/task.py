"""Task accuracy beside the coupled measures, and whether the measures predict its loss.

Input is one row per (model, policy, split, doc_id) with the task's scores (``correct_full``:
the full cache's greedy answer is right, ``correct``: the press's is) and any number of
per-document *measure* columns: the coupled ones of :func:`task_documents` (``E_M``,
``p_div``, ``tau_first``, ``S_answer``) and any others joined on the same keys (e.g.
teacher-forced KL divergence, a perplexity ratio, same top-1), each oriented by
:func:`direction` (``+1``: a larger value predicts a worse answer).

- :func:`accuracy_table` — per run: full-cache accuracy, accuracy, drop, each with a
  document-bootstrap interval; documents the full cache fails are kept and counted
  (``n_full_failed``), broken (right under the full cache, wrong under the press) and
  fixed answers counted, and ``accuracy_kept``: the press's accuracy on the documents the
  full cache answers. The mean of each measure over the run's documents sits beside.
- :func:`correlation_table` — across the points (runs other than the controls), Spearman's
  rho and Kendall's tau (``scipy.stats``) between the accuracy drop and each measure's
  mean, with paired document-bootstrap intervals: every resample draws one set of
  documents and recomputes every point's drop and measure on it.
- :func:`auc_table` — per document: the ROC AUC of each measure (oriented by
  :data:`DIRECTIONS`) for separating answers a press breaks from those it keeps, over the
  (point, document) pairs whose full-cache answer is right; ``AUC = U / (n_broken n_kept)``
  with ``U`` the Mann-Whitney statistic (``scipy.stats.mannwhitneyu``; ties count one half),
  the interval from resampling documents with all their points.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
import polars as pl
from scipy import stats

from kvdiverge.estimation.bootstrap import Bootstrap, resample_counts

__all__ = ["DIRECTIONS", "MEASURES", "accuracy_table", "direction", "auc_table", "correlation_table", "task_documents"]

KEYS = ["model", "policy", "split", "doc_id"]
#: The coupled measures per document: expected mismatch fraction, divergence probability,
#: first-divergence step (``T + 1`` when the sides never diverge) and the agreement chain's
#: survival at the full cache's answer length.
MEASURES = ("E_M", "p_div", "tau_first", "S_answer")
#: +1: a larger value predicts a broken answer; -1: a smaller one does.
DIRECTIONS = {
    "E_M": 1,
    "p_div": 1,
    "tau_first": -1,
    "S_answer": -1,
    "same_top1": -1,
    "same_top_p": -1,
    "same_top_p_key": -1,
}


def direction(measure: str) -> int:
    """The sign that makes a measure grow with the damage it predicts.

    Parameters
    ----------
    measure : str
        A measure column: ``E_M``, ``p_div``, ``tau_first``, ``S_answer``, ``S_<t>`` (the
        agreement chain's survival after ``t`` steps), ``kld_mean``, ``same_top_p``, ...

    Returns
    -------
    int
        ``-1`` for the survival ``S_<t>`` and for the measures :data:`DIRECTIONS` marks ``-1``
        (a smaller value predicts a worse answer), ``+1`` otherwise.
    """
    if re.fullmatch(r"S_\d+", measure):
        return -1
    return int(DIRECTIONS.get(measure, 1))


def task_documents(answers: pl.DataFrame, estimates: pl.DataFrame, extra: pl.DataFrame | None = None) -> pl.DataFrame:
    """Scored answers joined with each document's coupled measures (and any ``extra`` columns).

    Parameters
    ----------
    answers : polars.DataFrame
        :data:`kvdiverge.data.tasks.answers.ANSWER_SCHEMA` rows.
    estimates : polars.DataFrame
        Document estimates (``T``, ``E_M``, ``p_div``, ``E_tau_div``: ``E[tau 1{tau <= T}]``).
    extra : polars.DataFrame, optional
        More measures per (model, policy, split, doc_id), e.g. the teacher-forced ones.

    Returns
    -------
    polars.DataFrame
        ``answers``' columns, ``E_M``, ``p_div``, ``tv_max`` (largest ``tv_t``), ``tau_first = E_tau_div + (1 - p_div)(T + 1)``
        (steps) and the ``extra`` columns (left join: null where missing).
    """
    est = estimates.select(
        *KEYS,
        "E_M",
        "p_div",
        "tv_max",
        (pl.col("E_tau_div") + (1 - pl.col("p_div")) * (pl.col("T") + 1)).alias("tau_first"),
    )
    out = answers.join(est, on=KEYS, how="inner")
    if extra is not None:
        out = out.join(extra, on=KEYS, how="left")
    return out.sort(KEYS)


def _interval(samples: np.ndarray, boot: Bootstrap) -> tuple[float, float]:
    lo, hi = boot.interval(samples)
    return float(lo), float(hi)


def _run_row(part: pl.DataFrame, measures: Sequence[str], boot: Bootstrap) -> dict:
    full = part["correct_full"].to_numpy().astype(float)
    mine = part["correct"].to_numpy().astype(float)
    model, split = part["model"][0], part["split"][0]
    idx = boot.indices(len(full), "task", model, split, len(full))
    row = {"model": model, "policy": part["policy"][0], "split": split, "n_docs": len(full)}
    for name, x in (("full_accuracy", full), ("accuracy", mine), ("drop", full - mine)):
        row[name] = float(x.mean())
        row[f"{name}_lo"], row[f"{name}_hi"] = _interval(x[idx].mean(axis=1), boot)
    kept = full == 1
    row["n_full_failed"] = int((~kept).sum())
    row["n_broken"] = int((kept & (mine == 0)).sum())
    row["n_fixed"] = int((~kept & (mine == 1)).sum())
    row["accuracy_kept"] = float(mine[kept].mean()) if kept.any() else float("nan")
    row["tv_max"] = float(part["tv_max"].max()) if "tv_max" in part.columns else float("nan")
    for m in measures:
        row[m] = float(np.nanmean(part[m].cast(pl.Float64).fill_null(np.nan).to_numpy()))
    return row


def accuracy_table(
    documents: pl.DataFrame,
    measures: Sequence[str] = MEASURES,
    boot: Bootstrap = Bootstrap(),
) -> pl.DataFrame:
    """Per run: accuracy, full-cache accuracy and drop with intervals, counts, measure means.

    Resamples (:class:`kvdiverge.estimation.bootstrap.Bootstrap` ``boot``) come from (seed,
    "task", model, split, number of documents), so runs on the same documents share them.
    Columns: ``model``, ``policy``, ``split``, ``n_docs``; ``full_accuracy``, ``accuracy``,
    ``drop`` (fractions of documents) each with ``_lo``, ``_hi``; ``n_full_failed``,
    ``n_broken``, ``n_fixed``, ``accuracy_kept``; one column per measure (its mean over the
    documents, NaN entries left out).
    """
    rows = [
        _run_row(part, measures, boot)
        for _, part in documents.sort(KEYS).group_by(["model", "split", "policy"], maintain_order=True)
    ]
    return pl.DataFrame(rows).sort(["model", "split", "policy"])


def _matrices(documents: pl.DataFrame, measures: Sequence[str]) -> tuple[list[str], list[str], dict[str, np.ndarray]]:
    """Points, documents common to all points, and (points, docs) arrays of drop and measures."""
    points = sorted(documents["policy"].unique().to_list())
    common = set.intersection(*(set(documents.filter(pl.col("policy") == p)["doc_id"]) for p in points))
    docs = sorted(common)
    part = documents.filter(pl.col("doc_id").is_in(docs)).sort(["policy", "doc_id"])
    shape = (len(points), len(docs))
    drop = part["correct_full"].cast(pl.Float64) - part["correct"].cast(pl.Float64)
    arrays = {"drop": drop.to_numpy().reshape(shape)}
    for m in measures:
        arrays[m] = part[m].cast(pl.Float64).fill_null(np.nan).to_numpy().reshape(shape)
    return points, docs, arrays


def _rank_correlations(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    ok = np.isfinite(x) & np.isfinite(y)
    if ok.sum() < 3 or np.ptp(x[ok]) == 0 or np.ptp(y[ok]) == 0:
        return float("nan"), float("nan")
    return float(stats.spearmanr(x[ok], y[ok]).statistic), float(stats.kendalltau(x[ok], y[ok]).statistic)


def _means(counts: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Resampled per-point means, (n_boot, points), finite entries only."""
    ok = np.isfinite(values)
    num = counts @ np.where(ok, values, 0.0).T
    den = counts @ ok.T.astype(float)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1), np.nan)


def _floor_band(documents: pl.DataFrame, floor: str | None, m: str, boot: Bootstrap, purpose: tuple) -> dict:
    part = documents.filter(pl.col("policy") == floor) if floor else documents.clear()
    if part.is_empty():
        return {"floor": float("nan"), "floor_lo": float("nan"), "floor_hi": float("nan")}
    x = part[m].cast(pl.Float64).fill_null(np.nan).to_numpy()
    idx = boot.indices(len(x), *purpose, len(x))
    lo, hi = _interval(np.nanmean(x[idx], axis=1), boot)
    return {"floor": float(np.nanmean(x)), "floor_lo": lo, "floor_hi": hi}


def correlation_table(
    documents: pl.DataFrame,
    measures: Sequence[str] = MEASURES,
    controls: Sequence[str] = (),
    floor: str | None = None,
    boot: Bootstrap = Bootstrap(),
) -> pl.DataFrame:
    """Across points: Spearman's rho and Kendall's tau of the accuracy drop with each measure.

    Parameters
    ----------
    documents : polars.DataFrame
        :func:`task_documents` rows (any measure columns).
    measures : sequence of str
        Measure columns to correlate.
    controls : sequence of str
        Policies left out of the points (the ``none`` control, the noise floor).
    floor : str, optional
        The noise floor's policy: its mean of each measure, with an interval, is the
        ``floor`` band of the figure.
    boot : kvdiverge.estimation.bootstrap.Bootstrap
        Settings of the paired document bootstrap (purposes ``"task-correlation"`` and
        ``"task-floor"``).

    Returns
    -------
    polars.DataFrame
        One row per (model, split, measure): ``n_points``, ``n_docs`` (documents every point
        ran), ``spearman``, ``kendall`` each with ``_lo``, ``_hi`` (paired document bootstrap),
        ``floor``, ``floor_lo``, ``floor_hi``. NaN where a measure or the drop is constant.
    """
    rows = []
    for (model, split), part in documents.group_by(["model", "split"], maintain_order=True):
        points, docs, arr = _matrices(part.filter(~pl.col("policy").is_in(list(controls))), measures)
        idx = boot.indices(len(docs), "task-correlation", model, split)
        counts = resample_counts(idx)
        drop, drop_b = np.nanmean(arr["drop"], axis=1), _means(counts, arr["drop"])
        for m in measures:
            rho, tau = _rank_correlations(np.nanmean(arr[m], axis=1), drop)
            mb = _means(counts, arr[m])
            corr_b = np.array([_rank_correlations(mb[i], drop_b[i]) for i in range(len(idx))]).reshape(-1, 2)
            row = {"model": model, "split": split, "measure": m, "n_points": len(points), "n_docs": len(docs)}
            row.update(spearman=rho, kendall=tau)
            (row["spearman_lo"], row["kendall_lo"]), (row["spearman_hi"], row["kendall_hi"]) = (
                tuple(map(float, v)) for v in boot.interval(corr_b)
            )
            row.update(_floor_band(part, floor, m, boot, ("task-floor", model, split)))
            rows.append(row)
    return pl.DataFrame(rows)


def roc_auc(score: np.ndarray, broken: np.ndarray) -> float:
    """ROC AUC of ``score`` for ``broken`` (bool): ``U / (n_broken n_kept)``, ties one half; NaN without both classes.

    ``U`` is the Mann-Whitney statistic of the broken scores against the kept ones
    (``scipy.stats.mannwhitneyu``), the probability that a random broken answer scores above
    a random kept one.
    """
    ok = np.isfinite(score)
    pos, neg = score[ok & broken], score[ok & ~broken]
    if not len(pos) or not len(neg):
        return float("nan")
    return float(stats.mannwhitneyu(pos, neg, method="asymptotic").statistic / (len(pos) * len(neg)))


def auc_table(
    documents: pl.DataFrame,
    measures: Sequence[str] = MEASURES,
    controls: Sequence[str] = (),
    boot: Bootstrap = Bootstrap(),
) -> pl.DataFrame:
    """Per document: the ROC AUC of each measure for the answers a press breaks.

    Over the (point, document) pairs whose full-cache answer is right (controls left out);
    ``broken``: the press's answer is wrong. Each measure is oriented by :func:`direction`
    (``+1`` when absent), so 0.5 is chance and 1 a perfect separation. The interval resamples
    documents (with all their points; :class:`kvdiverge.estimation.bootstrap.Bootstrap` ``boot``,
    seed purpose ``"task-auc"``).

    Returns
    -------
    polars.DataFrame
        One row per (model, split, measure): ``n_pairs``, ``n_broken``, ``auc``, ``auc_lo``,
        ``auc_hi``, ``direction``.
    """
    rows = []
    for (model, split), part in documents.group_by(["model", "split"], maintain_order=True):
        part = part.filter(~pl.col("policy").is_in(list(controls)) & pl.col("correct_full")).sort(KEYS)
        docs = sorted(part["doc_id"].unique().to_list())
        where = {d: np.flatnonzero(part["doc_id"].to_numpy() == d) for d in docs}
        broken = ~part["correct"].to_numpy().astype(bool)
        idx = boot.indices(len(docs), "task-auc", model, split)
        for m in measures:
            sign = direction(m)
            score = sign * part[m].cast(pl.Float64).fill_null(np.nan).to_numpy()
            auc_b = []
            for draw in idx:
                rows_b = np.concatenate([where[docs[i]] for i in draw]) if len(draw) else np.zeros(0, int)
                auc_b.append(roc_auc(score[rows_b], broken[rows_b]))
            lo, hi = _interval(np.asarray(auc_b), boot)
            rows.append(
                {"model": model, "split": split, "measure": m, "n_pairs": len(score), "n_broken": int(broken.sum())}
                | {"auc": roc_auc(score, broken), "auc_lo": lo, "auc_hi": hi, "direction": sign}
            )
    return pl.DataFrame(rows)
