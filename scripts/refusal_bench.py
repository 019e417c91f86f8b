"""How long `attnzoo-train` takes to refuse each bad input of docs/reliability.md's table (the cases of
tests/test_bad_input.py, run through the console script as a user types them): issue 45's everyday loop. A
benchmark, not a test: it writes numbers (JSON + a markdown table) and checks only that each case was refused
(exit 2, one `attnzoo: error: <field>` line).

    .venv/bin/python scripts/refusal_bench.py [--out docs/bench] [--limit N]

Run it on an idle machine (it prints `uptime` before and after); each case is one fresh process.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


# `attnzoo-train ARGS`, saying at exit which of the heavy packages it had imported by then
PROBE = ("import atexit, runpy, sys\n"
         "atexit.register(lambda: print('refusal-bench imported:', *[m for m in ('torch', 'lightning') if m in "
         "sys.modules], file=sys.stderr))\n"
         "sys.argv[0] = 'attnzoo-train'\n"
         "runpy.run_module('attnzoo.cli.train', run_name='__main__')")


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench_results", help="folder for refusals.json / refusals.md")
    ap.add_argument("--limit", type=int, default=0, help="the first N cases only (0: all)")
    args = ap.parse_args(argv)
    from tests.test_bad_input import _cases, base_for

    rows, before = [], uptime()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cases = _cases(tmp)
        cases = cases[: args.limit] if args.limit else cases
        for i, (name, overrides, field, _) in enumerate(cases):
            own = any(o.startswith("paths.output_dir=") for o in overrides)
            cmd = [sys.executable, "-c", PROBE, *base_for(overrides), *overrides,
                   *([] if own else [f"hydra.run.dir={tmp}/run{i}"])]
            t0 = time.perf_counter()
            r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, timeout=300)
            seconds = time.perf_counter() - t0
            errors = [ln for ln in r.stderr.splitlines() if ln.startswith("attnzoo: error:")]
            refused = r.returncode == 2 and len(errors) == 1 and errors[0].startswith(f"attnzoo: error: {field}")
            imported = next((ln.split(":", 1)[1].split() for ln in r.stderr.splitlines()
                             if ln.startswith("refusal-bench imported:")), ["?"])
            rows.append({"case": name, "seconds": round(seconds, 2), "refused": refused,
                         "imported": " ".join(imported) or "-"})
            print(f"{seconds:6.2f} s  {'ok ' if refused else 'BAD'}  {' '.join(imported) or '-':16s} {name}", flush=True)
    after = uptime()
    times = [r["seconds"] for r in rows]
    worst = max(rows, key=lambda r: r["seconds"])
    light = [r["seconds"] for r in rows if r["imported"] == "-"]
    result = {"title": "attnzoo-train refusals, one fresh process a case", "median_s": statistics.median(times),
              "n_before_torch": len(light), "median_before_torch_s": statistics.median(light) if light else None,
              "worst_before_torch_s": max(light) if light else None,
              "worst_s": worst["seconds"], "worst_case": worst["case"], "n": len(rows),
              "all_refused": all(r["refused"] for r in rows), "uptime_before": before, "uptime_after": after,
              "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "refusals.json").write_text(json.dumps(result, indent=2))
    lines = [f"# {result['title']}", "", f"{len(rows)} cases; median {result['median_s']:.2f} s, worst "
             f"{result['worst_s']:.2f} s ({result['worst_case']}); every case refused in one line: "
             f"{result['all_refused']}; refused before torch was imported: {len(light)} (median "
             f"{result['median_before_torch_s'] or 0:.2f} s, worst {result['worst_before_torch_s'] or 0:.2f} s)", "", f"uptime before: `{before}`", "", f"uptime after: `{after}`", "",
             "| case | seconds | refused | imported before the refusal |", "|---|---:|---|---|"]
    lines += [f"| {r['case']} | {r['seconds']:.2f} | {r['refused']} | {r['imported']} |" for r in rows]
    (out / "refusals.md").write_text("\n".join(lines) + "\n")
    print(f"median {result['median_s']:.2f} s, worst {result['worst_s']:.2f} s ({result['worst_case']}); "
          f"{sum(r['refused'] for r in rows)}/{len(rows)} refused in one line; {out}/refusals.md")


if __name__ == "__main__":
    main()
