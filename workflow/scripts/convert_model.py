"""Snakemake adapter: convert a GGUF model entry to a safetensors directory (kvdiverge.models)."""

import logging

from kvdiverge.models import convert_to_directory

logging.basicConfig(filename=snakemake.log[0], level=logging.INFO,  # noqa: F821
                    format="%(asctime)s %(levelname)s %(message)s")
log = logging.getLogger("convert_model")
try:
    entry = convert_to_directory(dict(snakemake.params.model), snakemake.output[0],  # noqa: F821
                                 snakemake.wildcards.model)  # noqa: F821
    log.info("converted %s -> %s", snakemake.wildcards.model, entry["path"])  # noqa: F821
except Exception:
    log.exception("model conversion failed")
    raise
