# Stage 3: coupled trajectories per (model, policy, split, shard) — kvdiverge.trajectories.
# One job per shard; a shard is written atomically, so an interrupted run resumes by
# regenerating only the missing shards. Jobs whose model runs on CUDA request one GPU
# (`gpu` resource, read by the SLURM profile); CPU jobs request none.


rule trajectories:
    input:
        PROMPTS,
    output:
        SHARD,
    log:
        f"{LOGS}/trajectories/{{model}}/{{policy}}/{{split}}/shard-{{shard}}.log",
    params:
        shard=lambda wildcards: int(wildcards.shard),
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


ALL_TARGETS.extend(all_trajectory_shards())
