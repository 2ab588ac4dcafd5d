"""Tables rendered as plain text and as HTML: the one renderer of each.

:func:`text_table` serves the measurement summary and the frontier ranking
(:mod:`kvdiverge.report.formatting`) and the study's cost table (:mod:`kvdiverge.planning.cost`);
:func:`html_table` the report pages (:mod:`kvdiverge.report.pages`) and the provenance section
(:func:`kvdiverge.report.pages.provenance_html`); :func:`markdown_table` the tables docs/task.md
quotes (:func:`kvdiverge.report.formatting.prediction_markdown`). Cells arrive formatted; nothing
here reads numbers.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

__all__ = ["html_table", "markdown_table", "text_table"]


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A Markdown (GitHub) table: the header row, its ``|---|`` rule, the rows; cells as given.

    Raises
    ------
    ValueError
        A row whose length is not the header's.
    """
    bad = [r for r in rows if len(r) != len(header)]
    if bad:
        raise ValueError(f"a row has {len(bad[0])} cells, the header {len(header)}")
    return ["| " + " | ".join(cells) + " |" for cells in (header, ["---"] * len(header), *rows)]


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> list[str]:
    """A plain-text table: the header, a rule of dashes, the rows; columns two spaces apart.

    Parameters
    ----------
    header : sequence of str
        Column titles.
    rows : sequence of sequence of str
        Cells, already formatted, one sequence per row (as long as ``header``).
    left : int
        The first ``left`` columns are left-aligned, the others right-aligned.

    Returns
    -------
    list of str
        The lines, trailing spaces stripped.
    """
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return [line(header), line(["-" * w for w in widths]), *map(line, rows)]


def html_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """An HTML ``<table>`` with a ``<thead>`` of ``header`` and one ``<tr>`` per row, every cell escaped (``str`` of it)."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
