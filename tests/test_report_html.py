"""report.html draws its charts and tables with Plotly (issue 31; before it, hand-written SVG and a sort script
that failed on every table after the first, issue 30): the page holds each chart's Plotly specification
(data traces + layout) beside its PNG, every table as Plotly tables whose own menus sort and filter every
job's row, plotly.js once (offline). What a reader sees, in the PNG and the page alike: error bars where seeds
were swept, no chart of a degenerate column, the legend titled by the swept key, one y axis per chart,
whole-number step axes and round y ticks. No training: the sweeps are fabricated job directories."""
import json
import math
import re
import statistics
import subprocess
import sys

import matplotlib.pyplot as plt
import pytest
from plotly.offline import get_plotlyjs

from attnzoo.analysis.report import build_report, main
from attnzoo.analysis.report.charts import DENSE
from attnzoo.analysis.report.plots import draw
from scripts.screenshot_report import fake_sweep
from scripts.warm_run import run_python


def plotly_figures(page: str) -> dict[str, dict]:
    """{div id: {'data': [...], 'layout': {...}}}: the arguments of every Plotly.newPlot call of the page."""
    dec, figs = json.JSONDecoder(), {}
    for m in re.finditer(r'Plotly\.newPlot\(\s*"([^"]+)",\s*', page):
        data, end = dec.raw_decode(page, m.end())
        rest = page[end:].lstrip()
        assert rest.startswith(","), rest[:80]
        layout, _ = dec.raw_decode(rest[1:].lstrip())
        figs[m.group(1)] = {"data": data, "layout": layout}
    return figs


def write_job(job, overrides: list[str], metrics: dict | None, curve: list[tuple[int, float]] = (), **summary):
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    status = "ok" if metrics is not None else "failed"
    (job / "summary.json").write_text(json.dumps({"status": status, "metrics": metrics or {}, **summary}))
    if curve:
        (job / "csv").mkdir()
        (job / "csv" / "metrics.csv").write_text("step,val/loss\n" + "".join(f"{s},{v}\n" for s, v in curve))


def built(d):
    rep = build_report(d)
    page = (d / "report.html").read_text()
    return rep, page, plotly_figures(page)


@pytest.fixture(scope="module")
def lengths_sweep(tmp_path_factory):
    """4 finished jobs (2 mixers x 2 learning rates) evaluated at two extra lengths: three tables (best per
    variant, length extrapolation, all jobs), one seed."""
    d = tmp_path_factory.mktemp("report") / "sweep"
    losses = {("gqa", "1e-3"): 2.5, ("gqa", "3e-3"): 2.1, ("gated_deltanet", "1e-3"): 2.9, ("gated_deltanet", "3e-3"): 1.7}
    for n, ((mixer, lr), loss) in enumerate(losses.items()):
        metrics = {"val/loss": loss, "val/loss@64": loss + 0.5 + n / 10, "val/loss@128": loss + 1 - n / 10,
                   "cache/bytes_per_token": 100.0 * (n + 1), "params/total": 1000.0 - n}
        write_job(d / str(n), [f"model/mixer={mixer}", f"optim.lr={lr}"], metrics, context_len=32,
                  config={"model": {"mixer": {"name": mixer}}})
    return built(d)


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    """scripts/screenshot_report.py's demo: MQAR, 3 mixers x 2 learning rates x 2 seeds, one job failed."""
    return built(fake_sweep(tmp_path_factory.mktemp("seeded") / "demo"))


def tables(figs: dict) -> dict[str, dict]:
    return {k: f for k, f in figs.items() if k.startswith("table-")}


def rows_of(trace: dict) -> list[tuple]:
    return list(zip(*trace["cells"]["values"]))


def test_every_table_is_a_plotly_table_with_every_jobs_row(lengths_sweep, seeded):
    rep, page, figs = lengths_sweep
    assert set(tables(figs)) == {"table-best", "table-lengths", "table-all"}
    for name, n_rows in (("table-best", 2), ("table-lengths", 2), ("table-all", 4)):
        data = figs[name]["data"]
        assert data and all(t["type"] == "table" for t in data)
        head = data[0]["header"]["values"]
        assert data[0]["visible"] is True and len(data[0]["cells"]["values"]) == len(head)
        assert all(len(col) == n_rows for col in data[0]["cells"]["values"]), name
    all_jobs = figs["table-all"]["data"][0]
    assert list(all_jobs["cells"]["values"][0]) == ["0", "1", "2", "3"]
    assert "<b>val/loss@128</b>" in figs["table-lengths"]["data"][0]["header"]["values"]
    # the seeded sweep: all 12 jobs, the failed one red; the best-of-lr rows show seeds and the spread
    rep, page, figs = seeded
    all_jobs = figs["table-all"]["data"][0]
    assert sorted(all_jobs["cells"]["values"][0], key=int) == [j["job"] for j in rep["jobs"]] and len(rep["jobs"]) == 12
    fills = all_jobs["cells"]["fill"]["color"][0]
    assert [i for i, c in enumerate(fills) if c == "#fdd"] == [i for i, j in enumerate(rep["jobs"]) if j["status"] != "ok"] == [9]
    assert {"<b>seeds</b>", "<b>val/acc std</b>"} <= set(figs["table-best"]["data"][0]["header"]["values"])
    assert "class='failed'" in page and "nan at step 170" in page


def _number(text: str):
    return float(text.replace(",", "")) if re.fullmatch(r"-?[\d,]+(\.\d+)?(e-?\d+)?", text) else None


def test_sort_menu_orders_every_column_of_every_view(lengths_sweep, seeded):
    """Every 'sort by' entry restyles every view (trace) of its table: each view keeps its own rows, in the
    order of that column (numbers by value, empty cells last)."""
    for _, _, figs in (lengths_sweep, seeded):
        for name, fig in tables(figs).items():
            views, (sorts, shows) = fig["data"], fig["layout"]["updatemenus"]
            head = [re.sub(r"</?b>|<br>", "", h) for h in views[0]["header"]["values"]]
            assert len(shows["buttons"]) == len(views) and sorts["buttons"][0]["label"] == "as listed"
            for button in sorts["buttons"][1:]:
                update, traces = button["args"]
                assert traces == list(range(len(views)))
                col = head.index(button["label"][:-2])
                for view, values in zip(views, update["cells.values"]):
                    assert sorted(zip(*values)) == sorted(rows_of(view)), (name, button["label"])
                    cells = [c for c in values[col] if c != ""]
                    assert list(values[col][len(cells):]) == [""] * (len(values[col]) - len(cells))  # empty last
                    numbers = [_number(c) for c in cells]
                    if all(x is not None for x in numbers):
                        assert numbers == sorted(numbers, reverse=button["label"].endswith("▼")), (name, button["label"])


def test_show_menu_keeps_the_rows_of_one_swept_value(seeded):
    rep, _, figs = seeded
    fig = figs["table-all"]
    views, shows = fig["data"], fig["layout"]["updatemenus"][1]["buttons"]
    labels = [b["label"] for b in shows]
    assert labels[0] == "all rows (12)" and "model/mixer=gqa (4)" in labels and "seed=2 (6)" in labels
    assert "not ok (failed or incomplete) (1)" in labels
    for i, b in enumerate(shows):
        assert b["args"][0]["visible"] == [k == i for k in range(len(views))]
        value, n = re.fullmatch(r"(.*) \((\d+)\)", b["label"]).groups()
        rows = rows_of(views[i])
        assert len(rows) == int(n)
        if "=" in value:
            assert all(value in re.split(r" |<br>", r[1]) for r in rows), value  # the overrides column


def test_plotly_js_is_embedded_once_and_nothing_is_fetched(seeded):
    _, page, figs = seeded
    assert page.count(get_plotlyjs()) == 1
    assert "<script src" not in page and "<link" not in page and not re.search(r"src=['\"]https?:", page)
    assert page.count("Plotly.newPlot(") == len(figs)


def test_each_plot_is_a_plotly_figure_beside_its_png(lengths_sweep, seeded):
    """The page holds, for each PNG the report draws, that chart's Plotly specification with the same points."""
    for rep, page, figs in (lengths_sweep, seeded):
        pngs = sorted(k for k in rep["files"] if k.endswith(".png"))
        assert sorted(f"{c.name}.png" for c in rep["charts"]) == pngs
        assert sorted(k for k in figs if k.startswith("chart-")) == sorted(f"chart-{p[:-4]}" for p in pngs)
        assert page.count("src='data:image/png;base64,") == len(pngs)  # plotly.js holds one such string of its own
        for chart in rep["charts"]:
            fig = figs[f"chart-{chart.name}"]
            assert fig["layout"]["title"]["text"] == chart.title
            drawn = [(t["name"], list(t["x"]), list(t["y"])) for t in fig["data"] if t.get("fill") != "toself"]
            want = [(s.name, list(s.x), list(s.y)) for p in chart.panels for s in p.series]
            assert sorted(drawn, key=str) == sorted(want, key=str), chart.name
    assert {c.name for c in lengths_sweep[0]["charts"]} == {"acc_vs_cache", "lengths"}
    assert {c.name for c in seeded[0]["charts"]} == {"curves", "acc_vs_cache", "tokens_per_sec", "mqar_difficulty",
                                                     "recall_vs_state"}


def _seed_std(rep, mixer: str, key: str) -> float:
    """The spread over seeds of `key` for the mixer's best learning rate, from the jobs themselves."""
    runs = {}
    for j in rep["jobs"]:
        if j["mixer"] == mixer and j["status"] == "ok":
            runs.setdefault(j["lr"], []).append(j["metrics"])
    best = max(runs.values(), key=lambda ms: statistics.mean(m["val/acc"] for m in ms))
    return statistics.stdev(m[key] for m in best)


def test_error_bars_where_seeds_are_swept(seeded, lengths_sweep):
    rep, _, figs = seeded
    by = {c.name: figs[f"chart-{c.name}"]["data"] for c in rep["charts"]}
    for mixer in ("gqa", "deltanet", "gated_deltanet"):
        (point,) = [t for t in by["acc_vs_cache"] if t["name"] == mixer]
        assert point["error_y"]["array"][0] == pytest.approx(_seed_std(rep, mixer, "val/acc"))
        (bar,) = [t for t in by["tokens_per_sec"] if t["name"] == mixer]
        assert bar["error_x"]["array"][0] == pytest.approx(_seed_std(rep, mixer, "perf/tokens_per_sec"))
    for name in ("curves", "mqar_difficulty", "recall_vs_state"):
        assert all(t.get("error_y", {}).get("array") for t in by[name] if t["name"]), name
    # the PNGs: every series drawn with error bars
    for chart in rep["charts"]:
        if chart.kind != "bar":
            fig = draw(chart)
            assert sum(len(ax.containers) for ax in fig.axes) == sum(len(p.series) for p in chart.panels), chart.name
    # one seed: no error bars anywhere
    rep, _, figs = lengths_sweep
    assert not any("error_y" in t or "error_x" in t for k, f in figs.items() if k.startswith("chart-") for t in f["data"])


def test_a_curve_with_many_steps_shows_the_seeds_spread_as_a_band(tmp_path):
    d = tmp_path / "curves"
    for n, (mixer, seed) in enumerate([("gqa", 1), ("gqa", 2), ("deltanet", 1), ("deltanet", 2)]):
        curve = [(s, 3 - s / 100 + (0.1 if seed == 2 else 0) + (0.2 if mixer == "deltanet" else 0)) for s in range(0, 200, 10)]
        write_job(d / str(n), [f"model/mixer={mixer}", f"seed={seed}"], {"val/loss": curve[-1][1]}, curve)
    rep, _, figs = built(d)
    bands = [t for t in figs["chart-curves"]["data"] if t.get("fill") == "toself"]
    assert len(bands) == 2 and len(rep["charts"][0].panels[0].series[0].x) > DENSE
    (gqa,) = [s for s in rep["charts"][0].panels[0].series if s.name == "gqa"]
    assert gqa.err == pytest.approx([statistics.stdev([0, 0.1])] * len(gqa.x))


def test_degenerate_columns_are_not_plotted(tmp_path):
    """A metric equal for every job, or one job only: no chart of it, neither PNG nor figure."""
    d = tmp_path / "flat"
    for n, kv in enumerate((1, 2, 4)):  # cache bytes and tokens/s equal across the jobs; val/loss varies
        write_job(d / str(n), [f"model.n_kv_heads={kv}"], {"val/loss": 2.0 + n / 10, "cache/bytes_per_token": 512.0,
                                                         "perf/tokens_per_sec": 1000.0}, [(0, 4.0), (10, 3.0 - n / 10)])
    rep, page, figs = built(d)
    assert [c.name for c in rep["charts"]] == ["curves"]
    assert not (d / "plots" / "acc_vs_cache.png").exists() and not (d / "plots" / "tokens_per_sec.png").exists()
    assert [k for k in figs if k.startswith("chart-")] == ["chart-curves"]
    d = tmp_path / "one"
    write_job(d / "0", ["model.n_kv_heads=1"], {"val/loss": 2.0, "cache/bytes_per_token": 512.0, "perf/tokens_per_sec": 1.0})
    rep, page, figs = built(d)
    assert rep["charts"] == [] and not any(k.startswith("chart-") for k in figs) and "<img" not in page
    assert "table-all" in figs  # the table still shows the one job
    # nothing swept but the job itself: no best-of-lr table (issue 47), in the page or in report.md
    assert "table-best" not in figs and "Best learning rate" not in page + (d / "report.md").read_text()


def test_legend_is_titled_by_the_swept_key_and_panels_share_y(tmp_path, seeded):
    rep, _, figs = seeded
    for chart in rep["charts"]:
        assert chart.legend == "model/mixer"
        assert figs[f"chart-{chart.name}"]["layout"]["legend"]["title"]["text"] == "model/mixer"
        fig = draw(chart)
        if chart.kind != "bar":
            assert fig.legends[0].get_title().get_text() == "model/mixer"
    # the swept key is not the mixer: rope_theta is the colour, pairs the panels; the values as the sweep writes
    # them (Hydra records 1e4 as 10000.0; issue 47: a legend read 'max_flops=2000000000000.0')
    d = tmp_path / "theta"
    for n, (theta, pairs) in enumerate([("10000.0", 4), ("500000.0", 4), ("10000.0", 8), ("500000.0", 8)]):
        write_job(d / str(n), [f"model.rope_theta={theta}", f"data.num_kv_pairs={pairs}"],
                  {"val/loss": 2.0 + n / 7 - n % 2 / 5, "cache/bytes_per_token": 256.0 * (1 + n % 2)},
                  [(0, 4.0), (5, 3.5), (10, 3.0 - n / 10)])
    rep, _, figs = built(d)
    (curves,) = [c for c in rep["charts"] if c.name == "curves"]
    assert [p.title for p in curves.panels] == ["num_kv_pairs=4", "num_kv_pairs=8"]
    for chart in rep["charts"]:
        layout = figs[f"chart-{chart.name}"]["layout"]
        assert layout["legend"]["title"]["text"] == "model.rope_theta"
        assert {t["name"] for t in figs[f"chart-{chart.name}"]["data"]} == {"rope_theta=1e4", "rope_theta=5e5"}
        assert layout["yaxis2"]["matches"] == "y"  # one y axis: the panels compare
        axes = draw(chart).axes
        assert axes[0].get_shared_y_axes().joined(axes[0], axes[1]) and axes[0].get_ylim() == axes[1].get_ylim()
        fig = draw(chart)
        assert fig.legends[0].get_title().get_text() == "model.rope_theta"
        assert [t.get_text() for t in fig.legends[0].get_texts()] == ["rope_theta=1e4", "rope_theta=5e5"]


NOTATION = {"plain": r"-?[\d,]+(\.\d+)?", "si": r"[\d.]+[kMGT]?", "bytes": r"[\d.]+(Ki|Mi|Gi|Ti)?", "sci": r"[\d.]+e-?\d+"}


def axis_labels(layout: dict, name: str) -> tuple[list[str], str]:
    """(the tick labels written out on an axis, else its d3 tick format)."""
    axis = layout[name]
    assert axis.get("showticklabels", True) or name.startswith("yaxis") and axis.get("matches") == "y", name
    return list(axis.get("ticktext") or []), axis.get("tickformat", "")


def test_every_axis_has_tick_labels_in_one_notation(seeded, lengths_sweep):
    """Issue 47 item 6: the page's charts label both axes of every panel (a log axis' ticks written out, inside
    its data; a linear one by a d3 format), each axis in one notation (no '60,256' beside '463.25Ki'); the PNGs
    too."""
    for rep, _, figs in (seeded, lengths_sweep):
        for chart in rep["charts"]:
            layout = figs[f"chart-{chart.name}"]["layout"]
            for name in [k for k in layout if re.fullmatch(r"[xy]axis\d*", k)]:
                if chart.kind == "bar" and name == "yaxis":  # a bar's label: its variant
                    assert layout[name]["categoryarray"] and layout[name]["showticklabels"]
                    continue
                texts, tickformat = axis_labels(layout, name)
                log = layout[name].get("type") == "log"
                assert bool(texts) == log and (log or tickformat), (chart.name, name)
                notation = chart.xfmt if name.startswith("x") else chart.yfmt
                assert all(re.fullmatch(NOTATION[notation], t) for t in texts), (chart.name, name, texts)
                values = [v for t in figs[f"chart-{chart.name}"]["data"] for v in t[name[0]] if isinstance(v, float | int)]
                assert all(min(values) <= v <= max(values) for v in layout[name].get("tickvals", [])), (chart.name, name)
            fig = draw(chart)
            for ax in fig.axes:
                for axis, notation in ((ax.xaxis, chart.xfmt), (ax.yaxis, chart.yfmt)):
                    lo, hi = sorted(axis.get_view_interval())
                    locs = [v for v in axis.get_majorticklocs() if lo <= v <= hi]
                    labels = [t for t in axis.get_major_formatter().format_ticks(locs) if t] if axis.get_visible() \
                        and (axis is ax.xaxis or ax.get_subplotspec().is_first_col()) else []
                    assert labels or axis is ax.yaxis and ax is not fig.axes[0], (chart.name, labels)
                    if chart.kind != "bar" or axis is ax.xaxis:
                        assert all(re.fullmatch(NOTATION[notation], t.replace("\u2212", "-")) for t in labels), labels
            plt.close(fig)
    (rvs,) = [c for c in seeded[0]["charts"] if c.name == "recall_vs_state"]
    assert rvs.xfmt == "bytes" and seeded[2]["chart-recall_vs_state"]["layout"]["xaxis"]["ticktext"] == ["8.5Ki", "9Ki", "64Ki"]


def test_tables_show_every_header_and_row_whole(seeded, lengths_sweep):
    """Issue 47 item 6: no header clipped ('statu', 'perf/tokens_per_se'), no row behind a scrollbar inside the
    table. Plotly wraps a cell only at spaces and clips the rest, and scrolls a table taller than its figure; so
    every line of every header and cell fits its column (by the width estimate the columns are sized with), the
    figure is exactly as wide as its columns (the page shows it at that width and scrolls, not the table) and at
    least as tall as its rows: in Chromium a row of n lines draws 15.5 n + 15 px, one of single lines 24 px, 30
    with markup (a header) (measured)."""
    from attnzoo.analysis.report.datatable import PAD_PX, text_px

    for _, page, figs in (seeded, lengths_sweep):
        for name, fig in tables(figs).items():
            trace, layout = fig["data"][0], fig["layout"]
            widths, margin = trace["columnwidth"], layout["margin"]
            assert layout["width"] == round(sum(widths) + margin["l"] + margin["r"])
            assert re.search(f'<div style="height:{layout["height"]}px; width:{layout["width"]}px;">\\s*<div id="{name}"', page)
            head = [h.split("<br>") for h in trace["header"]["values"]]
            cells = [[c.split("<br>") for c in col] for col in trace["cells"]["values"]]
            for c, width in enumerate(widths):
                for line in head[c]:
                    assert text_px(re.sub(r"</?b>", "", line), bold=True) + 2 * PAD_PX <= width, (name, line)
                for lines in cells[c]:
                    assert all(text_px(x.replace("&amp;", "&")) + 2 * PAD_PX <= width for x in lines), (name, lines)
            rows = [[col[r] for col in cells] for r in range(len(cells[0]))]
            need = sum(24 if all(len(c) == 1 and not re.search("[&<]", c[0]) for c in row)
                       else 15.5 * max(map(len, row)) + 15 for row in [head, *rows])
            assert layout["height"] >= margin["t"] + margin["b"] + need, name
    assert re.search(r"<b>perf/</b><br><b>tokens_per_sec</b>", json.dumps(seeded[2]["table-all"]["data"][0]["header"]))


def _round(ticks) -> bool:
    """Ticks evenly spaced by 1, 2, 2.5 or 5 x 10^k, each a multiple of that step."""
    steps = {round(b - a, 12) for a, b in zip(ticks, ticks[1:])}
    if len(steps) != 1:
        return False
    (step,) = steps
    mantissa = step / 10 ** math.floor(math.log10(step))
    return any(math.isclose(mantissa, m) for m in (1, 2, 2.5, 5)) and all(
        math.isclose(t / step, round(t / step), abs_tol=1e-9) for t in ticks)


def test_step_axes_are_whole_numbers_and_y_ticks_round(seeded):
    rep, _, figs = seeded
    (curves,) = [c for c in rep["charts"] if c.name == "curves"]
    xaxis = figs["chart-curves"]["layout"]["xaxis"]
    assert isinstance(xaxis["dtick"], int) and xaxis["dtick"] >= 1 and xaxis["tickformat"] == ",d"
    for chart in rep["charts"]:
        assert not any("tickvals" in v for k, v in figs[f"chart-{chart.name}"]["layout"].items() if k.startswith("yaxis"))
        fig = draw(chart)
        ax = fig.axes[0]
        lo, hi = ax.get_ylim() if chart.kind != "bar" else ax.get_xlim()
        ticks = [t for t in (ax.get_yticks() if chart.kind != "bar" else ax.get_xticks()) if lo <= t <= hi]
        assert _round(ticks), (chart.name, ticks)
        if chart.x_integer:
            xlo, xhi = ax.get_xlim()
            xt = [t for t in ax.get_xticks() if xlo <= t <= xhi]
            assert xt and all(float(t).is_integer() for t in xt), (chart.name, xt)


def test_the_command_and_the_module_still_run(seeded, tmp_path, capsys):
    """`attnzoo-report DIR` (main) and `python -m attnzoo.analysis.report DIR` (scripts/check_readme.py)."""
    d = fake_sweep(tmp_path / "cli")
    main([str(d)])
    assert "12 jobs ->" in capsys.readouterr().out and (d / "report.html").is_file()
    r = run_python(["-m", "attnzoo.analysis.report", str(d)], timeout=120)
    assert r.returncode == 0 and "5 plots" in r.stdout, r.stderr[-2000:]
