"""report.html's tables as Plotly tables, sorted and filtered by Plotly's own menus (no script of ours).

A table is one Plotly `Table` trace per *view* (all rows, the rows of one swept value such as
`model/mixer=gqa`, the failed jobs), only one visible at a time: the "show" menu switches the view (a
restyle of `visible`). The "sort by" menu holds, per column (ascending; numbers descending too), every view's rows in that order
(a restyle of `cells.values` and of the row colours), so a sort keeps the view and a view keeps the sort.
Numbers sort by value, text in natural order ('2' before '10'), empty cells last; failed rows stay red.

Every header and cell is shown whole and every row at once: the figure is as wide as its columns and as tall
as its rows (the page scrolls, never the table). Plotly wraps a cell only at spaces and clips what does not fit,
so the text is wrapped here, by an estimate of its width in DejaVu Sans (the widest common sans-serif; Arial and
Helvetica are narrower, so an estimate errs on the roomy side): a header at spaces and after '/', a cell at
spaces and, inside a word longer than a column may be, after ',' ';' '/'. Each row is then as tall as its most
wrapped cell, which fixes the figure's height.
"""
from __future__ import annotations

import re

import plotly.graph_objects as go

from attnzoo.analysis.report.tables import Cell

MAX_VIEWS = 30  # the show menu's entries (each view's rows are stored once per sort order)
ROW_HEIGHT = 24
FAILED, STRIPES = "#fdd", ("#ffffff", "#f3f5f8")
FONT_PX, LINE_PX, PAD_PX = 12, 15.6, 8  # the font; a line of a cell (plotly: 1.3 x the font); plotly's cell padding
CELL_PX, HEAD_PX = 300, 100  # a cell wider than this wraps; a header too, where it can
MARGIN = dict(l=10, r=10, t=48, b=6)
# DejaVu Sans advance widths in em (others: 0.64, a digit or a lower-case letter)
_EM = {**dict.fromkeys(" .,:;'|!ijl", 0.32), **dict.fromkeys("ftr()[]{}/-\"", 0.4), **dict.fromkeys("sz_", 0.53),
       **dict.fromkeys("mw", 0.98), **dict.fromkeys("MW@%", 1.0), **dict.fromkeys("=+~^<>*#", 0.84)}


def text_px(text: str, bold: bool = False) -> float:
    """The width of `text` on one line, in pixels (an estimate on the wide side)."""
    em = sum(_EM.get(c, 0.74 if c.isupper() else 0.64) for c in text)
    return em * FONT_PX * (1.1 if bold else 1.0)


def wrap(text: str, width: float, bold: bool = False, breaks: str = ",;/") -> list[str]:
    """`text` in lines of at most `width` pixels: broken at spaces, and where a word alone is wider, after one of
    `breaks` (a word without one stays whole: the column is made as wide as it). A line broken at a space keeps
    it at its end: the lines join back into `text`."""
    pieces = []  # (glue before it, text): a word's parts join without a space
    for word in text.split(" "):
        parts = [word] if text_px(word, bold) <= width else \
            [p for p in re.split(f"(?<=[{re.escape(breaks)}])", word) if p] or [word]
        pieces += [(" " if k == 0 else "", part) for k, part in enumerate(parts)]
    lines: list[str] = []
    for glue, part in pieces:
        if lines and text_px(lines[-1] + glue + part, bold) <= width:
            lines[-1] += glue + part
        elif lines:
            lines[-1] += glue
            lines.append(part)
        else:
            lines.append(part)
    return lines or [""]


def _key(cell: Cell):
    """(empty last, numbers before text, then the number or the natural-order text)."""
    text, value = cell
    if value is not None:
        return (0, 0, float(value), [])
    if text == "":
        return (2, 0, 0.0, [])
    return (1, 0, 0.0, [(0, int(t), "") if t.isdigit() else (1, 0, t.lower()) for t in re.split(r"(\d+)", text) if t])


def _orders(head: list[str], rows: list[list[Cell]], numeric: list[bool]) -> list[tuple[str, list[int]]]:
    """('as listed', identity) and, per column, the row indices in ascending order, and for a column of
    numbers in descending order too (empty cells last in both)."""
    out = [("as listed", list(range(len(rows))))]
    for c, h in enumerate(head):
        asc = sorted(range(len(rows)), key=lambda i: _key(rows[i][c]))
        out.append((f"{h} ▲", asc))
        if numeric[c]:
            filled = [i for i in asc if rows[i][c][0] != ""]
            out.append((f"{h} ▼", filled[::-1] + [i for i in asc if rows[i][c][0] == ""]))
    return out


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _cells(texts: list[list[str]], failed: list[bool], order: list[int]) -> tuple[list[list[str]], list[list[str]]]:
    """The columns' (wrapped) texts in `order`, and the row colours (one list: Plotly repeats it across the columns)."""
    values = [[texts[i][c] for i in order] for c in range(len(texts[0]))] if texts else []
    fill = [[FAILED if failed[i] else STRIPES[pos % 2] for pos, i in enumerate(order)]]
    return values, fill


def _lines_px(lines: list[str], text: str) -> float:
    """A cell's height: plotly grows a cell of several lines, or of markup (& < >), to its text plus padding;
    any other keeps the row height (measured in Chromium: n lines 15.5 n + 15 px, one line of markup 30)."""
    return len(lines) * LINE_PX + 2 * PAD_PX if len(lines) > 1 or re.search("[&<>]", text) else ROW_HEIGHT


def _menu_px(head: list[str]) -> tuple[float, float, float]:
    """Where the 'sort by' menu, the 'show' label and its menu start, in pixels from the table's left edge."""
    sort_w = max(text_px(f"{h} ▼") for h in head) + 40  # plotly sizes a dropdown to its longest entry
    return 55, 55 + sort_w + 25, 55 + sort_w + 65


def table_figure(head: list[str], rows: list[list[Cell]], failed: list[bool],
                 views: list[tuple[str, list[int]]] = ()) -> go.Figure:
    """A sortable, filterable table: `views` are (menu label, row indices) besides 'all rows'. Its layout's width
    and height hold every column and row whole (the page shows it at that size)."""
    views = [(f"all rows ({len(rows)})", list(range(len(rows))))] + [(f"{n} ({len(ix)})", ix) for n, ix in views][:MAX_VIEWS]
    numeric = [all(r[c][1] is not None or r[c][0] == "" for r in rows) and any(r[c][1] is not None for r in rows)
               for c in range(len(head))]
    head_lines = [wrap(h, HEAD_PX, bold=True, breaks="/") for h in head]
    lines = [[wrap(text, CELL_PX) for text, _ in r] for r in rows]
    texts = [["<br>".join(_escape(x) for x in cell) for cell in r] for r in lines]
    widths = [2 * PAD_PX + 4 + max([text_px(x, bold=True) for x in head_lines[c]]
                                   + [text_px(x) for r in lines for x in r[c]]) for c in range(len(head))]
    fig = go.Figure()
    for v, (_, members) in enumerate(views):
        values, fill = _cells(texts, failed, members)
        fig.add_trace(go.Table(
            visible=v == 0, columnwidth=widths,
            header=dict(values=["<br>".join(f"<b>{_escape(x)}</b>" for x in h) for h in head_lines],
                        fill_color="#e8ebf0", align="left", font=dict(size=FONT_PX), height=ROW_HEIGHT + 4),
            cells=dict(values=values, fill=dict(color=fill), align=["right" if n else "left" for n in numeric],
                       font=dict(size=FONT_PX), height=ROW_HEIGHT)))
    sorts, member_sets = [], [set(members) for _, members in views]
    for label, order in _orders(head, rows, numeric):
        per_view = [_cells(texts, failed, [i for i in order if i in ms]) for ms in member_sets]
        sorts.append(dict(label=label, method="restyle", args=[{"cells.values": [vals for vals, _ in per_view],
                                                                "cells.fill.color": [fill for _, fill in per_view]},
                                                               list(range(len(views)))]))
    shows = [dict(label=name, method="restyle", args=[{"visible": [k == v for k in range(len(views))]}])
             for v, (name, _) in enumerate(views)]
    menu = dict(type="dropdown", direction="down", xanchor="left", yanchor="bottom", y=1.01, pad=dict(r=4, t=2, b=2),
                bgcolor="#f7f7f7", font=dict(size=FONT_PX))
    # the menus need room too: the table is never narrower than both side by side
    at = _menu_px(head)
    inner = max(sum(widths), at[2] + max(text_px(name) for name, _ in views) + 40)
    sort_x, show_label_x, show_x = (x / inner for x in at)
    header_px = max(len(h) for h in head_lines) * LINE_PX + 2 * PAD_PX  # bold: markup
    rows_px = sum(max(_lines_px(cell, text) for cell, (text, _) in zip(r, row)) for r, row in zip(lines, rows))
    fig.update_layout(
        updatemenus=[dict(menu, buttons=sorts, x=sort_x, active=0), dict(menu, buttons=shows, x=show_x, active=0)],
        annotations=[dict(text="sort by", x=0, y=1.01, xref="paper", yref="paper", xanchor="left", yanchor="bottom",
                          showarrow=False, yshift=10), dict(text="show", x=show_label_x, y=1.01, xref="paper",
                                                           yref="paper", xanchor="left", yanchor="bottom",
                                                           showarrow=False, yshift=10)],
        margin=MARGIN, font=dict(family="sans-serif", size=FONT_PX), autosize=False,
        width=round(inner + MARGIN["l"] + MARGIN["r"]),
        height=round(MARGIN["t"] + MARGIN["b"] + header_px + rows_px + 8))
    return fig
