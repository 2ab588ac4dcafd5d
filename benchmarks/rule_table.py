"""Per-rule cost of a workflow run, from its Snakemake ``benchmark:`` files, as a markdown table.

Every job writes ``{results_dir}/benchmarks/<rule>/<job>.tsv`` (Snakemake's benchmark: ``s`` wall
seconds, ``max_rss`` peak resident memory in MB, ``cpu_time`` seconds). This prints, per rule,
the jobs, the longest and the median wall time, the largest peak memory, the summed CPU time,
and the request those figures support, with a stated margin (twice the peak memory, rounded up
to 500 MB; three times the longest wall time, rounded up to 5 minutes; at least 10 minutes);
then the files and bytes of each result folder::

    python benchmarks/rule_table.py /tmp/rehearsal/work/results-rehearsal
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import polars as pl

MEM_MARGIN, TIME_MARGIN = 2.0, 3.0


def rule_rows(results: Path) -> list[dict]:
    """One dict per rule: jobs, wall (max, median), max_rss, cpu total, requests."""
    rows = []
    for rule_dir in sorted(p for p in (results / "benchmarks").iterdir() if p.is_dir()):
        frames = [pl.read_csv(f, separator="\t") for f in sorted(rule_dir.rglob("*.tsv"))]
        if not frames:
            continue
        bench = pl.concat([f.select("s", "max_rss", "cpu_time") for f in frames])
        wall = bench["s"].to_list()
        rss = float(bench["max_rss"].max())
        rows.append(
            {
                "rule": rule_dir.name,
                "jobs": len(wall),
                "max_wall_s": max(wall),
                "median_wall_s": statistics.median(wall),
                "max_rss_mb": rss,
                "cpu_s": float(bench["cpu_time"].sum()),
                "mem_mb": max(500, math.ceil(MEM_MARGIN * rss / 500) * 500),
                "runtime_min": max(10, math.ceil(TIME_MARGIN * max(wall) / 60 / 5) * 5),
            }
        )
    return rows


def markdown(rows: list[dict]) -> str:
    head = "| rule | jobs | max wall s | median wall s | max peak RSS MB | total CPU s | mem_mb | runtime min |"
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        lines.append(
            f"| {r['rule']} | {r['jobs']} | {r['max_wall_s']:.1f} | {r['median_wall_s']:.1f} | {r['max_rss_mb']:.0f} "
            f"| {r['cpu_s']:.0f} | {r['mem_mb']} | {r['runtime_min']} |"
        )
    total_cpu = sum(r["cpu_s"] for r in rows)
    lines.append(f"| total | {sum(r['jobs'] for r in rows)} | | | | {total_cpu:.0f} | | |")
    return "\n".join(lines)


def folder_sizes(results: Path) -> str:
    """Files and MB of each result folder but logs and benchmarks, as a markdown table."""
    lines = ["| folder | files | MB |", "|---|---|---|"]
    for d in sorted(p for p in results.iterdir() if p.is_dir() and p.name not in ("logs", "benchmarks")):
        files = [p for p in d.rglob("*") if p.is_file()]
        lines.append(f"| {d.name} | {len(files)} | {sum(p.stat().st_size for p in files) / 1e6:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, help="a run's results directory (with benchmarks/)")
    args = ap.parse_args(argv)
    print(markdown(rule_rows(args.results)))
    print()
    print(folder_sizes(args.results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
