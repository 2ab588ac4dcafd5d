"""The gap decomposition (``docs/estimators.md`` §7, exploratory split).

:func:`~kvdiverge.estimation.gap.gap_decomposition` — the gap in expected token loss between two policies on the
same documents, split exactly into first-mismatch, exposure and rate terms
(:func:`~kvdiverge.estimation.gap.gap_terms`), each with its share of the gap and paired document-bootstrap intervals;
:data:`~kvdiverge.estimation.gap.GAP_SCHEMA`, the table's column types.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import polars as pl

from kvdiverge.estimation.bootstrap import Bootstrap, percentile_interval
from kvdiverge.estimation.decomposition import DECOMP_ATOL, DECOMP_RTOL, DecompositionError, rho
from kvdiverge.estimation.numeric import safe_divide

__all__ = ["GAP_COLUMNS", "GAP_SCHEMA", "TERMS", "gap_decomposition", "gap_terms"]


#: The pooled means of a policy that :func:`gap_terms` reads.
GAP_COLUMNS = ("p_div", "E_L", "E_N_post", "E_N")


def gap_terms(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The §7 two-factor symmetric split of ``Delta = E_A[N] - E_B[N]``.

    Elementwise on pooled means (floats or arrays of bootstrap resamples):
    ``rho = E[N_post] / E[L]`` (0 when ``E[L] = 0``, where ``E[N_post]`` is 0 too).

    Parameters
    ----------
    a, b : mapping of str to float or numpy.ndarray
        The pooled means of policies A and B, by :data:`GAP_COLUMNS`: ``p_div``, ``E_L``
        (steps), ``E_N_post``, ``E_N`` (tokens); arrays of one shape for resamples.

    Returns
    -------
    dict
        ``delta``, ``first_mismatch = Delta p_div``,
        ``exposure = Delta E[L] (rho_A + rho_B) / 2``,
        ``rate = (E_A[L] + E_B[L]) / 2 * Delta rho``, ``rho_A``, ``rho_B``.
    """
    pA, LA, NpA, NA = (np.asarray(a[c], dtype=np.float64) for c in GAP_COLUMNS)
    pB, LB, NpB, NB = (np.asarray(b[c], dtype=np.float64) for c in GAP_COLUMNS)
    rA, rB = np.asarray(rho(NpA, LA, 0.0)), np.asarray(rho(NpB, LB, 0.0))
    return {
        "delta": NA - NB,
        "first_mismatch": pA - pB,
        "exposure": (LA - LB) * (rA + rB) / 2,
        "rate": (LA + LB) / 2 * (rA - rB),
        "rho_A": rA,
        "rho_B": rB,
    }


TERMS = ("first_mismatch", "exposure", "rate")


def gap_decomposition(
    docs: pl.DataFrame, model: str, policy_a: str, policy_b: str, split: str, boot: Bootstrap
) -> pl.DataFrame:
    """Exact decomposition of a policy gap with paired document-bootstrap intervals (§7).

    Documents are paired by ``doc_id`` (inner join of the two policies' per-document
    estimates); each bootstrap resample draws documents with replacement and uses the same
    documents for both policies.

    Parameters
    ----------
    docs : polars.DataFrame
        Per-document estimates (:func:`kvdiverge.estimation.estimators.document_estimates`) holding
        at least the two runs ``(model, policy_a, split)`` and ``(model, policy_b, split)``.
    model, policy_a, policy_b, split : str
        The gap ``A - B``.
    boot : kvdiverge.estimation.bootstrap.Bootstrap
        Settings of the paired document bootstrap (purpose ``("gap", model, policy_a,
        policy_b, split)``).

    Returns
    -------
    polars.DataFrame
        One row per term (``delta``, ``first_mismatch``, ``exposure``, ``rate``): model,
        policy_a, policy_b, split, n_docs, T, ``term``, ``value`` (tokens), ``value_lo``,
        ``value_hi``, ``share`` (of ``delta``; 1 for ``delta``), ``share_lo``, ``share_hi``,
        ``value_M = value / T``, ``rho_A``, ``rho_B``.

    Raises
    ------
    ValueError
        If a run is missing or the two share no document.
    DecompositionError
        If the terms do not sum to the gap to float tolerance.
    """
    A, B, T = _paired_columns(docs, model, policy_a, policy_b, split)
    n = len(A["p_div"])
    point = _gap_means(A, B)
    total = point["first_mismatch"] + point["exposure"] + point["rate"]
    if not np.isclose(total, point["delta"], rtol=DECOMP_RTOL, atol=DECOMP_ATOL):
        raise DecompositionError(
            f"gap terms of {model} {policy_a} - {policy_b} sum to {total!r}, not Delta={point['delta']!r}"
        )
    resampled = _gap_means(A, B, boot.indices(n, "gap", model, policy_a, policy_b, split))
    head = {"model": model, "policy_a": policy_a, "policy_b": policy_b, "split": split, "n_docs": n, "T": T}
    return pl.DataFrame(_gap_rows(head, point, resampled, boot.confidence))


def _paired_columns(
    docs: pl.DataFrame, model: str, policy_a: str, policy_b: str, split: str
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], int]:
    """The two runs of a gap, paired by ``doc_id`` (:func:`gap_decomposition`).

    Returns
    -------
    A, B : dict of str to numpy.ndarray
        ``p_div``, ``E_L``, ``E_N_post``, ``E_N`` of policies A and B (float64, shape
        ``(n_docs,)``, documents in ``doc_id`` order, the same for both).
    T : int
        The horizon both runs share.

    Raises
    ------
    ValueError
        If a run is missing, the two share no document, or ``T`` differs.
    """
    cols = ["doc_id", "T", *GAP_COLUMNS]

    def run(policy: str) -> pl.DataFrame:
        d = docs.filter((pl.col("model") == model) & (pl.col("policy") == policy) & (pl.col("split") == split))
        if d.height == 0:
            raise ValueError(f"no per-document estimates for {model}/{policy}/{split}")
        return d.select(cols)

    j = run(policy_a).join(run(policy_b), on="doc_id", suffix="_B").sort("doc_id")
    if j.height == 0:
        raise ValueError(f"{policy_a} and {policy_b} share no document for {model}/{split}")
    T = int(j["T"][0])
    if not (j["T"] == T).all() or not (j["T_B"] == T).all():
        raise ValueError("gap decomposition needs one horizon T for both policies")
    A = {c: j[c].to_numpy().astype(np.float64) for c in cols[2:]}
    B = {c: j[c + "_B"].to_numpy().astype(np.float64) for c in cols[2:]}
    return A, B, T


def _gap_means(
    A: Mapping[str, np.ndarray], B: Mapping[str, np.ndarray], idx: np.ndarray | None = None
) -> dict[str, np.ndarray]:
    """:func:`gap_terms` of the document means of two paired runs.

    Returns
    -------
    dict
        :func:`gap_terms`' entries: scalars over all documents when ``idx`` is None, else
        arrays of shape ``(n_boot,)``, one per resample (row) of ``idx`` ``(n_boot, n_docs)``.
    """

    def m(x):
        return x.mean() if idx is None else x[idx].mean(axis=1)

    return gap_terms({c: m(A[c]) for c in GAP_COLUMNS}, {c: m(B[c]) for c in GAP_COLUMNS})


def _gap_rows(
    head: Mapping[str, Any], point: Mapping[str, np.ndarray], resampled: Mapping[str, np.ndarray], confidence: float
) -> list[dict[str, Any]]:
    """The rows of :func:`gap_decomposition`, from the point terms and their resamples.

    Returns
    -------
    list of dict
        One per term (``delta`` and :data:`TERMS`): ``head``'s entries (model, policy_a,
        policy_b, split, n_docs, T), then ``term``, ``value`` (+ ``_lo``, ``_hi``),
        ``share`` (+ ``_lo``, ``_hi``), ``value_M``, ``rho_A``, ``rho_B``.
    """
    rows = []
    for term in ("delta",) + TERMS:
        val = float(point[term])
        lo, hi = percentile_interval(resampled[term], confidence)
        sh_b = safe_divide(resampled[term], resampled["delta"], where=resampled["delta"] != 0)
        slo, shi = percentile_interval(sh_b, confidence)
        share = safe_divide(val, point["delta"], where=point["delta"] != 0)
        rows.append(
            {
                **head,
                "term": term,
                "value": val,
                "value_lo": float(lo),
                "value_hi": float(hi),
                "share": share,
                "share_lo": float(slo),
                "share_hi": float(shi),
                "value_M": val / head["T"],
                "rho_A": float(point["rho_A"]),
                "rho_B": float(point["rho_B"]),
            }
        )
    return rows


#: Column types of the gap table (also for an empty one).
GAP_SCHEMA = {
    "model": pl.String,
    "policy_a": pl.String,
    "policy_b": pl.String,
    "split": pl.String,
    "n_docs": pl.Int64,
    "T": pl.Int64,
    "term": pl.String,
    "value": pl.Float64,
    "value_lo": pl.Float64,
    "value_hi": pl.Float64,
    "share": pl.Float64,
    "share_lo": pl.Float64,
    "share_hi": pl.Float64,
    "value_M": pl.Float64,
    "rho_A": pl.Float64,
    "rho_B": pl.Float64,
}
