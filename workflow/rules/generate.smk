# Stage 3: coupled trajectories per (model, policy, split, shard) — kvdiverge.engine.core.coupled.
# One job per (model, split, shard) writes the shard of every policy that runs on the split: one
# start-up (the interpreter, torch and the model, about 9 s on a 2-core CPU), and each document
# prefilled once for the policies whose presses allow it (kvdiverge.engine.runner.run_policies), the
# controls on the shard's first documents included (kvdiverge.engine.llm.sharing.PrefillCarry);
# each policy's records are those of the policy run alone, bit for bit. A shard is written
# atomically, so an interrupted run resumes by regenerating only the jobs with a missing shard;
# a changed policy reruns the shard jobs of its split. Before its coupled run a job runs the
# teacher-forced pass on its documents (teacher.smk), with the settings of its split's teacher-forced
# job (an environment variable, not its rerun key), and the coupled run takes the prefills the pass made.
# One rule per split (trajectories_<split>), each with its split's policies as outputs; they take
# their resources from generation_resources (common.smk): one GPU per job whose model runs on
# CUDA, none on the CPU.
#
# A GGUF model (the embedded default) is first converted once to a plain safetensors
# directory under {results_dir}/models/: de-quantizing GGUF costs ~20 s per load, and every
# shard job (and a teacher-forced job that runs its pass itself) loads the model. A model of
# backend llama_cpp is not converted: its shard job runs the GGUF file in llama.cpp
# (kvdiverge.jobs.shard.run_llama_shard) with the job's threads, and writes empty positions.


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


for _split, _policies in SPLIT_POLICIES.items():

    rule:
        name:
            f"trajectories_{_split}"
        input:
            prompts=rules.prompts.output[0],
            model=converted_model,
            corpus=rules.corpus.output[0],
        output:
            shards=expand(SHARD, policy=_policies, split=_split, allow_missing=True),
            positions=expand(SHARD_POSITIONS, split=_split, allow_missing=True),
        log:
            f"{LOGS}/trajectories/{{model}}/{_split}/shard-{{shard}}.log",
        benchmark:
            benchmark_file(f"trajectories/{{model}}/{_split}/shard-{{shard}}")
        # the longest generation jobs first on a local run (SHARD_PRIORITY, common.smk)
        priority: SHARD_PRIORITY[_split]
        params:
            # what the job reads, its rerun key: per policy the model and policy entries,
            # decoding, replicates, seed, shards, control documents
            settings=shard_job(_split),
        resources:
            **generation_resources(len(_policies)),
        conda:
            CONDA_ENV
        script:
            "../scripts/trajectories.py"
