"""report.html's tables as Plotly tables, sorted and filtered by Plotly's own menus (no script of ours).

A table is one Plotly `Table` trace per *view* (all rows, the rows of one swept value such as
`model/mixer=gqa`, the failed jobs), only one visible at a time: the "show" menu switches the view (a
restyle of `visible`). The "sort by" menu holds, per column (ascending; numbers descending too), every view's rows in that order
(a restyle of `cells.values` and of the row colours), so a sort keeps the view and a view keeps the sort.
Numbers sort by value, text in natural order ('2' before '10'), empty cells last; failed rows stay red.
"""
from __future__ import annotations

import re

import plotly.graph_objects as go

from attnzoo.analysis.report.tables import Cell

MAX_VIEWS = 30  # the show menu's entries (each view's rows are stored once per sort order)
ROW_HEIGHT = 24
FAILED, STRIPES = "#fdd", ("#ffffff", "#f3f5f8")


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


def _cells(rows: list[list[Cell]], failed: list[bool], order: list[int]) -> tuple[list[list[str]], list[list[str]]]:
    """The columns' texts in `order`, and the row colours (one list: Plotly repeats it across the columns)."""
    values = [[_escape(rows[i][c][0]) for i in order] for c in range(len(rows[0]))] if rows else []
    fill = [[FAILED if failed[i] else STRIPES[pos % 2] for pos, i in enumerate(order)]]
    return values, fill


def table_figure(head: list[str], rows: list[list[Cell]], failed: list[bool],
                 views: list[tuple[str, list[int]]] = ()) -> go.Figure:
    """A sortable, filterable table: `views` are (menu label, row indices) besides 'all rows'."""
    views = [(f"all rows ({len(rows)})", list(range(len(rows))))] + [(f"{n} ({len(ix)})", ix) for n, ix in views][:MAX_VIEWS]
    numeric = [all(r[c][1] is not None or r[c][0] == "" for r in rows) and any(r[c][1] is not None for r in rows)
               for c in range(len(head))]
    widths = [max([len(h)] + [len(r[c][0]) for r in rows]) for c, h in enumerate(head)]
    fig = go.Figure()
    for v, (_, members) in enumerate(views):
        values, fill = _cells(rows, failed, members)
        fig.add_trace(go.Table(
            visible=v == 0, columnwidth=[min(max(w, 6), 60) for w in widths],
            header=dict(values=[f"<b>{_escape(h)}</b>" for h in head], fill_color="#e8ebf0", align="left",
                        font=dict(size=12), height=ROW_HEIGHT + 4),
            cells=dict(values=values, fill=dict(color=fill), align=["right" if n else "left" for n in numeric],
                       font=dict(size=12), height=ROW_HEIGHT)))
    sorts, member_sets = [], [set(members) for _, members in views]
    for label, order in _orders(head, rows, numeric):
        per_view = [_cells(rows, failed, [i for i in order if i in ms]) for ms in member_sets]
        sorts.append(dict(label=label, method="restyle", args=[{"cells.values": [vals for vals, _ in per_view],
                                                                "cells.fill.color": [fill for _, fill in per_view]},
                                                               list(range(len(views)))]))
    shows = [dict(label=name, method="restyle", args=[{"visible": [k == v for k in range(len(views))]}])
             for v, (name, _) in enumerate(views)]
    menu = dict(type="dropdown", direction="down", xanchor="left", yanchor="bottom", y=1.01, pad=dict(r=4, t=2, b=2),
                bgcolor="#f7f7f7", font=dict(size=12))
    lines = max(1, *(len(t) // 60 + 1 for r in rows for t, _ in r[:2])) if rows else 1  # long overrides wrap
    fig.update_layout(
        updatemenus=[dict(menu, buttons=sorts, x=0.06, active=0), dict(menu, buttons=shows, x=0.42, active=0)],
        annotations=[dict(text="sort by", x=0, y=1.01, xref="paper", yref="paper", xanchor="left", yanchor="bottom",
                          showarrow=False, yshift=10), dict(text="show", x=0.37, y=1.01, xref="paper", yref="paper",
                                                           xanchor="left", yanchor="bottom", showarrow=False, yshift=10)],
        margin=dict(l=10, r=10, t=48, b=6), font=dict(family="sans-serif", size=12),
        height=min(1000, 90 + (ROW_HEIGHT + 2) * len(rows) * min(lines, 2)))
    return fig
