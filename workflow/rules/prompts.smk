# Stage 2: chat-rendered prompts per model, with exclusions and their reasons.
# A GGUF model's tokenizer and config are read from its converted copy (rule convert_model):
# parsing them from the GGUF file takes seconds, the converted copy a fraction of one.


rule prompts:
    input:
        CORPUS,
        model=converted_model,
    output:
        PROMPTS,
    log:
        f"{LOGS}/prompts/{{model}}.log",
    params:
        model=lambda wildcards: canonical(config["models"][wildcards.model]),
        settings=PROMPT_SETTINGS,
    threads: 1
    resources:
        mem_mb=4000,
        runtime=30,
    conda:
        CONDA_ENV
    script:
        "../scripts/prompts.py"
