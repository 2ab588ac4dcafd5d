"""Uniform streams: every random number of a replicate, by purpose (estimators.md §5).

Every uniform comes from a generator derived from (master seed, model, document id,
replicate, purpose), not the policy, and tokens are drawn by inverse CDF, so policies
compared on one document share random numbers (common random numbers).
"""

from __future__ import annotations

import hashlib

import numpy as np

__all__ = ["PURPOSES", "uniform_streams"]

#: Purposes of the uniform streams; the code is part of each generator's seed.
PURPOSES = {
    "chain": 0,  # overlap draw of the agreement chain, per step
    "divergence": 1,  # U_t of tau_naive, per step
    "residual_x": 2,  # divergent pair at each chain step, reference side
    "residual_y": 3,  # divergent pair at each chain step, evicted side
    "t_star": 4,  # t* drawn from f_hat when tau_naive > T (first entry)
    "coin": 5,  # branch: agree (overlap) or split (residuals), per lag
    "overlap": 6,  # branch: overlap draw, per lag
    "branch_x": 7,  # branch: reference residual draw, per lag
    "branch_y": 8,  # branch: evicted residual draw, per lag
}


def _stable_int(text: str) -> int:
    """A 64-bit integer from a string, stable across runs and machines (BLAKE2b)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def uniform_streams(seed: int, model: str, doc_id: str, replicate: int, T: int) -> dict[str, np.ndarray]:
    """All uniforms one replicate uses, by purpose.

    Each purpose has its own generator, seeded by
    ``SeedSequence(seed, spawn_key=(hash(model), hash(doc_id), replicate, purpose))``,
    so a shard reproduces alone, in any order, and the policy does not enter.

    Returns
    -------
    dict[str, numpy.ndarray]
        Purpose name -> uniforms in [0, 1), float64, shape (T,).
    """
    streams = {}
    for purpose, code in PURPOSES.items():
        seq = np.random.SeedSequence(
            entropy=int(seed), spawn_key=(_stable_int(model), _stable_int(doc_id), int(replicate), code)
        )
        streams[purpose] = np.random.default_rng(seq).random(T)
    return streams
