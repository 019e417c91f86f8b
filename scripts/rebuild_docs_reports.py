"""Redraw the sweep reports committed under docs/ with today's report code, from each report's own report.csv.

    .venv/bin/python scripts/rebuild_docs_reports.py                 # every report below
    .venv/bin/python scripts/rebuild_docs_reports.py scaling_cpu     # one of them
    .venv/bin/python scripts/rebuild_docs_reports.py --html /tmp/r   # also keep each report.html in /tmp/r/NAME/

The sweeps' job directories were not kept (each sweep took hours of CPU), but report.csv holds, per job, what
the report reads from them: status, overrides, mixer, layers, learning rate, every final metric (the exact
summary.json numbers), steps, wall seconds and error. This script writes those back as job directories
(.hydra/overrides.yaml + summary.json) in a temporary sweep directory named as the original one (so the report's
command line is the original's), runs attnzoo-report on it and copies report.md, report.csv and the plots back.
What a CSV does not hold is given per report in REPORTS below, each from the docs that describe the sweep: the
training length (data.seq_len), the data module's name (MQAR's plots need it).

Not redrawn: curves.png (a metric vs step) needs each job's csv/metrics.csv, which report.csv does not hold. The
original runs' curves.png had the defects the current report code fixes (legends "max_flops=2000000000000.0",
issue 47), so a stale one is removed rather than kept beside a report it does not match; the report.md says the
curves are not drawn and why (rerun the sweep to get them).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

# name -> (plots beside report.md (True) or in plots/ (False), the summary's `data` facts the CSV lacks)
REPORTS = {
    "scaling_cpu": (False, {"name": "text", "seq_len": 128}),  # sweeps/scaling.yaml
    "long_context_mixers": (True, {"name": "text", "seq_len": 128}),  # docs/sweeps.md: trained at 128 tokens
    "long_context_positions": (True, {"name": "text", "seq_len": 128}),  # sweeps/long_context_positions.yaml
    "multimodal": (True, {"name": "shapes"}),  # sweeps/multimodal.yaml
    "sweeps_mqar": (True, {"name": "mqar"}),  # sweeps/mixers.yaml
}
NOT_REDRAWN = "curves.png"


def _number(text: str):
    return None if text == "" else int(text) if re.fullmatch(r"-?\d+", text) else float(text)


def _summary(row: dict, metric_cols: list[str], data: dict) -> dict:
    """A job's summary.json, as attnzoo-train wrote it, from its report.csv row."""
    overrides = row["overrides"].split()
    values = {o.split("=", 1)[0].lstrip("+~"): o.split("=", 1)[1] for o in overrides if "=" in o}
    metrics = {c: float(row[c]) for c in metric_cols if row[c] != ""}
    mixer = row["mixer"]
    model = {"mixers": mixer.strip("[]").split(",") if mixer.startswith("[") else [mixer]}
    if row.get("layers"):  # '4x gqa h4 kv2 d32 + 2x ...': each run's text back as its layers (the report prints it)
        model["layers"] = [{"mixer": desc} for run in row["layers"].split(" + ")
                           for n, desc in [run.split("x ", 1)] for _ in range(int(n))]
    if "model.d_model" in values:
        model["d_model"] = int(values["model.d_model"])
    data = dict(data)
    if "data.num_kv_pairs" in values:
        data["num_kv_pairs"] = int(values["data.num_kv_pairs"])
    summary = {"status": row["status"], "error": row["error"], "metrics": metrics, "model": model, "data": data,
               "config": {"optim": {"lr": _number(row["lr"])}}, "global_step": _number(row["global_step"]),
               "wall_seconds": _number(row["wall_seconds"])}
    if "trainer.max_flops" in values:  # a budget sweep: every job of these ran to its budget (the CSV's train/flops)
        summary["length"] = {"max_flops": float(values["trainer.max_flops"]), "flops": metrics.get("train/flops"),
                             "limit": "trainer.max_flops"}
    return summary


def _command(report_md: Path) -> tuple[list[str], str]:
    """(the sweep's task overrides, its sweep dir) from the original report's `Command:` line."""
    m = re.search(r"^Command: `(.*)`$", report_md.read_text(), re.M)
    words = m.group(1).split()
    sweep_dir = next(w.split("=", 1)[1] for w in words if w.startswith("hydra.sweep.dir="))
    rest = [w for w in words[2:] if not w.startswith("hydra.sweep.dir=")]
    task = ([f"+sweeps={words[1]}"] if words[0] == "attnzoo-sweep" else []) + rest
    return task, sweep_dir


def rebuild(name: str, docs: Path, html_dir: Path | None) -> list[Path]:
    from attnzoo.analysis.report import build_report

    flat, data = REPORTS[name]
    dest = docs / name
    task, sweep_dir = _command(dest / "report.md")
    with open(dest / "report.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    fixed = {"job", "status", "overrides", "mixer", "layers", "lr", "global_step", "wall_seconds", "error"}
    metric_cols = [c for c in rows[0] if c not in fixed]
    if Path(sweep_dir).is_absolute() and Path(sweep_dir).exists():  # never written into, never removed
        sys.exit(f"rebuild_docs_reports: {sweep_dir} exists; move it away first")
    with tempfile.TemporaryDirectory() as tmp:
        cwd = os.getcwd()
        os.chdir(tmp)  # a relative sweep dir (multirun/scaling) is made here, an absolute one where it was
        root = Path(sweep_dir)
        try:
            for row in rows:
                job = root / row["job"]
                (job / ".hydra").mkdir(parents=True)
                (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in row["overrides"].split()))
                (job / "summary.json").write_text(json.dumps(_summary(row, metric_cols, data)))
            (root / "multirun.yaml").write_text(json.dumps({"hydra": {"overrides": {"task": task}}}))
            build_report(root)
            return _copy_back(root, dest, flat, name, html_dir)
        finally:
            os.chdir(cwd)
            if root.is_absolute():
                shutil.rmtree(root, ignore_errors=True)


def _copy_back(root: Path, dest: Path, flat: bool, name: str, html_dir: Path | None) -> list[Path]:
    plots = dest if flat else dest / "plots"
    plots.mkdir(exist_ok=True)
    drawn = {p.name for p in (root / "plots").glob("*.png")}
    for old in plots.glob("*.png"):  # a chart the report no longer draws (a degenerate one, stale curves) goes
        if old.name not in drawn:
            old.unlink()
    written = []
    for png in sorted((root / "plots").glob("*.png")):
        shutil.copyfile(png, plots / png.name)
        written.append(plots / png.name)
    md = (root / "report.md").read_text()
    if flat:
        md = md.replace("](plots/", "](")
    if NOT_REDRAWN not in drawn:
        md += (f"\nNot drawn: {NOT_REDRAWN} (the ranking metric vs step). It is drawn from the jobs' csv/metrics.csv, "
               f"which were not kept; this report was redrawn from report.csv (scripts/rebuild_docs_reports.py), which "
               f"holds each job's final numbers only. Rerun the sweep (its command above) to draw the curves.\n")
    (dest / "report.md").write_text(md)  # report.csv stays as it is: it is the source
    if html_dir is not None:
        (html_dir / name).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / "report.html", html_dir / name / "report.html")
    return written


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help=f"reports to redraw (default: all): {', '.join(REPORTS)}")
    ap.add_argument("--docs", type=Path, default=DOCS, help="the folder holding them (default: docs/)")
    ap.add_argument("--html", type=Path, help="keep each report.html in HTML/NAME/ (not committed: 4 MB of plotly.js)")
    args = ap.parse_args(argv)
    if unknown := set(args.names) - set(REPORTS):
        ap.error(f"unknown report {sorted(unknown)[0]}; allowed: {', '.join(REPORTS)}")
    for name in args.names or REPORTS:
        for path in rebuild(name, args.docs.resolve(), args.html):
            print(path)


if __name__ == "__main__":
    main()
