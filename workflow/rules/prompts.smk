# Stage 2: chat-rendered prompts per model, with exclusions and their reasons.


rule prompts:
    input:
        CORPUS,
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
