"""Models from a config entry: the embedded models, local files, hub ids and stand-ins.

The embedded models (:mod:`~kvdiverge.models.embedded`), where an entry's files are
(:mod:`~kvdiverge.models.sources`), loading a model, its tokenizer or its config alone
(:mod:`~kvdiverge.models.loading`), a
GGUF file's config and Gemma tokenizer read from its header
(:mod:`~kvdiverge.models.gguf_config`, :mod:`~kvdiverge.models.gguf_tokenizer`), and
random-weight stand-ins of the paper's architectures (:mod:`~kvdiverge.models.standins`).
"""
