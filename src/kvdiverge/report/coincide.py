"""Curves that coincide on a figure: found, given offset markers, and named in the legend.

Two curves drawn on one axes coincide when one of them has no step the other lacks and, at
every step they share, they lie within ``COINCIDE_TOL`` of the axes' height of one another:
drawn with the same line width, the one drawn last hides the other (the `none` control and the
noise floor both at ``S_t = 1``, two policies whose survival agrees to a thousandth).
:func:`coinciding_groups` finds them; :func:`show_coinciding` gives the ``j``-th of a group's
``n`` curves its own marker shape at steps ``j, j + n, j + 2n, ...``, so that each curve shows
its markers where the others show none, and :func:`legend_with_coinciding` draws the legend
with one entry per group naming its curves ("on one curve (markers offset): a; b").
"""

from __future__ import annotations

import textwrap
from typing import Callable, Mapping, Sequence

import numpy as np
from matplotlib.lines import Line2D

__all__ = ["COINCIDE_TOL", "coinciding_groups", "coincidence_note", "legend_with_coinciding", "show_coinciding"]

#: Curves closer than this fraction of the axes' height at every shared step coincide.
COINCIDE_TOL = 0.01

#: The marker shapes of a group's curves, in order (the first curve's first).
COINCIDE_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")

#: Characters per line of a legend's note.
NOTE_WIDTH = 52


def _coincide(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray], tol: float) -> bool:
    """Whether curves ``a`` and ``b`` (x, y) coincide: one's steps all among the other's, within ``tol`` at each."""
    (xa, ya), (xb, yb) = a, b
    shared, ia, ib = np.intersect1d(xa, xb, assume_unique=True, return_indices=True)
    if shared.size == 0 or shared.size < min(xa.size, xb.size):
        return False
    return bool(np.all(np.abs(ya[ia] - yb[ib]) <= tol))


def coinciding_groups(curves: Mapping[str, tuple[np.ndarray, np.ndarray]], tol: float) -> list[list[str]]:
    """The groups of two or more curves that coincide, each in the order of ``curves``.

    Parameters
    ----------
    curves : mapping of str to (x, y)
        Each curve's distinct x values (1-D, float) and its y values there, by label.
    tol : float
        The largest distance, in y units, at which two curves' values at one step coincide.

    Returns
    -------
    list of list of str
        Labels of each group, groups in the order of their first curve; curves that coincide
        with a curve of a group join it (a chain of near curves is one group).
    """
    labels = list(curves)
    group = {label: i for i, label in enumerate(labels)}
    data = {k: (np.asarray(x, dtype=float), np.asarray(y, dtype=float)) for k, (x, y) in curves.items()}
    for i, a in enumerate(labels):
        for b in labels[i + 1 :]:
            if group[a] != group[b] and _coincide(data[a], data[b], tol):
                old, new = max(group[a], group[b]), min(group[a], group[b])
                group.update({k: new for k, g in group.items() if g == old})
    members: dict[int, list[str]] = {}
    for label in labels:
        members.setdefault(group[label], []).append(label)
    return [m for m in members.values() if len(m) > 1]


def show_coinciding(ax, lines: Sequence[Line2D], tol: float = COINCIDE_TOL) -> list[list[str]]:
    """Give each curve of every coinciding group among ``lines`` its own marker at offset steps.

    Call it after the axes' y limits are set: ``tol`` is a fraction of their span.

    Parameters
    ----------
    ax : matplotlib.axes.Axes
        The axes the lines are drawn on.
    lines : sequence of matplotlib.lines.Line2D
        The curves, each with its own label.
    tol : float
        Fraction of the axes' height within which two curves coincide (``COINCIDE_TOL``).

    Returns
    -------
    list of list of str
        The groups' labels (:func:`coinciding_groups`).
    """
    lo, hi = ax.get_ylim()
    by_label = {line.get_label(): line for line in lines}
    curves = {k: (np.asarray(v.get_xdata(), float), np.asarray(v.get_ydata(), float)) for k, v in by_label.items()}
    groups = coinciding_groups(curves, tol * abs(hi - lo))
    for group in groups:
        for j, label in enumerate(group):
            line = by_label[label]
            line.set(marker=COINCIDE_MARKERS[j % len(COINCIDE_MARKERS)], markevery=(j, len(group)), ms=5)
            line.set(mfc=line.get_color(), mec="white", mew=0.6)
    return groups


def coincidence_note(names: Sequence[str], width: int = NOTE_WIDTH) -> str:
    """The legend's note for one group: "on one curve (markers offset): a; b", wrapped at ``width``."""
    return textwrap.fill("on one curve (markers offset): " + "; ".join(names), width)


def legend_with_coinciding(
    ax,
    lines: Sequence[Line2D],
    handles: Sequence | None = None,
    describe: Callable[[list[str]], list[str]] | None = None,
    **legend_kw,
):
    """Mark the coinciding curves among ``lines`` (:func:`show_coinciding`) and draw the axes' legend.

    Parameters
    ----------
    ax : matplotlib.axes.Axes
    lines : sequence of matplotlib.lines.Line2D
        The curves that may coincide, each with its own label.
    handles : sequence of artists, optional
        The legend's entries, each with its label (default: the axes' labelled artists).
    describe : callable, optional
        A group's labels to the names its note gives (default: the labels).
    **legend_kw
        Passed to ``ax.legend``.

    Returns
    -------
    matplotlib.legend.Legend
        The legend: ``handles``, then one entry without a mark per group,
        :func:`coincidence_note`.
    """
    groups = show_coinciding(ax, lines)
    handles = list(handles) if handles is not None else ax.get_legend_handles_labels()[0]
    notes = [Line2D([], [], ls="none", label=coincidence_note(describe(g) if describe else g)) for g in groups]
    entries = handles + notes
    return ax.legend(entries, [h.get_label() for h in entries], **legend_kw)
