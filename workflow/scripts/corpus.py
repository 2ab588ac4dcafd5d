"""Snakemake adapter: build results/corpus/documents.parquet (kvdiverge.data.corpus)."""

from kvdiverge.data.corpus import build_corpus, exclusion_lines
from kvdiverge.io.files import write_parquet_atomic
from kvdiverge.jobs.rulelog import rule_log

with rule_log(snakemake.log[0], "corpus", "corpus stage") as log:
    corpus = dict(snakemake.params.corpus)
    log.info("corpus config: %s", corpus)
    table = build_corpus(corpus, exclusions=True)
    docs = table.filter(table["exclusion_reason"].is_null())
    for split, n in docs.group_by("split").len().sort("split").iter_rows():
        part = docs.filter(docs["split"] == split)
        log.info(
            "%s: %d documents from %d addresses, %d-%d words",
            split,
            n,
            part["address"].n_unique(),
            part["n_words"].min(),
            part["n_words"].max(),
        )
    for line in exclusion_lines(table):
        log.info("%s", line)
    write_parquet_atomic(table, snakemake.output[0])
    log.info("wrote %s", snakemake.output[0])
