# kvdiverge: how KV-cache eviction changes LLM generation.
#
#   snakemake --cores all                                  # embedded default (CPU)
#   snakemake --configfile config/paper.yaml --profile profiles/slurm
#   snakemake --cores 2 results/prompts/smollm2-135m.parquet   # one stage by its file
#
# Stages (workflow/rules): corpus -> prompts -> generate -> estimate -> analyse -> report;
# teacher (teacher-forced fidelity) beside generate, from the prompts.

import os

from snakemake.utils import min_version

min_version("9.0")

# With --use-conda, environment.post-deploy.sh installs the project into the rules' environment
# from this checkout, by its absolute path (Snakemake runs a copy of the script elsewhere).
os.environ.update(KVDIVERGE_SOURCE=workflow.basedir)


# The embedded default config is read only when no --configfile is given: a config file
# on the command line replaces it instead of being merged into it (Snakemake would
# otherwise keep the default's models and policies next to the paper's).
if not workflow.overwrite_configfiles:

    configfile: "config/config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/corpus.smk"
include: "workflow/rules/prompts.smk"
include: "workflow/rules/generate.smk"
include: "workflow/rules/estimate.smk"
include: "workflow/rules/analyse.smk"
include: "workflow/rules/teacher.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/task.smk"


# Every stage appends its final outputs to ALL_TARGETS (defined in common.smk) when
# its rules file is included above; this rule therefore comes last.
rule all:
    default_target: True
    input:
        ALL_TARGETS,
