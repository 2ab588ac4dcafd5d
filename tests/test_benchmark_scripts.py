"""Every script in benchmarks/ imports against the package as it is, so a moved or renamed name fails here,
not on the day the benchmark is next run (running them is the benchmarks' own business)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py"))


def test_there_are_benchmark_scripts():
    assert len(SCRIPTS) >= 10


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_the_script_imports(path):
    spec = importlib.util.spec_from_file_location(f"benchmark_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # module level only: main() runs under `if __name__ == "__main__"`
    assert callable(getattr(module, "main", None)), f"{path.name} has no main()"
