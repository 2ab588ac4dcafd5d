"""The document bootstrap of estimators.md §7: seeded resamples and percentile intervals.

Every interval of the pooled tables, the gap decomposition, the confirmatory test and
the noise-floor comparison resamples documents with replacement (documents are the
independent units; replicates within a document are not). Each table's resamples come
from their own generator, derived from the master seed and a purpose tuple
(:func:`bootstrap_rng`), so adding a run or a table never changes another's draws.

- :func:`resample_indices` — ``n_boot`` resamples of ``n`` documents, shape (n_boot, n).
- :func:`resample_counts` — the same resamples as document multiplicities, so that
  ``counts @ X / n`` is the resampled mean of every column of ``X``.
- :func:`resampled_nanmean` — resampled means over the finite entries of each column.
- :func:`percentile_interval` — the percentile interval of resampled statistics.
- :class:`Bootstrap` — the settings every table's intervals share: resamples, coverage, seed.
"""

from __future__ import annotations

import hashlib
import numbers
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvdiverge.estimation.numeric import safe_divide

__all__ = [
    "INTERVAL",
    "Bootstrap",
    "bootstrap_rng",
    "interval_columns",
    "percentile_interval",
    "put_interval",
    "resample_counts",
    "resample_indices",
    "resampled_nanmean",
]

#: Suffixes of an estimate's columns: the value, the interval's lower and upper ends.
INTERVAL = ("", "_lo", "_hi")


def _bootstrap_iv(n_boot: Any, confidence: Any, seed: Any) -> tuple[int, float, int]:
    """The settings of a :class:`Bootstrap` checked and converted (``int``, ``float``, ``int``).

    Raises
    ------
    ValueError
        Naming the first field out of range: ``n_boot`` not an integer ``>= 0``,
        ``confidence`` not a number in (0, 1), ``seed`` not an integer ``>= 0``.
    """
    for name, value in (("n_boot", n_boot), ("seed", seed)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"Bootstrap.{name} must be an integer >= 0, got {value!r}")
    if isinstance(confidence, bool) or not isinstance(confidence, numbers.Real) or not 0 < confidence < 1:
        raise ValueError(f"Bootstrap.confidence must be a number in (0, 1), got {confidence!r}")
    return int(n_boot), float(confidence), int(seed)


@dataclass(frozen=True)
class Bootstrap:
    """Settings of the document bootstrap (estimators.md §7): how many resamples, which coverage, which seed.

    Every table with intervals takes one: the pooled tables, the gap decomposition, the
    confirmatory test, the noise-floor comparison, the drift, teacher-forced, speculative,
    task and frontier tables. The resamples of a table derive from ``seed`` and the
    table's purpose (:func:`resample_indices`), the interval from ``confidence``
    (:func:`percentile_interval`).

    Parameters
    ----------
    n_boot : int
        Number of resamples of the documents (a count, ``>= 0``; config
        ``analysis.bootstrap``). 0 draws none: the intervals are NaN, or left out where a
        table says so (:func:`kvdiverge.estimation.teacher_forced.summary_table`).
    confidence : float
        Coverage of the percentile intervals, a fraction in (0, 1) (config
        ``analysis.confidence``): 0.95 gives the 2.5 % and 97.5 % percentiles.
    seed : int
        Master seed of the resamples, ``>= 0`` (config ``seed``): with the purpose tuple it
        seeds each table's generator (:func:`bootstrap_rng`).

    Raises
    ------
    ValueError
        Naming the field out of range (``Bootstrap.n_boot must be an integer >= 0, got -1``).

    Examples
    --------
    >>> Bootstrap(n_boot=200, seed=3)
    Bootstrap(n_boot=200, confidence=0.95, seed=3)
    """

    n_boot: int = 2000
    confidence: float = 0.95
    seed: int = 0

    def __post_init__(self) -> None:
        n_boot, confidence, seed = _bootstrap_iv(self.n_boot, self.confidence, self.seed)
        object.__setattr__(self, "n_boot", n_boot)
        object.__setattr__(self, "confidence", confidence)
        object.__setattr__(self, "seed", seed)

    @classmethod
    def of(cls, settings: Mapping[str, Any]) -> Bootstrap:
        """The settings of a settings record or workflow params: its ``bootstrap`` (resamples),
        ``confidence`` and ``seed`` (those of a :class:`kvdiverge.doors.results.Measurement` and
        of the analysis rules' ``ANALYSIS_PARAMS``)."""
        return cls(settings["bootstrap"], settings["confidence"], settings["seed"])

    def indices(self, n: int, *purpose: object) -> np.ndarray:
        """:func:`resample_indices` of ``n`` documents with these settings, shape (n_boot, n)."""
        return resample_indices(n, self.n_boot, self.seed, *purpose)

    def interval(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:func:`percentile_interval` of resampled statistics at this coverage."""
        return percentile_interval(samples, self.confidence)


def interval_columns(name: str) -> tuple[str, str, str]:
    """The columns of an estimate with its interval: ``(name, name_lo, name_hi)``."""
    return tuple(name + suffix for suffix in INTERVAL)


def put_interval(row: dict, name: str, value: float, lo: float, hi: float) -> None:
    """Set ``row[name]``, ``row[name_lo]``, ``row[name_hi]`` (in that order) to floats (:func:`interval_columns`)."""
    for column, v in zip(interval_columns(name), (value, lo, hi)):
        row[column] = float(v)


def bootstrap_rng(seed: int, *purpose: object) -> np.random.Generator:
    """Generator derived from the master seed and a purpose tuple (stable across runs).

    Parameters
    ----------
    seed : int
        Master seed (config ``seed``).
    *purpose : object
        Labels (e.g. "pooled", model, policy, split); their ``str`` is hashed with SHA-256.

    Returns
    -------
    numpy.random.Generator
        PCG64 seeded with ``SeedSequence([seed, first 8 bytes of the hash, little-endian])``.
    """
    h = hashlib.sha256("\x1f".join(str(p) for p in purpose).encode()).digest()
    return np.random.default_rng(np.random.SeedSequence([int(seed), int.from_bytes(h[:8], "little")]))


def resample_indices(n: int, n_boot: int, seed: int, *purpose: object) -> np.ndarray:
    """Document indices of ``n_boot`` resamples of ``n`` documents drawn with replacement.

    Parameters
    ----------
    n : int
        Number of documents.
    n_boot : int
        Number of resamples.
    seed : int
        Master seed.
    *purpose : object
        The table's labels, for :func:`bootstrap_rng`.

    Returns
    -------
    numpy.ndarray of int64, shape (n_boot, n)
        Row ``b`` lists the documents of resample ``b``; ``x[idx].mean(axis=1)`` is the
        resampled mean of a per-document ``x``; no columns when ``n = 0``.
    """
    return bootstrap_rng(seed, *purpose).integers(0, n, size=(n_boot, n))


def resample_counts(indices: np.ndarray) -> np.ndarray:
    """Document multiplicities of resamples, shape (n_boot, n), float64.

    ``counts @ X / n`` is then the resampled mean of each column of ``X`` (n, K) without
    materialising a (n_boot, n, K) array (the survival curve of the paper config would
    need gigabytes).

    Parameters
    ----------
    indices : numpy.ndarray of int, shape (n_boot, n)
        From :func:`resample_indices`.
    """
    n_boot, n = indices.shape
    counts = np.zeros((n_boot, n))
    np.add.at(counts, (np.repeat(np.arange(n_boot), n), indices.ravel()), 1.0)
    return counts


def resampled_nanmean(counts: np.ndarray, X: np.ndarray) -> np.ndarray:
    """Resampled means of the columns of ``X`` over their finite entries.

    Parameters
    ----------
    counts : numpy.ndarray, shape (n_boot, n)
        From :func:`resample_counts`.
    X : numpy.ndarray, shape (n, K)
        Per-document values; NaN or inf entries are left out of a column's mean.

    Returns
    -------
    numpy.ndarray, shape (n_boot, K)
        NaN where a resample holds no finite entry of a column.
    """
    ok = np.isfinite(X)
    num = counts @ np.where(ok, X, 0.0)
    den = counts @ ok.astype(np.float64)
    return safe_divide(num, den)


def percentile_interval(samples: np.ndarray, confidence: float) -> tuple[np.ndarray, np.ndarray]:
    """Percentile bootstrap interval along axis 0, ignoring NaN resamples.

    Parameters
    ----------
    samples : numpy.ndarray, shape (B, ...)
        Bootstrap replicates of a statistic.
    confidence : float
        Coverage in (0, 1), e.g. 0.95.

    Returns
    -------
    lo, hi : numpy.ndarray, shape (...)
        The ``(1 - confidence) / 2`` and ``(1 + confidence) / 2`` percentiles (linear
        interpolation); NaN where every resample is NaN.

    Raises
    ------
    ValueError
        If ``confidence`` is not in (0, 1).
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    alpha = 1.0 - confidence
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        lo = np.nanpercentile(samples, 100 * alpha / 2, axis=0)
        hi = np.nanpercentile(samples, 100 * (1 - alpha / 2), axis=0)
    return lo, hi
