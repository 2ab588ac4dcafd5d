"""Key tokens: the scored positions of a teacher-forced target that need the far context (LongPPL's rule).

Fang et al., ICLR 2025, "What is Wrong with Perplexity for Long-context Language Modeling?"
(LongPPL; its code, ``longppl.find_key_token`` in PKU-ML/LongPPL) call a token ``x_i`` a *key
token* where a long context raises its log-probability far above what a short context gives,
and the model predicts it well with the long one:

- long-short difference ``LSD(x_i) = log P(x_i | long) - log P(x_i | short) > alpha``;
- long-context likelihood ``LCL(x_i) = log P(x_i | long) > beta``;

both strict, in nats (their code: ``loss_short - loss_full > alpha`` and ``loss_full < -beta``).
LongPPL's defaults are ``alpha = 2``, ``beta = -2`` and a short context of 4,096 tokens.

Here the long context is the whole prompt under the full cache: ``log P`` is the teacher-forced
pass's reference side (``ll_ref``). The short context is the prompt's last ``short`` tokens, fed
with the same target tokens to the same full-cache model in a fresh forward (``ll_short``). The
rule is applied once per document, from its first policy's reference side, so every policy of a
document is scored on the same key positions. The key measures are the per-position KLD and
top-1 agreement restricted to the key positions: ``kld_key_mean``, ``same_top_p_key``, with their
count ``n_key``. A document without a key position has no key measure (a missing value, never
0): the tables count such documents (``n_documents_no_key``) and :func:`missing_key_lines` says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import polars as pl

__all__ = ["DEFAULT_SHORT", "KeyTokens", "key_mask", "missing_key_lines"]

#: Short-context tokens by default. LongPPL's 4,096 is longer than the prompts the embedded studies run
#: (about 250-650 tokens), where no position could be key; 128 tokens keep its role there: the short
#: reference sees the prompt's last paragraph or so, not the rest.
DEFAULT_SHORT = 128


@dataclass(frozen=True)
class KeyTokens:
    """LongPPL's key-token rule and the short context's length.

    Parameters
    ----------
    short : int
        Tokens at the end of the prompt the short-context reference sees (default :data:`DEFAULT_SHORT`).
    alpha : float
        Least long-short difference ``log P(x | long) - log P(x | short)`` of a key token, nats
        (strict; LongPPL's 2).
    beta : float
        Least long-context log-probability ``log P(x | long)`` of a key token, nats (strict; LongPPL's -2).

    Raises
    ------
    ValueError
        If ``short`` is not an integer >= 1, or ``alpha`` or ``beta`` is not a finite number.
    """

    short: int = DEFAULT_SHORT
    alpha: float = 2.0
    beta: float = -2.0

    def __post_init__(self) -> None:
        if isinstance(self.short, bool) or not isinstance(self.short, int) or self.short < 1:
            raise ValueError(f"teacher_forced.key_tokens.short must be an integer >= 1, got {self.short!r}")
        for name in ("alpha", "beta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"teacher_forced.key_tokens.{name} must be a finite number, got {value!r}")


def key_mask(ll_long: np.ndarray, ll_short: np.ndarray, rule: KeyTokens) -> np.ndarray:
    """LongPPL's key positions: ``ll_long - ll_short > rule.alpha`` and ``ll_long > rule.beta``.

    Parameters
    ----------
    ll_long, ll_short : array_like
        (L,) log-probabilities of the scored tokens with the long and the short context, nats.
    rule : KeyTokens

    Returns
    -------
    numpy.ndarray
        (L,) bool.
    """
    long, short = np.asarray(ll_long, dtype=np.float64), np.asarray(ll_short, dtype=np.float64)
    return ((long - short) > float(rule.alpha)) & (long > float(rule.beta))


def missing_key_lines(table: pl.DataFrame) -> list[str]:
    """One line per (model, split) whose documents include some without a key position.

    Parameters
    ----------
    table : polars.DataFrame
        :func:`kvdiverge.estimation.teacher_forced.summary_table`: ``model``, ``policy``, ``split``,
        ``n_documents``, ``n_documents_no_key`` (null where no key tokens were selected).

    Returns
    -------
    list of str
        ``"key tokens: 2 of 8 documents have no key position (model m, split s; 3 runs): their
        kld_key_mean and same_top_p_key are missing"``, the largest count of the runs; empty when
        every document has one.
    """
    if table.is_empty() or "n_documents_no_key" not in table.columns:
        return []
    lacking = table.filter(pl.col("n_documents_no_key") > 0)
    lines = []
    for (model, split), part in lacking.group_by(["model", "split"], maintain_order=True):
        worst = part.sort("n_documents_no_key", descending=True).row(0, named=True)
        runs = f"; {part.height} runs" if part.height > 1 else f"; run {worst['policy']}"
        lines.append(
            f"key tokens: {worst['n_documents_no_key']} of {worst['n_documents']} documents have no key position "
            f"(model {model}, split {split}{runs}): their kld_key_mean and same_top_p_key are missing"
        )
    return lines
