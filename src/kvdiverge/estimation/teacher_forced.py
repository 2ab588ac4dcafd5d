"""Teacher-forced fidelity statistics: llama.cpp's ``--kl-divergence`` blocks, per document and pooled.

The per-position values come from the engine's teacher-forced pass
(:mod:`kvdiverge.engine.llm.teacher`: a continuation fed to the full-cache and the
compressed-cache side, at temperature 1 on the raw logits). This module turns them into
the numbers ``llama-perplexity --kl-divergence`` prints (``tools/perplexity/perplexity.cpp``
of llama.cpp, function ``kl_divergence``), with its names, percentiles and standard errors:

- ``mean_and_uncertainty``: ``f = mean(x)``, ``se = sqrt((mean(x^2) - f^2) / (n - 1))``,
  and ``se = 0`` unless that variance is positive and ``n > 10``;
- ``covariance(a, b)``: ``(mean(ab) - mean(a) mean(b)) / (n - 1)``, 0 when ``n < 10``;
- ``PPL = exp(mean nll)`` ± ``PPL * se(nll)``; ``Cor(ln PPL(Q), ln PPL(base)) = cov / (se_Q se_base)``;
  ``ln(PPL(Q)/PPL(base))`` ± ``sqrt(se_Q^2 + se_base^2 - 2 cov)``, computed here as the se of
  the per-position differences ``nll_Q - nll_base`` (equal in exact arithmetic for ``n > 10``,
  and exactly 0 for equal sides where llama.cpp's form rounds to about 1e-8 or NaN);
  ``PPL(Q)/PPL(base) = exp(ln ratio)`` ± ratio times that; ``PPL(Q) - PPL(base)`` ± ``sqrt(u_Q^2 + u_base^2 - 2 PPL_Q PPL_base cov)``;
- KLD: mean ± se, maximum, the 99.9, 99, 95, 90 % percentiles, median, 10, 5, 1, 0.1 %,
  minimum (linear interpolation between order statistics: ``values[floor(f (n-1))]`` and
  the next, as llama.cpp's ``percentile``);
- Δp = ``Q(c) - P(c)``: mean ± se, the same percentiles plus 75 and 25 %; ``RMS Δp =
  sqrt(mean Δp^2)`` ± ``se(Δp^2) / (2 RMS)`` (0 when RMS is 0);
- ``Same top p`` = share of positions whose arg-max agree ± ``sqrt(p (1 - p) / (n - 1))``.

llama.cpp prints the blocks only from 100 positions on; they are computed here for any
``n >= 2`` (with ``se = 0`` up to ``n = 10``, as its formulas give). The pooled table adds
document-bootstrap percentile intervals (:mod:`kvdiverge.estimation.bootstrap`) for the
position-weighted means, and, for every policy, the noise-floor policy's statistics on the
same model and split beside it (``floor_*`` columns).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import polars as pl

from kvdiverge.estimation.bootstrap import Bootstrap, resample_counts
from kvdiverge.estimation.numeric import safe_divide

__all__ = [
    "DOCUMENT_SCHEMA",
    "HEADLINE",
    "LLAMA_LABELS",
    "POSITION_SCHEMA",
    "document_table",
    "format_llama",
    "kl_statistics",
    "mean_and_uncertainty",
    "summary_table",
    "with_teacher_columns",
]

#: Per-position values of the teacher-forced pass (``results/teacher_forced/.../positions``).
POSITION_SCHEMA: dict[str, Any] = {
    "model": pl.String,
    "policy": pl.String,
    "split": pl.String,
    "doc_id": pl.String,
    "position": pl.Int32,  # 0-based index of the fed token in the continuation
    "token": pl.Int64,  # the fed token c_i
    "continuation": pl.String,  # "corpus" (the text after the excerpt), "greedy" (full cache's arg-max), "prompt"
    "target": pl.String,  # "continuation" (tokens after the prompt) or "reconstruction" (the prompt's text, repeated)
    "one_forward": pl.Boolean,  # the fed tokens went in one forward (else token by token)
    "kld": pl.Float64,  # KL(P || Q), nats
    "delta_p": pl.Float64,  # Q(c_i) - P(c_i)
    "ll_ref": pl.Float64,  # log P(c_i), nats
    "ll_ev": pl.Float64,  # log Q(c_i), nats
    "top_ref": pl.Int64,
    "top_ev": pl.Int64,
    "same_top": pl.Boolean,
    "ll_short": pl.Float64,  # log P(c_i) of the full cache on the prompt's last tokens only, nats (null: not computed)
    "key": pl.Boolean,  # a key token (kvdiverge.estimation.key_tokens; null: not computed)
}

_KEYS = ["model", "policy", "split"]

#: Headline statistics: the per-document table's columns and the frontier's.
HEADLINE = ("kld_mean", "ppl_ratio", "ln_ppl_ratio", "same_top_p", "delta_p_mean", "delta_p_rms")

#: Per (model, policy, split, doc_id): the headline means of one document's positions.
DOCUMENT_SCHEMA: dict[str, Any] = {
    "model": pl.String,
    "policy": pl.String,
    "split": pl.String,
    "doc_id": pl.String,
    "continuation": pl.String,
    "target": pl.String,
    "one_forward": pl.Boolean,
    "n_positions": pl.Int64,
    "kld_mean": pl.Float64,
    "kld_max": pl.Float64,
    "ppl_ref": pl.Float64,
    "ppl_ev": pl.Float64,
    "ppl_ratio": pl.Float64,
    "ln_ppl_ratio": pl.Float64,
    "same_top_p": pl.Float64,
    "delta_p_mean": pl.Float64,
    "delta_p_rms": pl.Float64,
    "n_key": pl.Int64,  # key positions (null: not computed)
    "kld_key_mean": pl.Float64,  # mean KLD over the key positions (null: none)
    "same_top_p_key": pl.Float64,  # Same top p over the key positions (null: none)
}

_KLD_PCT = (("p999", 0.999), ("p99", 0.99), ("p95", 0.95), ("p90", 0.90))
_KLD_LOW = (("p10", 0.10), ("p05", 0.05), ("p01", 0.01), ("p001", 0.001))
_DP_PCT = (*_KLD_PCT, ("p75", 0.75))
_DP_LOW = (("p25", 0.25), *_KLD_LOW)

#: Column -> llama.cpp's label (``llama-perplexity --kl-divergence``'s final blocks).
LLAMA_LABELS: dict[str, str] = {
    "ppl_ev": "Mean PPL(Q)",
    "ppl_ref": "Mean PPL(base)",
    "ln_ppl_cor": "Cor(ln(PPL(Q)), ln(PPL(base)))",
    "ln_ppl_ratio": "Mean ln(PPL(Q)/PPL(base))",
    "ppl_ratio": "Mean PPL(Q)/PPL(base)",
    "ppl_diff": "Mean PPL(Q)-PPL(base)",
    "kld_mean": "Mean    KLD",
    "kld_max": "Maximum KLD",
    **{f"kld_{k}": f"{100 * f:4.1f}%   KLD" for k, f in (*_KLD_PCT, *_KLD_LOW)},
    "kld_median": "Median  KLD",
    "kld_min": "Minimum KLD",
    "delta_p_mean": "Mean    Δp",
    "delta_p_max": "Maximum Δp",
    **{f"delta_p_{k}": f"{100 * f:4.1f}%   Δp" for k, f in (*_DP_PCT, *_DP_LOW)},
    "delta_p_median": "Median  Δp",
    "delta_p_min": "Minimum Δp",
    "delta_p_rms": "RMS Δp    ",
    "same_top_p": "Same top p",
}


def mean_and_uncertainty(x: np.ndarray) -> tuple[float, float]:
    """llama.cpp's ``mean_and_uncertainty``: the mean and its standard error.

    ``se = sqrt((mean(x^2) - mean(x)^2) / (n - 1))`` when that variance is positive and
    ``n > 10``, else 0; ``(0, 0)`` for no values.
    """
    x = np.asarray(x, dtype=np.float64)
    n = x.size
    if n < 1:
        return 0.0, 0.0
    f = float(x.sum() / n)
    df = float((x * x).sum() / n - f * f)
    return f, math.sqrt(df / (n - 1)) if df > 0 and n > 10 else 0.0


def _covariance(a: np.ndarray, b: np.ndarray) -> float:
    """llama.cpp's ``covariance``: ``(mean(ab) - mean(a) mean(b)) / (n - 1)``, 0 when ``n < 10``."""
    n = a.size
    if n < 10:
        return 0.0
    return float(((a * b).sum() / n - (a.sum() / n) * (b.sum() / n)) / (n - 1))


def _percentile(sorted_values: np.ndarray, fraction: float) -> float:
    """llama.cpp's ``percentile``: linear interpolation at ``fraction * (n - 1)``."""
    if fraction <= 0:
        return float(sorted_values[0])
    if fraction >= 1:
        return float(sorted_values[-1])
    p = fraction * (sorted_values.size - 1)
    i = int(p)
    p -= i
    return float((1 - p) * sorted_values[i] + p * sorted_values[min(i + 1, sorted_values.size - 1)])


def _distribution(values: np.ndarray, prefix: str, upper, lower) -> dict[str, float]:
    """Maximum, upper percentiles, median, lower percentiles and minimum of ``values``."""
    v = np.sort(np.asarray(values, dtype=np.float64))
    out = {f"{prefix}_max": float(v[-1])}
    out.update({f"{prefix}_{k}": _percentile(v, f) for k, f in upper})
    out[f"{prefix}_median"] = float(np.median(v))
    out.update({f"{prefix}_{k}": _percentile(v, f) for k, f in lower})
    out[f"{prefix}_min"] = float(v[0])
    return out


def _perplexity_block(nll_ev: np.ndarray, nll_ref: np.ndarray) -> dict[str, float]:
    """PPL(Q), PPL(base), their correlation, ln ratio, ratio and difference, each ± se (llama.cpp)."""
    lq, se_q = mean_and_uncertainty(nll_ev)
    lb, se_b = mean_and_uncertainty(nll_ref)
    cov = _covariance(nll_ev, nll_ref)
    ppl_q, ppl_b = math.exp(lq), math.exp(lb)
    ratio_se = mean_and_uncertainty(nll_ev - nll_ref)[1]  # = sqrt(se_q^2 + se_b^2 - 2 cov) in exact arithmetic
    ratio = math.exp(lq - lb)
    u_q, u_b = ppl_q * se_q, ppl_b * se_b
    return {
        "ppl_ev": ppl_q,
        "ppl_ev_se": u_q,
        "ppl_ref": ppl_b,
        "ppl_ref_se": u_b,
        "ln_ppl_cor": cov / (se_q * se_b) if se_q > 0 and se_b > 0 else float("nan"),
        "ln_ppl_ratio": lq - lb,
        "ln_ppl_ratio_se": ratio_se,
        "ppl_ratio": ratio,
        "ppl_ratio_se": ratio * ratio_se,
        "ppl_diff": ppl_q - ppl_b,
        "ppl_diff_se": math.sqrt(max(u_q * u_q + u_b * u_b - 2.0 * ppl_q * ppl_b * cov, 0.0)),
    }


def kl_statistics(positions: pl.DataFrame) -> dict[str, float]:
    """llama.cpp's ``--kl-divergence`` statistics over the positions of one table.

    Parameters
    ----------
    positions : polars.DataFrame
        :data:`POSITION_SCHEMA` columns ``kld``, ``delta_p``, ``ll_ref``, ``ll_ev``,
        ``same_top`` (one model and policy; any number of documents, pooled by position).

    Returns
    -------
    dict of str to float
        ``n_positions``; the perplexity block (:data:`LLAMA_LABELS`: ``ppl_ev``, ``ppl_ref``,
        ``ln_ppl_cor``, ``ln_ppl_ratio``, ``ppl_ratio``, ``ppl_diff``, each but the
        correlation with ``*_se``); ``kld_mean``, ``kld_se`` and the KLD distribution;
        ``delta_p_mean``, ``delta_p_se``, the Δp distribution, ``delta_p_rms``,
        ``delta_p_rms_se``; ``same_top_p``, ``same_top_p_se``. Probabilities as fractions
        (llama.cpp prints Δp and Same top p in %).

    Raises
    ------
    ValueError
        If the table holds fewer than two positions.
    """
    n = positions.height
    if n < 2:
        raise ValueError(f"teacher-forced statistics need at least 2 positions, got {n}")
    kld = positions["kld"].to_numpy().astype(np.float64)
    dp = positions["delta_p"].to_numpy().astype(np.float64)
    out: dict[str, float] = {"n_positions": float(n)}
    out.update(_perplexity_block(-positions["ll_ev"].to_numpy(), -positions["ll_ref"].to_numpy()))
    out["kld_mean"], out["kld_se"] = mean_and_uncertainty(kld)
    out.update(_distribution(kld, "kld", _KLD_PCT, _KLD_LOW))
    out["delta_p_mean"], out["delta_p_se"] = mean_and_uncertainty(dp)
    out.update(_distribution(dp, "delta_p", _DP_PCT, _DP_LOW))
    mse, mse_se = mean_and_uncertainty(dp * dp)
    rms = math.sqrt(mse)
    out["delta_p_rms"], out["delta_p_rms_se"] = rms, (0.5 / rms * mse_se if rms > 0 else 0.0)
    same = float(positions["same_top"].cast(pl.Float64).mean())
    out["same_top_p"], out["same_top_p_se"] = same, math.sqrt(max(same * (1.0 - same), 0.0) / (n - 1))
    return out


def document_table(positions: pl.DataFrame) -> pl.DataFrame:
    """Per (model, policy, split, doc_id): the headline means of the document's positions.

    ``ppl_* = exp(mean nll)``, ``ln_ppl_ratio = mean(nll_ev - nll_ref)``, ``ppl_ratio =
    exp(ln_ppl_ratio)``, ``same_top_p`` a fraction, ``delta_p_rms = sqrt(mean Δp^2)``; over the key
    positions (:mod:`kvdiverge.estimation.key_tokens`) ``n_key``, ``kld_key_mean`` and ``same_top_p_key``,
    the two means null where the document has no key position (``n_key`` 0) and all three null where
    no key tokens were selected. Returns :data:`DOCUMENT_SCHEMA`, sorted by its keys (joins on
    ``doc_id`` with the estimates of the same model, policy and split).
    """
    if positions.is_empty():
        return pl.DataFrame(schema=DOCUMENT_SCHEMA)
    out = positions.group_by([*_KEYS, "doc_id"]).agg(
        pl.col("continuation").first(),
        pl.col("target").first(),
        pl.col("one_forward").all(),
        *_key_means(),
        pl.len().cast(pl.Int64).alias("n_positions"),
        pl.col("kld").mean().alias("kld_mean"),
        pl.col("kld").max().alias("kld_max"),
        (-pl.col("ll_ref")).mean().exp().alias("ppl_ref"),
        (-pl.col("ll_ev")).mean().exp().alias("ppl_ev"),
        (pl.col("ll_ref") - pl.col("ll_ev")).mean().alias("ln_ppl_ratio"),
        pl.col("same_top").cast(pl.Float64).mean().alias("same_top_p"),
        pl.col("delta_p").mean().alias("delta_p_mean"),
        (pl.col("delta_p") ** 2).mean().sqrt().alias("delta_p_rms"),
    )
    out = out.with_columns(pl.col("ln_ppl_ratio").exp().alias("ppl_ratio"))
    return out.select(list(DOCUMENT_SCHEMA)).cast(DOCUMENT_SCHEMA).sort([*_KEYS, "doc_id"])


def _key_means() -> list[pl.Expr]:
    """``n_key`` (null where ``key`` is), ``kld_key_mean`` and ``same_top_p_key`` (null over no key position)."""
    key = pl.col("key").fill_null(False)
    return [
        pl.when(pl.col("key").is_null().all()).then(None).otherwise(key.sum()).cast(pl.Int64).alias("n_key"),
        pl.col("kld").filter(key).mean().alias("kld_key_mean"),
        pl.col("same_top").filter(key).cast(pl.Float64).mean().alias("same_top_p_key"),
    ]


#: The key-token columns of the summary table, typed (they are null in every row of a run without key tokens).
_KEY_TYPES = {"n_key": pl.Int64, "n_documents_no_key": pl.Int64, "kld_key_mean": pl.Float64,
              "same_top_p_key": pl.Float64, "kld_key_mean_lo": pl.Float64, "kld_key_mean_hi": pl.Float64}  # fmt: skip


def _key_statistics(positions: pl.DataFrame) -> dict[str, Any]:
    """A run's key-token columns: ``n_key`` (None where no key tokens were selected), ``n_documents_no_key``,
    ``kld_key_mean`` and ``same_top_p_key`` pooled over every key position (None where there is none)."""
    docs = positions.group_by("doc_id").agg(*_key_means()[:1])
    if docs["n_key"].is_null().all():
        return {"n_key": None, "n_documents_no_key": None, "kld_key_mean": None, "same_top_p_key": None}
    keyed = positions.filter(pl.col("key").fill_null(False))
    return {
        "n_key": keyed.height,
        "n_documents_no_key": int((docs["n_key"].fill_null(0) == 0).sum()),
        "kld_key_mean": float(keyed["kld"].mean()) if keyed.height else None,
        "same_top_p_key": float(keyed["same_top"].cast(pl.Float64).mean()) if keyed.height else None,
    }


#: Position-weighted means with document-bootstrap intervals: column -> (per-position expression, transform).
_BOOTSTRAPPED = {
    "kld_mean": (pl.col("kld"), None),
    "ln_ppl_ratio": (pl.col("ll_ref") - pl.col("ll_ev"), None),
    "ppl_ratio": (pl.col("ll_ref") - pl.col("ll_ev"), np.exp),
    "same_top_p": (pl.col("same_top").cast(pl.Float64), None),
    "delta_p_mean": (pl.col("delta_p"), None),
    "delta_p_rms": (pl.col("delta_p") ** 2, np.sqrt),
}


def _bootstrap_intervals(positions: pl.DataFrame, boot: Bootstrap, purpose) -> dict:
    """``{column}_lo`` / ``{column}_hi``: percentile intervals of the position-weighted means over documents.

    Documents are resampled with replacement (:meth:`kvdiverge.estimation.bootstrap.Bootstrap.indices`,
    purpose ``("teacher_forced", model, policy, split)``); a resample's mean is its positions'
    sum over its positions' count, so long and short continuations weigh as in the pooled mean.
    """
    per_doc = (
        positions.group_by("doc_id", maintain_order=True)
        .agg(pl.len().cast(pl.Float64).alias("_n"), *[e.sum().alias(k) for k, (e, _) in _BOOTSTRAPPED.items()])
        .sort("doc_id")
    )
    counts = resample_counts(boot.indices(per_doc.height, "teacher_forced", *purpose))
    den = counts @ per_doc["_n"].to_numpy()
    out = {}
    for key, (_, transform) in _BOOTSTRAPPED.items():
        means = (counts @ per_doc[key].to_numpy()) / den
        lo, hi = boot.interval(transform(means) if transform else means)
        out[f"{key}_lo"], out[f"{key}_hi"] = float(lo), float(hi)
    if positions["key"].fill_null(False).any():  # the same resamples; one without a key position is left out
        key = pl.col("key").fill_null(False)
        sums = positions.group_by("doc_id").agg(key.sum().cast(pl.Float64).alias("n"), pl.col("kld").filter(key).sum())
        sums = sums.sort("doc_id")
        means = safe_divide(counts @ sums["kld"].to_numpy(), counts @ sums["n"].to_numpy())
        lo, hi = boot.interval(means)
        out["kld_key_mean_lo"], out["kld_key_mean_hi"] = float(lo), float(hi)
    else:
        out["kld_key_mean_lo"] = out["kld_key_mean_hi"] = None
    return out


def summary_table(positions: pl.DataFrame, *, floor: str | None = None, boot: Bootstrap = Bootstrap()) -> pl.DataFrame:
    """The ``teacher_forced`` table: per (model, policy, split), llama.cpp's statistics and bootstrap intervals.

    Parameters
    ----------
    positions : polars.DataFrame
        :data:`POSITION_SCHEMA` rows of any number of models, policies and splits.
    floor : str or None
        The noise-floor policy's name: each row gets its statistics on the same model and
        split as ``floor_kld_mean``, ``floor_kld_se``, ``floor_ppl_ratio``, ``floor_same_top_p``,
        ``floor_delta_p_rms``, ``floor_kld_key_mean`` (null where it did not run).
    boot : kvdiverge.estimation.bootstrap.Bootstrap
        Document-bootstrap resamples, coverage and master seed (``analysis.bootstrap``,
        ``analysis.confidence``, ``seed``); ``n_boot = 0`` leaves the intervals out.

    Returns
    -------
    polars.DataFrame
        One row per (model, policy, split): ``target``, ``n_documents``, :func:`kl_statistics`'s
        columns; the key tokens' (:mod:`kvdiverge.estimation.key_tokens`) ``n_key`` (key positions),
        ``n_documents_no_key`` (documents without one), ``kld_key_mean`` and ``same_top_p_key`` over
        every key position (all null where no key tokens were selected; the means null where no
        position is key); ``{mean}_lo`` / ``{mean}_hi`` for ``kld_mean``, ``ln_ppl_ratio``,
        ``ppl_ratio``, ``same_top_p``, ``delta_p_mean``, ``delta_p_rms``, ``kld_key_mean``; the floor's columns.
    """
    rows = []
    for key, part in positions.group_by(_KEYS, maintain_order=True):
        row: dict[str, Any] = dict(zip(_KEYS, key))
        row["target"] = part["target"][0]
        row["n_documents"] = part["doc_id"].n_unique()
        row.update(kl_statistics(part))
        row.update(_key_statistics(part))
        if boot.n_boot > 0:
            row.update(_bootstrap_intervals(part, boot, key))
        rows.append(row)
    if not rows:
        return pl.DataFrame(schema={k: pl.String for k in _KEYS})
    table = pl.DataFrame(rows)
    table = table.cast({k: t for k, t in _KEY_TYPES.items() if k in table.columns}).sort(_KEYS)
    if floor is None or table.is_empty():
        return table
    cols = ["kld_mean", "kld_se", "ppl_ratio", "same_top_p", "delta_p_rms", "kld_key_mean"]
    beside = table.filter(pl.col("policy") == floor).select(
        "model", "split", *[pl.col(c).alias(f"floor_{c}") for c in cols]
    )
    return table.join(beside, on=["model", "split"], how="left")


def format_llama(stats: dict[str, float]) -> str:
    """The statistics as llama.cpp prints its three final blocks (Δp and Same top p in %)."""
    s = stats
    lines = ["====== Perplexity statistics ======"]
    for key in ("ppl_ev", "ppl_ref"):
        lines.append(f"{LLAMA_LABELS[key]:<30}: {s[key]:10.6f} ± {s[key + '_se']:10.6f}")
    lines.append(f"{LLAMA_LABELS['ln_ppl_cor']}: {100.0 * s['ln_ppl_cor']:6.2f}%")
    for key in ("ln_ppl_ratio", "ppl_ratio", "ppl_diff"):
        lines.append(f"{LLAMA_LABELS[key]:<30}: {s[key]:10.6f} ± {s[key + '_se']:10.6f}")
    lines += ["", "====== KL divergence statistics ======"]
    lines.append(f"{LLAMA_LABELS['kld_mean']}: {s['kld_mean']:10.6f} ± {s['kld_se']:10.6f}")
    for key in ("max", *[k for k, _ in _KLD_PCT], "median", *[k for k, _ in _KLD_LOW], "min"):
        lines.append(f"{LLAMA_LABELS['kld_' + key]}: {s['kld_' + key]:10.6f}")
    lines += ["", "====== Token probability statistics ======"]
    lines.append(f"{LLAMA_LABELS['delta_p_mean']}: {100 * s['delta_p_mean']:6.3f} ± {100 * s['delta_p_se']:5.3f} %")
    for key in ("max", *[k for k, _ in _DP_PCT], "median", *[k for k, _ in _DP_LOW], "min"):
        lines.append(f"{LLAMA_LABELS['delta_p_' + key]}: {100 * s['delta_p_' + key]:6.3f}%")
    lines.append(f"{LLAMA_LABELS['delta_p_rms']}: {100 * s['delta_p_rms']:6.3f} ± {100 * s['delta_p_rms_se']:5.3f} %")
    lines.append(f"{LLAMA_LABELS['same_top_p']}: {100 * s['same_top_p']:6.3f} ± {100 * s['same_top_p_se']:5.3f} %")
    return "\n".join(lines)


def with_teacher_columns(table: pl.DataFrame, teacher: pl.DataFrame | None) -> pl.DataFrame:
    """``table`` (keyed by ``model``, ``policy`` and, if present in both, ``split``) with the teacher-forced
    headline columns of :func:`summary_table` joined on the left (frontier points, summaries).

    Adds ``kld_mean``, ``kld_mean_lo``, ``kld_mean_hi``, ``ppl_ratio``, ``same_top_p``,
    ``delta_p_rms`` and ``floor_kld_mean`` (those ``teacher`` holds), prefixed ``tf_`` where
    ``table`` has a column of that name already; ``teacher`` None or empty returns ``table``
    unchanged.
    """
    if teacher is None or teacher.is_empty():
        return table
    keys = [k for k in _KEYS if k in table.columns and k in teacher.columns]
    wanted = ["kld_mean", "kld_mean_lo", "kld_mean_hi", "ppl_ratio", "same_top_p", "delta_p_rms", "floor_kld_mean"]
    cols = [c for c in wanted if c in teacher.columns]
    right = teacher.select(*keys, *[pl.col(c).alias(f"tf_{c}" if c in table.columns else c) for c in cols])
    return table.join(right, on=keys, how="left")
