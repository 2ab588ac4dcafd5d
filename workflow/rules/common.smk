# Shared definitions: the validated config, the settings derived from it, output paths,
# the helpers of the rules (params, resources, benchmarks) and the targets of rule `all`.
#
# Helper functions live here, not in the stage files (snakemake --lint wants rules and
# functions apart).

import dataclasses
import os
import sys

import kvdiverge.estimation.bootstrap
import kvdiverge.estimation.drift
import kvdiverge.config.backends
import kvdiverge.config.reading
import kvdiverge.config.workflow
import kvdiverge.engine.llamacpp.caches
import kvdiverge.jobs.devices
import kvdiverge.config.frontier
import kvdiverge.jobs.params
import kvdiverge.jobs.positions
import kvdiverge.jobs.prediction
import kvdiverge.data.prompts
import kvdiverge.config.provenance
import kvdiverge.planning.cost

# The config is validated once, by kvdiverge.config.workflow.validate: clear messages (key
# path, allowed values, cross-references), the schema's defaults filled in, and the
# `frontier` section expanded into ordinary policies (<press>@<ratio>) scheduled on its
# split. Snakemake's own `config` stays as read from the files; the rules read CONFIG.
# Snakemake's YAML reader keeps the last of two equal keys, so each config file is read
# again by kvdiverge.config.reading.read_yaml, which refuses duplicate keys with their lines.
try:
    for _configfile in workflow.configfiles:
        kvdiverge.config.reading.read_yaml(_configfile)
    CONFIG = kvdiverge.config.workflow.validate(config)  # the package's schema (SCHEMA_PATH)
except kvdiverge.config.reading.ConfigError as exc:
    raise WorkflowError(str(exc)) from None

SPLITS = ("exploratory", "confirmatory")
# The frontier's points (kvdiverge.config.frontier.frontier_points), its split, and the
# policies those points run as; empty without a `frontier` section.
FRONTIER_POINTS = kvdiverge.config.frontier.frontier_points(CONFIG)
FRONTIER_SPLIT = kvdiverge.config.frontier.frontier_split(CONFIG)
FRONTIER_POLICIES = [pt.policy for pt in FRONTIER_POINTS]
MODELS = list(CONFIG["models"])
RUNS = kvdiverge.config.workflow.runs(CONFIG)  # [(model, policy, split), ...], control included
MODEL_RUNS = [(p, s) for m, p, s in RUNS if m == MODELS[0]]  # [(policy, split), ...]: every model runs the same
SHARDS = list(range(int(CONFIG["shards"])))
FLOOR = kvdiverge.config.workflow.floor_policy(CONFIG)  # the noise-floor control, or None
# the loop detector of the length drift (config `drift`; the period at most the horizon)
DRIFT_LOOP = kvdiverge.estimation.drift.loop_settings(CONFIG["drift"], CONFIG["decoding"]["max_new_tokens"])


# Every rule declares, as params, exactly the settings that decide its output, in
# canonical form (mapping keys sorted, 1.0 written as 1): Snakemake's default `params`
# rerun trigger then reruns exactly the jobs a changed setting affects (and, through
# their changed outputs, everything downstream), and reordering keys in a config file
# is no change. README.md "Rerunning stages" tabulates which setting reruns what.
canonical = kvdiverge.config.provenance.canonical

# The document bootstrap of every analysis with intervals (pool, gaps, floor, confirmatory,
# speculative, drift, frontier, teacher-forced table, task, prediction): one Bootstrap, as
# `params: **ANALYSIS_PARAMS` (`boot`, its fields in plain form); each script reads
# `Bootstrap(**snakemake.params.boot)`.
BOOTSTRAP = kvdiverge.estimation.bootstrap.Bootstrap(
    n_boot=CONFIG["analysis"]["bootstrap"], confidence=CONFIG["analysis"]["confidence"], seed=CONFIG["seed"]
)
ANALYSIS_PARAMS = {"boot": canonical(dataclasses.asdict(BOOTSTRAP))}


def shard_settings(wildcards):
    """Settings that decide a trajectory shard (kvdiverge.config.provenance.shard_settings)."""
    return kvdiverge.config.provenance.shard_settings(CONFIG, wildcards.model, wildcards.policy, wildcards.split)


# What each generation job reads, as the plain form of its settings object (kvdiverge.jobs.params):
# its rule's `params: settings=...`, which is also the job's rerun key. The scripts read the
# object back (ShardSettings.from_params); none reads or validates the config again.
# The policies of each split, in the order of RUNS (the frontier's points on its split included):
# one trajectory job per (model, split, shard) writes all of them (generate.smk).
SPLIT_POLICIES = {split: [p for p, s in MODEL_RUNS if s == split] for split in SPLITS}
SPLIT_POLICIES = {split: policies for split, policies in SPLIT_POLICIES.items() if policies}


# The order a local run starts its generation jobs in (the rules' `priority`; a cluster queues them
# all at once): the longest first, so that the last jobs to start are short ones and no core idles
# long at the end (longest processing time first, the classic rule of list scheduling). The shard
# jobs first, a split with more token-steps per job before one with fewer (replays included); then
# the teacher-forced jobs, a split with more documents to prefill before one with fewer
# (kvdiverge.planning.cost: study_cost, teacher_cost). Shard jobs before teacher-forced jobs
# assumes that a shard job, which decodes, takes longer than a pass, which feeds one block, as on
# the default config (docs/benchmarks.md); with many shards a pass can be the longer, and a local
# run then loses at most its length at the end. Every other rule keeps priority 0.
def _generation_priorities():
    def ranked(work):  # split -> work: the fewest first, ties in SPLITS order
        return sorted(work, key=lambda split: (work[split], -SPLITS.index(split)))

    steps, prefills = dict.fromkeys(SPLIT_POLICIES, 0), dict.fromkeys(SPLIT_POLICIES, 0)
    for run in kvdiverge.planning.cost.study_cost(CONFIG):
        if run.model == MODELS[0] and run.split in steps:
            steps[run.split] += run.token_steps + run.replay_token_steps
    for run in kvdiverge.planning.cost.teacher_cost(CONFIG):
        if run.model == MODELS[0] and run.split in prefills:
            prefills[run.split] = max(prefills[run.split], run.documents)
    teacher = {split: 1 + rank for rank, split in enumerate(ranked(prefills))}
    shard = {split: 1 + len(teacher) + rank for rank, split in enumerate(ranked(steps))}
    return shard, teacher


SHARD_PRIORITY, TEACHER_PRIORITY = _generation_priorities()


def shard_job(split):
    """The settings of a trajectory shard job of `split` (rules trajectories_<split>), as a params function."""

    def settings(wildcards):
        job = kvdiverge.jobs.params.ShardSettings.from_config(
            CONFIG, wildcards.model, SPLIT_POLICIES[split], split, int(wildcards.shard)
        )
        return job.to_params()

    return settings


# The runs of the teacher-forced pass: every run of a transformers model (llama_cpp models run the
# coupled measurement alone, kvdiverge.config.backends).
TEACHER_RUNS = [r for r in RUNS if not kvdiverge.config.backends.runs_on_llama_cpp(CONFIG["models"][r[0]])]


def teacher_job(split):
    """The settings of a teacher-forced job of `split` (rules teacher_forced_<split>), every run of the
    split on the model, as a params function."""

    def settings(wildcards):
        runs = [(p, split) for p in SPLIT_POLICIES[split]]
        return kvdiverge.jobs.params.TeacherSettings.from_config(CONFIG, wildcards.model, runs).to_params()

    return settings


def export_teacher_settings():
    """Tell the shard jobs the teacher-forced settings of their split, which they run the pass on their
    documents with (kvdiverge.jobs.positions): an environment variable, not a param or an input, so that
    a changed teacher_forced section reruns no shard job (the teacher-forced jobs then run the pass
    themselves). Called once, by the Snakefile."""
    settings = {
        model: {
            split: kvdiverge.jobs.params.TeacherSettings.from_config(
                CONFIG, model, [(p, split) for p in policies]
            ).to_params()
            for split, policies in SPLIT_POLICIES.items()
        }
        for model in MODELS
        if not kvdiverge.config.backends.runs_on_llama_cpp(CONFIG["models"][model])
    }
    kvdiverge.jobs.positions.export_settings(settings)


def check_presses():
    """What kvpress's own checks refuse of each policy's press (kvdiverge.engine.presses.policies.press_build_problems:
    the press built once, which loads torch), as the config check's error, and a llama_cpp model without
    llama-cpp-python, in the sentence that says how to install it (kvdiverge.config.backends.require_backends).
    Called once, by the Snakefile's onstart: a run, not a dry run, and no job's parse; the parse checks the
    rest from the press catalogue. A llama.cpp cache is no press: a config of llama.cpp caches alone loads no torch."""
    try:
        kvdiverge.config.backends.require_backends(CONFIG)
    except ModuleNotFoundError as exc:
        raise WorkflowError(str(exc)) from None
    presses = {n: p for n, p in CONFIG["policies"].items() if not kvdiverge.engine.llamacpp.caches.is_cache_entry(p)}
    if not presses:
        return
    import kvdiverge.engine.presses.policies as press_policies  # torch and kvpress: a run's start, never a parse

    problems = press_policies.press_build_problems(presses)
    if problems:
        raise WorkflowError("invalid config:\n  " + "\n  ".join(problems))


def export_configfiles():
    """Tell the jobs the config files of this run (for the regenerate command in the estimate
    stage's error messages): an environment variable, not a param, so that the same settings
    from another file rerun nothing. Called once, by the Snakefile."""
    os.environ[kvdiverge.config.provenance.CONFIGFILES_ENV] = os.pathsep.join(
        os.path.relpath(f) if not os.path.relpath(f).startswith("..") else str(f) for f in workflow.configfiles
    )


# what decides the prompts tables (a change reruns the prompts stage)
PROMPT_SETTINGS = canonical(kvdiverge.data.prompts.prompt_settings(CONFIG))

# Output paths (docs/internals.md), each named once: in its rule's `output:`; the rules
# that read it name it as rules.<rule>.output.<name>. Everything a config makes, logs and
# benchmarks included, goes under its `results_dir` (default `results`), so configs run
# side by side in one clone without touching each other.
RESULTS = CONFIG["results_dir"].rstrip("/")
CORPUS = f"{RESULTS}/corpus/documents.parquet"
PROMPTS = f"{RESULTS}/prompts/{{model}}.parquet"
MODEL_DIR = f"{RESULTS}/models/{{model}}"  # a GGUF model converted once (rule convert_model)
SHARD = f"{RESULTS}/trajectories/{{model}}/{{policy}}/{{split}}/shard-{{shard}}.parquet"
ESTIMATES = f"{RESULTS}/estimates/{{model}}/{{policy}}/{{split}}.parquet"
TEACHER = f"{RESULTS}/teacher_forced/{{model}}/{{policy}}/{{split}}.parquet"  # a run's teacher-forced positions
# the teacher-forced positions of a shard's documents, which its shard job computes before its coupled
# run (kvdiverge.jobs.positions)
SHARD_POSITIONS = f"{RESULTS}/teacher_forced/{{model}}/_shards/{{split}}/shard-{{shard}}.parquet"
ANALYSIS = f"{RESULTS}/analysis"
FIGURES = f"{RESULTS}/figures"
LOGS = f"{RESULTS}/logs"


def table_report(path, caption, table, category="Tables"):
    """`path` marked for the report: captioned by workflow/report/<caption>.rst, under
    `category`, labelled `table` (Snakemake's report(), one shape for every table)."""
    return report(path, caption=f"../report/{caption}.rst", category=category, labels={"table": table})


def benchmark_file(job):
    """Snakemake's `benchmark:` file of a job, {results_dir}/benchmarks/<rule>/<job>.tsv:
    wall time, peak memory (max_rss, MB) and CPU time of the job, one row per run."""
    return f"{RESULTS}/benchmarks/{job}.tsv"


# Software of every rule: environment.yml at the top of the repository (used with
# --use-conda; without it, rules run in the current environment, e.g. make's .venv).
# The path is relative to the files in workflow/rules/, where rules use `conda: CONDA_ENV`.
CONDA_ENV = "../../environment.yml"


# The figures (report.smk, one job each): name -> the tables it draws
# ({script's name: (rule, output)}), the settings it reads (of FIGURE_SETTINGS), the
# report's category and label. The frontier's figure exists with a `frontier` section only.
FIGURE_TABLE = {
    "survival": {"input": {"survival": ("pool", "survival_parquet")}, "settings": ["floor"]},
    "gap_decomposition": {"input": {"gaps": ("gaps", "parquet")}},
    "branch_tv": {"input": {"branch_tv": ("pool", "branch_tv_parquet")}, "settings": ["early", "late"]},
    "confirmatory_differences": {
        "input": {
            "confirmatory": ("confirmatory", "parquet"),
            "confirmatory_documents": ("confirmatory", "documents_parquet"),
        }
    },
    "variance": {"input": {"variance": ("pool", "variance_parquet")}},
    "speculative": {
        "input": {"speculative": ("speculative", "parquet")},
        "settings": ["floor"],
        "label": "self-speculative reading",
    },
    "length": {
        "input": {"length_survival": ("drift", "survival_parquet")},
        "settings": ["floor"],
        "label": "output length (EOS time)",
    },
}
if FRONTIER_POINTS:
    FIGURE_TABLE["frontier"] = {"input": {"frontier": ("frontier", "parquet")}, "category": "Frontier"}
FIGURE_SETTINGS = {
    "floor": FLOOR,
    "early": canonical(CONFIG["confirmatory"]["early"]),
    "late": canonical(CONFIG["confirmatory"]["late"]),
}


def figure_inputs(wildcards):
    """The tables one figure draws, by the names its drawing reads (FIGURE_TABLE)."""
    inputs = FIGURE_TABLE[wildcards.figure]["input"]
    return {name: getattr(getattr(rules, rule).output, key) for name, (rule, key) in inputs.items()}


def figure_settings(wildcards):
    """The settings one figure reads, and no other (a changed setting redraws only its figures)."""
    return {k: FIGURE_SETTINGS[k] for k in FIGURE_TABLE[wildcards.figure].get("settings", [])}


def figure_category(wildcards):
    """The report category of one figure."""
    return FIGURE_TABLE[wildcards.figure].get("category", "Figures")


def figure_labels(wildcards):
    """The report label of one figure: its name, or the table's label."""
    entry = FIGURE_TABLE[wildcards.figure]
    return {"figure": entry.get("label", wildcards.figure.replace("_", " "))}


wildcard_constraints:
    model=r"[A-Za-z0-9][A-Za-z0-9._-]*",
    policy=r"[A-Za-z0-9][A-Za-z0-9._-]*(@b?[0-9][A-Za-z0-9._-]*(\+[A-Za-z0-9][A-Za-z0-9._-]*)?)?",
    split=r"exploratory|confirmatory",
    shard=r"\d+",
    figure="|".join(FIGURE_TABLE),


def model_on_gpu(model):
    """True when the model runs on a CUDA device (its jobs then request a GPU)."""
    return str(CONFIG["models"][model].get("device", "cpu")).startswith("cuda")


#: A generation job's requests where its model runs on CUDA (host memory, MB; minutes), the largest
#: over config/paper.yaml's models of kvdiverge.planning.roofline.gpu_job_request: the weights plus
#: 8 GB of host memory; 10x the predicted shard (or teacher-forced pass) plus loading the weights.
#: tests/test_roofline.py keeps them equal to the prediction; docs/rehearsal.md shows the numbers.
GPU_REQUESTS = {"trajectories": {"mem_mb": 41000, "runtime": 20}, "teacher_forced": {"mem_mb": 41000, "runtime": 540}}
#: The same on the CPU. The full-size rehearsal's stand-ins peak at 796 MB and 69 s a shard, 710 MB
#: and 96 s a teacher-forced pass (docs/rehearsal.md, "Per rule"); the embedded models' jobs are
#: larger and slower on a laptop CPU, so these stay generous.
CPU_REQUESTS = {"trajectories": {"mem_mb": 6000, "runtime": 120}, "teacher_forced": {"mem_mb": 6000, "runtime": 120}}


def generation_resources(points=1, rule="trajectories"):
    """Resources of a job of `rule` (trajectories or teacher_forced) over `points` policies, by where
    its model runs: one GPU (the `gpu` resource, which the SLURM profile turns into --gpus=1) and
    GPU_REQUESTS on CUDA; no GPU and CPU_REQUESTS on the CPU. The policies of a job run one after the
    other, their prefills shared: the runtime is the request's for every 4 policies or fewer (a split of
    5 to 8 policies asks twice it). Every other rule takes its resources from the profile."""
    scale = max(1, -(-points // 4))
    requests = lambda wildcards: (GPU_REQUESTS if model_on_gpu(wildcards.model) else CPU_REQUESTS)[rule]
    return {
        "gpu": lambda wildcards: 1 if model_on_gpu(wildcards.model) else 0,
        "mem_mb": lambda wildcards: requests(wildcards)["mem_mb"],
        "runtime": lambda wildcards: requests(wildcards)["runtime"] * scale,
    }


def register_gpu_cap():
    """Local runs: at most one generation job per GPU (kvdiverge.jobs.devices). Called once, by the Snakefile.

    The generation rules request gpu=1 per job with a CUDA model; without a cap Snakemake
    would start one such job per core. --resources gpu=N wins; otherwise the config key
    `gpus`, otherwise the number of visible CUDA devices (KVDIVERGE_GPUS simulates a device
    list); the cap is printed, with a warning when it is 0. A dry run counts no devices (that loads
    torch): it says so, unless the config, --resources or KVDIVERGE_GPUS gives the cap. Cluster runs
    (--jobs / the SLURM profile) are left alone: SLURM hands each job its own GPU."""
    if not workflow.is_main_process or workflow.nodes is not None or not any(model_on_gpu(m) for m in MODELS):
        return
    if "gpu" in workflow.global_resources:
        cap, source = workflow.global_resources["gpu"].value, "--resources"
    elif getattr(workflow.output_settings, "dryrun", False) and kvdiverge.jobs.devices.counted_by_torch(CONFIG):
        # a dry run schedules nothing: counting the devices would load torch into every `snakemake -n`
        print(
            "kvdiverge: local GPU cap: the visible CUDA devices are counted when the run starts "
            "(the config key gpus or --resources gpu=N sets the cap)",
            file=sys.stderr,
        )
        return
    else:
        cap, source = kvdiverge.jobs.devices.gpu_cap(CONFIG)
        workflow.register_resource("gpu", cap)
    print(
        f"kvdiverge: local GPU cap gpu={cap} ({source}): at most {cap} "
        f"generation job(s) at once, each bound to its own GPU",
        file=sys.stderr,
    )
    if not cap:
        print(
            "kvdiverge: WARNING: no CUDA device visible; generation jobs of CUDA models "
            "will fail (set the model's device to cpu, or run where there is a GPU)",
            file=sys.stderr,
        )


def converted_model(wildcards):
    """The converted model directory that the shard and teacher-forced jobs load from, if its model is a GGUF
    file that transformers runs (a llama_cpp model runs the GGUF file itself: no conversion)."""
    spec = CONFIG["models"][wildcards.model]
    if kvdiverge.config.backends.runs_on_llama_cpp(spec):
        return []
    return MODEL_DIR.format(model=wildcards.model) if spec.get("gguf_file") else []


def run_files(pattern, runs=None, partial=False):
    """`pattern` (with {model}, {policy}, {split}) of every run of `runs` (default: RUNS);
    `partial`: other wildcards stay in place."""
    runs = RUNS if runs is None else runs
    return [expand(pattern, model=m, policy=p, split=s, allow_missing=partial)[0] for m, p, s in runs]


def all_trajectory_shards(runs=None):
    """Shard files of every run of `runs` (default: every run in kvdiverge.config.workflow.runs)."""
    return [f for path in run_files(SHARD, runs, partial=True) for f in expand(path, shard=SHARDS)]


def estimate_files():
    """Estimate tables of every run."""
    return run_files(rules.estimate.output.documents)


def drift_files():
    """Length-drift tables (per replicate) of every run."""
    return run_files(rules.estimate.output.drift)


# The task (config `task`): its runs are the frontier's split when there is a frontier (its
# points are the study's), else every split; the noise floor and the `none` control are left
# out of the correlations and the AUC. TASK_RUNS is empty without a `task` block.
TASK_TABLES = ("documents", "accuracy", "correlations", "auc")
TASK_DIR = f"{RESULTS}/analysis/task/{{model}}"
TASK_RUNS = [(m, p, s) for m, p, s in RUNS if FRONTIER_SPLIT is None or s == FRONTIER_SPLIT] if CONFIG.get("task") else []
TASK_CONTROLS = sorted({p for p in (FLOOR, (CONFIG["runs"].get("control") or {}).get("policy")) if p})


def task_shards(wildcards):
    """The trajectory shards of one model's task runs."""
    return all_trajectory_shards([r for r in TASK_RUNS if r[0] == wildcards.model])


def task_estimates(wildcards):
    """The estimate tables of one model's task runs."""
    return run_files(rules.estimate.output.documents, [r for r in TASK_RUNS if r[0] == wildcards.model])


# The prediction study (config `prediction`): its task sides by name (niah-inside, ...), each
# one job per model; empty without a `prediction` block.
PREDICTION_SIDES = list(kvdiverge.jobs.prediction.prediction_sides(CONFIG))
PREDICTION_DIR = f"{RESULTS}/analysis/prediction/{{model}}"


def prediction_task_job(wildcards):
    """The settings of a task-side job of the prediction study (rule prediction_task)."""
    job = kvdiverge.jobs.prediction.PredictionTaskSettings.from_config(CONFIG, wildcards.model, wildcards.side)
    return job.to_params()


# The prediction study's reconstruction pass (measures reconstruction_<measure>): the teacher-forced
# pass of the frontier's runs again, with the reconstruction target; None when no measure reads it.
RECONSTRUCTION_CONFIG = kvdiverge.jobs.prediction.reconstruction_config(CONFIG)
RECONSTRUCTION = f"{RESULTS}/teacher_forced_reconstruction/{{model}}/{{policy}}/{{split}}.parquet"
RECONSTRUCTION_RUNS = [(p, FRONTIER_SPLIT) for p in FRONTIER_POLICIES] if RECONSTRUCTION_CONFIG else []


def reconstruction_job(wildcards):
    """The settings of a model's reconstruction pass (rule teacher_forced_reconstruction), over the frontier's runs."""
    job = kvdiverge.jobs.params.TeacherSettings.from_config(RECONSTRUCTION_CONFIG, wildcards.model, RECONSTRUCTION_RUNS)
    return job.to_params()


def prediction_costs(wildcards):
    """The benchmark files of one model's frontier generation jobs (the measures' CPU time per point):
    read when present, not inputs (a benchmark file is no rule's output)."""
    costs = {
        "coupled": [benchmark_file(f"trajectories/{wildcards.model}/{FRONTIER_SPLIT}/shard-{s}") for s in SHARDS],
        "teacher": [benchmark_file(f"teacher_forced/{wildcards.model}/{FRONTIER_SPLIT}")],
    }
    if RECONSTRUCTION_CONFIG:
        costs["reconstruction"] = [benchmark_file(f"teacher_forced_reconstruction/{wildcards.model}")]
    return costs


def all_targets(wildcards):
    """What a plain `snakemake` makes (the `all` rule): every stage's final outputs."""
    outputs = [
        rules.corpus.output[0],
        *expand(rules.prompts.output[0], model=MODELS),
        *all_trajectory_shards(),
        *estimate_files(),
        rules.provenance.output.parquet,
        *(rules.pool.output[f"{t}_parquet"] for t in ANALYSIS_TABLES),
        rules.gaps.output.parquet,
        rules.floor.output.parquet,
        rules.confirmatory.output.parquet,
        rules.confirmatory_page.output[0],
        rules.speculative.output.parquet,
        rules.speculative_page.output[0],
        rules.drift.output.parquet,
        rules.drift.output.survival_parquet,
        *expand(rules.figure.output, figure=list(FIGURE_TABLE)),
        rules.summary.output[0],
    ]
    if FRONTIER_POINTS:
        outputs += [rules.frontier.output.parquet, rules.frontier.output.areas_parquet, rules.frontier_page.output[0]]
    if TASK_RUNS:
        outputs += expand(rules.task.output.accuracy, model=MODELS)
    if TEACHER_RUNS:
        outputs += [rules.teacher_forced_table.output.parquet, rules.teacher_forced_table.output.documents_parquet]
    if PREDICTION_SIDES:
        outputs += expand(rules.prediction.output.prediction_parquet, model=MODELS)
    return outputs
