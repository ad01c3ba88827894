"""A table of run figures as formatted cells, and its layouts.

A :class:`Grid` holds already formatted strings; it is rendered rich for the
terminal (laid out to its width by :func:`fit`), as plain text, or as GitHub
markdown, so the terminal and the committed markdown show the same numbers.
Building grids from runs is ``ladsd.metrics.comparison`` and
``ladsd.metrics.peer_compare``; nothing here knows about runs or policies.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass

from rich.cells import cell_len
from rich.console import Console
from rich.table import Table


@dataclass(frozen=True)
class Grid:
    title: str
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    keys: int = 1  # leading columns that name a row; repeated in every part of a split table


def fmt(x: float | None, digits: int = 2) -> str:
    """A figure as a cell with ``digits`` decimals ("-": none)."""
    return "-" if x is None else f"{x:.{digits}f}"


def fmt_count(x: float | None) -> str:
    """A counter as a cell: whole numbers without decimals, means with 2 ("-": none)."""
    if x is None:
        return "-"
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.2f}"


def rich_table(grid: Grid) -> Table:
    t = Table(title=grid.title)
    for i, h in enumerate(grid.headers):
        t.add_column(h, justify="left" if i == 0 else "right", no_wrap=True)
    for row in grid.rows:
        t.add_row(*row)
    return t


def table_width(grid: Grid) -> int:
    """Columns :func:`rich_table` needs to show every cell in full (its natural width)."""
    widths = [
        max([cell_len(grid.headers[i]), *(cell_len(r[i]) for r in grid.rows)])
        for i in range(len(grid.headers))
    ]
    return sum(w + 3 for w in widths) + 1  # one space each side and a rule per column, one edge


def fit(grid: Grid, width: int) -> list[Grid]:
    """``grid`` laid out for a ``width``-column terminal, every cell in full where possible.

    In order of preference: the grid as it is; transposed (one column per row,
    named by its key cells, one line per figure); split by columns, each part
    repeating the key columns (policy, seed) and taking as many of the
    following columns, in order, as fit, so the first part holds the mean
    latency; one transposed table per row. The content is the same in every
    layout; markdown and JSON outputs never depend on the width.
    """
    if not grid.rows or table_width(grid) <= width:
        return [grid]
    flipped = transposed(grid)
    if table_width(flipped) <= width:
        return [flipped]
    parts = _split(grid, width)
    if all(table_width(p) <= width for p in parts):
        return parts
    return [transposed(_select(grid, grid.title, rows=[i])) for i in range(len(grid.rows))]


def transposed(grid: Grid) -> Grid:
    """Rows become columns, named by their key cells (``lads seed 1``)."""
    k = min(grid.keys, len(grid.headers))

    def name(row: Sequence[str]) -> str:
        return " ".join([row[0], *(f"{grid.headers[i]} {row[i]}" for i in range(1, k))])

    return Grid(
        grid.title,
        (grid.headers[0], *(name(r) for r in grid.rows)),
        tuple((grid.headers[i], *(r[i] for r in grid.rows)) for i in range(k, len(grid.headers))),
    )


def _split(grid: Grid, width: int) -> list[Grid]:
    keys = list(range(min(grid.keys, len(grid.headers))))
    parts: list[list[int]] = []
    cur = list(keys)
    for i in range(len(keys), len(grid.headers)):
        if len(cur) > len(keys) and table_width(_select(grid, "", cols=[*cur, i])) > width:
            parts.append(cur)
            cur = list(keys)
        cur.append(i)
    parts.append(cur)
    n = len(parts)
    return [
        _select(grid, grid.title if n == 1 else f"{grid.title} ({j + 1}/{n})", cols=cols)
        for j, cols in enumerate(parts)
    ]


def _select(
    grid: Grid, title: str, cols: Sequence[int] | None = None, rows: Sequence[int] | None = None
) -> Grid:
    c = range(len(grid.headers)) if cols is None else cols
    r = range(len(grid.rows)) if rows is None else rows
    return Grid(
        title,
        tuple(grid.headers[i] for i in c),
        tuple(tuple(grid.rows[j][i] for i in c) for j in r),
        keys=grid.keys,
    )


def rich_tables(grid: Grid, width: int) -> list[Table]:
    """The terminal tables of ``grid`` for a ``width``-column terminal (see :func:`fit`)."""
    return [rich_table(g) for g in fit(grid, width)]


def text(grids: Sequence[Grid], width: int = 400) -> str:
    """Plain text (no colour codes); tables keep their natural width up to ``width``."""
    buf = io.StringIO()
    con = Console(file=buf, width=width, color_system=None, force_terminal=False)
    for g in grids:
        con.print(rich_table(g))
    return buf.getvalue()


def markdown(grids: Sequence[Grid]) -> str:
    """GitHub markdown: a bold title line and a pipe table per grid."""
    out = []
    for g in grids:
        align = ["---", *["---:"] * (len(g.headers) - 1)]
        lines = [f"**{g.title}**", "", _md_row(g.headers), _md_row(align)]
        lines += [_md_row(r) for r in g.rows]
        out.append("\n".join(lines))
    return "\n\n".join(out) + "\n"


def _md_row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"
