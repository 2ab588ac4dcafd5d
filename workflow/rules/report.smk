# Stage 6: figures (seaborn, PNG + PDF) and the HTML report.
#   snakemake --report results/report.html   (--configfile X: X's results_dir, e.g. results-smoke)
# collects every output marked report(...) below and in analyse.smk, with the captions
# in workflow/report/.


report: "../report/workflow.rst"


FIGURES = f"{RESULTS}/figures"
FIGURE_NAMES = ["survival", "gap_decomposition", "branch_tv", "confirmatory_differences", "variance"]


rule figures:
    input:
        survival=f"{ANALYSIS}/survival.parquet",
        branch_tv=f"{ANALYSIS}/branch_tv.parquet",
        variance=f"{ANALYSIS}/variance.parquet",
        gaps=f"{ANALYSIS}/gaps.parquet",
        confirmatory=f"{ANALYSIS}/confirmatory.parquet",
        confirmatory_documents=f"{ANALYSIS}/confirmatory_documents.parquet",
    output:
        **{
            f"{name}_png": report(
                f"{FIGURES}/{name}.png",
                caption=f"../report/{name}.rst",
                category="Figures",
                labels={"figure": name.replace("_", " ")},
            )
            for name in FIGURE_NAMES
        },
        **{f"{name}_pdf": f"{FIGURES}/{name}.pdf" for name in FIGURE_NAMES},
    log:
        f"{LOGS}/figures.log",
    params:
        early=canonical(config["confirmatory"]["early"]),
        late=canonical(config["confirmatory"]["late"]),
        floor=FLOOR,
    threads: 1
    resources:
        mem_mb=2000,
        runtime=20,
    conda:
        CONDA_ENV
    script:
        "../scripts/figures.py"


rule summary:
    input:
        pooled=f"{ANALYSIS}/pooled.parquet",
        gaps=f"{ANALYSIS}/gaps.parquet",
        confirmatory=f"{ANALYSIS}/confirmatory.parquet",
        floor=f"{ANALYSIS}/floor.parquet",
        provenance=PROVENANCE,
    output:
        report(
            f"{ANALYSIS}/summary.html",
            caption="../report/summary.rst",
            category="Summary",
            labels={"table": "headline numbers"},
        ),
    log:
        f"{LOGS}/summary.log",
    params:
        plan=canonical(config["confirmatory"]),
    threads: 1
    resources:
        mem_mb=1000,
        runtime=10,
    conda:
        CONDA_ENV
    script:
        "../scripts/summary.py"


ALL_TARGETS.extend(
    [
        *(f"{FIGURES}/{name}.{ext}" for name in FIGURE_NAMES for ext in ("png", "pdf")),
        f"{ANALYSIS}/summary.html",
    ]
)


# The frontier figure (config `frontier`): p_div, E[M] and the mean first-divergence step
# against retention, one line per press (against KV bytes per prompt token, one line per
# curve, with quantized caches), the noise floor as a grey band.
if FRONTIER_POINTS:

    rule frontier_figure:
        input:
            f"{ANALYSIS}/frontier.parquet",
        output:
            png=report(
                f"{FIGURES}/frontier.png",
                caption="../report/frontier.rst",
                category="Frontier",
                labels={"figure": "frontier"},
            ),
            pdf=f"{FIGURES}/frontier.pdf",
        log:
            f"{LOGS}/frontier_figure.log",
        threads: 1
        resources:
            mem_mb=2000,
            runtime=10,
        conda:
            CONDA_ENV
        script:
            "../scripts/frontier_figure.py"

    ALL_TARGETS.extend([f"{FIGURES}/frontier.png", f"{FIGURES}/frontier.pdf"])


# The self-speculative figure: tokens per target forward A_k + 1 of a first draft block
# against its length k, beside the i.i.d. formula, and the accepted fraction A_k / k.
rule speculative_figure:
    input:
        f"{ANALYSIS}/speculative.parquet",
    output:
        png=report(
            f"{FIGURES}/speculative.png",
            caption="../report/speculative.rst",
            category="Figures",
            labels={"figure": "self-speculative reading"},
        ),
        pdf=f"{FIGURES}/speculative.pdf",
    log:
        f"{LOGS}/speculative_figure.log",
    params:
        floor=FLOOR,
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    conda:
        CONDA_ENV
    script:
        "../scripts/speculative_figure.py"


ALL_TARGETS.extend([f"{FIGURES}/speculative.png", f"{FIGURES}/speculative.pdf"])
