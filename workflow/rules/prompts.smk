# Stage 2: chat-rendered prompts per model, with exclusions and their reasons.
# A GGUF model's tokenizer and config are read from its converted copy (rule convert_model):
# parsing them from the GGUF file takes seconds, the converted copy a fraction of one.


rule prompts:
    input:
        rules.corpus.output[0],
        model=converted_model,
    output:
        PROMPTS,
    log:
        f"{LOGS}/prompts/{{model}}.log",
    benchmark:
        benchmark_file("prompts/{model}")
    params:
        model=lambda wildcards: canonical(CONFIG["models"][wildcards.model]),
        settings=PROMPT_SETTINGS,
    conda:
        CONDA_ENV
    script:
        "../scripts/prompts.py"
