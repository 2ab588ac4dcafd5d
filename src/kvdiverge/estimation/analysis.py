"""Exploratory and confirmatory analyses (``docs/estimators.md`` §7–§8).

Exploratory (exploratory split):

- :func:`timing_table` — divergence timing per model and policy: occurrence ``p_div``,
  mean and median first-divergence step, exposure.
- :func:`gap_decomposition` — the gap in expected token loss between two policies on the
  same documents, split exactly into first-mismatch, exposure and rate terms (§7), each
  with its share of the gap and paired document-bootstrap intervals.
- :func:`variance_table` — ``Var(N_naive) / Var(N_cmc)`` per run (§5).

Noise floor (every split that has policies):

- :func:`floor_comparison` — each policy next to the numerical noise-floor control
  (``PermutationPress``: equal kernels in exact arithmetic) on the documents both ran:
  ``p_div``, ``E[N]`` and mean TV per step with intervals, and whether the policy lies
  above the floor (paired document bootstrap of the difference).

Confirmatory (confirmatory split only, prespecified plan in config ``confirmatory``):

- :func:`validate_plan`, :func:`plan_hash` — the plan must be complete; its hash is
  printed in the report.
- :func:`confirmatory_analysis` — per model, per document ``d = btv[late] - btv[early]``
  (§6 branch-aligned TV), one-sided Wilcoxon signed-rank (scipy), Holm across models,
  paired mean difference with a bootstrap interval. Documents whose branches never reach
  a window are counted and reported. Refuses any split but ``confirmatory``. The
  noise floor's own late − early difference is reported beside it (outside the
  multiplicity family).

The HTML pages of the report are rendered in :mod:`kvdiverge.report.pages`.
"""

from __future__ import annotations

import hashlib
import json
import math
import warnings
from typing import Any, Mapping, Sequence

import numpy as np
import polars as pl
from scipy import stats

from kvdiverge.estimation.bootstrap import Bootstrap, interval_columns, percentile_interval, put_interval
from kvdiverge.estimation.decomposition import DECOMP_ATOL, DECOMP_RTOL, DecompositionError, rho
from kvdiverge.estimation.estimators import btv_window
from kvdiverge.estimation.numeric import safe_divide

__all__ = [
    "CONFIRMATORY_SPLIT",
    "GAP_COLUMNS",
    "PLAN_FIELDS",
    "PlanError",
    "FLOOR_METRICS",
    "confirmatory_analysis",
    "floor_comparison",
    "gap_decomposition",
    "gap_terms",
    "holm",
    "plan_hash",
    "timing_table",
    "validate_plan",
    "variance_table",
]

CONFIRMATORY_SPLIT = "confirmatory"

#: Fields a confirmatory plan must state (config ``confirmatory``).
PLAN_FIELDS = ("policy", "early", "late", "test", "alternative", "correction", "alpha")
TESTS = ("wilcoxon-signed-rank",)
ALTERNATIVES = ("greater", "less", "two-sided")
CORRECTIONS = ("holm", "bonferroni", "none")


class PlanError(ValueError):
    """The confirmatory plan is incomplete or invalid."""


# --------------------------------------------------------------------------- exploratory


def timing_table(pooled: pl.DataFrame, survival: pl.DataFrame) -> pl.DataFrame:
    """Divergence timing per run: occurrence, mean and median first-divergence step.

    Parameters
    ----------
    pooled : polars.DataFrame
        :func:`kvdiverge.estimation.estimators.pooled_estimates` output.
    survival : polars.DataFrame
        :func:`kvdiverge.estimation.estimators.survival_curve` output.

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


# --------------------------------------------------------------------------- confirmatory


def validate_plan(plan: Mapping[str, Any] | None) -> dict[str, Any]:
    """Check that the prespecified confirmatory plan states every field, with valid values.

    Parameters
    ----------
    plan : mapping
        Config section ``confirmatory``: ``policy``, ``early`` and ``late`` (``[a, b]``
        lag windows, steps after first divergence, ``1 <= a <= b``), ``test``
        (``wilcoxon-signed-rank``), ``alternative`` (greater | less | two-sided),
        ``correction`` (holm | bonferroni | none), ``alpha`` in (0, 1).

    Returns
    -------
    dict
        A plain copy of the plan.

    Raises
    ------
    PlanError
        Naming every missing field, or the first invalid one.
    """
    if not isinstance(plan, Mapping):
        raise PlanError(f"confirmatory plan must be a mapping with fields {list(PLAN_FIELDS)}, got {plan!r}")
    missing = [f for f in PLAN_FIELDS if plan.get(f) is None]
    if missing:
        raise PlanError(
            f"confirmatory plan lacks fields {missing}; a prespecified plan states all of {list(PLAN_FIELDS)}"
        )
    for name in ("early", "late"):
        w = plan[name]
        if (
            not isinstance(w, Sequence)
            or len(w) != 2
            or not all(isinstance(v, int) for v in w)
            or not 1 <= w[0] <= w[1]
        ):
            raise PlanError(f"confirmatory.{name} must be [a, b] with integers 1 <= a <= b, got {w!r}")
    if plan["test"] not in TESTS:
        raise PlanError(f"confirmatory.test must be one of {list(TESTS)}, got {plan['test']!r}")
    if plan["alternative"] not in ALTERNATIVES:
        raise PlanError(f"confirmatory.alternative must be one of {list(ALTERNATIVES)}, got {plan['alternative']!r}")
    if plan["correction"] not in CORRECTIONS:
        raise PlanError(f"confirmatory.correction must be one of {list(CORRECTIONS)}, got {plan['correction']!r}")
    alpha = plan["alpha"]
    if not isinstance(alpha, (int, float)) or not 0 < float(alpha) < 1:
        raise PlanError(f"confirmatory.alpha must be in (0, 1), got {alpha!r}")
    return json.loads(json.dumps(dict(plan)))


def plan_hash(plan: Mapping[str, Any]) -> str:
    """SHA-256 of the plan as canonical JSON (sorted keys, no spaces), hex.

    Parameters
    ----------
    plan : mapping
        Config section ``confirmatory``, exactly as given.

    Returns
    -------
    str
        64 hex digits; any change of the section changes it.
    """
    text = json.dumps(plan, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def holm(pvalues: Sequence[float], method: str = "holm") -> np.ndarray:
    """Multiplicity-adjusted p-values (Holm step-down, Bonferroni, or none).

    NaN entries (untested families) stay NaN and do not count in the family size.

    Parameters
    ----------
    pvalues : sequence of float
        Raw p-values.
    method : {"holm", "bonferroni", "none"}

    Returns
    -------
    numpy.ndarray
        Adjusted p-values, capped at 1.
    """
    p = np.asarray(pvalues, dtype=np.float64)
    out = np.full_like(p, np.nan)
    ok = np.flatnonzero(np.isfinite(p))
    m = ok.size
    if m == 0:
        return out
    if method == "none":
        out[ok] = p[ok]
    elif method == "bonferroni":
        out[ok] = np.minimum(1.0, p[ok] * m)
    elif method == "holm":
        order = ok[np.argsort(p[ok], kind="stable")]
        running = 0.0
        for i, j in enumerate(order):
            running = max(running, min(1.0, (m - i) * p[j]))
            out[j] = running
    else:
        raise ValueError(f"unknown correction {method!r}")
    return out


def _late_minus_early(
    g: pl.DataFrame,
    model: str,
    policy: str,
    split: str,
    plan: Mapping[str, Any],
    boot: Bootstrap,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One model's per-document ``d = btv[late] - btv[early]``, test and intervals (internal)."""
    g = g.sort("doc_id")
    early, late = _window_btv(g, plan)
    d = late - early
    ok = np.isfinite(d)
    per_doc = _per_document_rows(g["doc_id"].to_list(), model, policy, early, late, d, ok)
    du = d[ok]
    stat, p = float("nan"), float("nan")
    if du.size and np.any(du != 0):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = stats.wilcoxon(du, alternative=plan["alternative"], zero_method="wilcox")
        stat, p = float(res.statistic), float(res.pvalue)
    if du.size:
        resampled = du[boot.indices(du.size, "confirmatory", model, policy)]
        mlo, mhi = (float(v) for v in boot.interval(resampled.mean(axis=1)))
        dlo, dhi = (float(v) for v in boot.interval(np.median(resampled, axis=1)))
    else:
        mlo = mhi = dlo = dhi = float("nan")
    result = {
        "model": model,
        "policy": policy,
        "split": split,
        "n_docs": g.height,
        "n_no_early": int((~np.isfinite(early)).sum()),
        "n_no_late": int((~np.isfinite(late)).sum()),
        "n_excluded": int((~ok).sum()),
        "n_used": int(du.size),
        "n_zero": int((du == 0).sum()),
        "mean_diff": float(du.mean()) if du.size else float("nan"),
        "mean_diff_lo": mlo,
        "mean_diff_hi": mhi,
        "median_diff": float(np.median(du)) if du.size else float("nan"),
        "median_diff_lo": dlo,
        "median_diff_hi": dhi,
        "statistic": stat,
        "p_raw": p,
    }
    return result, per_doc


def _window_btv(g: pl.DataFrame, plan: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """Each document's §6 branch-aligned TV over the plan's early and late windows.

    Returns
    -------
    early, late : numpy.ndarray
        Shape ``(n_docs,)``, in the row order of ``g``; NaN where no branch reached the window.
    """
    (ea, eb), (la, lb) = plan["early"], plan["late"]
    early, late = [], []
    for num, den in zip(g["btv_num"].to_list(), g["btv_den"].to_list()):
        num, den = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
        early.append(btv_window(num, den, ea, eb)[0])
        late.append(btv_window(num, den, la, lb)[0])
    return np.asarray(early), np.asarray(late)


def _per_document_rows(
    doc_ids: Sequence[str],
    model: str,
    policy: str,
    early: np.ndarray,
    late: np.ndarray,
    d: np.ndarray,
    ok: np.ndarray,
) -> list[dict[str, Any]]:
    """The per-document rows of :func:`confirmatory_analysis` for one model and policy.

    Returns
    -------
    list of dict
        One per document: model, policy, doc_id, ``btv_early``, ``btv_late``, ``d`` (None
        where not ``ok``), ``reached_early``, ``reached_late``.
    """
    return [
        {
            "model": model,
            "policy": policy,
            "doc_id": doc,
            "btv_early": float(e),
            "btv_late": float(l_),
            "d": float(dd) if o else None,
            "reached_early": bool(np.isfinite(e)),
            "reached_late": bool(np.isfinite(l_)),
        }
        for doc, e, l_, dd, o in zip(doc_ids, early, late, d, ok)
    ]


#: Decision of the noise floor's row: reported beside the test, not part of its family.
FLOOR_DECISION = "floor (reference)"


def confirmatory_analysis(
    docs: pl.DataFrame,
    plan: Mapping[str, Any],
    split: str,
    boot: Bootstrap,
    floor: str | None = None,
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The prespecified confirmatory test of estimators.md §8.

    Per model, on the plan's policy: per document ``d = btv[late] - btv[early]`` from the
    §6 per-lag sums (``btv_num``, ``btv_den``); a Wilcoxon signed-rank test of
    ``median(d)`` in the plan's direction (``scipy.stats.wilcoxon``, zero differences
    dropped), the plan's correction across models, and the mean difference with a
    percentile document-bootstrap interval. Documents whose branches reach neither or
    only one window have no ``d``; they are counted (``n_no_early``, ``n_no_late``,
    ``n_excluded``) and listed, never silently dropped.

    With ``floor`` (the noise-floor policy, config ``runs.floor.policy``) present in
    ``docs``, the floor's own late − early difference is computed the same way, per
    model, and reported in rows with ``role = "floor"``: its p-value is not adjusted
    and its decision is ``FLOOR_DECISION`` (the plan's family holds the plan's
    policy only).

    Parameters
    ----------
    docs : polars.DataFrame
        Per-document estimates of the confirmatory runs.
    plan : mapping
        Config section ``confirmatory`` (validated here).
    split : str
        Must be ``"confirmatory"``.
    boot : kvdiverge.estimation.bootstrap.Bootstrap
        Settings of the document bootstrap of the mean and median difference (purpose
        ``("confirmatory", model, policy)``).
    floor : str, optional
        The noise-floor policy's name.

    Returns
    -------
    result : polars.DataFrame
        One row per model (plan's policy, ``role = "plan"``), then one per model for the
        floor (``role = "floor"``) when it ran: model, policy, split, ``n_docs``, ``n_no_early``,
        ``n_no_late``, ``n_excluded``, ``n_used``, ``n_zero``, ``mean_diff``,
        ``mean_diff_lo``, ``mean_diff_hi``, ``median_diff`` (+ ``_lo``, ``_hi``), ``statistic``, ``p_raw``,
        ``p_adjusted``, ``decision`` (reject | not rejected | not tested | floor), ``role``,
        and the plan (``test``, ``alternative``, ``correction``, ``alpha``, ``early``, ``late``,
        ``plan_hash``).
    per_doc : polars.DataFrame
        model, policy, doc_id, ``btv_early``, ``btv_late``, ``d`` (null when excluded),
        ``reached_early``, ``reached_late``.

    Raises
    ------
    ValueError
        If ``split`` is not the confirmatory split, or ``docs`` holds rows of another split.
    PlanError
        If the plan is incomplete or invalid.
    """
    _check_confirmatory_split(docs, split)
    plan = validate_plan(plan)
    h = plan_hash(plan)
    policy = plan["policy"]
    (ea, eb), (la, lb) = plan["early"], plan["late"]
    sel = docs.filter(pl.col("policy") == policy)
    if sel.height == 0:
        raise ValueError(f"no confirmatory estimates for the plan's policy {policy!r}")
    results, per_doc = [], []
    for (model,), g in sel.group_by(["model"], maintain_order=True):
        r, pd_ = _late_minus_early(g, model, policy, split, plan, boot)
        results.append(r)
        per_doc.extend(pd_)
    adj = holm([r["p_raw"] for r in results], plan["correction"])
    alpha = float(plan["alpha"])
    for r, a in zip(results, adj):
        r["p_adjusted"] = float(a)
        r["decision"] = "not tested" if not np.isfinite(a) else ("reject" if a < alpha else "not rejected")
        r["role"] = "plan"
    if floor is not None and floor != policy:
        for (model,), g in docs.filter(pl.col("policy") == floor).group_by(["model"], maintain_order=True):
            r, pd_ = _late_minus_early(g, model, floor, split, plan, boot)
            r.update(p_adjusted=float("nan"), decision=FLOOR_DECISION, role="floor")
            results.append(r)
            per_doc.extend(pd_)
    res = pl.DataFrame(results, infer_schema_length=None).with_columns(
        pl.lit(plan["test"]).alias("test"),
        pl.lit(plan["alternative"]).alias("alternative"),
        pl.lit(plan["correction"]).alias("correction"),
        pl.lit(alpha).alias("alpha"),
        pl.lit(f"[{ea}, {eb}]").alias("early"),
        pl.lit(f"[{la}, {lb}]").alias("late"),
        pl.lit(h).alias("plan_hash"),
    )
    return res, _per_document_table(per_doc)


def _check_confirmatory_split(docs: pl.DataFrame, split: str) -> None:
    """Refuse any split but the confirmatory one, asked for or among ``docs``' rows.

    Raises
    ------
    ValueError
        If ``split`` is not the confirmatory split, or ``docs`` holds rows of another split.
    """
    if split != CONFIRMATORY_SPLIT:
        raise ValueError(f"the confirmatory test runs on the {CONFIRMATORY_SPLIT!r} split only; refusing {split!r}")
    if docs.height and (docs["split"] != CONFIRMATORY_SPLIT).any():
        bad = sorted(set(docs["split"].to_list()) - {CONFIRMATORY_SPLIT})
        raise ValueError(f"the confirmatory test refuses documents of split(s) {bad}")


def _per_document_table(per_doc: Sequence[Mapping[str, Any]]) -> pl.DataFrame:
    """The ``per_doc`` table of :func:`confirmatory_analysis` from its rows.

    Returns
    -------
    polars.DataFrame
        model, policy, doc_id (String), ``btv_early``, ``btv_late``, ``d`` (Float64),
        ``reached_early``, ``reached_late`` (Boolean); these columns also when empty.
    """
    return pl.DataFrame(
        per_doc,
        schema={
            "model": pl.String,
            "policy": pl.String,
            "doc_id": pl.String,
            "btv_early": pl.Float64,
            "btv_late": pl.Float64,
            "d": pl.Float64,
            "reached_early": pl.Boolean,
            "reached_late": pl.Boolean,
        },
    )


# --------------------------------------------------------------------------- outputs for the report

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


# --------------------------------------------------------------------------- noise floor

#: Per-document columns compared with the noise floor: occurrence, expected token loss
#: (tokens), mean TV per chain step.
FLOOR_METRICS = ("p_div", "E_N", "tv_mean")


def floor_comparison(docs: pl.DataFrame, floor: str, boot: Bootstrap) -> pl.DataFrame:
    """Every policy next to the numerical noise floor, per model and split.

    The floor is the ``PermutationPress`` control: its two kernels are equal in exact
    arithmetic, so what it measures is floating-point rounding. Each policy is paired
    with the floor by ``doc_id`` on the documents both ran (all of a split's, or the
    subset ``runs.floor.documents``); each bootstrap resample draws those documents
    with replacement and uses them for both. A policy lies above the floor in a metric
    when the lower end of the interval of ``policy - floor`` is above 0.

    Parameters
    ----------
    docs : polars.DataFrame
        Per-document estimates (:func:`kvdiverge.estimation.estimators.document_estimates`) of
        any runs, with ``p_div``, ``E_N`` (tokens) and ``tv_mean``.
    floor : str
        Name of the floor policy (config ``runs.floor.policy``).
    boot : kvdiverge.estimation.bootstrap.Bootstrap
        Settings of the paired document bootstrap (purpose ``("floor", model, policy, split)``).

    Returns
    -------
    polars.DataFrame
        One row per (model, split, policy) other than the floor, where the floor ran:
        model, split, policy, floor, ``n_docs`` (paired), and for each metric ``m`` of
        :data:`FLOOR_METRICS` the policy's mean ``m`` (+ ``_lo``, ``_hi``), the
        floor's ``floor_m`` (+ interval), the difference ``diff_m`` (+ interval), and
        ``above_floor_p_div``, ``above_floor_E_N`` (booleans). Empty (same columns)
        when the floor did not run.
    """
    rows = []
    metrics = list(FLOOR_METRICS)
    for (model, split), g in docs.group_by(["model", "split"], maintain_order=True):
        fl = g.filter(pl.col("policy") == floor)
        if fl.height == 0:
            continue
        fl = fl.select(["doc_id", *metrics])
        for (policy,), gp in g.group_by(["policy"], maintain_order=True):
            if policy == floor:
                continue
            j = gp.select(["doc_id", *metrics]).join(fl, on="doc_id", suffix="_floor").sort("doc_id")
            n = j.height
            r: dict[str, Any] = {"model": model, "split": split, "policy": policy, "floor": floor, "n_docs": n}
            idx = boot.indices(n, "floor", model, policy, split)
            for m in metrics:
                a = j[m].to_numpy().astype(np.float64)
                b = j[m + "_floor"].to_numpy().astype(np.float64)
                for name, x in ((m, a), (f"floor_{m}", b), (f"diff_{m}", a - b)):
                    if n == 0:
                        put_interval(r, name, math.nan, math.nan, math.nan)
                        continue
                    put_interval(r, name, x.mean(), *boot.interval(x[idx].mean(axis=1)))
            for m in ("p_div", "E_N"):
                r[f"above_floor_{m}"] = bool(n > 0 and r[f"diff_{m}_lo"] > 0)
            rows.append(r)
    return pl.DataFrame(rows, schema=FLOOR_SCHEMA) if rows else pl.DataFrame(schema=FLOOR_SCHEMA)


#: Column types of the floor comparison (also for an empty one).
FLOOR_SCHEMA: dict[str, pl.DataType] = {
    "model": pl.String,
    "split": pl.String,
    "policy": pl.String,
    "floor": pl.String,
    "n_docs": pl.Int64,
    **{c: pl.Float64 for m in FLOOR_METRICS for pre in ("", "floor_", "diff_") for c in interval_columns(pre + m)},
    "above_floor_p_div": pl.Boolean,
    "above_floor_E_N": pl.Boolean,
}


#: Columns of :func:`floor_differences` besides ``policy``.
FLOOR_DIFFERENCE_COLUMNS = (
    "E_M_minus_floor",
    "E_M_minus_floor_lo",
    "E_M_minus_floor_hi",
    "p_div_minus_floor",
    "p_div_minus_floor_lo",
    "p_div_minus_floor_hi",
)


def floor_differences(gaps_to_floor: Mapping[str, pl.DataFrame | None]) -> pl.DataFrame:
    """Each policy's ``E[M]`` and ``p_div`` minus the noise floor's, from its gap to the floor.

    The difference of ``E[M] = E[N] / T`` is the gap decomposition's ``delta`` divided by
    ``T``; that of ``p_div`` is its ``first_mismatch`` term (§7), both with the gap's paired
    document-bootstrap interval. :func:`floor_comparison` gives the workflow's table of the
    same comparison over ``p_div``, ``E_N`` and ``tv_mean``, with its own resamples.

    Parameters
    ----------
    gaps_to_floor : mapping of str to polars.DataFrame or None
        Policy -> :func:`gap_decomposition` of ``policy - floor`` (four rows), or None for
        the floor itself; rows come out in this order.

    Returns
    -------
    polars.DataFrame
        ``policy`` and :data:`FLOOR_DIFFERENCE_COLUMNS` (Float64; null on the floor's row).
    """
    rows = []
    for policy, gap in gaps_to_floor.items():
        r: dict[str, Any] = {"policy": policy}
        if gap is not None:
            t = {row["term"]: row for row in gap.iter_rows(named=True)}
            delta, first, T = t["delta"], t["first_mismatch"], t["delta"]["T"]
            r.update(
                {
                    "E_M_minus_floor": delta["value"] / T,
                    "E_M_minus_floor_lo": delta["value_lo"] / T,
                    "E_M_minus_floor_hi": delta["value_hi"] / T,
                    "p_div_minus_floor": first["value"],
                    "p_div_minus_floor_lo": first["value_lo"],
                    "p_div_minus_floor_hi": first["value_hi"],
                }
            )
        rows.append(r)
    return pl.DataFrame(rows, schema={"policy": pl.String, **{c: pl.Float64 for c in FLOOR_DIFFERENCE_COLUMNS}})
