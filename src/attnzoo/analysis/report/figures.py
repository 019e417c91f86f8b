"""report.html's charts: each `Chart` as a Plotly figure, the same panels, colours, error bars and legend as
its PNG, with what Plotly gives a reader: hover (a point's job, overrides and metrics), zoom and pan
(double-click resets), a click on a legend entry hides that series in every panel (double-click isolates it)."""
from __future__ import annotations

import math

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from attnzoo.analysis.report.charts import DENSE, Chart, Series, data_ticks, log_ticks, tick_text

PANEL_HEIGHT = 330
FONT = dict(family="sans-serif", size=12)


def _rgba(hex_color: str, alpha: float) -> str:
    r, g, b = (int(hex_color[i:i + 2], 16) for i in (1, 3, 5))
    return f"rgba({r},{g},{b},{alpha})"


def _int_dtick(xs: list[float]) -> int:
    """A whole-number tick step (1, 2, 5 x 10^k) giving about six ticks over xs: steps never read 0.5."""
    raw = max((max(xs) - min(xs)) / 6, 1) if xs else 1
    exp = 10 ** math.floor(math.log10(raw))
    return int(next(m * exp for m in (1, 2, 5, 10) if m * exp >= raw))


# d3 tick formats of a linear axis per notation (charts.NOTATIONS); a log axis gets its ticks written out
TICKFORMAT = {"plain": ",~r", "si": "~s", "bytes": "~s", "sci": ".2~e"}


def _axis_ticks(values: list[float], data: list[float], log: int, notation: str, room: int) -> dict:
    """Tick labels on one axis, all in one notation: a log axis ticked at its few data values, else at 1, 2, 5 x
    10^k of every value plotted (so the ticks fall inside its range), each label written out; a linear axis by
    the notation's d3 format. `room`: how many labels fit across the panel."""
    if not log:
        return dict(tickformat=TICKFORMAT[notation], showticklabels=True)
    ticks = data_ticks(data, room) or log_ticks(values, log, notation)
    return dict(type="log", tickvals=ticks, ticktext=[tick_text(t, notation) for t in ticks], showticklabels=True)


def _traces(chart: Chart, s: Series, color: str, first: bool) -> list:
    """A series' traces in one panel; its legend entry (and group: a click hides it everywhere) once per chart."""
    common = dict(name=s.name, legendgroup=s.name, showlegend=first, text=[h.replace("\n", "<br>") for h in s.hover] or None,
                  hovertemplate="%{text}<extra></extra>" if s.hover else None)
    if s.style in ("fit", "void"):  # a fitted curve, under its points; dashed: a fit that does not hold
        return [go.Scatter(x=s.x, y=s.y, mode="lines", opacity=0.8 if s.style == "fit" else 0.6, **common,
                           line=dict(color=color, width=1.5, dash="solid" if s.style == "fit" else "dash"))]
    if s.style in ("points", "optimum"):
        marker = dict(color=color, size=8) if s.style == "points" else \
            dict(color="rgba(0,0,0,0)", size=14, line=dict(color=color, width=2))
        return [go.Scatter(x=s.x, y=s.y, mode="markers", marker=marker, **common)]
    if s.err and len(s.x) > DENSE:  # a curve: the mean over seeds with the standard deviation as a band
        band = go.Scatter(x=list(s.x) + list(s.x)[::-1], y=[y + e for y, e in zip(s.y, s.err)]
                          + [y - e for y, e in zip(s.y, s.err)][::-1], fill="toself", fillcolor=_rgba(color, 0.2),
                          line=dict(width=0), hoverinfo="skip", legendgroup=s.name, showlegend=False)
        return [band, go.Scatter(x=s.x, y=s.y, mode="lines", line=dict(color=color, width=1.5), **common)]
    mode = "markers" if chart.kind == "scatter" else "lines+markers" if len(s.x) <= 30 else "lines"
    err = dict(type="data", array=s.err, visible=True, thickness=1.2, width=4) if s.err else None
    return [go.Scatter(x=s.x, y=s.y, mode=mode, marker=dict(color=color, size=9 if chart.kind == "scatter" else 6),
                       line=dict(color=color, width=1.5), error_y=err, **common)]


def chart_figure(chart: Chart) -> go.Figure:
    if chart.kind == "bar":
        return _bar_figure(chart)
    colors = chart.colors()
    ncols = min(3, len(chart.panels))
    nrows = math.ceil(len(chart.panels) / ncols)
    fig = make_subplots(rows=nrows, cols=ncols, shared_yaxes="all", horizontal_spacing=0.06, vertical_spacing=0.5 / nrows / 2,
                        subplot_titles=[p.title if p.title != "all" else "" for p in chart.panels])
    seen: set[str] = set()
    all_y = [y for p in chart.panels for s in p.series for y in s.y]  # one y axis: the same ticks on every panel
    for i, panel in enumerate(chart.panels):
        row, col = i // ncols + 1, i % ncols + 1
        for s in panel.series:
            for tr in _traces(chart, s, colors[s.name], s.name not in seen):
                fig.add_trace(tr, row=row, col=col)
            seen.add(s.name)
        xs = sorted({float(x) for s in panel.series if s.style in ("", "points") for x in s.x})  # fitted: not data
        xaxis = dict(title_text=chart.xlabel, showgrid=True, gridcolor="#e5e5e5", zeroline=False)
        if chart.x_integer and not chart.xlog:
            xaxis.update(tick0=0, dtick=_int_dtick(xs), tickformat=",d", showticklabels=True)
        else:  # few values on a log axis: tick them (4Ki, 16)
            xaxis.update(_axis_ticks([x for s in panel.series for x in s.x], xs, chart.xlog, chart.xfmt, 12 * 3 // ncols))
        fig.update_xaxes(row=row, col=col, **xaxis)
        fig.update_yaxes(row=row, col=col, showgrid=True, gridcolor="#e5e5e5", zeroline=False,
                         title_text=chart.ylabel if col == 1 else None, range=list(chart.ylim) if chart.ylim else None,
                         **{**_axis_ticks(all_y, [], chart.ylog, chart.yfmt, 8),
                            **({} if col == 1 else {"showticklabels": False})})  # the first column's labels read across
    fig.update_layout(title=dict(text=chart.title, x=0, xanchor="left"), template="plotly_white", font=FONT,
                      height=PANEL_HEIGHT * nrows + 110, margin=dict(l=70, r=20, t=80, b=60),
                      legend=dict(title=dict(text=chart.legend), itemclick="toggle", itemdoubleclick="toggleothers"))
    return fig


def _bar_figure(chart: Chart) -> go.Figure:
    """Horizontal bars, one trace per series (a legend click hides its bars), labels in the series' order."""
    colors = chart.colors()
    series = chart.panels[0].series
    labels = [s.y[0] for s in series]
    fig = go.Figure()
    for name, color in colors.items():
        mine = [s for s in series if s.name == name]
        err = [s.err[0] if s.err else 0 for s in mine]
        fig.add_trace(go.Bar(x=[s.x[0] for s in mine], y=[s.y[0] for s in mine], orientation="h", name=name,
                             marker_color=color, error_x=dict(type="data", array=err, visible=True) if any(err) else None,
                             text=[s.hover[0].replace("\n", "<br>") for s in mine], textposition="none",
                             hovertemplate="%{text}<extra></extra>"))
    fig.update_yaxes(categoryorder="array", categoryarray=labels, autorange="reversed", title_text=chart.legend,
                     showticklabels=True)
    fig.update_xaxes(title_text=chart.xlabel, tickformat=",d", showgrid=True, gridcolor="#e5e5e5", showticklabels=True)
    fig.update_layout(title=dict(text=chart.title, x=0, xanchor="left"), template="plotly_white", font=FONT,
                      height=26 * len(series) + 170, margin=dict(l=70, r=20, t=70, b=60), barmode="overlay",
                      legend=dict(title=dict(text=chart.legend)))
    return fig
