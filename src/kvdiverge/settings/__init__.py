"""One setting's rules, the same at every door: the config schema and the checks it drives.

The JSON schema, package data parsed once (:mod:`~kvdiverge.settings.schema`), and each
measurement setting checked against its entry, in words that name the key
(:mod:`~kvdiverge.settings.checks`). A whole config's cross-references are checked above, in
:mod:`kvdiverge.config`.
"""
