"""report.html: one self-contained page that works offline. plotly.js is embedded once in the page's head;
every chart and table is a Plotly figure (its specification, data traces and layout, written into the page
by plotly.io.to_html); the matplotlib PNGs follow, embedded as base64, for papers."""
from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Any

import plotly.io as pio
from plotly.offline import get_plotlyjs

from attnzoo.analysis.report.charts import Chart, sort_key
from attnzoo.analysis.report.datatable import table_figure
from attnzoo.analysis.report.figures import chart_figure
from attnzoo.analysis.report.tables import length_table, table

CSS = """body{font-family:sans-serif;margin:2em;max-width:1400px} h2{margin-top:1.6em}
ul.failed li{color:#a00} img{max-width:100%} code{background:#f4f4f4;padding:1px 4px}
details summary{cursor:pointer;font-size:1.2em;margin:1em 0}"""

HELP = ("Charts: hover a point for its job, overrides and metrics; drag to zoom, double-click to reset; click a legend "
        "entry to hide that series in every panel, double-click it to show it alone; the camera icon saves a PNG. "
        "Tables: <i>sort by</i> orders the rows by a column (numbers by value), <i>show</i> keeps the rows of one "
        "swept value (or the failed jobs); the two combine. Error bars: the standard deviation over seeds.")


def views(rows: list[dict], field: str) -> list[tuple[str, list[int]]]:
    """A table's filters: the rows that did not finish, then per swept value (an override in `field`, e.g.
    'model/mixer=gqa') the rows holding it, keys in the order the overrides name them, values in natural order."""
    members: dict[str, list[int]] = {}
    for i, j in enumerate(rows):
        for o in j.get(field, []):
            members.setdefault(o, []).append(i)
    keys = list(dict.fromkeys(o.split("=", 1)[0] for o in members))
    out = sorted(((o, ix) for o, ix in members.items() if len(ix) < len(rows)),
                 key=lambda v: (keys.index(v[0].split("=", 1)[0]), sort_key(v[0].split("=", 1)[-1])))
    bad = [i for i, j in enumerate(rows) if j["status"] != "ok"]
    return ([("not ok (failed or incomplete)", bad)] if 0 < len(bad) < len(rows) else []) + out


def figure_html(fig, div_id: str) -> str:
    """The figure's div and its specification (plotly.js is loaded once, in the page's head); a table at the width
    its layout sets (its columns whole: the page scrolls sideways if it must), a chart across the page."""
    width = f"{fig.layout.width}px" if fig.layout.width else "100%"
    return pio.to_html(fig, full_html=False, include_plotlyjs=False, div_id=div_id, default_width=width,
                       config={"displaylogo": False, "responsive": True,
                               "toImageButtonOptions": {"filename": div_id, "scale": 2}})


def _table_html(div_id: str, rows: list[dict], head_cells: tuple[list[str], list], field: str) -> str:
    head, cells = head_cells
    return figure_html(table_figure(head, cells, [j["status"] != "ok" for j in rows], views(rows, field)), div_id)


def plain_table_html(div_id: str, head: list[str], rows: list[list]) -> str:
    """A table of computed rows (no job status): sortable, one view per value of its first column."""
    firsts: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        firsts.setdefault(r[0][0], []).append(i)
    views = [(v, ix) for v, ix in firsts.items() if len(ix) < len(rows)]
    return figure_html(table_figure(head, rows, [False] * len(rows), views), div_id)


def page(title: str, command: str, jobs: list[dict], best: list[dict], cols: list[str], extra: list[tuple[str, Any]],
         metric: str, charts: list[Chart], pngs: dict[str, Path], sections: str = "", best_title: str = "") -> str:
    """`sections`: further sections' html (a budget sweep's scaling study), before the best-of-lr table;
    `best_title`: that table's heading ('' when neither the learning rate nor the seed was swept: no such table)."""
    e = html.escape
    lengths = length_table(best, metric)
    fails = "".join(f"<li class='failed'>job {e(j['job'])} ({e(j['label'])}): {e(j['status'])}: {e(j['error'])}</li>"
                    for j in jobs if j["status"] != "ok")
    imgs = "".join(f"<h3>{e(name)}</h3><img alt='{e(name)}' src='data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}'/>"
                   for name, p in pngs.items())
    parts = [
        f"<h1>Sweep report: {e(title)}</h1>",
        f"<p>Command: <code>{e(command)}</code></p>" if command else "",
        f"<p>{len(jobs)} jobs, {sum(j['status'] == 'ok' for j in jobs)} ok; ranking metric <code>{e(metric)}</code>; "
        f"best-of-lr rows are means over seeds where seeds were swept.</p><p>{HELP}</p>",
        sections,
        *([f"<h2>{e(best_title)}</h2>", _table_html("table-best", best, table(best, cols, extra), "variant_overrides")]
          if best_title else []),
        *(["<h2>Charts</h2>"] if charts else []), *[figure_html(chart_figure(c), f"chart-{c.name}") for c in charts],
        *(["<h2>Length extrapolation</h2>", _table_html("table-lengths", best, lengths, "variant_overrides")] if lengths[1] else []),
        "<h2>All jobs</h2>", _table_html("table-all", jobs, table(jobs, cols), "swept"),
        f"<h2>Failed jobs</h2><ul class='failed'>{fails}</ul>" if fails else "",
        f"<details><summary>The plots as PNG, for papers (also in plots/)</summary>{imgs}</details>" if imgs else "",
    ]
    body = "\n".join(p for p in parts if p)
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>attnzoo sweep {e(title)}</title>\n"
            f"<style>{CSS}</style>\n<script type='text/javascript'>{get_plotlyjs()}</script>\n</head><body>\n{body}\n</body></html>\n")
