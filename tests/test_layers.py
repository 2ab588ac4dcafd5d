"""The package's layers: import contracts, the estimate stage without torch, function length and parameters,
module length (at most 600 lines, the modules still over listed with why) and the count of function-local
imports of the package (a listed cap per module).

The contracts live in ``pyproject.toml`` (``[tool.importlinter]``) and are checked with
import-linter's ``lint-imports``, which follows every import statement, those inside
functions included:

- layers, top to bottom: ``doors``, ``planning``, ``jobs``, ``config``, ``data | models``
  (independent), ``settings``, ``testing``, ``engine``, ``estimation``, ``io``; a lower layer never
  imports a higher one; inside ``doors``, ``cli`` > ``measurement`` > ``results`` > ``screening``;
- no import cycles between the modules of any subpackage, nor between subpackages;
- ``estimation`` and ``io`` import neither torch, transformers, kvpress nor any layer above them;
- ``engine`` imports no package above it, nor ``report`` or ``testing``;
- ``report`` imports ``estimation`` only (no torch, engine, testing or the packages between), and
  nothing below the doors imports it;
- ``testing`` is protected: no module of the package outside it imports it (only the tests
  and benchmarks do).
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import polars as pl
import pytest
from polars.testing import assert_frame_equal

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
MAX_LINES = 60


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` on the package under ``root/src`` with ``root/pyproject.toml``'s contracts."""
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--config", str(root / "pyproject.toml")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def contracts() -> list[dict]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def test_import_contracts_are_kept():
    assert {c["type"] for c in contracts()} == {"layers", "acyclic_siblings", "forbidden", "protected"}
    res = lint_imports(REPO)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-2000:]
    assert f"Contracts: {len(contracts())} kept, 0 broken." in res.stdout, res.stdout[-3000:]


def test_import_contracts_catch_a_lazy_torch_import_a_cycle_and_a_testing_import(tmp_path):
    # the same contracts on a copy of the package with three violations added inside functions
    shutil.copytree(SRC, tmp_path / "src", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    with open(tmp_path / "src/kvdiverge/estimation/tables.py", "a") as f:
        f.write("\n\ndef _violation():\n    import torch  # noqa\n")
    with open(tmp_path / "src/kvdiverge/engine/core/coupled.py", "a") as f:
        f.write("\n\ndef _violation():\n    from kvdiverge.engine import runner  # noqa\n")
    with open(tmp_path / "src/kvdiverge/models/loading.py", "a") as f:
        f.write("\n\ndef _violation():\n    from kvdiverge.testing import exact  # noqa\n")
    res = lint_imports(tmp_path)
    assert res.returncode != 0
    broken = {line.removesuffix(" BROKEN") for line in res.stdout.splitlines() if line.endswith(" BROKEN")}
    assert broken == {
        "No import cycles between modules or subpackages",
        "The engine's parts, forced down to hf",
        "Estimation and io run without torch, the model libraries or the engine",
        "Only the tests import testing: no module outside kvdiverge.testing does",
    }, res.stdout[-3000:]
    assert "kvdiverge.estimation.tables -> torch" in res.stdout
    assert "No cycles are allowed in kvdiverge.engine." in res.stdout
    assert "- .core -> .runner (1 import)" in res.stdout
    assert "kvdiverge.engine.core.coupled -> kvdiverge.engine.runner" in res.stdout
    assert "- kvdiverge.models.loading -> kvdiverge.testing.exact" in res.stdout


# --------------------------------------------------------------------------- estimate stage

#: Runs the workflow's estimate, pool and gaps adapters (workflow/scripts) with a stand-in
#: ``snakemake`` object, then reports which model or engine modules were imported.
STAGE_SCRIPT = r"""
import json, runpy, sys
from pathlib import Path
from types import SimpleNamespace as NS

root, work = Path(sys.argv[1]), Path(sys.argv[2])
scripts = root / "workflow" / "scripts"
spec = json.loads((work / "spec.json").read_text())
est = work / "estimates"
for policy, shards in spec["shards"].items():
    sm = NS(input=shards, log=[str(work / f"estimate-{policy}.log")],
            wildcards=NS(model="synthetic", policy=policy, split="exploratory"),
            params=NS(settings=spec["settings"][policy], window=2, windows={"early": [1, 2], "late": [3, 5]},
                      drift={"max_period": 5, "min_repeats": 3}),
            output=NS(replicates=str(est / f"{policy}.replicates.parquet"),
                      documents=str(est / f"{policy}.documents.parquet"),
                      drift=str(est / f"{policy}.drift.parquet")))
    runpy.run_path(str(scripts / "estimate.py"), init_globals={"snakemake": sm})
docs = [str(est / f"{p}.documents.parquet") for p in spec["shards"]]
ana = work / "analysis"
names = ["documents", "pooled", "timing", "survival", "branch_tv", "variance"]
out = NS(**{f"{n}_{k}": str(ana / f"{n}.{k}") for n in names for k in ("parquet", "csv")})
params = NS(boot={"n_boot": 50, "confidence": 0.9, "seed": 5})
runpy.run_path(str(scripts / "pool.py"), init_globals={"snakemake": NS(
    input=docs, log=[str(work / "pool.log")], output=out, params=params)})
runpy.run_path(str(scripts / "gaps.py"), init_globals={"snakemake": NS(
    input=docs, log=[str(work / "gaps.log")], params=NS(gaps=[["a", "b"]], models=None, **vars(params)),
    output=NS(parquet=str(ana / "gaps.parquet"), csv=str(ana / "gaps.csv")))})
runpy.run_path(str(scripts / "drift.py"), init_globals={"snakemake": NS(
    input=[str(est / f"{p}.drift.parquet") for p in spec["shards"]], log=[str(work / "drift.log")], params=params,
    output=NS(parquet=str(ana / "drift.parquet"), csv=str(ana / "drift.csv"),
              survival_parquet=str(ana / "length_survival.parquet"), survival_csv=str(ana / "length_survival.csv")))})
heavy = sorted(m for m in sys.modules
               if m.split(".")[0] in {"torch", "transformers", "kvpress", "accelerate"}
               or (m.startswith("kvdiverge.engine") and m not in TORCH_FREE_ENGINE)
               or m.startswith(("kvdiverge.testing", "kvdiverge.report")))
print(json.dumps(heavy))
"""


@pytest.fixture(scope="module")
def synthetic_shards(tmp_path_factory, kernel):
    """Two policies ``a``, ``b`` of model ``synthetic``, two shards of two documents each (T=5, R=4)."""
    from kvdiverge.config.provenance import shard_metadata
    from kvdiverge.engine.core.coupled import simulate
    from kvdiverge.engine.core.pairs import TableKernelPair
    from kvdiverge.io.files import write_parquet_atomic

    work = tmp_path_factory.mktemp("stage")
    spec = {"shards": {}, "settings": {}}
    for k, policy in enumerate(["a", "b"]):
        settings = {"policy": policy, "T": 5, "R": 4}
        paths = []
        for shard in range(2):
            frame = pl.concat(
                [
                    simulate(TableKernelPair(kernel, 3), 5, 4, seed=10 * k + shard, doc_id=f"d{shard}{i}")
                    for i in range(2)
                ]
            )
            frame = frame.with_columns(policy=pl.lit(policy), split=pl.lit("exploratory"))
            path = work / "shards" / policy / f"shard-{shard}.parquet"
            meta = shard_metadata(
                settings, model="synthetic", policy=policy, split="exploratory", shard=shard, eos_ids=[]
            )
            write_parquet_atomic(frame, path, metadata=meta)
            paths.append(str(path))
        spec["shards"][policy], spec["settings"][policy] = paths, settings
    (work / "spec.json").write_text(json.dumps(spec))
    return work


def test_estimate_stage_runs_without_torch(synthetic_shards):
    work = synthetic_shards
    script = work / "stage.py"
    script.write_text(f"TORCH_FREE_ENGINE = {sorted(TORCH_FREE_ENGINE)!r}\n" + STAGE_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    res = subprocess.run(
        [sys.executable, str(script), str(REPO), str(work)], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert json.loads(res.stdout.strip().splitlines()[-1]) == []

    # the subprocess's tables are those of the same functions run here
    from kvdiverge.estimation.bootstrap import Bootstrap
    from kvdiverge.estimation.estimators import read_shards
    from kvdiverge.estimation.tables import estimate, gaps, pool

    spec = json.loads((work / "spec.json").read_text())
    docs = []
    for policy, paths in spec["shards"].items():
        reps, d = estimate(read_shards(paths), 2, {"early": [1, 2], "late": [3, 5]})
        assert d.height == 4 and reps.height == 16
        assert_frame_equal(pl.read_parquet(work / "estimates" / f"{policy}.documents.parquet"), d)
        assert_frame_equal(pl.read_parquet(work / "estimates" / f"{policy}.replicates.parquet"), reps)
        docs.append(d)
    docs = pl.concat(docs)
    for name, frame in pool(docs, Bootstrap(50, 0.9, 5)).items():
        assert_frame_equal(pl.read_parquet(work / "analysis" / f"{name}.parquet"), frame)
    table = gaps(docs, [["a", "b"]], Bootstrap(50, 0.9, 5))
    assert table.height == 4
    assert_frame_equal(pl.read_parquet(work / "analysis" / "gaps.parquet"), table)
    drift = pl.read_parquet(work / "analysis" / "drift.parquet")
    assert drift.height == 2 * 6 and set(drift["policy"]) == {"a", "b"}


#: The engine's modules that load no torch, transformers nor kvpress when imported (docs/internals.md): the
#: press catalogue, the cache facts and llama.cpp's cache types the config check reads, the errors and the
#: decoding settings, and the packages' own modules (which import nothing).
TORCH_FREE_ENGINE = {
    "kvdiverge.engine",
    "kvdiverge.engine.core",
    "kvdiverge.engine.core.documents",
    "kvdiverge.engine.core.errors",
    "kvdiverge.engine.core.sampling",
    "kvdiverge.engine.presses",
    "kvdiverge.engine.presses.cache_facts",
    "kvdiverge.engine.presses.catalogue",
    "kvdiverge.engine.llamacpp",
    "kvdiverge.engine.llamacpp.caches",
}

#: A workflow parse in a fresh interpreter: ``import`` the modules ``workflow/rules/common.smk`` imports at its
#: top, or ``snakemake -n`` a config through Snakemake's own command line; prints the heavy modules loaded.
PARSE_SCRIPT = r"""
import json, os, re, sys
from pathlib import Path

root, mode, work, configfile = sys.argv[1:5]
os.chdir(root)
if mode == "imports":
    common = Path(root, "workflow", "rules", "common.smk").read_text()
    names = re.findall(r"^import (kvdiverge[.\w]*)$", common, re.M)
    assert len(names) >= 5, names
    for name in names:
        __import__(name)
else:
    from snakemake.cli import args_to_api, parse_args

    parser, args = parse_args(["-n", "-q", "-s", str(Path(root, "Snakefile")), "-d", work, "--configfile", configfile])
    assert args_to_api(args, parser), "the dry run failed"
    assert "kvdiverge.config.workflow" in sys.modules and "kvdiverge.engine.presses.catalogue" in sys.modules
heavy = sorted(m for m in sys.modules
               if m.split(".")[0] in {"torch", "transformers", "kvpress", "accelerate"}
               or (m.startswith("kvdiverge.engine") and m not in TORCH_FREE_ENGINE))
print(json.dumps(heavy))
"""


@pytest.mark.workflow
@pytest.mark.parametrize("mode, config", [("imports", ""), ("dry run", "paper.yaml"), ("dry run", "config.yaml")])
def test_the_workflows_parse_loads_neither_torch_nor_kvpress(tmp_path, mode, config):
    """Every Snakemake process parses the Snakefile (``snakemake -n``, and each job's own parse): the config
    check reads the press catalogue, not the engine, and a dry run counts no GPUs, so no parse loads torch,
    transformers or kvpress (config/paper.yaml's models run on CUDA; the device count is left to the run)."""
    script = tmp_path / "parse.py"
    script.write_text(f"TORCH_FREE_ENGINE = {sorted(TORCH_FREE_ENGINE)!r}\n" + PARSE_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "KVDIVERGE_GPUS"} | {"PYTHONPATH": str(SRC)}
    configfile = str(REPO / "config" / config) if config else ""
    res = subprocess.run(
        [sys.executable, str(script), str(REPO), mode.split()[0], str(tmp_path / "work"), configfile],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert json.loads(res.stdout.strip().splitlines()[-1]) == []
    if config == "paper.yaml":
        assert "the visible CUDA devices are counted when the run starts" in res.stderr + res.stdout


# --------------------------------------------------------------------------- function length (every module of the package)


def code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from ``def`` to the function's last line, its docstring not counted."""
    lines = node.end_lineno - node.lineno + 1
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        lines -= first.end_lineno - first.lineno + 1
    return lines


def long_functions(path: Path, limit: int = MAX_LINES) -> list[str]:
    """``name (lines)`` of every function or method in ``path`` longer than ``limit`` lines."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        f"{node.name} ({code_lines(node)} lines)"
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and code_lines(node) > limit
    ]


def test_long_functions_are_found(tmp_path):
    source = "def short():\n    '''doc\n\n    more doc'''\n    return 1\n\n\ndef long():\n" + "    x = 1\n" * 61
    path = tmp_path / "probe.py"
    path.write_text(source)
    assert long_functions(path) == ["long (62 lines)"]
    assert long_functions(path, limit=62) == []


PACKAGE = SRC / "kvdiverge"
MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_of_the_package_is_checked():
    names = {str(p.relative_to(PACKAGE)) for p in MODULES}
    assert {
        "doors/cli.py",
        "doors/measurement.py",
        "engine/runner.py",
        "engine/core/coupled.py",
        "engine/llm/llm_pair.py",
        "estimation/estimators.py",
        "config/workflow.py",
        "report/formatting.py",
        "testing/exact.py",
    } <= names


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_functions_are_short(path):
    assert long_functions(path) == [], f"{path.name}: functions over {MAX_LINES} lines"


# --------------------------------------------------------------------------- parameter count (every module of the package)

MAX_PARAMETERS = 7

#: Functions allowed more than :data:`MAX_PARAMETERS` parameters, by ``module:qualified name``, and why.
#: A function leaves the list when it is brought under the limit (the test refuses a stale entry).
MANY_PARAMETERS = {
    "doors/measurement.py:measure": "the public keyword options of kvdiverge.measure, one per config setting",
    "engine/llm/planner.py:plan_batch": "the planner's sizes, one keyword each",
    "engine/llm/attention.py:grouped_sdpa": "torch's scaled_dot_product_attention's arguments",
    "engine/core/coupling.py:maximal_coupling": "the coupling's tensors and options",
    "engine/core/errors.py:NonFiniteLogitsError.__init__": "what the message names",
}


def parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """Parameter names of a function, keyword-only and ``*args``/``**kwargs`` included, ``self``/``cls`` not."""
    a = node.args
    names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
    names += [p.arg for p in (a.vararg, a.kwarg) if p is not None]
    return [n for n in names if n not in ("self", "cls")]


def many_parameters(path: Path, limit: int = MAX_PARAMETERS) -> dict[str, int]:
    """``{qualified name: parameters}`` of every function or method in ``path`` with more than ``limit``."""
    found = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if len(parameters(child)) > limit:
                    found[f"{prefix}{child.name}"] = len(parameters(child))
                visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(path.read_text(), filename=str(path)), "")
    return found


def test_many_parameters_are_found(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(
        "def ok(a, b, c, d, e, f, g): pass\n"
        "def wide(a, b, c, d, *, e, f, g, h): pass\n"
        "class K:\n    def m(self, a, b, c, d, e, f, g): pass\n    def n(self, *args, a, b, c, d, e, f, **kw): pass\n"
    )
    assert many_parameters(path) == {"wide": 8, "K.n": 8}


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_functions_take_few_parameters(path):
    module = str(path.relative_to(PACKAGE))
    found = {f"{module}:{name}": n for name, n in many_parameters(path).items()}
    unlisted = {name: n for name, n in found.items() if name not in MANY_PARAMETERS}
    assert unlisted == {}, f"functions over {MAX_PARAMETERS} parameters: take a settings object"
    stale = [name for name in MANY_PARAMETERS if name.startswith(f"{module}:") and name not in found]
    assert stale == [], "listed in MANY_PARAMETERS but no longer over the limit: remove the entry"


# --------------------------------------------------------------------------- module length (every module of the package)

MAX_MODULE_LINES = 600

#: Modules allowed more than :data:`MAX_MODULE_LINES` lines, by path under ``src/kvdiverge``, and why.
#: A module leaves the list when it is split under the limit (the test refuses a stale entry).
LONG_MODULES: dict[str, str] = {}


def module_lines(path: Path) -> int:
    """Lines of the file ``path`` (as ``wc -l`` counts them for a file ending in a newline)."""
    return len(path.read_text().splitlines())


def test_module_lines_are_counted(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text('"""doc."""\n\n' + "x = 1\n" * 598)
    assert module_lines(path) == 600
    path.write_text(path.read_text() + "y = 2\n")
    assert module_lines(path) == 601


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_are_short(path):
    module, lines = str(path.relative_to(PACKAGE)), module_lines(path)
    if module in LONG_MODULES:
        assert lines > MAX_MODULE_LINES, f"{module} is listed in LONG_MODULES but has {lines} lines: remove the entry"
    else:
        assert lines <= MAX_MODULE_LINES, f"{module}: {lines} lines, over {MAX_MODULE_LINES}: split it by what it holds"


def test_every_long_module_listed_exists():
    assert [m for m in LONG_MODULES if not (PACKAGE / m).is_file()] == [], "remove the entries of modules gone"


# --------------------------------------------------------------------------- function-local imports of the package

#: Imports of kvdiverge modules inside function bodies, per module under ``src/kvdiverge``: each
#: one defers loading what the module's importers must not load (torch, the engine, a door), or
#: breaks a cycle. The test refuses a module with more than its entry, or with fewer (lower the entry
#: and :data:`MAX_LOCAL_IMPORTS` with it): the count cannot grow unnoticed.
LOCAL_IMPORTS = {
    "__init__.py": 2,
    "config/workflow.py": 1,
    "doors/cli.py": 1,
    "doors/results.py": 1,
    "engine/core/sampling.py": 1,
    "models/gguf_config.py": 1,
    "models/gguf_tokenizer.py": 1,
    "models/loading.py": 1,
    "planning/cost.py": 1,
}
#: The package's function-local imports of kvdiverge modules, all modules together.
MAX_LOCAL_IMPORTS = 10


def local_imports(path: Path) -> list[str]:
    """``line: module`` of every ``import kvdiverge...`` / ``from kvdiverge... import`` inside a function
    body of ``path`` (methods and nested functions included; module-level and class-level ones not)."""
    found = []

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in child.names] if isinstance(child, ast.Import) else [child.module or ""]
                found.extend(f"{child.lineno}: {n}" for n in names if n.split(".")[0] == "kvdiverge")
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text(), filename=str(path)), False)
    return found


def test_local_imports_are_found(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(
        "import kvdiverge.io.files\nfrom kvdiverge.io import render\n\n\n"
        "def f():\n    import torch\n    from kvdiverge.io.files import save_table\n\n"
        "    def g():\n        import kvdiverge.io.render, json\n\n"
        "class K:\n    from kvdiverge.io import files\n\n    def m(self):\n        from kvdiverge import measure\n"
    )
    assert local_imports(path) == ["7: kvdiverge.io.files", "10: kvdiverge.io.render", "16: kvdiverge"]


def test_local_imports_of_the_package_are_counted():
    found = {str(p.relative_to(PACKAGE)): local_imports(p) for p in MODULES}
    counts = {module: len(lines) for module, lines in found.items() if lines}
    more = {m: found[m] for m, n in counts.items() if n > LOCAL_IMPORTS.get(m, 0)}
    assert more == {}, "new function-local imports of kvdiverge modules: import at the top, or raise the entry"
    fewer = {m: (counts.get(m, 0), n) for m, n in LOCAL_IMPORTS.items() if counts.get(m, 0) < n}
    assert fewer == {}, "fewer function-local imports than LOCAL_IMPORTS lists (found, listed): lower the entry"
    assert sum(LOCAL_IMPORTS.values()) == MAX_LOCAL_IMPORTS
    assert sum(counts.values()) <= MAX_LOCAL_IMPORTS
