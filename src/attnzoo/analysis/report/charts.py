"""What each of the report's plots shows, computed once: a `Chart` (panels of named series of points, with
the spread over seeds) that plots.py draws with matplotlib (the PNGs, for papers) and figures.py with Plotly
(report.html, interactive), so the two never disagree.

A chart is left out when it would show nothing: fewer than two points, or a plotted metric equal for every
job (one degenerate column). Panels of one chart share their y axis (they are compared side by side), the
legend is titled by the swept key whose values the colours are (written as the sweep writes them: 2e12), every
axis is labelled in one notation (NOTATIONS), and when seeds are swept every point is the mean over the seeds
of its variant's best learning rate, with the standard deviation as its error bar.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from attnzoo.analysis.report.load import as_written, finite, mean_std
from attnzoo.analysis.report.tables import fmt

# matplotlib's tab10 and tab20 (the PNGs and the page use the same colour for a series)
TAB10 = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]
TAB20 = ["#1f77b4", "#aec7e8", "#ff7f0e", "#ffbb78", "#2ca02c", "#98df8a", "#d62728", "#ff9896", "#9467bd", "#c5b0d5",
         "#8c564b", "#c49c94", "#e377c2", "#f7b6d2", "#7f7f7f", "#c7c7c7", "#bcbd22", "#dbdb8d", "#17becf", "#9edae5"]
DENSE = 12  # a series with more points than this is a curve: its spread is drawn as a band, not error bars
HOVER_METRICS = ("val/acc", "val/loss", "perf/tokens_per_sec", "cache/bytes_per_token", "cache/bytes_at_ctx", "params/total")


@dataclass
class Series:
    """One colour: its points (x, y), each y's standard deviation over seeds (None: one seed), hover texts.
    `style` overrides how the chart's kind draws it: "points" (markers only), "fit" (a fitted curve: a line, no
    markers), "void" (a fitted curve that does not hold: dashed), "optimum" (large open markers: a fitted
    minimum). Series of one name share colour and legend entry."""
    name: str
    x: list
    y: list
    err: list[float] | None = None
    hover: list[str] = field(default_factory=list)
    style: str = ""


@dataclass
class Panel:
    title: str
    series: list[Series]


@dataclass
class Chart:
    name: str  # plots/<name>.png, and the page's figure id
    title: str
    kind: str  # "line", "scatter" or "bar" (horizontal: x the value, y one label per bar)
    panels: list[Panel]
    xlabel: str
    ylabel: str
    legend: str  # the legend's title: the swept key (or keys) whose values the colours are
    xlog: int = 0  # the x axis' log base (0: linear)
    ylog: int = 0  # the y axis' log base (0: linear)
    xfmt: str = "plain"  # the x tick labels' notation (NOTATIONS): one per axis, never two mixed
    yfmt: str = "plain"
    x_integer: bool = False  # steps, key-value pairs, lengths: whole-number ticks
    ylim: tuple[float, float] | None = None

    def colors(self) -> dict[str, str]:
        names = sorted({s.name for p in self.panels for s in p.series}, key=sort_key)
        palette = TAB10 if len(names) <= 10 else TAB20
        return {n: palette[i % len(palette)] for i, n in enumerate(names)}


def sort_key(text: str):
    """Facets and series in natural order ('N=4' before 'N=16')."""
    return [(0, float(t), "") if re.fullmatch(r"-?\d+(\.\d+)?(e[+-]?\d+)?", t) else (1, 0.0, t)
            for t in re.split(r"[=\s]+", str(text))]


# the notations of an axis' tick labels, each used for every tick of the axis
NOTATIONS = {
    "plain": "decimal, thousands separated: 16, 1,024, 0.25 (steps, pairs, lengths, losses)",
    "si": "decimal prefixes: 656, 7.76k, 1.2M (parameter counts)",
    "bytes": "binary prefixes: 656, 82Ki, 2Mi (bytes)",
    "sci": "scientific: 2.5e11 (FLOPs)",
}
_PREFIXES = {"si": (1000, ("", "k", "M", "G", "T")), "bytes": (1024, ("", "Ki", "Mi", "Gi", "Ti"))}


def tick_text(x: float, notation: str) -> str:
    """One tick label in `notation` (NOTATIONS)."""
    if notation == "sci":
        return as_written(f"{x:.3g}") if x else "0"
    if notation in _PREFIXES:
        base, names = _PREFIXES[notation]
        k = 0
        while abs(x) >= base ** (k + 1) and k + 1 < len(names):
            k += 1

        def mantissa(k: int) -> str:  # 3 significant digits, never an exponent (1000-1023 bytes: '1020')
            m = x / base ** k
            return f"{m:.0f}" if abs(m) >= 100 else f"{m:.3g}"

        if abs(float(mantissa(k))) >= base and k + 1 < len(names):  # rounds up into the next prefix: 999,999.99 is 1M
            k += 1
        return mantissa(k) + names[k]
    return f"{x:,.0f}" if abs(x) >= 100 or float(x).is_integer() else f"{x:.3g}"


def log_ticks(values: list[float], base: int = 10, notation: str = "plain") -> list[float]:
    """Ticks of a log axis over `values` (every plotted value, fitted lines included, so the ticks fall inside the
    axis' range): 1, 2, 5 x 10^k, denser (1, 2, 3, 5; then 1..9) where that leaves fewer than three; on a base-2
    axis or one of bytes, powers of 2 (every other one, or fewer, past eight); the two ends if none of these
    leaves two."""
    vs = [v for v in values if finite(v) and v > 0]
    if not vs:
        return []
    lo, hi = min(vs), max(vs)
    if base == 2 or notation == "bytes":
        powers = [2.0 ** k for k in range(math.ceil(math.log2(lo)), math.floor(math.log2(hi)) + 1)]
        return powers[::math.ceil(len(powers) / 8)] if len(powers) >= 2 else sorted({lo, hi})
    decades = range(math.floor(math.log10(lo)), math.floor(math.log10(hi)) + 1)
    for subs, enough in (((1, 2, 5), 3), ((1, 2, 3, 5), 3), (range(1, 10), 2)):
        ticks = [m * 10.0 ** k for k in decades for m in subs if lo <= m * 10.0 ** k <= hi]
        if len(ticks) >= enough:
            return ticks
    return sorted({lo, hi})


def data_ticks(xs: list[float], room: int, most: int = 8) -> list[float]:
    """The ticks of a log axis with few data values (cache bytes, pairs, lengths): the values themselves (an
    axis inside one decade has no labelled tick otherwise), leaving out a value closer to the last tick than
    1/room of the axis (its label would overlap). No ticks (the axis' own) for more than `most` values."""
    xs = sorted({float(x) for x in xs if finite(x) and x > 0})
    if not 0 < len(xs) <= most:
        return []
    gap = math.log(xs[-1] / xs[0]) / room
    ticks = [xs[0]]
    for x in xs[1:]:
        if math.log(x / ticks[-1]) >= gap:
            ticks.append(x)
    return ticks


def _varies(values) -> bool:
    """Two values or more, not all equal: otherwise the plotted column is degenerate."""
    vals = [v for v in values if finite(v)]
    return len(vals) >= 2 and len(set(vals)) > 1


def _pm(value, err) -> str:
    return fmt(value) + (f" ± {fmt(err)}" if err else "")


def _hover(j: dict) -> str:
    """A point's text: the job (or the best-of-lr row: its lr and seeds), its overrides and key metrics."""
    who = f"job {j['job']}: {j['label']}" if j.get("n_seeds", 1) == 1 else \
        f"{j['variant']}, best lr {fmt(j['lr'])}, mean of {j['n_seeds']} seeds"
    spread = j.get("spread") or {}
    return "\n".join([who, *[f"{k} = {_pm(j['metrics'][k], spread.get(k))}" for k in HOVER_METRICS if finite(j["metrics"].get(k))]])


def _panels(items: list[dict], point) -> list[Panel]:
    """One panel per facet of `items` (rows with 'facet' and 'series'), one series per row: `point(row)` gives
    its Series (or None to leave the row out)."""
    panels = []
    for facet in sorted({j["facet"] for j in items}, key=sort_key):
        series = [s for j in sorted((j for j in items if j["facet"] == facet), key=lambda j: sort_key(j["series"]))
                  if (s := point(j)) is not None]
        if series:
            panels.append(Panel(facet, series))
    return panels


def _all_y(panels: list[Panel]) -> list:
    return [y for p in panels for s in p.series for y in s.y]


def _titled(title: str, which: str) -> str:
    return f"{title} ({which})" if which else title


def curves(best: list[dict], metric: str, legend: str, which: str = "") -> Chart | None:
    """The ranking metric vs step, best lr per variant (the mean over seeds, at the steps every seed logged).
    `which`: what a variant's row is (e.g. 'best learning rate per variant'), for the title."""
    def point(j):
        runs = [r for r in j.get("runs", [j]) if r["curves"].get(metric)] or [j]
        by_step: dict[int, list[float]] = {}
        for r in runs:
            for s, v in r["curves"].get(metric, []):
                by_step.setdefault(s, []).append(v)
        steps = sorted(s for s, vs in by_step.items() if len(vs) == len(runs))
        if len(steps) < 2:
            return None
        stats = [mean_std(by_step[s]) for s in steps]
        return Series(j["series"], steps, [m for m, _ in stats], [e for _, e in stats] if len(runs) > 1 else None,
                      [f"{j['variant']}: step {s}, {metric} = {_pm(m, e)}" for s, (m, e) in zip(steps, stats)])

    panels = _panels(best, point)
    if not _varies(_all_y(panels)):
        return None
    return Chart("curves", _titled(f"{metric} vs step", which), "line", panels, "step", metric, legend, x_integer=True)


def acc_vs_cache(best: list[dict], metric: str, legend: str, which: str = "") -> Chart | None:
    """The recall / memory trade-off: the metric vs the analytic cache bytes per token, a point per variant."""
    pts = [j for j in best if finite(j["metrics"].get(metric)) and finite(j["metrics"].get("cache/bytes_per_token"))
           and j["metrics"]["cache/bytes_per_token"] > 0]
    if not (_varies([j["metrics"][metric] for j in pts]) and _varies([j["metrics"]["cache/bytes_per_token"] for j in pts])):
        return None
    panels = _panels(pts, lambda j: Series(j["series"], [j["metrics"]["cache/bytes_per_token"]], [j["metrics"][metric]],
                                           [j["spread"][metric]] if metric in j.get("spread", {}) else None, [_hover(j)]))
    return Chart("acc_vs_cache", _titled(f"{metric} vs inference cache", which), "scatter", panels,
                 "cache/bytes_per_token", metric, legend, xlog=10, xfmt="bytes")


def tokens_per_sec(best: list[dict], legend: str, which: str = "") -> Chart | None:
    """Training throughput, a bar per variant, coloured by series."""
    pts = [j for j in best if finite(j["metrics"].get("perf/tokens_per_sec"))]
    if not _varies([j["metrics"]["perf/tokens_per_sec"] for j in pts]):
        return None
    pts.sort(key=lambda j: (sort_key(j["facet"]), sort_key(j["series"])))
    series = [Series(j["series"], [j["metrics"]["perf/tokens_per_sec"]],
                     [f"{j['series']} | {j['facet']}" if j["facet"] != "all" else j["series"]],
                     [j["spread"]["perf/tokens_per_sec"]] if "perf/tokens_per_sec" in j.get("spread", {}) else None,
                     [_hover(j)]) for j in pts]
    return Chart("tokens_per_sec", _titled("training throughput", which), "bar", [Panel("", series)],
                 "perf/tokens_per_sec (training)", "", legend)


def lengths(best: list[dict], metric: str, legend: str, which: str = "") -> Chart | None:
    """Length extrapolation (eval.context_lengths): the metric at every evaluated length, the training length
    included, a line per series, a panel per facet."""
    def point(j):
        spread = j.get("spread", {})
        pts = {int(m.group(1)): (v, spread.get(k)) for k, v in j["metrics"].items()
               if (m := re.fullmatch(re.escape(metric) + r"@(\d+)", k)) and finite(v)}
        L = (j["summary"].get("data") or {}).get("seq_len") or j["summary"].get("context_len")
        if pts and L and finite(j["metrics"].get(metric)):
            pts[int(L)] = (j["metrics"][metric], spread.get(metric))
        if len(pts) < 2:
            return None
        xs = sorted(pts)
        errs = [pts[x][1] or 0.0 for x in xs]
        return Series(j["series"], xs, [pts[x][0] for x in xs], errs if any(errs) else None,
                      [f"{j['variant']}: length {x}, {metric} = {_pm(*pts[x])}" for x in xs])

    panels = _panels(best, point)
    if not _varies(_all_y(panels)):
        return None
    return Chart("lengths", _titled(f"{metric} vs context length (trained at data.seq_len)", which), "line", panels,
                 "evaluation context length", metric, legend, xlog=2, x_integer=True)


def _pairs(j: dict):
    data = j["summary"].get("data") or {}
    return data.get("num_kv_pairs", (j["config"].get("data") or {}).get("num_kv_pairs"))


def _width(j: dict):
    return (j["summary"].get("model") or {}).get("d_model")


def _mqar_best(jobs: list[dict], key, extra: str | None = None) -> dict[tuple, dict]:
    """The finished MQAR jobs grouped by key(job); per group the best learning rate by mean val/acc over its
    seeds: {key: {'acc': (mean, std), 'n': seeds, 'x': mean of `extra`, 'job': a run}}."""
    groups: dict[tuple, dict[str, list[dict]]] = {}
    for j in jobs:
        if ((j["summary"].get("data") or {}).get("name") == "mqar" and j["status"] == "ok" and finite(j["metrics"].get("val/acc"))
                and _pairs(j) is not None and (extra is None or finite(j["metrics"].get(extra)))):
            groups.setdefault(key(j), {}).setdefault(str(j["lr"]), []).append(j)
    best = {}
    for k, by_lr in groups.items():
        runs = max(by_lr.values(), key=lambda rs: mean_std([r["metrics"]["val/acc"] for r in rs])[0])
        best[k] = {"acc": mean_std([r["metrics"]["val/acc"] for r in runs]), "n": len(runs), "job": runs[0],
                   "x": mean_std([r["metrics"][extra] for r in runs])[0] if extra else None}
    return best


def _mqar_series(points: dict[str, list[tuple]], seeds: bool, xname: str) -> list[Series]:
    """{line: [(x, best), ...]} -> one Series per line, its points in x order."""
    out = []
    for line in sorted(points, key=sort_key):
        pts = sorted(points[line], key=lambda p: p[0])
        out.append(Series(line, [x for x, _ in pts], [b["acc"][0] for _, b in pts], [b["acc"][1] for _, b in pts] if seeds else None,
                          [f"{line}: {b['job']['variant']}, best lr {fmt(b['job']['lr'])}\nval/acc = {_pm(*b['acc'])}"
                           + (f" (mean of {b['n']} seeds)" if b["n"] > 1 else "") + f"\n{xname} = {fmt(x)}" for x, b in pts]))
    return out


def mqar_difficulty(jobs: list[dict], legend: str, lr_swept: bool = True) -> Chart | None:
    """Best val/acc (best-of-lr, mean over seeds) vs key-value pairs, a line per series (mixer, or e.g.
    n_kv_heads=2 in the kv_heads sweep), a panel per width."""
    best = _mqar_best(jobs, lambda j: (_width(j), j["line"], int(_pairs(j))))
    if not _varies([b["acc"][0] for b in best.values()]):
        return None
    seeds = any(b["n"] > 1 for b in best.values())
    panels = []
    for w in sorted({k[0] for k in best}, key=lambda w: w or 0):
        points: dict[str, list] = {}
        for (kw, line, n), b in best.items():
            if kw == w:
                points.setdefault(line, []).append((n, b))
        panels.append(Panel(f"MQAR, d_model={w}", _mqar_series(points, seeds, "pairs")))
    return Chart("mqar_difficulty", _titled("MQAR accuracy vs difficulty", "best learning rate" if lr_swept else ""),
                 "line", panels, "key-value pairs (N)", "val/acc (best lr)" if lr_swept else "val/acc", legend, xlog=2,
                 x_integer=True, ylim=(-0.02, 1.02))


def recall_vs_state(jobs: list[dict], legend: str, lr_swept: bool = True) -> Chart | None:
    """Zoology's headline view (Arora et al. 2023, Fig. 2): MQAR accuracy vs the state a mixer holds at the
    task's context (`cache/bytes_at_ctx`, measured by a real prefill), a line per series through its widths,
    a panel per number of key-value pairs. Best learning rate per (series, N, d_model)."""
    best = _mqar_best(jobs, lambda j: (int(_pairs(j)), j["line"], _width(j)), "cache/bytes_at_ctx")
    if not (_varies([b["acc"][0] for b in best.values()]) and _varies([b["x"] for b in best.values()])):
        return None
    seeds = any(b["n"] > 1 for b in best.values())
    panels = []
    for n in sorted({k[0] for k in best}):
        points: dict[str, list] = {}
        for (kn, line, _), b in best.items():
            if kn == n:
                points.setdefault(line, []).append((b["x"], b))
        panels.append(Panel(f"MQAR, N={n} key-value pairs", _mqar_series(points, seeds, "cache/bytes_at_ctx")))
    return Chart("recall_vs_state", "recall vs state size (points: model widths)", "line", panels,
                 "state size: cache/bytes_at_ctx (bytes)", "val/acc (best lr)" if lr_swept else "val/acc", legend,
                 xlog=10, xfmt="bytes", ylim=(-0.02, 1.02))


def report_charts(jobs: list[dict], best: list[dict], metric: str, legends: dict[str, str], which: str = "") -> list[Chart]:
    """Every chart the sweep's files support, in the report's order. `which`: what a variant's point is, for the
    titles ('best learning rate per variant' when the learning rate was swept; '' when a point is one job)."""
    lr_swept = "learning rate" in which
    made = [curves(best, metric, legends["series"], which), acc_vs_cache(best, metric, legends["series"], which),
            tokens_per_sec(best, legends["series"], which), mqar_difficulty(jobs, legends["line"], lr_swept),
            recall_vs_state(jobs, legends["line"], lr_swept), lengths(best, metric, legends["series"], which)]
    return [c for c in made if c is not None]
