"""How long each console script takes to refuse a bad input, and to print its --help (issue 45's everyday loop):
attnzoo-train over docs/reliability.md's table (the cases of tests/test_bad_input.py), the other scripts over
their rows of it, every --help; each run as its console script runs, in a fresh process. A benchmark, not a
test: it writes numbers (JSON + a markdown table) and checks only that each case was refused (exit 2, one
`<script>: error: <field>` line) or helped (exit 0).

    .venv/bin/python scripts/refusal_bench.py [--out docs/bench] [--limit N] [--only train|scripts|help]

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


# every other console script as its console script runs it (pyproject's module:function), saying what it imported
SCRIPT_PROBE = ("import atexit, importlib, sys\n"
                "atexit.register(lambda: print('refusal-bench imported:', *[m for m in ('torch', 'lightning') if m in "
                "sys.modules], file=sys.stderr))\n"
                "module, func = sys.argv.pop(1).split(':')\n"
                "sys.argv[0] = sys.argv.pop(1)\n"
                "getattr(importlib.import_module(module), func)()")


def script_cases(tmp: Path, run: Path) -> list[tuple[str, list[str], str]]:
    """(name, [script, *argv], the error line's start) for the rows of docs/reliability.md's table that belong to
    the console scripts other than attnzoo-train. `run`: a finished tiny run (learned positions, max_seq_len 40)."""
    (tmp / "bad.ckpt").write_bytes(b"PK truncated")
    (tmp / "file.txt").write_text("x")
    (tmp / "blank.txt").write_text("\n \n")
    (tmp / "src").mkdir(exist_ok=True)
    (tmp / "src" / "notes.md").write_text("x")
    f, none, bad = str(tmp / "file.txt"), str(tmp / "none"), str(tmp / "bad.ckpt")
    g, e = "attnzoo-generate", "attnzoo-eval"
    return [
        ("generate: missing run", [g, none, "hi"], f"{g}: error: checkpoint"),
        ("generate: truncated checkpoint", [g, bad, "hi"], f"{g}: error: checkpoint"),
        ("generate: --temperature -0.5", [g, str(run), "x", "--temperature", "-0.5"], f"{g}: error: --temperature"),
        ("generate: --top-p 1.5", [g, str(run), "x", "--top-p", "1.5"], f"{g}: error: --top-p"),
        ("generate: --top-k -1", [g, str(run), "x", "--top-k", "-1"], f"{g}: error: --top-k"),
        ("generate: --device tpu", [g, str(run), "x", "--device", "tpu"], f"{g}: error: --device"),
        ("generate: --prompts blank file", [g, str(run), "--prompts", str(tmp / "blank.txt")], f"{g}: error: --prompts"),
        ("generate: past the learned table", [g, str(run), "def ", "--max-new-tokens", "37"],
         f"{g}: error: --max-new-tokens"),
        ("eval: missing run", [e, none], f"{e}: error: checkpoint"),
        ("eval: --context-lengths 0 -5", [e, str(run), "--context-lengths", "64", "0", "-5"],
         f"{e}: error: --context-lengths"),
        ("eval: --max-batches 0", [e, str(run), "--max-batches", "0"], f"{e}: error: --max-batches"),
        ("eval: --out under a file", [e, str(run), "--out", f"{f}/eval.json"], f"{e}: error: --out"),
        ("ckpt info: missing", ["attnzoo-ckpt", "info", none], "attnzoo-ckpt: error: CKPT"),
        ("ckpt info: truncated", ["attnzoo-ckpt", "info", bad], "attnzoo-ckpt: error: CKPT"),
        ("ckpt consolidate: not sharded", ["attnzoo-ckpt", "consolidate", str(tmp), f"{tmp}/x.ckpt"],
         "attnzoo-ckpt: error: SRC"),
        ("export: missing run", ["attnzoo-export", none, f"{tmp}/out"], "attnzoo-export: error: RUN_DIR"),
        ("export: OUT_DIR is a file", ["attnzoo-export", str(run), f], "attnzoo-export: error: OUT_DIR"),
        ("export: OUT_DIR under a file", ["attnzoo-export", str(run), f"{f}/export"], "attnzoo-export: error: OUT_DIR"),
        ("bench: --threads 0", ["attnzoo-bench", "--threads", "0", "decode"], "attnzoo-bench decode: error: --threads"),
        ("bench: --out under a file", ["attnzoo-bench", "--out", f"{f}/bench", "decode"],
         "attnzoo-bench decode: error: --out"),
        ("bench train --mixer nope", ["attnzoo-bench", "train", "--mixer", "nope"], "attnzoo-bench train: error: model/mixer"),
        ("data prepare: missing SRC", ["attnzoo-data", "prepare", none, f"{tmp}/o"], "attnzoo-data: error: SRC"),
        ("data prepare: SRC without inputs", ["attnzoo-data", "prepare", str(tmp / "src"), f"{tmp}/o"],
         "attnzoo-data: error: SRC"),
        ("data prepare: OUT under a file", ["attnzoo-data", "prepare", str(tmp / "src"), f"{f}/out"],
         "attnzoo-data: error:"),
        ("data info: not prepared", ["attnzoo-data", "info", str(tmp)], "attnzoo-data: error: OUT"),
        ("lm-eval: missing run", ["attnzoo-lm-eval", "run", "--model", "attnzoo", "--model_args", f"path={none}",
                                  "--tasks", "x"], "attnzoo-lm-eval: error: checkpoint"),
        ("sweep: unknown sweep", ["attnzoo-sweep", "nope"], "attnzoo-sweep: error:"),
        ("report: no jobs", ["attnzoo-report", none], "attnzoo-report: error:"),
    ]


def help_cases() -> list[list[str]]:
    from attnzoo.bench.cli import subcommand_names

    return [["attnzoo-train", "--help"], ["attnzoo-sweep", "--help"], ["attnzoo-generate", "--help"],
            ["attnzoo-eval", "--help"], ["attnzoo-export", "--help"], ["attnzoo-report", "--help"],
            ["attnzoo-lm-eval", "--help"], ["attnzoo-ckpt", "--help"], ["attnzoo-ckpt", "info", "--help"],
            ["attnzoo-ckpt", "consolidate", "--help"], ["attnzoo-data", "--help"], ["attnzoo-data", "prepare", "--help"],
            ["attnzoo-data", "info", "--help"], ["attnzoo-bench", "--help"],
            *(["attnzoo-bench", name, "--help"] for name in subcommand_names())]


def entry_points() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def timed(cmd: list[str], cwd: Path) -> tuple[float, subprocess.CompletedProcess, list[str]]:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=300)
    seconds = time.perf_counter() - t0
    imported = next((ln.split(":", 1)[1].split() for ln in r.stderr.splitlines()
                     if ln.startswith("refusal-bench imported:")), ["?"])
    return seconds, r, imported


def tiny_run(tmp: Path) -> Path:
    """A finished decoder run with learned positions (max_seq_len 40), as tests/test_bad_input_cli.py trains."""
    from tests.test_bad_input_cli import LEARNED

    out = tmp / "run"
    r = subprocess.run([sys.executable, "-m", "attnzoo.cli.train", *LEARNED, f"hydra.run.dir={out}"],
                       capture_output=True, text=True, cwd=tmp, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return out


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def summary(rows: list[dict]) -> dict:
    times = [r["seconds"] for r in rows]
    worst = max(rows, key=lambda r: r["seconds"])
    light = [r["seconds"] for r in rows if r["imported"] == "-"]
    return {"n": len(rows), "median_s": statistics.median(times), "worst_s": worst["seconds"],
            "worst_case": worst["case"], "under_1_5_s": sum(t < 1.5 for t in times), "n_before_torch": len(light),
            "median_before_torch_s": statistics.median(light) if light else None,
            "worst_before_torch_s": max(light) if light else None, "all_ok": all(r["refused"] for r in rows)}


def table(title: str, rows: list[dict], ok: str) -> list[str]:
    m = summary(rows)
    return [f"## {title}", "", f"{m['n']} cases; median {m['median_s']:.2f} s, worst {m['worst_s']:.2f} s "
            f"({m['worst_case']}); under 1.5 s: {m['under_1_5_s']}; every case {ok}: {m['all_ok']}; before torch "
            f"was imported: {m['n_before_torch']} (median {m['median_before_torch_s'] or 0:.2f} s, worst "
            f"{m['worst_before_torch_s'] or 0:.2f} s)", "",
            f"| case | seconds | {ok} | imported before the answer |", "|---|---:|---|---|",
            *(f"| {r['case']} | {r['seconds']:.2f} | {r['refused']} | {r['imported']} |" for r in rows), ""]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench_results", help="folder for refusals.json / refusals.md")
    ap.add_argument("--limit", type=int, default=0, help="the first N cases of each table only (0: all)")
    ap.add_argument("--only", choices=("train", "scripts", "help"), action="append",
                    help="these tables only (default: all three)")
    args = ap.parse_args(argv)
    only = set(args.only or ("train", "scripts", "help"))
    from tests.test_bad_input import _cases, base_for

    def cut(cases):
        return cases[: args.limit] if args.limit else cases

    tables: dict[str, list[dict]] = {}
    scripts = entry_points()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        run = tiny_run(tmp) if "scripts" in only else None  # before the clock: its training is not a refusal
        before = uptime()
        if "train" in only:
            rows = tables.setdefault("train", [])
            for i, (name, overrides, field, _) in enumerate(cut(_cases(tmp))):
                own = any(o.startswith("paths.output_dir=") for o in overrides)
                cmd = [sys.executable, "-c", PROBE, *base_for(overrides), *overrides,
                       *([] if own else [f"hydra.run.dir={tmp}/run{i}"])]
                seconds, r, imported = timed(cmd, tmp)
                errors = [ln for ln in r.stderr.splitlines() if ln.startswith("attnzoo: error:")]
                refused = r.returncode == 2 and len(errors) == 1 and errors[0].startswith(f"attnzoo: error: {field}")
                rows.append({"case": name, "seconds": round(seconds, 2), "refused": refused,
                             "imported": " ".join(imported) or "-"})
                print(f"{seconds:6.2f} s  {'ok ' if refused else 'BAD'}  {' '.join(imported) or '-':16s} {name}", flush=True)
        if "scripts" in only:
            rows = tables.setdefault("scripts", [])
            for name, (script, *rest), start in cut(script_cases(tmp, run)):
                seconds, r, imported = timed([sys.executable, "-c", SCRIPT_PROBE, scripts[script], script, *rest], tmp)
                errors = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("refusal-bench")]
                refused = r.returncode == 2 and len(errors) == 1 and errors[0].startswith(start)
                rows.append({"case": name, "seconds": round(seconds, 2), "refused": refused,
                             "imported": " ".join(imported) or "-"})
                print(f"{seconds:6.2f} s  {'ok ' if refused else 'BAD'}  {' '.join(imported) or '-':16s} {name}"
                      + ("" if refused else f"  rc={r.returncode} {errors[:2]}"), flush=True)
        if "help" in only:
            rows = tables.setdefault("help", [])
            for script, *rest in cut(help_cases()):
                seconds, r, imported = timed([sys.executable, "-c", SCRIPT_PROBE, scripts[script], script, *rest], tmp)
                ok = r.returncode == 0 and bool(r.stdout.strip())
                name = " ".join([script, *rest])
                rows.append({"case": name, "seconds": round(seconds, 2), "refused": ok,
                             "imported": " ".join(imported) or "-"})
                print(f"{seconds:6.2f} s  {'ok ' if ok else 'BAD'}  {' '.join(imported) or '-':16s} {name}", flush=True)
    after = uptime()
    titles = {"train": ("attnzoo-train refusals (docs/reliability.md's table: tests/test_bad_input.py)", "refused in one line"),
              "scripts": ("the other console scripts' refusals", "refused in one line"),
              "help": ("every console script's --help, and each subcommand's", "answered (exit 0)")}
    result = {"title": "refusals and help texts, one fresh process a case", "uptime_before": before,
              "uptime_after": after, **{k: {**summary(v), "rows": v} for k, v in tables.items()}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "refusals.json").write_text(json.dumps(result, indent=2))
    lines = [f"# {result['title']}", "", "`.venv/bin/python scripts/refusal_bench.py --out docs/bench`", "",
             f"uptime before: `{before}`", "", f"uptime after: `{after}`", ""]
    for k, v in tables.items():
        lines += table(titles[k][0], v, titles[k][1])
    (out / "refusals.md").write_text("\n".join(lines))
    for k, v in tables.items():
        m = summary(v)
        print(f"{k}: {m['n']} cases, median {m['median_s']:.2f} s, worst {m['worst_s']:.2f} s ({m['worst_case']}), "
              f"under 1.5 s {m['under_1_5_s']}, all ok {m['all_ok']}")
    print(f"{out}/refusals.md")


if __name__ == "__main__":
    main()
