"""The report: figures and HTML pages, from estimation tables."""
