# Stage 2: chat-rendered prompts per model, with exclusions and their reasons.
# A GGUF model's tokenizer and config are read from the GGUF file itself (its config from the
# header, kvdiverge.models.gguf_config), or from a kept conversion where the machine has one: the
# job runs beside rule convert_model instead of after it.


rule prompts:
    input:
        rules.corpus.output[0],
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
