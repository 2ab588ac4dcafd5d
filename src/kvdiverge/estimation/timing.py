"""The per-run tables read off the pooled estimates (``docs/estimators.md`` §5, exploratory split).

- :func:`~kvdiverge.estimation.timing.timing_table` — divergence timing per model and policy: occurrence ``p_div``,
  mean and median first-divergence step, exposure.
- :func:`~kvdiverge.estimation.timing.variance_table` — ``Var(N_naive) / Var(N_cmc)`` per run (§5).
"""

from __future__ import annotations

import numpy as np
import polars as pl

__all__ = ["timing_table", "variance_table"]


def timing_table(pooled: pl.DataFrame, survival: pl.DataFrame) -> pl.DataFrame:
    """Divergence timing per run: occurrence, mean and median first-divergence step.

    Parameters
    ----------
    pooled : polars.DataFrame
        :func:`kvdiverge.estimation.pooling.pooled_estimates` output.
    survival : polars.DataFrame
        :func:`kvdiverge.estimation.pooling.survival_curve` output.

    Returns
    -------
    polars.DataFrame
        model, policy, split, n_docs, T, ``p_div`` (+ interval), ``tau_mean`` (mean
        first-divergence step given divergence, steps; + interval), ``tau_median``
        (median of the pooled conditional law ``f_t / p_div``, steps; null without
        divergence), ``E_L`` (+ interval, steps), ``E_M``, ``exposure_share``.
    """
    med = []
    for key, g in survival.group_by(["model", "policy", "split"], maintain_order=True):
        g = g.sort("t")
        f = g["f"].to_numpy()
        p = f.sum()
        if p > 0:
            c = np.cumsum(f) / p
            tmed = int(g["t"][int(np.searchsorted(c, 0.5 - 1e-12))])
        else:
            tmed = None
        med.append({"model": key[0], "policy": key[1], "split": key[2], "tau_median": tmed})
    medf = pl.DataFrame(
        med, schema={"model": pl.String, "policy": pl.String, "split": pl.String, "tau_median": pl.Int32}
    )
    cols = [
        "model",
        "policy",
        "split",
        "n_docs",
        "T",
        "p_div",
        "p_div_lo",
        "p_div_hi",
        "tau_mean",
        "tau_mean_lo",
        "tau_mean_hi",
        "E_L",
        "E_L_lo",
        "E_L_hi",
        "E_M",
        "E_M_lo",
        "E_M_hi",
        "exposure_share",
    ]
    return pooled.select(cols).join(medf, on=["model", "policy", "split"], how="left")


def variance_table(pooled: pl.DataFrame) -> pl.DataFrame:
    """Naive vs conditional Monte Carlo variance per run (estimators.md §5).

    Returns
    -------
    polars.DataFrame
        model, policy, split, n_docs, R, ``var_N_naive``, ``var_N_cmc``,
        ``var_N_cmc_tv`` (mean within-document variances across replicates, tokens^2),
        ``var_ratio = var_N_naive / var_N_cmc``, ``var_ratio_tv``, ``var_ratio_median``,
        ``frac_cmc_dominates``.
    """
    return pooled.select(
        [
            "model",
            "policy",
            "split",
            "n_docs",
            "R",
            "var_N_naive",
            "var_N_cmc",
            "var_N_cmc_tv",
            "var_ratio",
            "var_ratio_tv",
            "var_ratio_median",
            "frac_cmc_dominates",
        ]
    )
