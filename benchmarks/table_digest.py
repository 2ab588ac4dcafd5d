"""A digest of a workflow run's tables: schema and rows of every parquet file, timing left out.

Two runs of the same config on the same machine give the same digest when the code computes
the same tables; a restructuring that must not change results is checked by running the smoke
config before and after and comparing the digests::

    PYTHONPATH=$PWD/src .venv/bin/snakemake --configfile config/smoke.yaml --cores 2 -d /tmp/smoke-a
    python benchmarks/table_digest.py /tmp/smoke-a/results-smoke             # prints one digest per file, then the total
    python benchmarks/table_digest.py /tmp/smoke-a/results-smoke /tmp/smoke-b/results-smoke   # compares; exit 1 if they differ

Timing columns (wall-clock seconds: :data:`TIMING`) are dropped; the rest of each file is hashed
as its schema (names and dtypes, in order) and its rows (in order, as polars' newline-delimited
JSON lines, floats written so that they round-trip: bit for bit). Parquet key-value metadata (library versions) is
not part of the digest.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import polars as pl

#: Columns that hold wall-clock time, left out of the digest.
TIMING = frozenset({"seconds", "wall_seconds", "wall_s", "elapsed"})


def file_digest(path: Path) -> str:
    """SHA-256 (hex) of one parquet file's schema and rows, timing columns dropped."""
    frame = pl.read_parquet(path)
    frame = frame.drop([c for c in frame.columns if c in TIMING])
    h = hashlib.sha256(repr(list(frame.schema.items())).encode())
    h.update(frame.write_ndjson().encode())  # floats written to round-trip: bit for bit
    return h.hexdigest()


def run_digest(results: Path) -> dict[str, str]:
    """``{relative path: digest}`` of every parquet file under ``results`` (sorted), and ``"total"``."""
    files = {str(p.relative_to(results)): file_digest(p) for p in sorted(results.rglob("*.parquet"))}
    total = hashlib.sha256("".join(f"{k}={v}\n" for k, v in files.items()).encode()).hexdigest()
    return {**files, "total": total}


def main(argv: list[str] | None = None) -> int:
    """Print one run's digests, or compare two runs' (exit 1 and name the files that differ)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", type=Path, help="a results directory; two to compare")
    args = ap.parse_args(argv)
    if len(args.results) == 1:
        for name, digest in run_digest(args.results[0]).items():
            print(f"{digest[:16]}  {name}")
        return 0
    a, b = (run_digest(r) for r in args.results[:2])
    differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k) and k != "total")
    for name in differ:
        print(f"differs: {name}")
    print(f"total {a['total'][:16]} vs {b['total'][:16]}: {'equal' if not differ else 'DIFFERENT'}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
