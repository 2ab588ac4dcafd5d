# kvdiverge: how KV-cache eviction changes LLM generation.
#
#   snakemake --cores all                                  # embedded default (CPU)
#   snakemake --configfile config/paper.yaml --profile profiles/slurm
#   snakemake --cores 2 results/prompts/smollm2-135m.parquet   # one stage by its file
#
# Stages (workflow/rules): corpus -> prompts -> generate -> estimate -> analyse -> report;
# teacher (teacher-forced fidelity) beside generate, from the prompts; task (a task score)
# beside estimate, when the config has a task block.
# Threads (1 unless set) and cluster resources come from the profile (profiles/);
# the generation rules' GPU, memory and time from generation_resources (common.smk).

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


# What starting the workflow does besides declaring (common.smk declares only): the jobs learn
# the config files of this run and the shard jobs the teacher-forced settings of their split, and a
# local run caps its generation jobs at one per GPU.
export_configfiles()
export_teacher_settings()
register_gpu_cap()


# What only building each press checks (kvpress's own checks of a value), once when a run starts and
# before its first job: the parse itself (every job's too) reads the torch-free press catalogue.
onstart:
    check_presses()


# What a plain `snakemake` makes: every stage's final outputs (all_targets, common.smk).
rule all:
    default_target: True
    input:
        all_targets,


include: "workflow/rules/corpus.smk"
include: "workflow/rules/prompts.smk"
include: "workflow/rules/generate.smk"
include: "workflow/rules/estimate.smk"
include: "workflow/rules/teacher.smk"
include: "workflow/rules/analyse.smk"
include: "workflow/rules/task.smk"
include: "workflow/rules/prediction.smk"
include: "workflow/rules/report.smk"
