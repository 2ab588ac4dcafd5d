"""Output files and rendered tables: atomic writes of files, folders and tables (:mod:`kvdiverge.io.files`)
and the plain-text and HTML table renderers (:mod:`kvdiverge.io.render`); polars only, the lowest layer,
so every stage that writes or renders can import it."""
