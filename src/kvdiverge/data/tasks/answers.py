"""Greedy answers read from the coupled run's trajectories, and their task scores.

Under greedy decoding (temperature 0) both kernels are point masses, so ``tv_t`` is 0 or 1:
the agreement chain is the common greedy prefix, ``t*`` the first step where the two greedy
tokens differ, ``x*`` and ``y*`` those tokens, and the branch continues each side greedily.
So the full cache's greedy answer is ``chain[:t*-1] + [x*] + branch_x`` and the press's
``chain[:t*-1] + [y*] + branch_y`` (the chain alone when the sides never differ): exactly
``model.generate(do_sample=False)`` without and with the press, with no decoding of its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import polars as pl

__all__ = ["ANSWER_SCHEMA", "greedy_pair", "score_answers"]

#: One row per (model, policy, split, doc_id).
ANSWER_SCHEMA = {
    "model": pl.String,
    "policy": pl.String,
    "split": pl.String,
    "doc_id": pl.String,
    "answer_full": pl.String,
    "answer": pl.String,
    "correct_full": pl.Boolean,
    "correct": pl.Boolean,
    "answer_len": pl.Int32,
    "S_answer": pl.Float64,
}


def greedy_pair(row: Mapping[str, Any]) -> tuple[list[int], list[int]]:
    """The full cache's and the press's greedy tokens of one trajectory row (shard schema).

    Raises
    ------
    ValueError
        When the row is not a greedy run (a ``tv`` strictly between 0 and 1).
    """
    tv = np.asarray([t for t in row["tv"] if t is not None], dtype=float)
    tv = tv[np.isfinite(tv)]
    if np.any((tv > 0) & (tv < 1)):
        raise ValueError(
            f"{row['policy']} doc {row['doc_id']!r}: tv between 0 and 1, so the run is not greedy; "
            f"the task's answers need decoding.temperature 0"
        )
    chain = [int(t) for t in row["chain_token"]]
    if row["t_star"] is None:
        return chain, chain
    k = int(row["t_star"]) - 1
    ref = chain[:k] + [int(row["x_star"])] + [int(t) for t in row["branch_x"]]
    ev = chain[:k] + [int(row["y_star"])] + [int(t) for t in row["branch_y"]]
    return ref, ev


def _length(tokens: Sequence[int], stops: set[int]) -> int:
    """Tokens of an answer up to and including its first special token (all when none)."""
    return next((i + 1 for i, t in enumerate(tokens) if t in stops), len(tokens))


def score_answers(trajectories: pl.DataFrame, prompts: pl.DataFrame, tokenizer, score) -> pl.DataFrame:
    """Each run's greedy answers, decoded and scored against the needle, per document.

    Parameters
    ----------
    trajectories : polars.DataFrame
        Shard rows (``TRAJECTORY_SCHEMA``) of greedy runs; replicate 0 of each document is read
        (greedy replicates are equal).
    prompts : polars.DataFrame
        The task's prompts table (``doc_id``, ``needle_value``).
    tokenizer
        The model's tokenizer (``decode``, ``all_special_ids``).
    score : callable
        ``(answer, value) -> bool``, the task's :attr:`kvdiverge.data.tasks.Task.score`.

    Returns
    -------
    polars.DataFrame
        :data:`ANSWER_SCHEMA`: both answers (special tokens removed), whether each contains the
        value, the full cache's answer length ``answer_len`` (tokens, to its first special
        token) and ``S_answer``, the chain's survival at that step, mean over replicates.
    """
    values = dict(zip(prompts["doc_id"].to_list(), prompts["needle_value"].to_list()))
    stops = {int(i) for i in tokenizer.all_special_ids}
    survival: dict[tuple, list[float]] = {}
    rows = {}
    for row in trajectories.sort("replicate").iter_rows(named=True):
        key = (row["model"], row["policy"], row["split"], row["doc_id"])
        if key not in rows:
            ref, ev = greedy_pair(row)
            full = tokenizer.decode(ref, skip_special_tokens=True)
            mine = tokenizer.decode(ev, skip_special_tokens=True)
            value = values[row["doc_id"]]
            rows[key] = [*key, full, mine, score(full, value), score(mine, value), _length(ref, stops)]
        survival.setdefault(key, []).append(float(row["survival"][rows[key][-1] - 1]))
    out = [[*r, float(np.mean(survival[k]))] for k, r in rows.items()]
    return pl.DataFrame(out, schema=ANSWER_SCHEMA, orient="row")
