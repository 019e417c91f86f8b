"""The report's PNGs (plots/*.png, for papers): each `Chart` drawn with matplotlib, a panel per facet on one
shared y axis, one colour per series with one legend titled by the swept key, the seeds' standard
deviation as error bars (or a band along a curve), round y ticks and whole-number step / pairs / length axes."""
from __future__ import annotations

import math
import textwrap
from pathlib import Path

import matplotlib
from matplotlib.lines import Line2D
from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator, NullFormatter, NullLocator, ScalarFormatter

from attnzoo.analysis.report.charts import DENSE, Chart, Series, data_ticks, log_ticks, tick_text


def _plt():
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: pyplot picks its backend when first imported; the report draws off-screen

    return plt


def draw(chart: Chart):
    """The chart as a matplotlib Figure (the caller saves and closes it)."""
    return _bars(chart) if chart.kind == "bar" else _panels(chart)


def draw_png(chart: Chart, path: Path) -> None:
    fig = draw(chart)
    fig.savefig(path, dpi=100)
    _plt().close(fig)


def _round_y(ax) -> None:
    """y ticks at round numbers (1, 2, 2.5, 5 x 10^k), written out (no '+2.302' offset above the axis)."""
    ax.yaxis.set_major_locator(MaxNLocator(nbins=6, steps=[1, 2, 2.5, 5, 10]))
    formatter = ScalarFormatter(useOffset=False)
    formatter.set_scientific(False)
    ax.yaxis.set_major_formatter(formatter)


def _log_axis(axis, ticks: list[float], notation: str) -> None:
    """A log axis ticked at `ticks` only, every label in one notation (matplotlib's own would mix 10^3 with 2x10^3)."""
    axis.set_major_locator(FixedLocator(ticks))
    axis.set_major_formatter(FuncFormatter(lambda v, _: tick_text(v, notation)))
    axis.set_minor_locator(NullLocator())
    axis.set_minor_formatter(NullFormatter())


def _x_axis(ax, chart: Chart, series: list[Series]) -> None:
    if chart.xlog:
        ax.set_xscale("log", base=chart.xlog)
        # a fit's x and a fitted optimum's are not data: ticking them too crowds a narrow panel's labels
        ticks = data_ticks([x for s in series if s.style in ("", "points") for x in s.x], room=10)
        _log_axis(ax.xaxis, ticks or log_ticks([x for s in series for x in s.x], chart.xlog, chart.xfmt), chart.xfmt)
    else:
        if chart.x_integer:
            ax.xaxis.set_major_locator(MaxNLocator(nbins=6, integer=True, steps=[1, 2, 2.5, 5, 10]))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: tick_text(v, chart.xfmt)))


def _draw(ax, chart: Chart, s: Series, color: str) -> None:
    if s.style in ("fit", "void"):  # a fitted curve, under its points; dashed: a fit that does not hold
        ax.plot(s.x, s.y, color=color, lw=1.2, alpha=0.8 if s.style == "fit" else 0.6, zorder=2,
                ls="-" if s.style == "fit" else "--")
        return
    if s.style == "optimum":
        ax.scatter(s.x, s.y, s=90, facecolors="none", edgecolors=color, linewidths=1.6, zorder=4)
        return
    if s.style == "points":
        ax.scatter(s.x, s.y, color=color, s=22, zorder=3)
        return
    if s.err and len(s.x) > DENSE:  # a curve: the mean over seeds, the standard deviation as a band
        ax.plot(s.x, s.y, color=color, lw=1.2)
        ax.fill_between(s.x, [y - e for y, e in zip(s.y, s.err)], [y + e for y, e in zip(s.y, s.err)], color=color,
                        alpha=0.2, lw=0)
    elif s.err:
        ax.errorbar(s.x, s.y, yerr=s.err, color=color, marker="o", ms=5, capsize=3,
                    ls="none" if chart.kind == "scatter" else "-", lw=1.2)
    elif chart.kind == "scatter":
        ax.scatter(s.x, s.y, color=color, s=30, zorder=3)
    else:
        ax.plot(s.x, s.y, color=color, lw=1.2, marker="o" if len(s.x) <= 30 else None, ms=4)


def _panels(chart: Chart):
    """A grid of panels (at most 4 columns) on one shared y axis, room on the right for the legend."""
    plt = _plt()
    colors = chart.colors()
    ncols = min(4, len(chart.panels))
    nrows = math.ceil(len(chart.panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols + 1.8, 3.4 * nrows + 0.7), squeeze=False, sharey="all")
    flat = list(axes.flat)
    for ax in flat[len(chart.panels):]:
        ax.set_visible(False)
    for i, (ax, panel) in enumerate(zip(flat, chart.panels)):
        for s in panel.series:
            _draw(ax, chart, s, colors[s.name])
        _x_axis(ax, chart, panel.series)
        if chart.ylog:  # ticks at 1, 2, 5 x 10^k of every panel's values, written out, the same on every panel
            ax.set_yscale("log", base=chart.ylog)
            _log_axis(ax.yaxis, log_ticks([y for p in chart.panels for s in p.series for y in s.y], chart.ylog,
                                          chart.yfmt), chart.yfmt)
        if panel.title != "all":
            ax.set_title(panel.title, fontsize=9)
        ax.set_xlabel(chart.xlabel, fontsize=8)
        if i % ncols == 0:
            ax.set_ylabel(chart.ylabel, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    if not chart.ylog:
        _round_y(flat[0])
    if chart.ylim:
        flat[0].set_ylim(*chart.ylim)
    handles = [Line2D([], [], color=c, marker="o", label=n) for n, c in colors.items()]
    fig.legend(handles=handles, loc="center right", title=chart.legend, fontsize=8, title_fontsize=8, frameon=False)
    fig.suptitle(textwrap.fill(chart.title, int(11 * fig.get_figwidth())), fontsize=10)  # ~11 characters an inch
    fig.tight_layout(rect=(0, 0, 1 - 1.8 / fig.get_figwidth(), 1))
    return fig


def _bars(chart: Chart):
    """Horizontal bars, one per series point (label on the y axis), coloured by series, the spread as error bars."""
    plt = _plt()
    colors = chart.colors()
    series = chart.panels[0].series
    fig, ax = plt.subplots(figsize=(8, 0.24 * len(series) + 1.6))
    ax.barh(range(len(series)), [s.x[0] for s in series], color=[colors[s.name] for s in series],
            xerr=[s.err[0] if s.err else 0 for s in series] if any(s.err for s in series) else None, capsize=3)
    ax.set_yticks(range(len(series)), [s.y[0] for s in series], fontsize=8)
    ax.invert_yaxis()
    ax.set_ylabel(chart.legend, fontsize=8)
    ax.set_xlabel(chart.xlabel)
    ax.xaxis.set_major_locator(MaxNLocator(nbins=6, steps=[1, 2, 2.5, 5, 10]))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: tick_text(v, "plain")))
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(textwrap.fill(chart.title, int(11 * fig.get_figwidth())), fontsize=10)
    fig.tight_layout()
    return fig
