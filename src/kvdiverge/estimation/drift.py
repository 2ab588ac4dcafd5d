"""Length and loop drift, paired per replicate from the coupled run: does the compressed cache make
the model talk longer, repeat itself, or stop early?

No new generation: each replicate of the coupled run already holds one draw of the stepwise
maximal coupling (``docs/estimators.md`` §2, §5). Its agreement chain ``h`` and naive
divergence time ``tau_naive`` give the coupled draw exactly: when ``tau_naive <= T`` (then
``t* = tau_naive``) the two sides are ``X = h_<t* x* branch_x`` and ``Y = h_<t* y* branch_y``,
otherwise both are ``h``. ``X`` is an exact draw from the full-cache kernel ``P`` and ``Y`` one
from the compressed-cache kernel ``Q``, sharing their prefix: lengths and repetition compare
*paired*.

Given the chain, ``{tau_naive <= T}`` has probability ``1 - S_T`` and, on it, ``t*`` has the law
the branch was drawn with, so for any function ``g`` of a side

    E[g(X)] = E[ S_T g(h) + (1 - S_T) g(X_branch) ]

(Rao–Blackwellised over the divergence coin, as ``N_cmc`` is in §5): each replicate contributes
its chain with weight ``S_T`` and its branch with weight ``1 - S_T``, on each side. A paired
difference is then ``(1 - S_T) (g(Y_branch) - g(X_branch))``: exactly 0 for a policy whose
kernel equals the full cache's (``S_T = 1``).

Per side and draw (tokens up to the first end-of-sequence id):

- ``length`` (tokens, the EOS included; ``T`` when it did not stop) and ``stopped``;
- ``loop``: the generated tail repeats one period of at most ``max_period`` tokens at least
  ``min_repeats`` times up to the end (:func:`loop_onset`; the repetition-loop definition of
  LoopGuard and of the degeneration literature, Holtzman et al., 2020);
- ``rep4``: the fraction of 4-grams that repeat an earlier 4-gram of the same sequence (seq-rep-4,
  Welleck et al., 2020, "Neural Text Generation with Unlikelihood Training");
- ``distinct2``: distinct bigrams over bigrams (Li et al., 2016, "A Diversity-Promoting Objective
  Function for Neural Conversation Models"); 1 for a sequence without a bigram.

Per policy (:func:`drift_table`): the means on each side, the paired difference (compressed minus
full) with its document-bootstrap interval, and the median length on each side. The EOS time's
survival on each side (:func:`length_survival`) is the Kaplan–Meier curve: censoring happens only at
the horizon ``T`` (administrative censoring), where Kaplan–Meier equals the empirical survival, so
``P(EOS time > t)`` for ``t < T`` is read directly off the weighted draws.

Only numpy and polars: nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import polars as pl

from kvdiverge.estimation.bootstrap import Bootstrap, percentile_interval, put_interval, resample_counts

__all__ = [
    "DRIFT_MEASURES",
    "LOOP_MAX_PERIOD",
    "LOOP_MIN_REPEATS",
    "distinct_n",
    "drift_problems",
    "drift_replicates",
    "drift_table",
    "format_drift_line",
    "length_ratios",
    "length_survival",
    "loop_onset",
    "loop_settings",
    "no_stop_note",
    "repeated_ngram_rate",
    "with_drift_columns",
]

#: Longest loop period, tokens (LoopGuard's window).
LOOP_MAX_PERIOD = 32
#: Fewest repeats of the period that make a loop.
LOOP_MIN_REPEATS = 3
#: The per-draw measures, each averaged with the replicate's weights (:func:`drift_replicates`).
DRIFT_MEASURES = ("length", "stopped", "loop", "rep4", "distinct2")

_KEYS = ["model", "policy", "split"]


def loop_onset(tokens: Sequence[int], max_period: int = LOOP_MAX_PERIOD, min_repeats: int = LOOP_MIN_REPEATS):
    """Where a repetition loop at the end of ``tokens`` starts, or None.

    The tail of ``tokens`` loops with period ``p`` (``1 <= p <= max_period``) when it is
    periodic with period ``p`` and spans at least ``min_repeats * p`` tokens up to the end. Of
    the periods that loop, the one whose loop starts earliest wins (then the shortest).

    Parameters
    ----------
    tokens : sequence of int
        Generated token ids, the end-of-sequence id excluded.
    max_period, min_repeats : int
        The loop's longest period (tokens) and fewest repeats.

    Returns
    -------
    tuple of (int, int) or None
        ``(onset, period)``: the 1-based step of the loop's first token and its period; None
        when the tail does not loop.
    """
    seq = list(tokens)
    n = len(seq)
    best = None
    for p in range(1, min(max_period, n // min_repeats) + 1):
        run = 0  # positions i (from the end) with seq[i] == seq[i - p]
        while run < n - p and seq[n - 1 - run] == seq[n - 1 - run - p]:
            run += 1
        span = run + p
        if span >= min_repeats * p:
            onset = n - span + 1
            if best is None or onset < best[0]:
                best = (onset, p)
    return best


def repeated_ngram_rate(tokens: Sequence[int], n: int = 4) -> float:
    """seq-rep-n (Welleck et al., 2020): the fraction of the ``n``-grams of ``tokens`` that repeat an
    earlier one, ``1 - distinct / total``; 0 for a sequence with no ``n``-gram."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return 0.0 if not grams else 1.0 - len(set(grams)) / len(grams)


def distinct_n(tokens: Sequence[int], n: int = 2) -> float:
    """distinct-n (Li et al., 2016): distinct ``n``-grams over ``n``-grams; 1 for a sequence with none."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return 1.0 if not grams else len(set(grams)) / len(grams)


def _draw(seq: Sequence[int], T: int, eos: frozenset, max_period: int, min_repeats: int) -> dict:
    """The measures of one side's draw ``seq`` (token ids, -1 or missing after a stopped chain)."""
    body = []
    stop = None
    for i, tok in enumerate(seq[:T]):
        if tok < 0:
            break
        if tok in eos:
            stop = i + 1
            break
        body.append(int(tok))
    loop = loop_onset(body, max_period, min_repeats)
    return {
        "length": stop if stop is not None else T,
        "stopped": stop is not None,
        "loop": loop is not None,
        "loop_onset": None if loop is None else loop[0],
        "rep4": repeated_ngram_rate(body, 4),
        "distinct2": distinct_n(body, 2),
    }


def drift_problems(T: int, max_period: int | None = None, min_repeats: int | None = None) -> list[str]:
    """One sentence per loop setting the horizon ``T`` cannot use: a period longer than the horizon,
    fewer than 2 repeats (a single pass is no loop), or more repeats than the horizon has tokens (even
    a 1-token period cannot repeat that often: no loop could be found, :func:`loop_onset`).

    Only the settings given are checked (None: not given): the default period of :func:`loop_settings`
    lies within the horizon, and its default 3 repeats stand even at a horizon under 3 tokens, where
    the drift table then reports lengths and stops without loops."""
    out = []
    if max_period is not None and max_period > T:
        out.append(
            f"drift.max_period: a loop period of {max_period} tokens is longer than the horizon "
            f"decoding.max_new_tokens = {T}; lower it to at most {T} (or raise the horizon)"
        )
    if min_repeats is not None and min_repeats < 2:
        out.append(f"drift.min_repeats: a loop repeats its period at least twice, got {min_repeats}")
    elif min_repeats is not None and min_repeats > T:
        out.append(
            f"drift.min_repeats: {min_repeats} repeats of even a 1-token period are longer than the horizon "
            f"decoding.max_new_tokens = {T}, so no loop could be found; lower it to at most {T} (or raise the horizon)"
        )
    return out


def loop_settings(block: dict | None, T: int) -> dict[str, int]:
    """The loop detector's settings of a config's ``drift`` block at horizon ``T``: ``max_period`` (given,
    else :data:`LOOP_MAX_PERIOD` or ``T``, whichever is shorter) and ``min_repeats`` (given, else
    :data:`LOOP_MIN_REPEATS`)."""
    block = block or {}
    return {
        "max_period": int(block.get("max_period", min(LOOP_MAX_PERIOD, int(T)))),
        "min_repeats": int(block.get("min_repeats", LOOP_MIN_REPEATS)),
    }


def no_stop_note(table: pl.DataFrame) -> list[str]:
    """One sentence per run whose draws never stopped, on either side, within the horizon: the
    length drift cannot be seen there (:func:`drift_table` rows)."""
    out = []
    rates = table.filter(pl.col("measure") == "stop_rate")
    for r in rates.iter_rows(named=True):
        if r["full"] == 0 and r["compressed"] == 0:
            out.append(
                f"{r['model']}/{r['policy']}/{r['split']}: no draw stopped within the horizon T = {r['T']} on "
                f"either side, so a change of length cannot be seen; raise decoding.max_new_tokens above the "
                f"full cache's lengths (config/length.yaml)"
            )
    return out


def drift_replicates(
    trajectories: pl.DataFrame,
    eos_ids: Sequence[int],
    *,
    max_period: int = LOOP_MAX_PERIOD,
    min_repeats: int = LOOP_MIN_REPEATS,
) -> pl.DataFrame:
    """Per replicate, each side's length, stop, loop and repetition measures, paired.

    Parameters
    ----------
    trajectories : polars.DataFrame
        Rows of the shard schema (:data:`kvdiverge.estimation.schema.TRAJECTORY_SCHEMA`).
    eos_ids : sequence of int
        The model's end-of-sequence ids (the ids its generation stops at).
    max_period, min_repeats : int
        The loop detector's settings (:func:`loop_onset`).

    Returns
    -------
    polars.DataFrame
        One row per (model, policy, split, doc_id, replicate): ``T``, ``weight_branch`` (``1 - S_T``,
        float64); for each draw ``d`` in ``chain`` (both sides before divergence), ``x`` and ``y`` (the
        branch's full-cache and compressed-cache continuations; null without a branch) and each
        measure ``m`` of :data:`DRIFT_MEASURES`: ``m_d`` and ``loop_onset_d`` (step, null without a
        loop); and the Rao–Blackwellised values per side and their paired difference,
        ``m_full = S_T m_chain + (1 - S_T) m_x``, ``m_compressed`` likewise with ``y``, ``m_diff``
        (float64; ``stopped`` and ``loop`` as rates).
    """
    eos = frozenset(int(e) for e in eos_ids)
    rows = []
    for r in trajectories.iter_rows(named=True):
        T = int(r["T"])
        weight = 1.0 - float(r["survival"][-1]) if r["survival"] else 0.0
        out = {k: r[k] for k in (*_KEYS, "doc_id", "replicate")}
        out.update(T=T, weight_branch=weight)
        draws = {"chain": _draw(r["chain_token"], T, eos, max_period, min_repeats)}
        if r["t_star"] is not None:
            prefix = list(r["chain_token"][: int(r["t_star"]) - 1])
            draws["x"] = _draw(prefix + [r["x_star"], *r["branch_x"]], T, eos, max_period, min_repeats)
            draws["y"] = _draw(prefix + [r["y_star"], *r["branch_y"]], T, eos, max_period, min_repeats)
        for d in ("chain", "x", "y"):
            for m in (*DRIFT_MEASURES, "loop_onset"):
                out[f"{m}_{d}"] = draws[d][m] if d in draws else None
        for m in DRIFT_MEASURES:
            chain = float(draws["chain"][m])
            x = float(draws["x"][m]) if "x" in draws else chain
            y = float(draws["y"][m]) if "y" in draws else chain
            full = chain if weight == 0 else (1 - weight) * chain + weight * x
            compressed = chain if weight == 0 else (1 - weight) * chain + weight * y
            out.update({f"{m}_full": full, f"{m}_compressed": compressed, f"{m}_diff": weight * (y - x)})
        rows.append(out)
    schema = {k: pl.String for k in (*_KEYS, "doc_id")} | {"replicate": pl.Int32, "T": pl.Int32}
    schema["weight_branch"] = pl.Float64
    for d in ("chain", "x", "y"):
        schema |= {f"length_{d}": pl.Int32, f"stopped_{d}": pl.Boolean, f"loop_{d}": pl.Boolean}
        schema |= {f"loop_onset_{d}": pl.Int32, f"rep4_{d}": pl.Float64, f"distinct2_{d}": pl.Float64}
    schema |= {f"{m}_{s}": pl.Float64 for m in DRIFT_MEASURES for s in ("full", "compressed", "diff")}
    return pl.DataFrame(rows, schema=schema)


def _eos_histograms(reps: pl.DataFrame, T: int) -> tuple[list[str], np.ndarray, np.ndarray]:
    """``(doc_ids, H_full, H_compressed)``: per document the law of the EOS step on each side, shape
    (n_docs, T + 1): column ``t - 1`` stopped at step ``t``, column ``T`` did not stop."""
    docs = sorted(reps["doc_id"].unique().to_list())
    index = {d: i for i, d in enumerate(docs)}
    H = {side: np.zeros((len(docs), T + 1)) for side in ("x", "y")}
    n = reps.group_by("doc_id").len()
    per_doc = dict(zip(n["doc_id"].to_list(), n["len"].to_list()))
    for r in reps.iter_rows(named=True):
        i, w = index[r["doc_id"]], float(r["weight_branch"])
        share = 1.0 / per_doc[r["doc_id"]]
        for side in ("x", "y"):
            for d, weight in (("chain", 1.0 - w), (side, w)):
                if weight == 0:
                    continue
                col = int(r[f"length_{d}"]) - 1 if r[f"stopped_{d}"] else T
                H[side][i, col] += share * weight
    return docs, H["x"], H["y"]


def _median_length(H: np.ndarray) -> np.ndarray:
    """The median length of pooled EOS-step laws ``H`` (..., T + 1): the first length whose
    cumulative share reaches 1/2 (not stopped counts as length T)."""
    law = np.concatenate([H[..., :-2], (H[..., -2] + H[..., -1])[..., None]], axis=-1)
    cum = np.cumsum(law, axis=-1) / law.sum(axis=-1, keepdims=True)
    return (np.argmax(cum >= 0.5 - 1e-12, axis=-1) + 1).astype(np.float64)


def drift_table(reps: pl.DataFrame, boot: Bootstrap) -> pl.DataFrame:
    """Per policy, each measure on both sides and the paired difference, with document-bootstrap intervals.

    Parameters
    ----------
    reps : polars.DataFrame
        :func:`drift_replicates` output.
    boot : kvdiverge.estimation.bootstrap.Bootstrap
        Settings of the document bootstrap (documents resampled with replacement, both sides
        together: the intervals of the differences are paired; the resamples' generator also
        derives from model, policy and split).

    Returns
    -------
    polars.DataFrame
        One row per (model, policy, split, measure), ``measure`` in ``length_mean`` (tokens),
        ``length_median`` (tokens), ``stop_rate``, ``loop_rate``, ``rep4``, ``distinct2``:
        ``n_docs``, ``T``, ``full``, ``compressed`` and ``diff`` (compressed minus full), each with
        ``_lo``/``_hi`` (the ``full`` and ``compressed`` intervals resample documents as ``diff``'s
        do). The documents weigh equally, the replicates of a document equally.
    """
    rows = []
    names = {"length": "length_mean", "stopped": "stop_rate", "loop": "loop_rate"}
    for key, part in reps.group_by(_KEYS, maintain_order=True):
        T = int(part["T"].max())
        means = part.group_by("doc_id").agg(
            pl.col(f"{m}_{s}").mean() for m in DRIFT_MEASURES for s in ("full", "compressed")
        )
        docs, Hx, Hy = _eos_histograms(part, T)
        means = means.sort("doc_id")
        n = len(docs)
        counts = resample_counts(boot.indices(n, "drift", *key))
        base = dict(zip(_KEYS, key)) | {"n_docs": n, "T": T}
        for m in DRIFT_MEASURES:
            X = means.select(f"{m}_full", f"{m}_compressed").to_numpy()
            point, resampled = X.mean(axis=0), counts @ X / n
            rows.append(_row(base, names.get(m, m), point, resampled, boot.confidence))
        point = np.array([_median_length(Hx.mean(0)), _median_length(Hy.mean(0))])
        resampled = np.stack([_median_length(counts @ Hx / n), _median_length(counts @ Hy / n)], axis=1)
        rows.append(_row(base, "length_median", point, resampled, boot.confidence))
    order = ["length_mean", "length_median", "stop_rate", "loop_rate", "rep4", "distinct2"]
    out = pl.DataFrame(rows)
    if out.height == 0:
        return out
    return out.sort(*_KEYS, pl.col("measure").replace_strict(order, list(range(len(order)))), maintain_order=True)


def length_ratios(reps: pl.DataFrame, boot: Bootstrap) -> pl.DataFrame:
    """Per policy, the mean length on the compressed side over the full-cache side's, with its interval.

    The frontier's length panel (:func:`with_drift_columns`): 1 means the compressed cache changes
    no length, above 1 it makes the model talk longer. The resamples are :func:`drift_table`'s.

    Parameters
    ----------
    reps : polars.DataFrame
        :func:`drift_replicates` output.
    boot : kvdiverge.estimation.bootstrap.Bootstrap
        Settings of the document bootstrap (the same resamples as :func:`drift_table` with them).

    Returns
    -------
    polars.DataFrame
        One row per (model, policy, split): ``length_ratio``, ``length_ratio_lo``, ``length_ratio_hi``
        (float64, a ratio of mean lengths in tokens).
    """
    rows = []
    for key, part in reps.group_by(_KEYS, maintain_order=True):
        means = part.group_by("doc_id").agg(pl.col("length_full").mean(), pl.col("length_compressed").mean())
        X = means.sort("doc_id").select("length_full", "length_compressed").to_numpy()
        n = X.shape[0]
        resampled = resample_counts(boot.indices(n, "drift", *key)) @ X / n
        lo, hi = boot.interval(resampled[:, 1] / resampled[:, 0])
        row = dict(zip(_KEYS, key))
        put_interval(row, "length_ratio", float(X[:, 1].mean() / X[:, 0].mean()), float(lo), float(hi))
        rows.append(row)
    schema = {
        **{k: pl.String for k in _KEYS},
        **dict.fromkeys(["length_ratio", "length_ratio_lo", "length_ratio_hi"], pl.Float64),
    }
    return pl.DataFrame(rows, schema=schema)


def with_drift_columns(table: pl.DataFrame, ratios: pl.DataFrame | None) -> pl.DataFrame:
    """``table`` (frontier points, keyed by model, policy and split) with :func:`length_ratios` joined on
    the left; ``ratios`` None or empty returns ``table`` unchanged."""
    if ratios is None or ratios.is_empty():
        return table
    keys = [k for k in _KEYS if k in table.columns and k in ratios.columns]
    return table.join(ratios.select(*keys, pl.col("^length_ratio.*$")), on=keys, how="left")


def _row(base: dict, measure: str, point: np.ndarray, resampled: np.ndarray, confidence: float) -> dict:
    """One row of :func:`drift_table`: full, compressed and their difference, each with its interval."""
    row = {**base, "measure": measure}
    values = np.array([point[0], point[1], point[1] - point[0]])
    samples = np.column_stack([resampled[:, 0], resampled[:, 1], resampled[:, 1] - resampled[:, 0]])
    lo, hi = percentile_interval(samples, confidence)
    for i, name in enumerate(("full", "compressed", "diff")):
        put_interval(row, name, float(values[i]), float(lo[i]), float(hi[i]))
    return row


def length_survival(reps: pl.DataFrame) -> pl.DataFrame:
    """The survival of the EOS time on each side, per policy: ``P(EOS step > t)``, ``t = 0..T``.

    The Kaplan–Meier curve of the EOS time censored at ``T``: censoring only at the horizon
    (administrative censoring) makes Kaplan–Meier the empirical survival of the weighted draws
    (documents equal, replicates equal within, chain and branch weighted ``S_T`` and ``1 - S_T``).

    Returns
    -------
    polars.DataFrame
        One row per (model, policy, split, side, t): ``side`` ``full`` or ``compressed``, ``t``
        (step, int32, 0..T), ``survival`` (float64; 1 at ``t = 0``; at ``T``, the share that did
        not stop).
    """
    frames = []
    for key, part in reps.group_by(_KEYS, maintain_order=True):
        T = int(part["T"].max())
        _, Hx, Hy = _eos_histograms(part, T)
        for side, H in (("full", Hx), ("compressed", Hy)):
            stopped = np.concatenate([[0.0], np.cumsum(H.mean(0)[:T])])
            frames.append(
                pl.DataFrame(
                    {
                        **{k: [v] * (T + 1) for k, v in zip(_KEYS, key)},
                        "side": [side] * (T + 1),
                        "t": np.arange(T + 1, dtype=np.int32),
                        "survival": 1.0 - stopped,
                    }
                )
            )
    return pl.concat(frames) if frames else pl.DataFrame()


def format_drift_line(table: pl.DataFrame, policies: Sequence[str]) -> str:
    """One line: per policy, the paired length difference (tokens) and the stop and loop rates' differences.

    Returns
    -------
    str
        ``"length drift (compressed - full) [CI]: snapkv +1.2 tokens [0.3, 2.0], stop -0.05 [...], loop
        +0.00 [...]; ..."``; a note when the table is empty.
    """
    if table.height == 0:
        return "length drift: no runs"
    by = {(r["policy"], r["measure"]): r for r in table.iter_rows(named=True)}
    cells = []
    for p in policies:
        if (p, "length_mean") not in by:
            continue
        length, stop, loop = (by[(p, m)] for m in ("length_mean", "stop_rate", "loop_rate"))
        cells.append(
            f"{p} {length['diff']:+.2f} tokens [{length['diff_lo']:+.2f}, {length['diff_hi']:+.2f}], "
            f"stop {stop['diff']:+.3f} [{stop['diff_lo']:+.3f}, {stop['diff_hi']:+.3f}], "
            f"loop {loop['diff']:+.3f} [{loop['diff_lo']:+.3f}, {loop['diff_hi']:+.3f}]"
        )
    return "length drift (compressed - full, paired) [CI]: " + "; ".join(cells)
