"""The `attnzoo-report <multirun dir>` command."""
from __future__ import annotations

import argparse

from attnzoo.analysis.report.build import build_report

DESCRIPTION = "a sweep report built offline from the jobs' own files (report.csv, report.md, plots/*.png, report.html)"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="attnzoo-report", description=DESCRIPTION)
    ap.add_argument("sweep_dir", help="a Hydra multirun directory (e.g. multirun/mixers_2025-01-01_12-00-00)")
    args = ap.parse_args(argv)
    try:
        res = build_report(args.sweep_dir)
    except FileNotFoundError as e:
        ap.exit(2, f"attnzoo-report: error: {e}\n")
    f = res["files"]
    print(f"{len(res['jobs'])} jobs -> {f['md']}, {f['csv']}, {f['html']} ({len(f) - 3} plots)")
