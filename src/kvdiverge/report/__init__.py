"""The report: figures, HTML pages and their number formatting, from estimation tables."""
