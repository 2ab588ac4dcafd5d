"""The prespecified confirmatory test (``docs/estimators.md`` §8, confirmatory split only).

- :func:`~kvdiverge.estimation.confirmatory.validate_plan`, :func:`~kvdiverge.estimation.confirmatory.plan_hash` —
  the plan (config ``confirmatory``) must be
  complete; its hash is printed in the report.
- :func:`~kvdiverge.estimation.confirmatory.confirmatory_analysis` — per model, per document ``d = btv[late] -
  btv[early]``
  (§6 branch-aligned TV), one-sided Wilcoxon signed-rank (scipy), Holm across models
  (:func:`~kvdiverge.estimation.confirmatory.holm`), paired mean difference with a bootstrap interval. Documents
  whose branches
  never reach a window are counted and reported. Refuses any split but ``confirmatory``. The
  noise floor's own late − early difference is reported beside it (outside the
  multiplicity family).

The HTML page is rendered in :mod:`kvdiverge.report.pages`.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from typing import Any, Mapping, Sequence

import numpy as np
import polars as pl
from scipy import stats

from kvdiverge.estimation.bootstrap import Bootstrap
from kvdiverge.estimation.estimators import btv_window

__all__ = [
    "CONFIRMATORY_SPLIT",
    "FLOOR_DECISION",
    "PLAN_FIELDS",
    "PlanError",
    "confirmatory_analysis",
    "holm",
    "plan_hash",
    "validate_plan",
]

CONFIRMATORY_SPLIT = "confirmatory"

#: Fields a confirmatory plan must state (config ``confirmatory``).
PLAN_FIELDS = ("policy", "early", "late", "test", "alternative", "correction", "alpha")
TESTS = ("wilcoxon-signed-rank",)
ALTERNATIVES = ("greater", "less", "two-sided")
CORRECTIONS = ("holm", "bonferroni", "none")


class PlanError(ValueError):
    """The confirmatory plan is incomplete or invalid."""


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
