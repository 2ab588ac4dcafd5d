"""The documentation: the site builds with every reference resolved, the module map of
``docs/internals.md`` names every module and places each named function in its module, the
README stays short and links to pages that exist."""

from __future__ import annotations

import importlib
import pkgutil
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kvdiverge

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def package_modules() -> set[str]:
    """Every module under src/kvdiverge, as ``engine.core.coupled`` (packages' ``__init__`` left out)."""
    found = set()
    for info in pkgutil.walk_packages(kvdiverge.__path__, prefix="kvdiverge."):
        if not info.ispkg:
            found.add(info.name.removeprefix("kvdiverge."))
    return found


def map_rows() -> list[tuple[list[str], list[str]]]:
    """The "Layers" table of docs/internals.md, one (modules, names) per row.

    A row's first column is the layer (`report/`, `engine/llm/`, ...; empty: the row above's, and
    "package" for the top-level modules); the second names its modules in backticks; every backticked
    name of the third (``run_batch``, ``LLMKernelPair.keep_rows``, ``kvdiverge.measure``) is one
    that one of the row's modules defines, or, starting with ``kvdiverge.``, one that exists."""
    text = (DOCS / "internals.md").read_text(encoding="utf-8")
    section = text.split("\n## Layers", 1)[1].split("\n## ", 1)[0]
    table = [block for block in section.split("\n\n") if block.startswith("| layer |")][0]
    rows, layer = [], ""
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == 3, line
        if cells[0]:
            layer = "" if cells[0] == "package" else cells[0].strip("`")
        modules = [layer.replace("/", ".") + m for m in re.findall(r"`([a-z_]+)`", cells[1])]
        rows.append((modules, [n for n in re.findall(r"`([^`]+)`", cells[2]) if NAME.fullmatch(n)]))
    return rows


def test_the_module_map_lists_every_module_once():
    listed = [m for modules, _ in map_rows() for m in modules]
    assert len(listed) == len(set(listed)), f"listed twice: {sorted({m for m in listed if listed.count(m) > 1})}"
    assert set(listed) == package_modules(), (
        f"missing from docs/internals.md: {sorted(package_modules() - set(listed))}; "
        f"not in the package: {sorted(set(listed) - package_modules())}"
    )


def defined_in(module, name: str) -> bool:
    """Whether ``module`` defines ``name`` (a dotted name: its first part, then attributes of it).

    A function or class must be defined there (``__module__``), not imported from elsewhere; a
    constant only needs to be there."""
    first, *rest = name.split(".")
    obj = getattr(module, first, None)
    if obj is None or getattr(obj, "__module__", module.__name__) != module.__name__:
        return False
    for part in rest:
        obj = getattr(obj, part, None)
    return obj is not None


def absolute(name: str) -> bool:
    """Whether ``kvdiverge.x.y`` names an object that exists: the longest importable module, then attributes."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part, None)
        return obj is not None
    return False


def test_the_module_map_places_every_name_in_its_module():
    misplaced = []
    for modules, names in map_rows():
        loaded = [importlib.import_module(f"kvdiverge.{m}") for m in modules]
        for name in names:
            if not (absolute(name) if name.startswith("kvdiverge.") else any(defined_in(m, name) for m in loaded)):
                misplaced.append(f"{name} ({', '.join(modules)})")
    assert not misplaced, f"names docs/internals.md places in modules that do not define them: {misplaced}"


@pytest.mark.docs
def test_the_site_builds_with_every_reference_resolved(tmp_path):
    """``sphinx-build -W`` (as ``make docs``): a broken cross-reference in a docstring or page fails.

    The API reference's stubs are generated into docs/reference/api (git-ignored); the site goes
    to a temporary directory."""
    command = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", "docs", str(tmp_path)]
    start = time.perf_counter()
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    print(f"\n[docs] sphinx-build: {time.perf_counter() - start:.1f} s")
    assert out.returncode == 0, out.stderr[-4000:]
    api = (tmp_path / "reference" / "api" / "kvdiverge.engine.core.sampling.html").read_text(encoding="utf-8")
    assert 'id="kvdiverge.engine.core.sampling.Sampling"' in api  # the docstrings made it into the reference
    index = (tmp_path / "index.html").read_text(encoding="utf-8")
    assert all(f'href="{page}.html"' in index for page in ("results", "benchmarks", "internals", "presses", "api"))


def test_make_docs_builds_the_site_with_warnings_as_errors():
    make = (ROOT / "Makefile").read_text()
    docs = re.search(r"^docs: \$\(STAMP\)\n\t(.*)$", make, re.M).group(1)
    assert docs == "$(BIN)/sphinx-build -W --keep-going -q -b html docs docs/_build/html"
    assert "docs/_build/" in (ROOT / ".gitignore").read_text().splitlines()


def test_the_readme_is_short_and_links_to_files_that_exist():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    links = re.findall(r"\]\(([^)#:]+)\)", text)
    assert {"docs/results.md", "docs/benchmarks.md", "CONTRIBUTING.md", "docs/api.md"} <= set(links)
    assert [link for link in links if not (ROOT / link).exists()] == []


def readme_section(title: str) -> str:
    """The README's section ``## title``, its heading to the next one's, the blank line before that left out."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return f"## {title}" + text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0].rstrip("\n")


def test_the_readme_shows_a_figure_and_a_table_before_its_first_prose_after_the_quick_start():
    """After the quick start's commands, the default run's survival figure (a PNG committed under docs/)
    and a result table come before any paragraph of prose."""
    section = readme_section("Quick start")
    after = section.split("```bash", 1)[1].split("```", 1)[1]
    blocks = [b.strip() for b in after.split("\n\n") if b.strip()]
    image = re.fullmatch(r"!\[[^\]]+\]\((docs/images/[\w-]+\.png)\)", blocks[0])
    assert image, blocks[0]
    assert (ROOT / image.group(1)).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = blocks[1].splitlines()
    assert all(row.startswith("|") for row in rows) and len(rows) == 2 + 3  # header, rule, three rows
    assert "`make run`" in blocks[2] and "results/analysis/pooled.csv" in blocks[2]


def test_measure_one_press_is_at_most_thirty_lines_and_the_api_page_shows_its_examples_word_for_word():
    """The README's two examples (run by tests/test_measure.py) are the ones docs/api.md explains."""
    section = readme_section("Measure one press")
    assert len(section.splitlines()) <= 30
    api = (DOCS / "api.md").read_text(encoding="utf-8")
    for language in ("python", "bash"):
        pattern = rf"```{language}\n(.*?)```"
        (example,) = re.findall(pattern, section, flags=re.S)
        assert example in re.findall(pattern, api, flags=re.S), language
    assert "(docs/api.md)" in section


def test_the_docs_cite_no_issue_numbers_and_no_path_outside_the_repository():
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *DOCS.glob("*.md")]
    sources = list((ROOT / "src" / "kvdiverge").rglob("*.py"))
    for path in pages + sources:
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"\b[Ii]ssues? ?#?\d+", text), path
        assert "shared/design" not in text and "../shared" not in text, path
