# Stage 3: coupled trajectories per (model, policy, split, shard) — kvdiverge.engine.core.coupled.
# One job per shard; a shard is written atomically, so an interrupted run resumes by
# regenerating only the missing shards. The frontier's points (config `frontier`) run as one
# job per (model, shard) that writes every point's shard: one start-up, and each document
# prefilled once for the points whose presses allow it (kvdiverge.engine.runner.run_policies).
# Both rules take their resources from generation_resources (common.smk): one GPU per job
# whose model runs on CUDA, none on the CPU.
#
# A GGUF model (the embedded default) is first converted once to a plain safetensors
# directory under {results_dir}/models/: de-quantizing GGUF costs ~20 s per load, and every
# shard is its own job. A model of backend llama_cpp is not converted: its shard job runs the
# GGUF file in llama.cpp (kvdiverge.jobs.shard.run_llama_shard) with the job's threads.


rule convert_model:
    output:
        directory(MODEL_DIR),
    log:
        f"{LOGS}/convert_model/{{model}}.log",
    benchmark:
        benchmark_file("convert_model/{model}")
    params:
        # what the conversion reads (it always runs on the CPU, whatever the entry's device)
        model=lambda wildcards: canonical({k: v for k, v in CONFIG["models"][wildcards.model].items() if k != "device"}),
    conda:
        CONDA_ENV
    script:
        "../scripts/convert_model.py"


rule trajectories:
    input:
        prompts=rules.prompts.output[0],
        model=converted_model,
    output:
        SHARD,
    log:
        f"{LOGS}/trajectories/{{model}}/{{policy}}/{{split}}/shard-{{shard}}.log",
    benchmark:
        benchmark_file("trajectories/{model}/{policy}/{split}/shard-{shard}")
    params:
        # what the job reads, its rerun key: per policy the model and policy entries,
        # decoding, replicates, seed, shards, control documents
        settings=shard_job,
    resources:
        **generation_resources(),
    conda:
        CONDA_ENV
    script:
        "../scripts/trajectories.py"


if FRONTIER_POLICIES:

    # The frontier's shards come from this rule, every other shard from rule trajectories.
    ruleorder: frontier_trajectories > trajectories

    rule frontier_trajectories:
        input:
            prompts=rules.prompts.output[0],
            model=converted_model,
        output:
            expand(SHARD, policy=FRONTIER_POLICIES, split=FRONTIER_SPLIT, allow_missing=True),
        log:
            f"{LOGS}/frontier/{{model}}/{FRONTIER_SPLIT}/shard-{{shard}}.log",
        benchmark:
            benchmark_file(f"frontier_trajectories/{{model}}/{FRONTIER_SPLIT}/shard-{{shard}}")
        params:
            # what the job reads, its rerun key: as rule trajectories', for every frontier policy
            settings=shard_job,
        # the longest jobs first: the ordinary shards then fill in beside them
        priority: 1
        resources:
            **generation_resources(len(FRONTIER_POLICIES)),
        conda:
            CONDA_ENV
        script:
            "../scripts/trajectories.py"
