"""run_batch reproduces its recorded output bit for bit.

``tests/data/coupled_golden.json`` holds the records of :func:`run_batch` on the cases
below (floats as ``float.hex``, NaN as ``"nan"``): synthetic table pairs (with and
without EOS, several documents), the §4 constructions around them, and a miniature
random-weight Llama with three documents of different prompt lengths under two presses,
at temperatures low enough that the branch start ``t*`` falls before the last chain
step, with and without EOS ids. Running this file as a script writes the records of the
code it imports to the path given.
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
from kvdiverge.engine.llm.llm_pair import LLMKernelPair
from kvdiverge.engine.core.pairs import TableKernelPair
from kvdiverge.reference.constructions import ConstructedPair
from kvdiverge.reference.miniatures import MINIATURE, random_model

GOLDEN = Path(__file__).parent / "data" / "coupled_golden.json"
TABLES = [(4, (), 0.5, 7, 5, ["a", "b", "c"]), (5, (4,), 0.3, 8, 6, ["x", "y"]),
          (3, (0, 2), 1.0, 6, 4, ["d0", "d1", "d2", "d3"])]
LLM = [("noeos", None, 0.05, "KnormPress", 6), ("eos", list(range(0, 512, 3)), 0.05, "StreamingLLMPress", 7),
       ("warm", None, 0.02, "KnormPress", 5)]


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
    """Records with floats as hex strings and NaN as ``"nan"``, so == compares bits."""
    def fix(v):
        if isinstance(v, float):
            return "nan" if math.isnan(v) else float.hex(v)
        return [fix(x) for x in v] if isinstance(v, list) else v
    return [{k: fix(v) for k, v in r.items()} for r in records]


def table_cases():
    out = {}
    for V, eos, sharp, T, R, docs in TABLES:
        out[f"table V={V} eos={eos}"] = exact(run_batch(TableKernelPair(table_fn(V, sharp), V, eos), T, R, 3, "m", docs))
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
            pair = LLMKernelPair.from_documents(model, prompts, presses, [None] * 3, temperature=temperature,
                                                eos_ids=eos)
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
        assert records == golden[key], key
    # the cases reach branch starts at several steps
    starts = {r["t_star"] for recs in got.values() for r in recs}
    assert {1, 2, 3, 4} <= starts


@pytest.mark.miniature
def test_miniature_model_batches_reproduce_the_golden_records(golden):
    got = llm_cases()
    for key, records in got.items():
        assert records == golden[key], key
    # t* before the last chain step (so the rewind masks a suffix) and EOS-stopped chains
    assert all(r["t_star"] is None or r["t_star"] < r["T"] - 1 for r in got["llm noeos"])
    assert any(r["t_star"] is None for r in got["llm eos"])


if __name__ == "__main__":
    Path(sys.argv[1]).write_text(json.dumps({**table_cases(), **llm_cases()}, sort_keys=True))
