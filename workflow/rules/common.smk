# Shared definitions: config validation, output paths, target helpers.
#
# Targets of the final "all" rule (in the Snakefile). The list ALL_TARGETS below starts
# with the stages defined here (corpus, prompts); every later stage's .smk file appends
# its own final outputs, e.g. in generate.smk
#     ALL_TARGETS.extend(all_trajectory_shards())
# and in estimate.smk
#     ALL_TARGETS.extend(estimate_files())
# The Snakefile defines "all" after every include, so it sees the full list.
#
# Helper functions live here, not in the stage files (snakemake --lint wants rules and
# functions apart).

import os
import sys

import kvdiverge.study.config
import kvdiverge.study.devices
import kvdiverge.study.frontier
import kvdiverge.study.prompts
import kvdiverge.study.provenance
from snakemake.utils import validate

# Clear messages (key path, allowed values, cross-references) first; then Snakemake's
# own validation against the same schema, which also fills in the defaults. Snakemake's
# YAML reader keeps the last of two equal keys, so each config file is read again by
# kvdiverge.study.config.read_yaml, which refuses duplicate keys with their lines.
try:
    for _configfile in workflow.configfiles:
        kvdiverge.study.config.read_yaml(_configfile)
    _checked = kvdiverge.study.config.validate(config)
except kvdiverge.study.config.ConfigError as exc:
    raise WorkflowError(str(exc)) from None
# A `frontier` section becomes ordinary policies (<press>@<ratio>) scheduled on its split
# before any rule sees the config (kvdiverge.study.config.expand_frontier).
if config.get("frontier"):
    config["policies"], config["runs"] = _checked["policies"], _checked["runs"]
validate(config, str(kvdiverge.study.config.SCHEMA_PATH))  # the package's schema

SPLITS = ("exploratory", "confirmatory")
# The frontier's points (kvdiverge.study.frontier.frontier_points), its split, and the
# policies those points run as; empty without a `frontier` section.
FRONTIER_POINTS = kvdiverge.study.frontier.frontier_points(config)
FRONTIER_SPLIT = kvdiverge.study.frontier.frontier_split(config)
FRONTIER_POLICIES = [pt.policy for pt in FRONTIER_POINTS]
MODELS = list(config["models"])
RUNS = kvdiverge.study.config.runs(config)  # [(model, policy, split), ...], control included
SHARDS = list(range(int(config["shards"])))


# Every rule declares, as params, exactly the settings that decide its output, in
# canonical form (mapping keys sorted, 1.0 written as 1): Snakemake's default `params`
# rerun trigger then reruns exactly the jobs a changed setting affects (and, through
# their changed outputs, everything downstream), and reordering keys in a config file
# is no change. README.md "Rerunning stages" tabulates which setting reruns what.
canonical = kvdiverge.study.provenance.canonical


def shard_settings(wildcards):
    """Settings that decide a trajectory shard (kvdiverge.study.provenance.shard_settings)."""
    return kvdiverge.study.provenance.shard_settings(config, wildcards.model, wildcards.policy, wildcards.split)


def frontier_settings(wildcards):
    """Settings that decide the frontier's shards of one model and shard index, per frontier policy."""
    return {p: kvdiverge.study.provenance.shard_settings(config, wildcards.model, p, FRONTIER_SPLIT)
            for p in FRONTIER_POLICIES}


# The config files of this run, for the regenerate command in the estimate stage's
# error messages; an environment variable, not a param: the same settings from another
# file rerun nothing.
os.environ[kvdiverge.study.provenance.CONFIGFILES_ENV] = os.pathsep.join(
    os.path.relpath(f) if not os.path.relpath(f).startswith("..") else str(f)
    for f in workflow.configfiles
)


# what decides the prompts tables (a change reruns the prompts stage)
PROMPT_SETTINGS = canonical(kvdiverge.study.prompts.prompt_settings(config))

# Output paths (docs/internals.md). Use these names in rules rather than literals.
# Everything a config makes, logs included, goes under its `results_dir` (default
# `results`), so configs run side by side in one clone without touching each other.
RESULTS = config["results_dir"].rstrip("/")
CORPUS = f"{RESULTS}/corpus/documents.parquet"
PROMPTS = f"{RESULTS}/prompts/{{model}}.parquet"
SHARD = f"{RESULTS}/trajectories/{{model}}/{{policy}}/{{split}}/shard-{{shard}}.parquet"
ESTIMATES = f"{RESULTS}/estimates/{{model}}/{{policy}}/{{split}}.parquet"
LOGS = f"{RESULTS}/logs"

# Software of every rule: environment.yml at the top of the repository (used with
# --use-conda; without it, rules run in the current environment, e.g. make's .venv).
# The path is relative to the files in workflow/rules/, where rules use `conda: CONDA_ENV`.
CONDA_ENV = "../../environment.yml"


wildcard_constraints:
    model=r"[A-Za-z0-9][A-Za-z0-9._-]*",
    policy=r"[A-Za-z0-9][A-Za-z0-9._-]*(@b?[0-9][A-Za-z0-9._-]*(\+[A-Za-z0-9][A-Za-z0-9._-]*)?)?",
    split=r"exploratory|confirmatory",
    shard=r"\d+",


def model_on_gpu(model):
    """True when the model runs on a CUDA device (its jobs then request a GPU)."""
    return str(config["models"][model].get("device", "cpu")).startswith("cuda")


# Local runs: at most one generation job per GPU (kvdiverge.study.devices). The trajectories
# rule requests gpu=1 per job with a CUDA model; without a cap Snakemake would start one
# such job per core. --resources gpu=N wins; otherwise the config key `gpus`, otherwise the
# number of visible CUDA devices (KVDIVERGE_GPUS simulates a device list). Cluster runs
# (--jobs / the SLURM profile) are left alone: SLURM hands each job its own GPU.
if workflow.is_main_process and workflow.nodes is None and any(model_on_gpu(m) for m in MODELS):
    if "gpu" in workflow.global_resources:
        _gpu_cap, _gpu_source = workflow.global_resources["gpu"].value, "--resources"
    else:
        _gpu_cap, _gpu_source = kvdiverge.study.devices.gpu_cap(config)
        workflow.register_resource("gpu", _gpu_cap)
    print(f"kvdiverge: local GPU cap gpu={_gpu_cap} ({_gpu_source}): at most {_gpu_cap} "
          f"generation job(s) at once, each bound to its own GPU", file=sys.stderr)
    if not _gpu_cap:
        print("kvdiverge: WARNING: no CUDA device visible; generation jobs of CUDA models "
              "will fail (set the model's device to cpu, or run where there is a GPU)",
              file=sys.stderr)


# GGUF models are converted once to a safetensors directory (rule convert_model).
MODEL_DIR = f"{RESULTS}/models/{{model}}"


def converted_model(wildcards):
    """The converted model directory that the prompts and shard jobs load from, if its model is a GGUF file."""
    spec = config["models"][wildcards.model]
    return MODEL_DIR.format(model=wildcards.model) if spec.get("gguf_file") else []


def prompts_files():
    """Prompt tables of every model."""
    return expand(PROMPTS, model=MODELS)


def trajectory_shards(model, policy, split):
    """All shard files of one (model, policy, split)."""
    return expand(SHARD, model=model, policy=policy, split=split, shard=SHARDS)


def all_trajectory_shards():
    """Shard files of every run in kvdiverge.study.config.runs(config)."""
    return [f for m, p, s in RUNS for f in trajectory_shards(m, p, s)]


def estimate_files():
    """Estimate tables of every run."""
    return [ESTIMATES.format(model=m, policy=p, split=s) for m, p, s in RUNS]


ALL_TARGETS = [CORPUS, *prompts_files()]
