"""run_batch reproduces its recorded output: tokens and integers exactly, floats within rounding.

``tests/data/coupled_golden.json`` holds the records of :func:`run_batch` on the cases
below (floats as decimal JSON numbers, NaN as ``null``): synthetic table pairs (with and
without EOS, several documents), the §4 constructions around them, and a miniature
random-weight Llama with three documents of different prompt lengths under two presses,
at temperatures low enough that the branch start ``t*`` falls before the last chain
step, with and without EOS ids. Running this file as a script writes the records of the
code it imports to the path given.

Tokens, branch starts and every other integer must match exactly. The floats (TV, survival)
are sums and products whose last bits depend on the CPU's instructions (vectorised
reductions, fused multiply-adds), so they are compared within a stated tolerance:
:data:`FLOAT64_TOL` on the float64 table pairs (measured: at most 5.6e-17 between two x86
CPUs) and :data:`FLOAT32_TOL` on the float32 miniature model (measured: at most 9.3e-7).
"""

from __future__ import annotations

import json
import math
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from kvdiverge.engine.core.coupled import run_batch
from kvdiverge.engine.core.pairs import TableKernelPair
from kvdiverge.engine.core.sampling import Decoding
from kvdiverge.engine.llm.llm_pair import LLMKernelPair, PairDocument
from kvdiverge.models.standins import MINIATURE, random_model
from kvdiverge.testing.constructions import ConstructedPair

GOLDEN = Path(__file__).parent / "data" / "coupled_golden.json"
#: Largest difference allowed between a recorded and a computed float of the float64 table
#: pairs (probabilities in [0, 1]: a few hundred float64 rounding steps).
FLOAT64_TOL = 1e-12
#: The same for the float32 miniature model (probabilities from a float32 softmax: about a
#: hundred float32 rounding steps).
FLOAT32_TOL = 1e-5
TABLES = [
    (4, (), 0.5, 7, 5, ["a", "b", "c"]),
    (5, (4,), 0.3, 8, 6, ["x", "y"]),
    (3, (0, 2), 1.0, 6, 4, ["d0", "d1", "d2", "d3"]),
]
LLM = [
    ("noeos", None, 0.05, "KnormPress", 6),
    ("eos", list(range(0, 512, 3)), 0.05, "StreamingLLMPress", 7),
    ("warm", None, 0.02, "KnormPress", 5),
]


def table_fn(V, sharp):
    """History-dependent ``p``, ``q`` on ``V`` tokens, seeded by a CRC of the histories."""

    def fn(hx, hy):
        rx = np.random.default_rng(zlib.crc32(repr(("p", V) + tuple(hx)).encode()))
        ry = np.random.default_rng(zlib.crc32(repr(("q", V) + tuple(hy)).encode()))
        p = rx.dirichlet(np.full(V, sharp))
        q = 0.6 * p + 0.4 * ry.dirichlet(np.full(V, sharp)) if len(hy) % 3 else ry.dirichlet(np.full(V, sharp))
        return p / p.sum(), q / q.sum()

    return fn


def exact(records):
    """Records as JSON stores them: NaN as ``None``, so that they compare with the golden file."""

    def fix(v):
        if isinstance(v, float):
            return None if math.isnan(v) else v
        return [fix(x) for x in v] if isinstance(v, list) else v

    return [{k: fix(v) for k, v in r.items()} for r in records]


def mismatches(got, want, tol, where=""):
    """Where two records (or values) differ: integers, tokens, ``None`` and lengths exactly,
    floats by more than ``tol``. An empty list when they match."""
    if isinstance(want, dict) and isinstance(got, dict):
        if sorted(got) != sorted(want):
            return [f"{where}: fields {sorted(got)} != {sorted(want)}"]
        return [m for k in want for m in mismatches(got[k], want[k], tol, f"{where}.{k}")]
    if isinstance(want, list) and isinstance(got, list):
        if len(got) != len(want):
            return [f"{where}: length {len(got)} != {len(want)}"]
        return [m for i, (g, w) in enumerate(zip(got, want)) for m in mismatches(g, w, tol, f"{where}[{i}]")]
    if isinstance(want, float) and isinstance(got, float):
        return [] if abs(got - want) <= tol else [f"{where}: {got!r} != {want!r} (tolerance {tol:g})"]
    if type(got) is not type(want) or got != want:  # ints, tokens and None: exactly
        return [f"{where}: {got!r} != {want!r}"]
    return []


def table_cases():
    out = {}
    for V, eos, sharp, T, R, docs in TABLES:
        out[f"table V={V} eos={eos}"] = exact(
            run_batch(TableKernelPair(table_fn(V, sharp), V, eos), T, R, 3, "m", docs)
        )
        for end in ("lower", "upper"):
            pair = ConstructedPair(TableKernelPair(table_fn(V, sharp), V, eos), 2, end)
            out[f"constructed {end} V={V} eos={eos}"] = exact(run_batch(pair, T, R, 5, "m", docs))
    return out


def llm_cases():
    import kvpress

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # CPU reductions in one fixed order
    try:
        model = random_model(MINIATURE["llama-3.1-8b"], seed=1)
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(1, 500, (n,), generator=gen).tolist() for n in (11, 19, 27)]
        out = {}
        for name, eos, temperature, press, T in LLM:
            presses = [getattr(kvpress, press)(compression_ratio=0.5) for _ in prompts]
            pair = LLMKernelPair.from_documents(
                model,
                [PairDocument(ids, p) for ids, p in zip(prompts, presses)],
                decoding=Decoding(temperature=temperature, eos_ids=eos),
            )
            out[f"llm {name}"] = exact(run_batch(pair, T, 4, 7, "mini", ["p0", "p1", "p2"]))
        return out
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def golden():
    return json.loads(GOLDEN.read_text())


def test_table_pairs_and_constructions_reproduce_the_golden_records(golden):
    got = table_cases()
    assert sorted(got) == sorted(k for k in golden if not k.startswith("llm"))
    for key, records in got.items():
        assert not mismatches(records, golden[key], FLOAT64_TOL, key), mismatches(
            records, golden[key], FLOAT64_TOL, key
        )
    # the cases reach branch starts at several steps
    starts = {r["t_star"] for recs in got.values() for r in recs}
    assert {1, 2, 3, 4} <= starts


@pytest.mark.miniature
def test_miniature_model_batches_reproduce_the_golden_records(golden):
    got = llm_cases()
    assert sorted(got) == sorted(k for k in golden if k.startswith("llm"))
    for key, records in got.items():
        assert not mismatches(records, golden[key], FLOAT32_TOL, key), mismatches(
            records, golden[key], FLOAT32_TOL, key
        )
    # t* before the last chain step (so the rewind masks a suffix) and EOS-stopped chains
    assert all(r["t_star"] is None or r["t_star"] < r["T"] - 1 for r in got["llm noeos"])
    assert any(r["t_star"] is None for r in got["llm eos"])


def perturbed(value, delta):
    """``value`` with every nonzero float moved by ``delta`` (toward the inside of [0, 1])."""
    if isinstance(value, dict):
        return {k: perturbed(v, delta) for k, v in value.items()}
    if isinstance(value, list):
        return [perturbed(v, delta) for v in value]
    if isinstance(value, float) and 0.0 < value:
        return value - delta
    return value


def test_golden_records_hold_decimal_floats_and_accept_another_cpus_rounding(golden):
    text = GOLDEN.read_text()
    assert "0x" not in text and '"nan"' not in text  # no float bit patterns in the golden file
    tables = {k: v for k, v in golden.items() if not k.startswith("llm")}
    llm = {k: v for k, v in golden.items() if k.startswith("llm")}
    # the differences measured between two x86 CPUs pass ...
    assert not mismatches(perturbed(tables, 5.6e-17), tables, FLOAT64_TOL)
    assert not mismatches(perturbed(llm, 9.3e-7), llm, FLOAT32_TOL)
    # ... a float off by more than the tolerance, a changed token or branch start does not
    assert mismatches(perturbed(tables, 1e-9), tables, FLOAT64_TOL)
    key = next(k for k, recs in tables.items() if recs[0]["chain_token"])
    moved = json.loads(json.dumps(tables))
    moved[key][0]["chain_token"][0] += 1
    assert mismatches(moved, tables, FLOAT64_TOL) == [
        f".{key}[0].chain_token[0]: {moved[key][0]['chain_token'][0]} != {tables[key][0]['chain_token'][0]}"
    ]
    assert mismatches([{"t_star": 2}], [{"t_star": None}], FLOAT64_TOL)
    assert mismatches([{"t_star": 2.0}], [{"t_star": 2}], FLOAT64_TOL)  # an integer stays an integer


if __name__ == "__main__":
    Path(sys.argv[1]).write_text(json.dumps({**table_cases(), **llm_cases()}, sort_keys=True, allow_nan=False))
