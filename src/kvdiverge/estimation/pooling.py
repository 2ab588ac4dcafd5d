"""Corpus-level pooling (``docs/estimators.md`` §7): equal-weight means over documents of the
per-document estimates (:func:`kvdiverge.estimation.estimators.document_estimates`), with
document-bootstrap percentile intervals (:mod:`kvdiverge.estimation.bootstrap`).

- :func:`~kvdiverge.estimation.pooling.pooled_estimates` — per run: the means, the §3 decomposition of ``E[M]``
  checked, the
  §4 sharp interval, the variance ratios (§5);
- :func:`~kvdiverge.estimation.pooling.survival_curve` — ``S_t`` and ``f_t`` per run with bands;
- :func:`~kvdiverge.estimation.pooling.branch_tv_curve` — the §6 branch-aligned TV by lag per run with bands.

Column names and units: :mod:`kvdiverge.estimation.estimators`.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from kvdiverge.estimation.bootstrap import Bootstrap, put_interval, resample_counts, resampled_nanmean
from kvdiverge.estimation.decomposition import check_decomposition, rho
from kvdiverge.estimation.estimators import RUN_KEYS, variance_ratio
from kvdiverge.estimation.intervals import sharp_interval
from kvdiverge.estimation.numeric import safe_divide

__all__ = ["POOLED_COLUMNS", "branch_tv_curve", "pooled_estimates", "survival_curve"]


#: Per-document columns pooled as equal-weight means over documents.
POOLED_COLUMNS = [
    "p_div",
    "E_tau_div",
    "E_L",
    "E_L_win",
    "E_L_tail",
    "E_N",
    "E_N_naive",
    "E_N_tv",
    "E_N_post",
    "E_N_win",
    "E_N_tail",
    "E_M",
    "tv_mean",
]


def pooled_estimates(docs: pl.DataFrame, boot: Bootstrap) -> pl.DataFrame:
    """Pooled per (model, policy, split): equal-weight means over documents (§7).

    Each mean gets a percentile document-bootstrap interval (``<col>_lo``, ``<col>_hi``);
    ``tv_mean`` is among them (mean chain TV per step), ``tv_max`` is the largest over
    documents (no interval).
    Also: ``rho = mean(E_N_post) / mean(E_L)``, ``tau_mean = mean(E_tau_div) /
    mean(p_div)`` (steps), the pooled §3 decomposition (``first_mismatch_term``,
    ``exposure_rate_term``, ``exposure_share``; checked), the §4 interval from the pooled
    means, and variance summaries: ``var_ratio = mean(var_N_naive) / mean(var_N_cmc)``
    (ratio of mean within-document variances), ``var_ratio_median`` (median of the
    per-document ratios) and ``frac_cmc_dominates`` (share of documents with
    ``var_N_cmc <= var_N_naive``).

    Parameters
    ----------
    docs : polars.DataFrame
        Output of :func:`~kvdiverge.estimation.estimators.document_estimates` (any number of runs).
    boot : kvdiverge.estimation.bootstrap.Bootstrap
        Resamples, coverage and master seed of the intervals; each run's resamples derive
        from (seed, "pooled", model, policy, split).

    Returns
    -------
    polars.DataFrame
        One row per run.

    Raises
    ------
    kvdiverge.estimation.decomposition.DecompositionError
        If the pooled identity fails.
    """
    rows = []
    for key, g in docs.group_by(RUN_KEYS, maintain_order=True):
        model, policy, split = key
        T = int(g["T"][0])
        if g["T"].n_unique() != 1:
            raise ValueError(f"{model}/{policy}/{split}: T varies across documents")
        n = g.height
        X = np.column_stack([g[c].to_numpy().astype(np.float64) for c in POOLED_COLUMNS])
        mean = X.mean(axis=0)
        B = resample_counts(boot.indices(n, "pooled", model, policy, split)) @ X / n
        lo, hi = boot.interval(B)
        r: dict = {
            "model": model,
            "policy": policy,
            "split": split,
            "n_docs": n,
            "T": T,
            "W": int(g["W"][0]),
            "R": int(g["R"].min()),
        }
        for j, c in enumerate(POOLED_COLUMNS):
            put_interval(r, c, mean[j], lo[j], hi[j])
        ci = {c: j for j, c in enumerate(POOLED_COLUMNS)}
        tau_b = safe_divide(B[:, ci["E_tau_div"]], B[:, ci["p_div"]])
        rho_b = rho(B[:, ci["E_N_post"]], B[:, ci["E_L"]])  # (n_boot,)
        put_interval(r, "rho", rho(r["E_N_post"], r["E_L"]), *boot.interval(rho_b))
        put_interval(r, "tau_mean", safe_divide(r["E_tau_div"], r["p_div"]), *boot.interval(tau_b))
        first, rate = check_decomposition(
            r["E_M"], r["p_div"], r["E_L"], r["E_N_post"], T, where=f"pooled {model}/{policy}/{split}"
        )
        r["first_mismatch_term"] = float(first)
        r["exposure_rate_term"] = float(rate)
        r["exposure_share"] = safe_divide(rate, r["E_M"])
        iv = sharp_interval(r["p_div"], r["E_N_win"], r["E_L_tail"], r["E_L"], T)
        r.update({"interval_" + k: v for k, v in iv.items()})
        vn = g["var_N_naive"].to_numpy().astype(np.float64)
        vc = g["var_N_cmc"].to_numpy().astype(np.float64)
        vt = g["var_N_cmc_tv"].to_numpy().astype(np.float64)
        r["var_N_naive"] = float(np.nanmean(vn)) if np.isfinite(vn).any() else float("nan")
        r["var_N_cmc"] = float(np.nanmean(vc)) if np.isfinite(vc).any() else float("nan")
        r["var_N_cmc_tv"] = float(np.nanmean(vt)) if np.isfinite(vt).any() else float("nan")
        r["var_ratio"] = variance_ratio(r["var_N_naive"], r["var_N_cmc"])
        r["var_ratio_tv"] = variance_ratio(r["var_N_cmc_tv"], r["var_N_cmc"])
        ratios = g["var_ratio"].to_numpy().astype(np.float64)
        fin = ratios[np.isfinite(ratios)]
        r["var_ratio_median"] = float(np.median(fin)) if fin.size else float("nan")
        ok = np.isfinite(vn) & np.isfinite(vc)
        r["frac_cmc_dominates"] = float(np.mean(vc[ok] <= vn[ok] + 1e-12)) if ok.any() else float("nan")
        r["tv_max"] = float(g["tv_max"].max())
        r["seconds"] = float(g["seconds"].sum())
        rows.append(r)
    return pl.DataFrame(rows, infer_schema_length=None)


def survival_curve(docs: pl.DataFrame, boot: Bootstrap) -> pl.DataFrame:
    """Mean survival ``S_t`` and divergence-time law ``f_t`` over documents, per run.

    The Kaplan–Meier-style curve of first divergence: per document ``S_t`` is the
    replicate mean of the chain survival (unbiased, §5), pooled with equal weight.
    Steps ``t = 0..T`` (``S_0 = 1``, ``f_0 = 0``).

    Parameters
    ----------
    docs : polars.DataFrame
        Output of :func:`~kvdiverge.estimation.estimators.document_estimates` (any number of runs).
    boot : kvdiverge.estimation.bootstrap.Bootstrap
        Settings of the document-bootstrap intervals (purpose ``"survival"``).

    Returns
    -------
    polars.DataFrame
        Columns model, policy, split, ``t`` (steps), ``S``, ``S_lo``, ``S_hi``, ``f``,
        ``f_lo``, ``f_hi``, ``n_docs``.
    """
    parts = []
    for key, g in docs.group_by(RUN_KEYS, maintain_order=True):
        model, policy, split = key
        T = int(g["T"][0])
        S = np.asarray(g["S"].to_list(), dtype=np.float64).reshape(g.height, T)
        f = np.asarray(g["f"].to_list(), dtype=np.float64).reshape(g.height, T)
        S = np.column_stack([np.ones(g.height), S])
        f = np.column_stack([np.zeros(g.height), f])
        counts = resample_counts(boot.indices(g.height, "survival", model, policy, split))
        Slo, Shi = boot.interval(counts @ S / g.height)
        flo, fhi = boot.interval(counts @ f / g.height)
        parts.append(
            pl.DataFrame(
                {
                    "model": [model] * (T + 1),
                    "policy": [policy] * (T + 1),
                    "split": [split] * (T + 1),
                    "t": np.arange(T + 1, dtype=np.int32),
                    "S": S.mean(axis=0),
                    "S_lo": Slo,
                    "S_hi": Shi,
                    "f": f.mean(axis=0),
                    "f_lo": flo,
                    "f_hi": fhi,
                    "n_docs": [g.height] * (T + 1),
                }
            )
        )
    return pl.concat(parts) if parts else pl.DataFrame()


def branch_tv_curve(docs: pl.DataFrame, boot: Bootstrap) -> pl.DataFrame:
    """Branch-aligned TV by lag since divergence (§6), pooled over documents per run.

    Per lag ``k``, the equal-weight mean over documents whose branches reached lag ``k``
    of the per-document ``btv_lag``, with a document-bootstrap interval.

    Parameters
    ----------
    docs : polars.DataFrame
        Output of :func:`~kvdiverge.estimation.estimators.document_estimates` (any number of runs).
    boot : kvdiverge.estimation.bootstrap.Bootstrap
        Settings of the document-bootstrap intervals (purpose ``"branch_tv"``).

    Returns
    -------
    polars.DataFrame
        Columns model, policy, split, ``lag`` (steps after divergence, 1..T), ``btv``,
        ``btv_lo``, ``btv_hi``, ``n_docs`` (documents reaching the lag).
    """
    import warnings

    parts = []
    for key, g in docs.group_by(RUN_KEYS, maintain_order=True):
        model, policy, split = key
        T = int(g["T"][0])
        V = np.asarray(g["btv_lag"].to_list(), dtype=np.float64).reshape(g.height, T)
        counts = resample_counts(boot.indices(g.height, "branch_tv", model, policy, split))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            mean = np.nanmean(V, axis=0)
            lo, hi = boot.interval(resampled_nanmean(counts, V))
        parts.append(
            pl.DataFrame(
                {
                    "model": [model] * T,
                    "policy": [policy] * T,
                    "split": [split] * T,
                    "lag": np.arange(1, T + 1, dtype=np.int32),
                    "btv": mean,
                    "btv_lo": lo,
                    "btv_hi": hi,
                    "n_docs": np.isfinite(V).sum(axis=0).astype(np.int32),
                }
            )
        )
    return pl.concat(parts) if parts else pl.DataFrame()
