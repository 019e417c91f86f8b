"""build_report: a sweep directory's jobs -> report.csv, report.md, plots/*.png and report.html."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

from attnzoo.analysis.report import niah, scaling
from attnzoo.analysis.report.charts import report_charts
from attnzoo.analysis.report.load import job_dirs, annotate, best_per_variant, load_job, primary_metric
from attnzoo.analysis.report.page import page, plain_table_html
from attnzoo.analysis.report.plots import draw_png
from attnzoo.analysis.report.tables import MD_METRICS, failures_md, lengths_md, markdown_table, metric_columns, write_csv


def build_report(root: str | Path) -> dict:
    """Write report.csv/.md/.html and plots/ into `root`; return {'jobs': [...], 'best': [...], 'files': {...}}."""
    root = Path(root)
    dirs = job_dirs(root)
    if not dirs:
        raise FileNotFoundError(f"no job directories (with .hydra/overrides.yaml or summary.json) under {root}")
    jobs = [load_job(d, root) for d in dirs]
    legends = annotate(jobs)
    best = best_per_variant(jobs)
    metric, _ = primary_metric(jobs)
    cols = [c for c in MD_METRICS if c in metric_columns(jobs)]

    lr_swept = any(j["n_lr"] > 1 for j in best)
    seeds = max(j["n_seeds"] for j in best) > 1
    # what a variant's row is: the best of its learning rates, the mean of its seeds, or (neither swept) its one job,
    # which the all-jobs table shows already
    which = "best learning rate per variant" if lr_swept else "mean over seeds per variant" if seeds else ""
    charts = report_charts(jobs, best, metric, legends, which)
    study = scaling.study(jobs)  # a sweep of FLOP budgets: its iso-FLOP fits
    if study is not None:  # loss vs cache and tokens/s per job would facet by size x budget: the fits show those
        charts = scaling.charts(study) + [c for c in charts if c.name not in ("acc_vs_cache", "tokens_per_sec")]
    plots_dir = root / "plots"
    plots_dir.mkdir(exist_ok=True)
    plots = {}
    for chart in charts:
        plots[f"{chart.name}.png"] = plots_dir / f"{chart.name}.png"
        draw_png(chart, plots[f"{chart.name}.png"])

    needles = niah.study(best)  # data=needle jobs with their depth x length grid (niah.json)
    if needles:
        needle_plots = niah.draw(needles, plots_dir)
    write_csv(jobs, root / "report.csv")
    n_ok = sum(j["status"] == "ok" for j in jobs)
    command = _sweep_command(root)
    extra = [("best lr", lambda j: j["lr"]), ("lrs", lambda j: j["n_lr"])] if lr_swept else []
    if seeds:  # mean over seeds of the best lr, with the spread of the ranking metric
        extra += [("seeds", lambda j: j["n_seeds"]), (f"{metric} std", lambda j: j["spread"].get(metric))]
    best_title = which[0].upper() + which[1:] if which else ""
    md = [f"# Sweep report: {root.name}", ""]
    if command:
        md += [f"Command: `{command}`", ""]
    md += [f"{len(jobs)} jobs, {n_ok} ok, {len(jobs) - n_ok} failed or incomplete. Ranking metric: `{metric}`"
           + (" (best-of-lr rows: means over seeds, with the standard deviation)." if seeds else "."), "",
           scaling.markdown(study) if study else "",
           *([f"## {best_title}", "", markdown_table(best, cols, extra=extra), ""] if best_title else []),
           lengths_md(best, metric), niah.markdown(needles) if needles else "", "## All jobs", "", markdown_table(jobs, cols), "", failures_md(jobs)]
    md += [f"![{p}](plots/{p})" for p in plots]
    (root / "report.md").write_text(re.sub(r"\n{3,}", "\n\n", "\n".join(md) + "\n"))  # sections left out: no gaps
    (root / "report.html").write_text(page(root.name, command, jobs, best, cols, extra, metric, charts, plots,
                                           (scaling.html_section(study, plain_table_html) if study else "")
                                           + (niah.html_section(needles) if needles else ""), best_title))
    return {"jobs": jobs, "best": best, "charts": charts, "scaling": study, "niah": needles,
            "files": {"csv": root / "report.csv", "md": root / "report.md", "html": root / "report.html", **plots,
                      **(needle_plots if needles else {})}}


def _sweep_command(root: Path) -> str:
    mr = root / "multirun.yaml"
    if not mr.is_file():
        return ""
    try:
        task = yaml.safe_load(mr.read_text())["hydra"]["overrides"]["task"]
    except Exception:  # noqa: BLE001 - the command line is a nicety
        return ""
    sweep = next((o.split("=", 1)[1] for o in task if o.startswith(("+sweeps=", "sweeps="))), None)
    # attnzoo-sweep adds +sweeps/smoke=NAME itself under debug=smoke
    rest = [o for o in task if not o.startswith(("+sweeps=", "sweeps=", "+sweeps/", "hydra.searchpath"))]
    rest.append(f"hydra.sweep.dir={root}")  # the rerun that skips finished jobs goes into the same dir
    return (f"attnzoo-sweep {sweep} " if sweep else "attnzoo-train -m ") + " ".join(rest)
