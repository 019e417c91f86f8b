"""`attnzoo-report <multirun dir>`: a sweep report built offline from the jobs' own files.

For every job directory (one holding `.hydra/overrides.yaml` or `summary.json`) it reads summary.json
(status, final metrics, the resolved config), csv/metrics.csv (curves) and .hydra/overrides.yaml, and
writes into the multirun dir:

  report.csv    one row per job: job, status, overrides, every final metric (the exact summary.json
                numbers), steps, wall seconds, error
  report.md     the best-of-learning-rate table (one row per variant) and the full per-job table
  plots/*.png   curves.png (loss / accuracy vs step, best lr per variant), acc_vs_cache.png (val/acc or
                val/loss vs cache/bytes_per_token), tokens_per_sec.png, recall_vs_state.png (MQAR accuracy vs
                cache/bytes_at_ctx, Zoology's view), mqar_difficulty.png (MQAR accuracy
                vs key-value pairs per mixer, one panel per width)
  report.html   self-contained: both tables and the plots embedded as base64

A *variant* is a job's swept overrides minus `optim.lr` and `seed`; its best job is the one with the best
`val/acc` (max) or, without accuracy, `val/loss` (min) — the Zoology convention of best-of-lr.
"""
from __future__ import annotations

import argparse
import base64
import csv
import html
import json
import math
import sys
from pathlib import Path
from typing import Any

import yaml

METRIC_ORDER = ["val/acc", "val/loss", "val/ppl", "train/loss", "perf/tokens_per_sec", "cache/bytes_per_token",
                "params/total", "params/active", "perf/step_ms", "perf/mfu", "perf/flops_per_token",
                "cache/bytes_at_ctx", "perf/decode_tokens_per_sec", "mem/peak_bytes"]
MD_METRICS = ["val/acc", "val/loss", "val/ppl", "perf/tokens_per_sec", "cache/bytes_per_token", "params/total"]
# overrides that identify the sweep or the machinery, not the variant
_FIXED_PREFIXES = ("+sweeps=", "sweeps=", "hydra.", "paths.", "debug=", "logger=", "trainer.accelerator", "trainer.devices")
_LR_KEYS = ("optim.lr", "seed")


# ----------------------------------------------------------------------------- loading


def _job_dirs(root: Path) -> list[Path]:
    found = {p.parent.parent for p in root.rglob(".hydra/overrides.yaml")} | {p.parent for p in root.rglob("summary.json")}
    found.discard(root)

    def key(p: Path):
        rel = p.relative_to(root).parts
        return tuple((0, int(s), "") if s.isdigit() else (1, 0, s) for s in rel)

    return sorted(found, key=key)


def _read_curves(path: Path) -> dict[str, list[tuple[int, float]]]:
    """{metric: [(step, value), ...]} from a Lightning CSVLogger metrics.csv (sparse rows)."""
    curves: dict[str, list[tuple[int, float]]] = {}
    if not path.is_file():
        return curves
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            step = int(float(row.get("step") or 0))
            for k, v in row.items():
                if k in ("step", "epoch") or v in (None, ""):
                    continue
                try:
                    curves.setdefault(k, []).append((step, float(v)))
                except ValueError:
                    pass
    return curves


def load_job(d: Path, root: Path) -> dict:
    ov_path = d / ".hydra" / "overrides.yaml"
    overrides = [str(o) for o in (yaml.safe_load(ov_path.read_text()) or [])] if ov_path.is_file() else []
    summary, broken = {}, ""
    if (d / "summary.json").is_file():
        try:
            summary = json.loads((d / "summary.json").read_text())
            if not isinstance(summary, dict):
                raise ValueError(f"expected a JSON object, got {type(summary).__name__}")
        except ValueError as e:  # a truncated or hand-edited file: report the job, build the rest
            broken = f"summary.json unreadable ({str(e).splitlines()[0][:120]})"
            print(f"attnzoo-report: {d.relative_to(root)}: {broken}", file=sys.stderr)
            summary = {"status": "failed", "error": broken}
    cfg = summary.get("config")
    if cfg is None and (d / ".hydra" / "config.yaml").is_file():
        cfg = yaml.safe_load((d / ".hydra" / "config.yaml").read_text())
    status = summary.get("status", "incomplete")
    err = summary.get("error", "")
    if not err and (d / "error.txt").is_file():
        err = (d / "error.txt").read_text().strip().splitlines()[-1]
    return {
        "job": str(d.relative_to(root)), "dir": d, "status": status, "overrides": overrides,
        "metrics": summary.get("metrics", {}), "summary": summary, "config": cfg or {}, "error": err,
        "curves": _read_curves(d / "csv" / "metrics.csv"),
    }


def _ov_key(o: str) -> str:
    return o.split("=", 1)[0].lstrip("+~")


def annotate(jobs: list[dict]) -> None:
    """Adds 'label' (the overrides that vary across jobs), 'variant' (label minus lr/seed), 'mixer'."""
    values: dict[str, set] = {}
    for j in jobs:
        for o in j["overrides"]:
            values.setdefault(_ov_key(o), set()).add(o)
    varying = {k for k, v in values.items() if len(v) > 1 or sum(1 for j in jobs if any(_ov_key(o) == k for o in j["overrides"])) < len(jobs)}
    for j in jobs:
        sweep_ov = [o for o in j["overrides"] if not o.startswith(_FIXED_PREFIXES)]
        label = [o for o in sweep_ov if _ov_key(o) in varying] or sweep_ov
        j["label"] = " ".join(label) or j["job"]
        j["variant"] = " ".join(o for o in label if _ov_key(o) not in _LR_KEYS) or "all"
        j["mixer"] = mixer_name(j)
        j["lr"] = (j["config"].get("optim") or {}).get("lr")


def mixer_name(job: dict) -> str:
    model = job["summary"].get("model") or {}
    kinds = model.get("mixers")
    if kinds:
        return kinds[0] if len(set(kinds)) == 1 else "[" + ",".join(kinds) + "]"
    mcfg = (job["config"].get("model") or {})
    return str((mcfg.get("mixer") or {}).get("name", "?"))


def primary_metric(jobs: list[dict]) -> tuple[str, bool]:
    """('val/acc', True) when any job reports accuracy (higher is better), else ('val/loss', False)."""
    if any("val/acc" in j["metrics"] for j in jobs):
        return "val/acc", True
    return "val/loss", False


def best_per_variant(jobs: list[dict]) -> list[dict]:
    """One job per variant: the best successful one by the primary metric (the failed one if all failed)."""
    key, higher = primary_metric(jobs)
    groups: dict[str, list[dict]] = {}
    for j in jobs:
        groups.setdefault(j["variant"], []).append(j)
    best = []
    for members in groups.values():
        ok = [j for j in members if j["status"] == "ok" and _finite(j["metrics"].get(key))]
        if not ok:
            best.append({**members[0], "n_lr": len(members)})
            continue
        pick = max(ok, key=lambda j: j["metrics"][key]) if higher else min(ok, key=lambda j: j["metrics"][key])
        best.append({**pick, "n_lr": len(members)})
    return best


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


# ----------------------------------------------------------------------------- tables


def metric_columns(jobs: list[dict]) -> list[str]:
    present = {k for j in jobs for k in j["metrics"]}
    return [k for k in METRIC_ORDER if k in present] + sorted(present - set(METRIC_ORDER))


def write_csv(jobs: list[dict], path: Path) -> None:
    cols = metric_columns(jobs)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["job", "status", "overrides", "mixer", "lr", *cols, "global_step", "wall_seconds", "error"])
        for j in jobs:
            m = j["metrics"]
            w.writerow([j["job"], j["status"], " ".join(j["overrides"]), j["mixer"], _raw(j["lr"]),
                        *[_raw(m.get(c)) for c in cols], _raw(j["summary"].get("global_step")),
                        _raw(j["summary"].get("wall_seconds")), j["error"]])


def _raw(v: Any) -> str:
    """Full precision (repr round-trips a float exactly), so the CSV equals summary.json."""
    return "" if v is None else repr(v) if isinstance(v, float) else str(v)


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:,.0f}"
    return str(v)


def markdown_table(rows: list[dict], cols: list[str], extra: list[tuple[str, Any]] = ()) -> str:
    head = ["job", "variant" if extra else "overrides", "mixer", "status", *[h for h, _ in extra], *cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for j in rows:
        status = j["status"] if j["status"] == "ok" else f"**{j['status'].upper()}**"
        cells = [j["job"], (j["variant"] if extra else j["label"]).replace("|", "\\|"), j["mixer"], status,
                 *[_fmt(fn(j)) for _, fn in extra], *[_fmt(j["metrics"].get(c)) for c in cols]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def failures_md(jobs: list[dict]) -> str:
    bad = [j for j in jobs if j["status"] != "ok"]
    if not bad:
        return ""
    return "\n".join(["## Failed jobs", ""] + [f"- job {j['job']} ({j['label']}): {j['status']}: {j['error']}" for j in bad]) + "\n"


# ----------------------------------------------------------------------------- plots


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_curves(best: list[dict], path: Path) -> bool:
    keys = [k for k in ("train/loss", "val/loss", "val/acc") if any(k in j["curves"] for j in best)]
    if not keys:
        return False
    plt = _plt()
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4), squeeze=False)
    for ax, k in zip(axes[0], keys):
        for j in best:
            pts = j["curves"].get(k)
            if pts:
                ax.plot([s for s, _ in pts], [v for _, v in pts], marker="." if len(pts) < 30 else None, label=j["variant"])
        ax.set_xlabel("step")
        ax.set_title(k)
        ax.grid(alpha=0.3)
    if len(best) <= 24:
        axes[0][-1].legend(fontsize=6, loc="best")
    fig.suptitle("curves per variant (best learning rate)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def plot_acc_vs_cache(best: list[dict], metric: str, path: Path) -> bool:
    pts = [j for j in best if _finite(j["metrics"].get(metric)) and _finite(j["metrics"].get("cache/bytes_per_token"))]
    if not pts:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 5))
    for j in pts:
        x, y = j["metrics"]["cache/bytes_per_token"], j["metrics"][metric]
        ax.scatter(x, y)
        ax.annotate(j["variant"], (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("cache/bytes_per_token (analytic, batch 1)")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} vs inference cache (best lr per variant)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def plot_tokens_per_sec(best: list[dict], path: Path) -> bool:
    pts = [j for j in best if _finite(j["metrics"].get("perf/tokens_per_sec"))]
    if not pts:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(pts) + 1.5))
    ax.barh([j["variant"] for j in pts], [j["metrics"]["perf/tokens_per_sec"] for j in pts])
    ax.set_xlabel("perf/tokens_per_sec (training)")
    ax.tick_params(axis="y", labelsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _pairs(j: dict):
    data = j["summary"].get("data") or {}
    return data.get("num_kv_pairs", (j["config"].get("data") or {}).get("num_kv_pairs"))


def plot_mqar_difficulty(jobs: list[dict], path: Path) -> bool:
    """Best val/acc (over every other swept setting, i.e. best-of-lr) vs pairs, a line per mixer, a panel per width."""
    mq = [j for j in jobs if (j["summary"].get("data") or {}).get("name") == "mqar" and j["status"] == "ok"
          and _finite(j["metrics"].get("val/acc")) and _pairs(j) is not None]
    if not mq:
        return False
    widths = sorted({(j["summary"].get("model") or {}).get("d_model") for j in mq}, key=lambda w: w or 0)
    plt = _plt()
    fig, axes = plt.subplots(1, len(widths), figsize=(5 * len(widths), 4), squeeze=False, sharey=True)
    for ax, w in zip(axes[0], widths):
        best: dict[str, dict[int, float]] = {}
        for j in mq:
            if (j["summary"].get("model") or {}).get("d_model") != w:
                continue
            n, acc = int(_pairs(j)), j["metrics"]["val/acc"]
            best.setdefault(j["mixer"], {})
            best[j["mixer"]][n] = max(acc, best[j["mixer"]].get(n, -1.0))
        for mixer, by_n in sorted(best.items()):
            ns = sorted(by_n)
            ax.plot(ns, [by_n[n] for n in ns], marker="o", label=mixer)
        ax.set_xlabel("key-value pairs (N)")
        ax.set_title(f"MQAR, d_model={w}")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("val/acc (best lr)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def plot_recall_vs_state(jobs: list[dict], path: Path) -> bool:
    """Zoology's headline view (Arora et al. 2023, Fig. 2): MQAR accuracy vs the state a mixer holds at the
    task's context (`cache/bytes_at_ctx`, measured by a real prefill), a line per mixer through its widths,
    a panel per number of key-value pairs. Best learning rate per (mixer, N, d_model)."""
    mq = [j for j in jobs if (j["summary"].get("data") or {}).get("name") == "mqar" and j["status"] == "ok"
          and _finite(j["metrics"].get("val/acc")) and _finite(j["metrics"].get("cache/bytes_at_ctx"))
          and _pairs(j) is not None]
    if not mq:
        return False
    best: dict[tuple, dict] = {}  # (N, mixer, d_model) -> the best job
    for j in mq:
        key = (int(_pairs(j)), j["mixer"], (j["summary"].get("model") or {}).get("d_model"))
        if key not in best or j["metrics"]["val/acc"] > best[key]["metrics"]["val/acc"]:
            best[key] = j
    ns = sorted({k[0] for k in best})
    mixers = sorted({k[1] for k in best})
    plt = _plt()
    colors = plt.get_cmap("tab10")
    fig, axes = plt.subplots(1, len(ns), figsize=(4.5 * len(ns), 4.2), squeeze=False, sharey=True)
    for ax, n in zip(axes[0], ns):
        for i, mixer in enumerate(mixers):
            pts = sorted((j["metrics"]["cache/bytes_at_ctx"], j["metrics"]["val/acc"])
                         for (kn, km, _), j in best.items() if kn == n and km == mixer)
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", color=colors(i % 10), label=mixer)
        ax.set_xscale("log")
        ax.set_xlabel("state size: cache/bytes_at_ctx (bytes)")
        ax.set_title(f"MQAR, N={n} key-value pairs")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("val/acc (best lr)")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.suptitle("recall vs state size (points: model widths)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------- report


def build_report(root: str | Path) -> dict:
    """Write report.csv/.md/.html and plots/ into `root`; return {'jobs': [...], 'files': {...}}."""
    root = Path(root)
    dirs = _job_dirs(root)
    if not dirs:
        raise FileNotFoundError(f"no job directories (with .hydra/overrides.yaml or summary.json) under {root}")
    jobs = [load_job(d, root) for d in dirs]
    annotate(jobs)
    best = best_per_variant(jobs)
    metric, _ = primary_metric(jobs)
    cols = [c for c in MD_METRICS if c in metric_columns(jobs)]

    plots_dir = root / "plots"
    plots_dir.mkdir(exist_ok=True)
    plots = {}
    for name, ok in [
        ("curves.png", plot_curves(best, plots_dir / "curves.png")),
        ("acc_vs_cache.png", plot_acc_vs_cache(best, metric, plots_dir / "acc_vs_cache.png")),
        ("tokens_per_sec.png", plot_tokens_per_sec(best, plots_dir / "tokens_per_sec.png")),
        ("mqar_difficulty.png", plot_mqar_difficulty(jobs, plots_dir / "mqar_difficulty.png")),
        ("recall_vs_state.png", plot_recall_vs_state(jobs, plots_dir / "recall_vs_state.png")),
    ]:
        if ok:
            plots[name] = plots_dir / name

    write_csv(jobs, root / "report.csv")
    n_ok = sum(j["status"] == "ok" for j in jobs)
    command = _sweep_command(root)
    best_md = markdown_table(best, cols, extra=[("best lr", lambda j: j["lr"]), ("lrs", lambda j: j["n_lr"])])
    all_md = markdown_table(jobs, cols)
    md = [f"# Sweep report: {root.name}", ""]
    if command:
        md += [f"Command: `{command}`", ""]
    md += [f"{len(jobs)} jobs, {n_ok} ok, {len(jobs) - n_ok} failed or incomplete. Ranking metric: `{metric}`.", "",
           "## Best learning rate per variant", "", best_md, "", "## All jobs", "", all_md, "", failures_md(jobs)]
    md += [f"![{p}](plots/{p})" for p in plots]
    (root / "report.md").write_text("\n".join(md) + "\n")
    (root / "report.html").write_text(_html(root.name, command, jobs, best, cols, plots, metric))
    return {"jobs": jobs, "best": best, "files": {"csv": root / "report.csv", "md": root / "report.md",
                                                  "html": root / "report.html", **plots}}


def _sweep_command(root: Path) -> str:
    mr = root / "multirun.yaml"
    if not mr.is_file():
        return ""
    try:
        task = yaml.safe_load(mr.read_text())["hydra"]["overrides"]["task"]
    except Exception:  # noqa: BLE001 - the command line is a nicety
        return ""
    sweep = next((o.split("=", 1)[1] for o in task if o.startswith(("+sweeps=", "sweeps="))), None)
    rest = [o for o in task if not o.startswith(("+sweeps=", "sweeps=", "hydra.searchpath"))]
    return (f"attnzoo-sweep {sweep} " if sweep else "attnzoo-train -m ") + " ".join(rest)


def _html_table(rows: list[dict], cols: list[str], best: bool) -> str:
    head = ["job", "variant" if best else "overrides", "mixer", "status"] + (["best lr", "lrs"] if best else []) + cols
    out = ["<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"]
    for j in rows:
        cls = "" if j["status"] == "ok" else " class='failed'"
        cells = [j["job"], j["variant"] if best else j["label"], j["mixer"], j["status"]]
        cells += [_fmt(j["lr"]), str(j["n_lr"])] if best else []
        cells += [_fmt(j["metrics"].get(c)) for c in cols]
        out.append(f"<tr{cls}>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    return "\n".join(out + ["</table>"])


def _html(title, command, jobs, best, cols, plots, metric) -> str:
    imgs = "".join(
        f"<h3>{html.escape(name)}</h3><img src='data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}'/>"
        for name, p in plots.items()
    )
    fails = "".join(f"<li>job {html.escape(j['job'])} ({html.escape(j['label'])}): {html.escape(j['error'])}</li>"
                    for j in jobs if j["status"] != "ok")
    return f"""<!doctype html><html><head><meta charset='utf-8'><title>attnzoo sweep {html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse;font-size:12px}}
td,th{{border:1px solid #ccc;padding:3px 6px}} tr.failed td{{background:#fdd}} img{{max-width:100%}}</style></head><body>
<h1>Sweep report: {html.escape(title)}</h1>
<p>Command: <code>{html.escape(command)}</code></p>
<p>{len(jobs)} jobs; ranking metric <code>{html.escape(metric)}</code>.</p>
<h2>Best learning rate per variant</h2>{_html_table(best, cols, True)}
<h2>All jobs</h2>{_html_table(jobs, cols, False)}
{f'<h2>Failed jobs</h2><ul>{fails}</ul>' if fails else ''}
<h2>Plots</h2>{imgs}
</body></html>
"""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="attnzoo-report", description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep_dir", help="a Hydra multirun directory (e.g. multirun/mixers_2025-01-01_12-00-00)")
    args = ap.parse_args(argv)
    try:
        res = build_report(args.sweep_dir)
    except FileNotFoundError as e:
        ap.exit(2, f"attnzoo-report: error: {e}\n")
    f = res["files"]
    print(f"{len(res['jobs'])} jobs -> {f['md']}, {f['csv']}, {f['html']} ({len(f) - 3} plots)")


if __name__ == "__main__":
    main()
