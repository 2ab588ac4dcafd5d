"""Tables rendered as plain text and as HTML: the one renderer of each.

:func:`text_table` serves the measurement summary and the frontier ranking
(:mod:`kvdiverge.report.formatting`) and the study's cost table (:mod:`kvdiverge.planning.cost`);
:func:`html_table` the report pages (:mod:`kvdiverge.report.pages`) and the provenance section
(:func:`kvdiverge.report.pages.provenance_html`). Cells arrive formatted; nothing here
reads numbers.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

__all__ = ["html_table", "text_table"]


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
