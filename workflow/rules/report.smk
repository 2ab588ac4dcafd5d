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


# The analyses' HTML pages (kvdiverge.report.pages), one job each, from their tables.
rule confirmatory_page:
    input:
        rules.confirmatory.output.parquet,
    output:
        table_report(f"{ANALYSIS}/confirmatory.html", "confirmatory", "confirmatory test", category="Confirmatory"),
    log:
        f"{LOGS}/analysis/confirmatory_page.log",
    benchmark:
        benchmark_file("confirmatory_page/confirmatory_page")
    params:
        plan=canonical(CONFIG["confirmatory"]),
        confidence=canonical(CONFIG["analysis"]["confidence"]),
    conda:
        CONDA_ENV
    script:
        "../scripts/confirmatory_page.py"


rule speculative_page:
    input:
        rules.speculative.output.parquet,
    output:
        table_report(f"{ANALYSIS}/speculative.html", "speculative_page", "self-speculative page"),
    log:
        f"{LOGS}/analysis/speculative_page.log",
    benchmark:
        benchmark_file("speculative_page/speculative_page")
    params:
        confidence=canonical(CONFIG["analysis"]["confidence"]),
    conda:
        CONDA_ENV
    script:
        "../scripts/speculative_page.py"


if FRONTIER_POINTS:

    rule frontier_page:
        input:
            points=rules.frontier.output.parquet,
            areas=rules.frontier.output.areas_parquet,
        output:
            table_report(f"{ANALYSIS}/frontier.html", "frontier_page", "frontier page", category="Frontier"),
        log:
            f"{LOGS}/analysis/frontier_page.log",
        benchmark:
            benchmark_file("frontier_page/frontier_page")
        params:
            confidence=canonical(CONFIG["analysis"]["confidence"]),
        conda:
            CONDA_ENV
        script:
            "../scripts/frontier_page.py"
