# Stage 3: coupled trajectories per (model, policy, split, shard) — kvdiverge.engine.core.coupled.
# One job per shard; a shard is written atomically, so an interrupted run resumes by
# regenerating only the missing shards. The frontier's points (config `frontier`) run as one
# job per (model, shard) that writes every point's shard: one start-up, and each document
# prefilled once for the points whose presses allow it (kvdiverge.engine.runner.run_policies). Jobs whose model runs on CUDA request one GPU
# (`gpu` resource, read by the SLURM profile); CPU jobs request none.
#
# A GGUF model (the embedded default) is first converted once to a plain safetensors
# directory under {results_dir}/models/: de-quantizing GGUF costs ~20 s per load, and every
# shard is its own job.

rule convert_model:
    output:
        directory(MODEL_DIR),
    log:
        f"{LOGS}/convert_model/{{model}}.log",
    params:
        # what the conversion reads (it always runs on the CPU, whatever the entry's device)
        model=lambda wildcards: canonical(
            {k: v for k, v in config["models"][wildcards.model].items() if k != "device"}
        ),
    threads: 1
    resources:
        mem_mb=8000,
        runtime=30,
    conda:
        CONDA_ENV
    script:
        "../scripts/convert_model.py"



rule trajectories:
    input:
        prompts=PROMPTS,
        model=converted_model,
    output:
        SHARD,
    log:
        f"{LOGS}/trajectories/{{model}}/{{policy}}/{{split}}/shard-{{shard}}.log",
    params:
        shard=lambda wildcards: int(wildcards.shard),
        policies=lambda wildcards: [wildcards.policy],
        split=lambda wildcards: wildcards.split,
        # model entry, policy entry, decoding, replicates, seed, shards, control documents
        settings=shard_settings,
    # CPU: two 1-thread jobs beat one 2-thread job (no thread oversubscription).
    threads: 1
    resources:
        gpu=lambda wildcards: 1 if model_on_gpu(wildcards.model) else 0,
        mem_mb=lambda wildcards: 64000 if model_on_gpu(wildcards.model) else 6000,
        runtime=lambda wildcards: 720 if model_on_gpu(wildcards.model) else 120,
    conda:
        CONDA_ENV
    script:
        "../scripts/trajectories.py"


if FRONTIER_POLICIES:

    # The frontier's shards come from this rule, every other shard from rule trajectories.
    ruleorder: frontier_trajectories > trajectories

    rule frontier_trajectories:
        input:
            prompts=PROMPTS,
            model=converted_model,
        output:
            expand(SHARD, policy=FRONTIER_POLICIES, split=FRONTIER_SPLIT, allow_missing=True),
        log:
            f"{LOGS}/frontier/{{model}}/{FRONTIER_SPLIT}/shard-{{shard}}.log",
        params:
            shard=lambda wildcards: int(wildcards.shard),
            policies=FRONTIER_POLICIES,
            split=FRONTIER_SPLIT,
            # per frontier policy: what decides its shard (a change reruns the job)
            settings=frontier_settings,
        # the longest jobs first: the ordinary shards then fill in beside them
        priority: 1
        threads: 1
        resources:
            gpu=lambda wildcards: 1 if model_on_gpu(wildcards.model) else 0,
            mem_mb=lambda wildcards: 64000 if model_on_gpu(wildcards.model) else 6000,
            # the points run one after the other
            runtime=lambda wildcards: (720 if model_on_gpu(wildcards.model) else 120)
            * max(1, len(FRONTIER_POLICIES) // 4),
        conda:
            CONDA_ENV
        script:
            "../scripts/trajectories.py"


ALL_TARGETS.extend(all_trajectory_shards())
