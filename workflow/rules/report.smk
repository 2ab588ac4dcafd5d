# Stage 6: figures (seaborn, PNG + PDF) and the HTML report.
#   snakemake --report results/report.html   (--configfile X: X's results_dir, e.g. results-smoke)
# collects every output marked report(...) below and in analyse.smk, with the captions
# in workflow/report/.


report: "../report/workflow.rst"


# One job per figure of FIGURE_TABLE (common.smk), so that one broken figure leaves the
# others drawn: the tables it draws, and only the settings it reads, are its inputs and params.
rule figure:
    input:
        unpack(figure_inputs),
    output:
        png=report(
            f"{FIGURES}/{{figure}}.png",
            caption="../report/figure.rst",
            category=figure_category,
            labels=figure_labels,
        ),
        pdf=f"{FIGURES}/{{figure}}.pdf",
    log:
        f"{LOGS}/figure/{{figure}}.log",
    benchmark:
        benchmark_file("figure/{figure}")
    params:
        settings=figure_settings,
    conda:
        CONDA_ENV
    script:
        "../scripts/figure.py"


rule summary:
    input:
        pooled=rules.pool.output.pooled_parquet,
        gaps=rules.gaps.output.parquet,
        confirmatory=rules.confirmatory.output.parquet,
        floor=rules.floor.output.parquet,
        provenance=rules.provenance.output.parquet,
    output:
        table_report(f"{ANALYSIS}/summary.html", "summary", "headline numbers", category="Summary"),
    log:
        f"{LOGS}/summary.log",
    benchmark:
        benchmark_file("summary/summary")
    params:
        plan=canonical(CONFIG["confirmatory"]),
        confidence=canonical(CONFIG["analysis"]["confidence"]),
    conda:
        CONDA_ENV
    script:
        "../scripts/summary.py"
