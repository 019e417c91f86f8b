"""A report.html as a reader sees it: headless Chromium renders the page (plotly.js runs, the charts and tables
draw) and saves a PNG of the whole window.

    .venv/bin/python scripts/screenshot_report.py multirun/kv/report.html --out report.png
    .venv/bin/python scripts/screenshot_report.py --demo /tmp/demo_sweep --out docs/report/after.png

`--demo DIR` first fabricates a small, realistic sweep in DIR (no training: the files a job writes, as
tests/test_report_html.py builds them) and runs attnzoo-report on it: MQAR, 3 mixers x 2 learning rates x
2 seeds (12 jobs, one of which failed), with curves, so every table, error bar and chart of the report shows.

Needs chromium (`apt-get install -y chromium`; also found as chromium-browser or google-chrome). The page is
laid out at --width in a window --height tall; the PNG shows the page down to there, the blank below the
page's end cut off. `--virtual-time-budget` lets plotly.js finish drawing before the capture.

`--check-menus` (with --demo) also runs the jobs table's menus in the browser, as a click would: plotly.js
applies 'sort by val/acc (descending)' then 'show model/mixer=deltanet'; the script checks that the shown rows
are that mixer's jobs in descending accuracy, drawn in that order, and that the failed job's empty cell sorts
last; exit status 1 otherwise. (The suite checks the menus' Plotly specification without a browser:
tests/test_report_html.py.)
"""
from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import subprocess
import sys
from pathlib import Path

from PIL import Image, ImageChops  # pillow: matplotlib's dependency

MIXERS = {  # the demo's variants: final accuracy at lr 1e-3 / 3e-3, cache bytes per token, tokens/s, params
    "gqa": dict(acc=(0.71, 0.99), cache=1024.0, tps=21000.0, params=101952),
    "deltanet": dict(acc=(0.62, 0.86), cache=136.0, tps=15500.0, params=102336),
    "gated_deltanet": dict(acc=(0.76, 0.94), cache=144.0, tps=14200.0, params=103104),
}
LRS, SEEDS, STEPS, CTX = ("1e-3", "3e-3"), (1, 2), 250, 64
FAILED = ("gated_deltanet", "1e-3", 2)  # diverged: a failed job, its rows red and its error listed


def fake_sweep(root: Path) -> Path:
    """A multirun dir of 12 jobs with the files attnzoo-train writes: .hydra/overrides.yaml, summary.json,
    csv/metrics.csv (Lightning's sparse rows), error.txt for the failed one; and multirun.yaml."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "multirun.yaml").write_text(json.dumps({"hydra": {"overrides": {"task": [
        "+sweeps=mixers", f"model/mixer={','.join(MIXERS)}", f"optim.lr={','.join(LRS)}", "seed=1,2"]}}}))
    n = 0
    for mixer, spec in MIXERS.items():
        for k, lr in enumerate(LRS):
            for seed in SEEDS:
                rng = random.Random(f"{mixer}{lr}{seed}")
                job = root / str(n)
                n += 1
                (job / ".hydra").mkdir(parents=True, exist_ok=True)
                (job / ".hydra" / "overrides.yaml").write_text(
                    f"- +sweeps=mixers\n- model/mixer={mixer}\n- optim.lr={lr}\n- seed={seed}\n- data.num_kv_pairs=16\n")
                acc = min(0.999, spec["acc"][k] + rng.uniform(-0.03, 0.03))
                failed = (mixer, lr, seed) == FAILED
                last = 170 if failed else STEPS
                _write_curves(job, acc, last, rng)
                model = {"mixers": [mixer, mixer], "d_model": 64, "vocab_size": 8192,
                         "layers": [{"mixer": mixer, "n_heads": 4, "head_dim": 16, "conv": 4}] * 2}
                summary = {"status": "failed" if failed else "ok", "model": model, "global_step": last,
                           "data": {"name": "mqar", "num_kv_pairs": 16, "seq_len": CTX},
                           "config": {"model": {"mixer": {"name": mixer}, "d_model": 64}, "optim": {"lr": float(lr)},
                                      "seed": seed, "data": {"name": "mqar", "num_kv_pairs": 16}},
                           "wall_seconds": round(60 * 21000 / spec["tps"] * rng.uniform(0.95, 1.05), 1)}
                if failed:
                    summary["error"] = "FloatingPointError: train/loss is nan at step 170"
                    (job / "error.txt").write_text(summary["error"] + "\n")
                else:
                    summary["metrics"] = {
                        "val/acc": acc, "val/loss": 0.04 + 3.2 * (1 - acc) + rng.uniform(0, 0.01),
                        "train/loss": 0.03 + 3.0 * (1 - acc), "perf/tokens_per_sec": spec["tps"] * rng.uniform(0.96, 1.04),
                        "cache/bytes_per_token": spec["cache"], "cache/bytes_at_ctx": spec["cache"] * CTX,
                        "params/total": float(spec["params"]), "perf/decode_tokens_per_sec": 3 * spec["tps"] / 64}
                    summary["metrics"]["val/ppl"] = math.exp(summary["metrics"]["val/loss"])
                (job / "summary.json").write_text(json.dumps(summary))
    return root


def _write_curves(job: Path, acc: float, last: int, rng: random.Random) -> None:
    """train/loss every 10 steps, val/acc and val/loss every 25: an S-shaped rise to the final accuracy."""
    (job / "csv").mkdir(exist_ok=True)
    lines = ["step,train/loss,val/acc,val/loss"]
    for step in range(10, last + 1, 10):
        progress = 1 / (1 + math.exp(-(step - 110) / 25))
        a = 1 / 16 + (acc - 1 / 16) * progress + rng.uniform(-0.01, 0.01)
        lines.append(f"{step},{0.03 + 3.0 * (1 - a) + rng.uniform(0, 0.05):.4f},,")
        if step % 25 == 0 or step == last:
            lines.append(f"{step},,{a:.4f},{0.04 + 3.2 * (1 - a):.4f}")
    (job / "csv" / "metrics.csv").write_text("\n".join(lines) + "\n")


def chromium() -> list[str]:
    """The browser and its flags: headless, offline (no update, sync or background requests: the page is local)."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return [path, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync", "--no-first-run"]
    sys.exit("screenshot_report: no chromium on PATH (apt-get install -y chromium)")


def screenshot(html: Path, out: Path, width: int = 1400, height: int = 8000, wait_ms: int = 10000) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [*chromium(), "--hide-scrollbars", f"--window-size={width},{height}",
           f"--virtual-time-budget={wait_ms}", f"--screenshot={out.resolve()}", html.resolve().as_uri()]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    if r.returncode != 0 or not out.is_file():
        sys.exit(f"screenshot_report: chromium failed ({r.returncode}):\n{r.stderr[-2000:]}")
    trim(out)
    return out


def trim(png: Path, margin: int = 24) -> None:
    """Cut the blank window below the page's end (the window is as tall as --height, the page often shorter)."""
    im = Image.open(png).convert("RGB")
    box = ImageChops.difference(im, Image.new("RGB", im.size, im.getpixel((im.width - 1, im.height - 1)))).getbbox()
    if box and box[3] + margin < im.height:
        im.crop((0, 0, im.width, box[3] + margin)).save(png)


PROBE = """<script>(async () => {
  const gd = document.getElementById('table-all'), [sorts, shows] = gd.layout.updatemenus;
  const col = gd.data[0].header.values.indexOf('<b>val/acc</b>');
  await Plotly.restyle(gd, ...sorts.buttons.find(b => b.label === 'val/acc \u25bc').args);
  await Plotly.restyle(gd, ...shows.buttons.find(b => b.label.startsWith('model/mixer=deltanet')).args);
  const out = {visible: gd.data.map(t => t.visible), values: gd.data.map(t => t.cells.values[col]),
               drawn: [...gd.querySelectorAll('.cell-text')].map(e => e.textContent)};
  const pre = document.createElement('pre'); pre.id = 'probe'; pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre); })();</script></body>"""


def check_menus(html: Path, jobs: list[dict]) -> list[str]:
    """Problems found when plotly.js runs the demo table's sort and show menus in headless chromium (none: [])."""
    import re

    probe = html.with_name("probe.html")
    probe.write_text(html.read_text().replace("</body>", PROBE))
    r = subprocess.run([*chromium(), "--virtual-time-budget=10000",
                        "--dump-dom", probe.resolve().as_uri()], capture_output=True, text=True, timeout=180)
    m = re.search(r'<pre id="probe">(.*?)</pre>', r.stdout, re.S)
    if not m:
        return [f"the probe did not run: {r.stderr[-1000:]}"]
    out = json.loads(m.group(1).replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">"))
    accs = sorted((j["metrics"]["val/acc"] for j in jobs if j["mixer"] == "deltanet"), reverse=True)
    shown = [float(v) for v in out["values"][out["visible"].index(True)]]
    drawn = [float(t) for t in out["drawn"] if re.fullmatch(r"0\.\d+", t)][:len(accs)]
    problems = []
    if any(abs(a - b) > 1e-4 for a, b in zip(shown, accs)) or len(shown) != len(accs):
        problems.append(f"shown rows {shown} != deltanet's accuracies, descending {accs}")
    if any(abs(a - b) > 1e-4 for a, b in zip(drawn, accs)) or len(drawn) != len(accs):
        problems.append(f"drawn cells {drawn} != {accs}")
    if out["values"][0][-1] != "":
        problems.append("the failed job's empty cell does not sort last in the all-rows view")
    return problems


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report", nargs="?", help="a report.html, or a sweep dir holding one")
    ap.add_argument("--demo", metavar="DIR", help="fabricate the demo sweep in DIR, build its report, screenshot it")
    ap.add_argument("--out", default="report.png")
    ap.add_argument("--width", type=int, default=1400)
    ap.add_argument("--height", type=int, default=8000, help="the window's height; the PNG is cut below the page's end")
    ap.add_argument("--check-menus", action="store_true", help="with --demo: run the table's menus in the browser")
    args = ap.parse_args(argv)
    if args.check_menus and not args.demo:
        ap.error("--check-menus needs --demo DIR")
    if args.demo:
        from attnzoo.analysis.report import build_report  # deferred: a screenshot of a given page needs no attnzoo

        rep = build_report(fake_sweep(Path(args.demo)))
        html = rep["files"]["html"]
        if args.check_menus:
            problems = check_menus(Path(html), rep["jobs"])
            print("menus: " + ("; ".join(problems) if problems else "sort and show work in the browser"))
            if problems:
                sys.exit(1)
    elif args.report:
        html = Path(args.report)
        html = html / "report.html" if html.is_dir() else html
    else:
        ap.error("give a report.html (or its sweep dir), or --demo DIR")
    print(screenshot(html, Path(args.out), args.width, args.height))


if __name__ == "__main__":
    main()
