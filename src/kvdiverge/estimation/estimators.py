"""Estimators of divergence timing and cumulative disagreement.

Implements ``docs/estimators.md`` §3, §5 and §6 on the trajectory shard
table of ``docs/internals.md`` (one row per document and replicate), and the
corpus-level pooling of §7:

- :func:`replicate_estimates` — §5 step 1 and 4, per replicate: ``p_div_hat``,
  ``f_hat_t``, ``E_L_hat``, ``E_L_win_hat``, ``E_L_tail_hat``, ``N_cmc``, ``N_naive``,
  ``N_post_cmc``, ``N_win_cmc``, ``N_post_cmc_tv`` (compensator variant) and the
  branch-aligned TV by lag with its weight ``w = 1 - S_T`` (§6).
- :func:`document_estimates` — means over the ``R`` replicates with standard errors,
  the §3 decomposition (checked by :mod:`kvdiverge.estimation.decomposition`; a failure
  raises its ``DecompositionError``), the §4 sharp interval, ``Var(N_naive) / Var(N_cmc)``
  and the §6 windowed branch TV.
- the checked readers of the shards and of the per-document estimates (:func:`read_shards`,
  :func:`read_estimates`).

The pooling over documents (§7) is :mod:`kvdiverge.estimation.pooling`.

Column names are the symbols of estimators.md in snake_case with the symbol's case kept:
``E[L]`` is ``E_L``, ``E[N_post]`` is ``E_N_post``, ``S_t`` is ``S``, ``f_t`` is ``f``.
Units: ``T``, ``W``, ``L``, lags and steps are counted in tokens (generation steps);
``N`` counts mismatched tokens; ``M = N / T`` is a fraction; ``p_div``, ``S``, ``f``,
TV are probabilities.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Sequence

import numpy as np
import polars as pl

from kvdiverge.estimation.decomposition import check_decomposition, rho
from kvdiverge.estimation.finite import check_document_estimates, check_shard
from kvdiverge.estimation.intervals import sharp_interval
from kvdiverge.estimation.numeric import safe_divide

__all__ = [
    "REQUIRED_COLUMNS",
    "RUN_KEYS",
    "btv_window",
    "document_estimates",
    "read_estimates",
    "read_shards",
    "replicate_estimates",
    "validate_shards",
    "variance_ratio",
]

RUN_KEYS = ["model", "policy", "split"]

REQUIRED_COLUMNS = [
    "model",
    "policy",
    "split",
    "doc_id",
    "replicate",
    "T",
    "prompt_len",
    "kept_len",
    "chain_token",
    "tv",
    "survival",
    "tau_naive",
    "t_star",
    "x_star",
    "y_star",
    "branch_x",
    "branch_y",
    "branch_tv",
    "branch_mismatch",
    "seconds",
]

# --------------------------------------------------------------------------- helpers


def _se(x: np.ndarray) -> float:
    """Standard error of the mean across replicates (NaN for fewer than 2)."""
    x = np.asarray(x, dtype=np.float64)
    return float(x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else float("nan")


def _var(x: np.ndarray) -> float:
    x = np.asarray(x, dtype=np.float64)
    return float(x.var(ddof=1)) if len(x) > 1 else float("nan")


def variance_ratio(a: float, b: float) -> float:
    """``a / b`` of two variances, with 0/0 -> NaN and a/0 -> inf for a > 0 (``var_ratio``, ``var_ratio_tv``)."""
    if b > 0:
        return a / b
    if a > 0:
        return float("inf")
    return float("nan")


def btv_window(num: np.ndarray, den: np.ndarray, a: int, b: int) -> tuple[float, float]:
    """Branch-aligned TV of the lag window ``[a, b]`` from per-lag sums (§6).

    Parameters
    ----------
    num : numpy.ndarray, shape (K,)
        ``sum_r w_r * branch_tv_{r,k} * 1{k <= L_r}`` for lags ``k = 1..K``.
    den : numpy.ndarray, shape (K,)
        ``sum_r w_r * 1{k <= L_r}``.
    a, b : int
        Lags, ``1 <= a <= b``.

    Returns
    -------
    btv : float
        ``sum_{k=a..b} num_k / sum_{k=a..b} den_k``; NaN when no branch reached the window.
    weight : float
        The denominator.

    Raises
    ------
    ValueError
        If ``a < 1`` or ``b < a``.
    """
    if not 1 <= a <= b:
        raise ValueError(f"lag window must satisfy 1 <= a <= b, got [{a}, {b}]")
    n = float(np.sum(num[a - 1 : b]))
    d = float(np.sum(den[a - 1 : b]))
    return (n / d if d > 0 else float("nan")), d


# --------------------------------------------------------------------------- per replicate


def validate_shards(df: pl.DataFrame) -> None:
    """Check a trajectory table against the shard schema of docs/internals.md.

    Raises
    ------
    ValueError
        Missing columns, list lengths different from ``T`` (chain) or ``T - t_star``
        (branch), a missing branch while ``S_T < 1``, or ``t_star != tau_naive`` when
        ``tau_naive <= T``; duplicated (model, policy, split, doc_id, replicate).
    """
    missing = [c for c in REQUIRED_COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"trajectory table lacks columns {missing} (docs/internals.md)")
    keys = RUN_KEYS + ["doc_id", "replicate"]
    if df.select(keys).is_duplicated().any():
        raise ValueError("trajectory table has duplicated (model, policy, split, doc_id, replicate) rows")


def _replicate_row(row: Mapping, W: int) -> dict:
    """Estimators of §5 for one shard row (internal; see :func:`replicate_estimates`)."""
    T = int(row["T"])
    where = f"doc {row['doc_id']!r} replicate {row['replicate']}"
    S = np.asarray(row["survival"], dtype=np.float64)
    if S.shape != (T,):
        raise ValueError(f"{where}: survival has length {S.shape[0]}, expected T={T}")
    S_prev = np.concatenate([[1.0], S[:-1]])
    f_hat = S_prev - S  # f_hat_t = S_{t-1} - S_t, no NaN (internals.md)
    t = np.arange(1, T + 1)
    S_T = float(S[-1])
    p_div_hat = 1.0 - S_T
    E_L_hat = float(np.sum(f_hat * (T - t)))
    E_L_win_hat = float(np.sum(f_hat * np.minimum(W, T - t)))
    E_L_tail_hat = float(np.sum(f_hat * np.maximum(T - t - W, 0)))
    E_tau_div_hat = float(np.sum(f_hat * t))

    t_star, tau_naive = row["t_star"], row["tau_naive"]
    bm, btv, L_branch = _checked_branch(row, T, p_div_hat, where)
    tv = np.asarray([np.nan if v is None else v for v in (row["tv"] or [])], dtype=np.float64)
    reached = tv[np.isfinite(tv)]  # chain steps reached (NaN after the chain stops)
    tv_mean = float(reached.mean()) if reached.size else float("nan")
    tv_max = float(reached.max()) if reached.size else float("nan")

    w = p_div_hat
    sum_bm = float(bm.sum())
    N_post_cmc = w * sum_bm
    N_win_cmc = w * float(bm[:W].sum())
    N_post_cmc_tv = w * float(btv.sum())
    naive = 1.0 if tau_naive is not None else 0.0
    return {
        "T": T,
        "p_div_hat": p_div_hat,
        "E_L_hat": E_L_hat,
        "E_L_win_hat": E_L_win_hat,
        "E_L_tail_hat": E_L_tail_hat,
        "E_tau_div_hat": E_tau_div_hat,
        "N_cmc": w + N_post_cmc,
        "N_naive": naive * (1.0 + sum_bm),
        "N_post_cmc": N_post_cmc,
        "N_win_cmc": N_win_cmc,
        "N_tail_cmc": N_post_cmc - N_win_cmc,
        "N_post_cmc_tv": N_post_cmc_tv,
        "N_cmc_tv": w + N_post_cmc_tv,
        "tv_mean": tv_mean,
        "tv_max": tv_max,
        "w": w,
        "t_star": None if t_star is None else int(t_star),
        "tau_naive": None if tau_naive is None else int(tau_naive),
        "L_branch": L_branch,
        "S": S.tolist(),
        "f_hat": f_hat.tolist(),
        "branch_tv": btv.tolist(),
    }


def _checked_branch(row: Mapping, T: int, p_div_hat: float, where: str) -> tuple[np.ndarray, np.ndarray, int]:
    """A row's branch lists (``branch_mismatch``, ``branch_tv``) and length ``L_branch``, checked
    against ``t_star``, ``tau_naive`` and ``1 - S_T`` (:func:`_replicate_row`).

    Raises
    ------
    ValueError
        Naming the document and replicate: a branch without ``t_star`` or the reverse,
        lists of the wrong length, or ``tau_naive`` disagreeing with ``t_star``.
    """
    t_star, tau_naive = row["t_star"], row["tau_naive"]
    bm = np.asarray(row["branch_mismatch"] if row["branch_mismatch"] is not None else [], dtype=np.float64)
    btv = np.asarray(row["branch_tv"] if row["branch_tv"] is not None else [], dtype=np.float64)
    if t_star is None:
        if p_div_hat > 1e-9:
            raise ValueError(f"{where}: no branch (t_star null) although 1 - S_T = {p_div_hat}")
        if len(bm) or len(btv):
            raise ValueError(f"{where}: branch lists present without t_star")
        L_branch = 0
    else:
        L_branch = T - int(t_star)
        if len(bm) != L_branch or len(btv) != L_branch:
            raise ValueError(
                f"{where}: branch lists have lengths {len(bm)}, {len(btv)}; expected T - t_star = {L_branch}"
            )
    if tau_naive is not None and t_star is not None and int(tau_naive) != int(t_star):
        raise ValueError(f"{where}: t_star={t_star} differs from tau_naive={tau_naive} <= T")
    if tau_naive is not None and t_star is None:
        raise ValueError(f"{where}: tau_naive={tau_naive} <= T but no branch")
    return bm, btv, L_branch


def replicate_estimates(df: pl.DataFrame, W: int, progress: bool = False) -> pl.DataFrame:
    """Per-replicate estimators of estimators.md §5.

    Parameters
    ----------
    df : polars.DataFrame
        Trajectory rows in the shard schema of docs/internals.md (any number of shards,
        runs and documents).
    W : int
        Window width (lags), config ``window``.
    progress : bool
        Show a tqdm progress bar over rows (on stderr).

    Returns
    -------
    polars.DataFrame
        One row per (model, policy, split, doc_id, replicate) with ``T``, ``W``,
        ``p_div_hat``, ``E_L_hat``, ``E_L_win_hat``, ``E_L_tail_hat``,
        ``E_tau_div_hat`` (``sum_t t f_hat_t``), ``N_cmc``, ``N_naive``,
        ``N_post_cmc``, ``N_win_cmc``, ``N_tail_cmc``, ``N_post_cmc_tv``, ``N_cmc_tv``,
        ``tv_mean`` and ``tv_max`` (mean and largest ``tv_t`` over the agreement chain's
        steps), the weight ``w = 1 - S_T``, ``t_star``, ``tau_naive``, ``L_branch = T - t_star``
        (0 without branch), lists ``S`` and ``f_hat`` (length T) and ``branch_tv``
        (length ``L_branch``), plus ``prompt_len``, ``kept_len``, ``seconds``.

    Raises
    ------
    ValueError
        If the table breaks the shard contract (see :func:`validate_shards`) or W < 0.
    """
    if W < 0:
        raise ValueError(f"window W must be >= 0, got {W}")
    validate_shards(df)
    df = df.sort(RUN_KEYS + ["doc_id", "replicate"])
    out = []
    from tqdm import tqdm

    for row in tqdm(df.iter_rows(named=True), total=df.height, desc="replicates", unit="row", disable=not progress):
        r = _replicate_row(row, W)
        r.update({k: row[k] for k in RUN_KEYS + ["doc_id", "replicate", "prompt_len", "kept_len", "seconds"]})
        r["W"] = int(W)
        out.append(r)
    schema = {
        "model": pl.String,
        "policy": pl.String,
        "split": pl.String,
        "doc_id": pl.String,
        "replicate": pl.Int32,
        "T": pl.Int32,
        "W": pl.Int32,
        "p_div_hat": pl.Float64,
        "E_L_hat": pl.Float64,
        "E_L_win_hat": pl.Float64,
        "E_L_tail_hat": pl.Float64,
        "E_tau_div_hat": pl.Float64,
        "N_cmc": pl.Float64,
        "N_naive": pl.Float64,
        "N_post_cmc": pl.Float64,
        "N_win_cmc": pl.Float64,
        "N_tail_cmc": pl.Float64,
        "N_post_cmc_tv": pl.Float64,
        "N_cmc_tv": pl.Float64,
        "tv_mean": pl.Float64,
        "tv_max": pl.Float64,
        "w": pl.Float64,
        "t_star": pl.Int32,
        "tau_naive": pl.Int32,
        "L_branch": pl.Int32,
        "S": pl.List(pl.Float64),
        "f_hat": pl.List(pl.Float64),
        "branch_tv": pl.List(pl.Float64),
        "prompt_len": pl.Int32,
        "kept_len": pl.Int32,
        "seconds": pl.Float64,
    }
    return pl.DataFrame(out, schema=schema, orient="row") if out else pl.DataFrame(schema=schema)


# --------------------------------------------------------------------------- per document


def _branch_lag_sums(group: pl.DataFrame, T: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-lag numerator and denominator of the §6 branch-aligned TV, lags 1..T."""
    num = np.zeros(T)
    den = np.zeros(T)
    for w, btv in zip(group["w"].to_list(), group["branch_tv"].to_list()):
        L = len(btv)
        if L == 0 or w <= 0:
            continue
        num[:L] += w * np.asarray(btv, dtype=np.float64)
        den[:L] += w
    return num, den


def document_estimates(reps: pl.DataFrame, windows: Mapping[str, Sequence[int]] | None = None) -> pl.DataFrame:
    """Per-document estimates: replicate means, standard errors, §3, §4, §6.

    Parameters
    ----------
    reps : polars.DataFrame
        Output of :func:`replicate_estimates`.
    windows : mapping of str to (a, b), optional
        Named lag windows for the §6 branch-aligned TV, e.g. the confirmatory
        ``{"early": (1, 4), "late": (5, 16)}``; each adds ``btv_<name>`` (NaN when no
        branch of the document reached the window) and ``btv_<name>_weight``.

    Returns
    -------
    polars.DataFrame
        One row per (model, policy, split, doc_id) with ``T``, ``W``, ``R``,
        ``prompt_len``, ``kept_len``, ``seconds``; means and ``*_se`` of ``p_div``,
        ``E_L``, ``E_L_win``, ``E_L_tail``, ``E_tau_div``, ``E_N`` (from ``N_cmc``),
        ``E_N_naive``, ``E_N_tv`` (compensator), ``E_N_post``, ``E_N_win``,
        ``E_N_tail``, ``E_M``, ``tv_mean`` (mean chain ``tv_t`` per step, the
        replicates' mean) and ``tv_max`` (largest over replicates and steps); ``tau_mean = E_tau_div / p_div`` (mean first-divergence
        step given divergence, steps); ``rho = E_N_post / E_L``;
        ``first_mismatch_term = p_div / T``, ``exposure_rate_term = (E_L / T) rho``,
        ``exposure_share`` of ``E_M``; the §4 interval ``E_N_lo/hi``, ``E_M_lo/hi``,
        ``rho_lo/hi``; ``var_N_naive``, ``var_N_cmc``, ``var_N_cmc_tv`` (across
        replicates, ddof 1) and ``var_ratio = var_N_naive / var_N_cmc``,
        ``var_ratio_tv = var_N_cmc_tv / var_N_cmc``; lists ``S`` and ``f`` (mean
        survival and divergence-time law, length T), ``btv_num``, ``btv_den``,
        ``btv_lag`` (per lag 1..T, §6), and the window columns.

    Raises
    ------
    kvdiverge.estimation.decomposition.DecompositionError
        If the §3 identity fails for any document.
    ValueError
        If ``T`` or ``W`` vary within a document.
    """
    windows = dict(windows or {})
    rows = [_document_row(key, g, windows) for key, g in reps.group_by(RUN_KEYS + ["doc_id"], maintain_order=True)]
    if not rows:
        raise ValueError("no replicate rows to aggregate")
    return pl.DataFrame(rows, infer_schema_length=None)


def _document_row(key: tuple, g: pl.DataFrame, windows: Mapping[str, Sequence[int]]) -> dict:
    """One document's row of :func:`document_estimates` from its replicates ``g``.

    Returns
    -------
    dict
        model, policy, split, doc_id (from ``key``), ``T``, ``W``, ``R``, ``prompt_len``,
        ``kept_len``, ``seconds``, then :func:`_replicate_means`, :func:`_document_terms`
        and :func:`_document_curves` in that order.

    Raises
    ------
    ValueError
        If ``T`` or ``W`` vary across the replicates.
    """
    model, policy, split, doc_id = key
    Ts = g["T"].unique().to_list()
    Ws = g["W"].unique().to_list()
    if len(Ts) != 1 or len(Ws) != 1:
        raise ValueError(f"doc {doc_id!r}: T or W vary across replicates ({Ts}, {Ws})")
    T, W = int(Ts[0]), int(Ws[0])
    R = g.height
    col = {c: g[c].to_numpy().astype(np.float64) for c in _REPLICATE_COLUMNS}
    r: dict = {
        "model": model,
        "policy": policy,
        "split": split,
        "doc_id": doc_id,
        "T": T,
        "W": W,
        "R": R,
        "prompt_len": int(g["prompt_len"][0]),
        "kept_len": int(g["kept_len"][0]),
        "seconds": float(g["seconds"][0]),
    }
    r.update(_replicate_means(col))
    r.update(_document_terms(r, col, T, where=f"{model}/{policy}/{split} doc {doc_id!r}"))
    r.update(_document_curves(g, T, R, windows))
    return r


#: Per-document means (and ``_se``) of :func:`document_estimates`: output column, replicate column.
_DOCUMENT_MEANS = (
    ("p_div", "p_div_hat"),
    ("E_L", "E_L_hat"),
    ("E_L_win", "E_L_win_hat"),
    ("E_L_tail", "E_L_tail_hat"),
    ("E_tau_div", "E_tau_div_hat"),
    ("E_N", "N_cmc"),
    ("E_N_naive", "N_naive"),
    ("E_N_tv", "N_cmc_tv"),
    ("E_N_post", "N_post_cmc"),
    ("E_N_win", "N_win_cmc"),
    ("E_N_tail", "N_tail_cmc"),
)

#: Replicate columns :func:`document_estimates` reads as float64 arrays.
_REPLICATE_COLUMNS = (
    "p_div_hat",
    "E_L_hat",
    "E_L_win_hat",
    "E_L_tail_hat",
    "E_tau_div_hat",
    "N_cmc",
    "N_naive",
    "N_cmc_tv",
    "N_post_cmc",
    "N_win_cmc",
    "N_tail_cmc",
    "tv_mean",
    "tv_max",
)


def _replicate_means(col: Mapping[str, np.ndarray]) -> dict:
    """One document's means over replicates and their standard errors.

    Returns
    -------
    dict
        Each output column of :data:`_DOCUMENT_MEANS` and its ``_se``, then ``tv_mean``,
        ``tv_mean_se`` and ``tv_max`` (largest over replicates).
    """
    r: dict = {}
    for out, src in _DOCUMENT_MEANS:
        r[out] = float(col[src].mean())
        r[out + "_se"] = _se(col[src])
    r["tv_mean"] = float(col["tv_mean"].mean())
    r["tv_mean_se"] = _se(col["tv_mean"])
    r["tv_max"] = float(col["tv_max"].max())
    return r


def _document_terms(r: Mapping, col: Mapping[str, np.ndarray], T: int, where: str) -> dict:
    """One document's §3 decomposition, §4 interval and §5 variances, from its means ``r``.

    Returns
    -------
    dict
        ``E_M``, ``E_M_se``, ``tau_mean``, ``rho``, ``first_mismatch_term``,
        ``exposure_rate_term``, ``exposure_share``, the :func:`sharp_interval` ends,
        ``E_N_in_interval``, ``var_N_naive``, ``var_N_cmc``, ``var_N_cmc_tv``,
        ``var_ratio``, ``var_ratio_tv``.

    Raises
    ------
    kvdiverge.estimation.decomposition.DecompositionError
        If the §3 identity fails.
    """
    t: dict = {"E_M": r["E_N"] / T, "E_M_se": r["E_N_se"] / T}
    t["tau_mean"] = safe_divide(r["E_tau_div"], r["p_div"])
    t["rho"] = rho(r["E_N_post"], r["E_L"])
    first, rate = check_decomposition(t["E_M"], r["p_div"], r["E_L"], r["E_N_post"], T, where=where)
    t["first_mismatch_term"] = float(first)
    t["exposure_rate_term"] = float(rate)
    t["exposure_share"] = safe_divide(rate, t["E_M"])
    t.update(sharp_interval(r["p_div"], r["E_N_win"], r["E_L_tail"], r["E_L"], T))
    t["E_N_in_interval"] = bool(t["E_N_lo"] - 1e-12 <= r["E_N"] <= t["E_N_hi"] + 1e-12)
    t["var_N_naive"] = _var(col["N_naive"])
    t["var_N_cmc"] = _var(col["N_cmc"])
    t["var_N_cmc_tv"] = _var(col["N_cmc_tv"])
    t["var_ratio"] = variance_ratio(t["var_N_naive"], t["var_N_cmc"])
    t["var_ratio_tv"] = variance_ratio(t["var_N_cmc_tv"], t["var_N_cmc"])
    return t


def _document_curves(g: pl.DataFrame, T: int, R: int, windows: Mapping[str, Sequence[int]]) -> dict:
    """One document's curves over steps and lags (:func:`document_estimates`): ``S``, ``f``,
    ``btv_num``, ``btv_den``, ``btv_lag`` and each window's ``btv_<name>`` with its weight."""
    S = np.asarray(g["S"].to_list(), dtype=np.float64).reshape(R, T)
    fh = np.asarray(g["f_hat"].to_list(), dtype=np.float64).reshape(R, T)
    r: dict = {"S": S.mean(axis=0).tolist(), "f": fh.mean(axis=0).tolist()}
    num, den = _branch_lag_sums(g, T)
    r["btv_num"] = num.tolist()
    r["btv_den"] = den.tolist()
    r["btv_lag"] = safe_divide(num, den).tolist()
    for name, (a, b) in windows.items():
        v, wgt = btv_window(num, den, int(a), int(b))
        r[f"btv_{name}"] = v
        r[f"btv_{name}_weight"] = wgt
    return r


# --------------------------------------------------------------------------- readers


def read_shards(paths: Iterable[str]) -> pl.DataFrame:
    """Concatenate trajectory shard parquet files (docs/internals.md schema).

    Every file is checked first (:func:`kvdiverge.estimation.finite.check_shard`): its float
    columns must be finite, ``tv`` after the chain stopped aside.

    Raises
    ------
    ValueError
        If ``paths`` is empty.
    kvdiverge.estimation.finite.NonFiniteError
        If a shard holds NaN or an infinity; the message names the file and the column.
    """
    frames = _read_checked(paths, check_shard, "trajectory shards")
    frames = [f for f in frames if f.height > 0] or frames[:1]
    return pl.concat(frames, how="diagonal_relaxed")


def read_estimates(paths: Iterable[str]) -> pl.DataFrame:
    """Concatenate per-document estimate tables (:func:`document_estimates` output files).

    Every file is checked first (:func:`kvdiverge.estimation.finite.check_document_estimates`): its
    float columns must be finite except where the quantity is undefined (e.g.
    ``tau_mean`` when ``p_div = 0``).

    Raises
    ------
    ValueError
        If ``paths`` is empty.
    kvdiverge.estimation.finite.NonFiniteError
        If a table holds NaN or an infinity where a number belongs; the message names the
        file and the column.
    """
    return pl.concat(_read_checked(paths, check_document_estimates, "estimate tables"), how="diagonal_relaxed")


def _read_checked(paths: Iterable[str], check, what: str) -> list[pl.DataFrame]:
    """Read parquet files, each passed to ``check(frame, path)``; ``ValueError`` when none."""
    paths = list(paths)
    if not paths:
        raise ValueError(f"no {what} given")
    frames = []
    for p in paths:
        frame = pl.read_parquet(p)
        check(frame, p)
        frames.append(frame)
    return frames
