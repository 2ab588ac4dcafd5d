"""The study's text: the corpus, the prompts rendered from it, and the tasks built on it.

Documents as excerpts of whole paragraphs in two disjoint splits
(:mod:`~kvdiverge.data.corpus`), each rendered in a model's chat template with its
exclusions (:mod:`~kvdiverge.data.prompts`), and synthetic tasks with known answers
(:mod:`~kvdiverge.data.tasks`). No model is loaded here; a tokenizer is passed in.
"""
