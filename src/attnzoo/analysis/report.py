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

A *variant* is a job's swept overrides minus `optim.lr` and `seed`; its best learning rate is the one with the
best `val/acc` (max) or, without accuracy, `val/loss` (min) — the Zoology convention of best-of-lr — averaged
over seeds when seeds are swept (the row then shows the means and the spread).
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
_AXIS_KEYS = ("data.num_kv_pairs", "model.d_model")  # the axes / panels of the MQAR plots


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
    keys = [k for k in varying if k not in _LR_KEYS and not any(o.startswith(_FIXED_PREFIXES) for o in values[k])]
    # the colour of a series: the swept mixer if it varies, else the first other swept key (kv heads, window...)
    color_key = "model/mixer" if "model/mixer" in keys else next((k for k in keys if k not in _AXIS_KEYS), None)
    for j in jobs:
        sweep_ov = [o for o in j["overrides"] if not o.startswith(_FIXED_PREFIXES)]
        label = [o for o in sweep_ov if _ov_key(o) in varying] or sweep_ov
        j["label"] = " ".join(label) or j["job"]
        j["variant"] = " ".join(o for o in label if _ov_key(o) not in _LR_KEYS) or "all"
        j["mixer"] = mixer_name(j)
        j["lr"] = (j["config"].get("optim") or {}).get("lr")
        var = [o for o in label if _ov_key(o) not in _LR_KEYS]
        j["series"] = " ".join(_short(o) for o in var if _ov_key(o) == color_key) or j["mixer"]
        j["facet"] = " ".join(_short(o) for o in var if _ov_key(o) != color_key) or "all"
        # MQAR plots put pairs and width on their axes: a line is everything else that varies
        j["line"] = " ".join(_short(o) for o in var if _ov_key(o) not in _AXIS_KEYS) or j["mixer"]


def _short(o: str) -> str:
    """'model/mixer=gqa' -> 'gqa'; 'model.n_kv_heads=2' -> 'n_kv_heads=2' (labels that fit a legend)."""
    key, _, value = o.lstrip("+~").partition("=")
    if "/" in key:
        return value
    return f"{key.rsplit('.', 1)[-1]}={value}"


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
    """One row per variant: the best learning rate by the primary metric (the failed job if all failed).
    When seeds are swept, a learning rate's score is its mean over seeds, and the row's metrics are those
    means, with `spread` = {metric: sample std over seeds} and `n_seeds` (one run: no spread)."""
    key, higher = primary_metric(jobs)
    groups: dict[str, list[dict]] = {}
    for j in jobs:
        groups.setdefault(j["variant"], []).append(j)
    best = []
    for members in groups.values():
        ok = [j for j in members if j["status"] == "ok" and _finite(j["metrics"].get(key))]
        n_lr = len({str(j["lr"]) for j in members})
        if not ok:
            best.append({**members[0], "n_lr": n_lr, "n_seeds": 1, "spread": {}})
            continue
        by_lr: dict[str, list[dict]] = {}
        for j in ok:
            by_lr.setdefault(str(j["lr"]), []).append(j)
        mean = lambda runs, k: sum(r["metrics"][k] for r in runs) / len(runs)  # noqa: E731
        pick = (max if higher else min)(by_lr.values(), key=lambda runs: mean(runs, key))
        first = max(pick, key=lambda j: j["metrics"][key]) if higher else min(pick, key=lambda j: j["metrics"][key])
        row = {**first, "n_lr": n_lr, "n_seeds": len(pick), "spread": {}}
        if len(pick) > 1:
            keys = [k for k in first["metrics"] if all(_finite(r["metrics"].get(k)) for r in pick)]
            row["metrics"] = {k: mean(pick, k) for k in keys}
            row["spread"] = {k: (sum((r["metrics"][k] - row["metrics"][k]) ** 2 for r in pick) / (len(pick) - 1)) ** 0.5
                             for k in keys}
        best.append(row)
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
        w.writerow(["job", "status", "overrides", "mixer", "layers", "lr", *cols, "global_step", "wall_seconds", "error"])
        for j in jobs:
            m = j["metrics"]
            w.writerow([j["job"], j["status"], " ".join(j["overrides"]), j["mixer"], layers_text(j), _raw(j["lr"]),
                        *[_raw(m.get(c)) for c in cols], _raw(j["summary"].get("global_step")),
                        _raw(j["summary"].get("wall_seconds")), j["error"]])


def _raw(v: Any) -> str:
    """Full precision (repr round-trips a float exactly), so the CSV equals summary.json."""
    return "" if v is None else repr(v) if isinstance(v, float) else str(v)


_SHAPE_ABBREV = {"n_heads": "h", "n_kv_heads": "kv", "head_dim": "d", "window": "W", "conv": "conv"}


def layers_text(j: dict) -> str:
    """What the job's layers really were (summary.json's per-layer shapes), compact: runs of equal layers
    as `4x gqa h4 kv2 d32`, joined by ' + ' in stack order."""
    layers = ((j.get("summary") or {}).get("model") or {}).get("layers") or []
    runs: list[list] = []
    for shape in layers:
        desc = " ".join([str(shape.get("mixer", "?"))] + [
            f"{_SHAPE_ABBREV.get(k, k + '=')}{'x'.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in shape.items() if k != "mixer"])
        if runs and runs[-1][1] == desc:
            runs[-1][0] += 1
        else:
            runs.append([1, desc])
    return " + ".join(f"{n}x {d}" for n, d in runs)


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):  # counts (params, bytes, tokens/s) with thousands separators, rates to 4 digits
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def markdown_table(rows: list[dict], cols: list[str], extra: list[tuple[str, Any]] = ()) -> str:
    """The best-of-lr table (`extra` columns) or the all-jobs table (with each job's built layers)."""
    extra = list(extra) or [("layers", layers_text)]
    head = ["job", "variant" if extra[0][0] != "layers" else "overrides", "mixer", "status", *[h for h, _ in extra], *cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for j in rows:
        status = j["status"] if j["status"] == "ok" else f"**{j['status'].upper()}**"
        cells = [j["job"], (j["variant"] if extra[0][0] != "layers" else j["label"]).replace("|", "\\|"), j["mixer"], status,
                 *[_fmt(fn(j)) for _, fn in extra], *[_fmt(j["metrics"].get(c)) for c in cols]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def length_rows(best: list[dict], metric: str) -> tuple[list[int], list[list[str]]]:
    """The length-extrapolation table (eval.context_lengths): per best variant, the ranking metric at the
    training length and at every evaluated one, then the cache bytes and the decode rate at each of them."""
    import re

    lengths = sorted({int(m.group(1)) for j in best for k in j["metrics"]
                      if (m := re.fullmatch(re.escape(metric) + r"@(\d+)", k))})
    if not lengths:
        return [], []
    rows = []
    for j in best:
        m = j["metrics"]
        L0 = (j["summary"].get("data") or {}).get("seq_len") or j["summary"].get("context_len")
        cells = [j["variant"].replace("|", "\\|"), j["mixer"], _fmt(L0), _fmt(m.get(metric))]
        cells += [_fmt(m.get(f"{metric}@{L}")) for L in lengths]
        cells += [_fmt(m.get(f"cache/bytes_at_ctx@{L}")) for L in lengths]
        cells += [_fmt(m.get(f"perf/decode_tokens_per_sec@{L}")) for L in lengths]
        rows.append(cells)
    return lengths, rows


def length_head(metric: str, lengths: list[int]) -> list[str]:
    return (["variant", "mixer", "trained at", metric] + [f"{metric}@{L}" for L in lengths]
            + [f"cache bytes@{L}" for L in lengths] + [f"decode tok/s@{L}" for L in lengths])


def lengths_md(best: list[dict], metric: str) -> str:
    lengths, rows = length_rows(best, metric)
    if not rows:
        return ""
    head = length_head(metric, lengths)
    lines = ["## Length extrapolation", "",
             f"`{metric}` at the training length and at each `eval.context_lengths` entry; the inference cache "
             "(bytes, batch 1) and the batch-1 decode rate after a prefill of that length.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


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


def _no_labels():
    from matplotlib.ticker import NullFormatter

    return NullFormatter()


def _compact(x: float) -> str:
    for div, unit in ((2**30, "Gi"), (2**20, "Mi"), (2**10, "Ki")):
        if x >= div and x % (div // 16) == 0:
            return f"{x / div:g}{unit}"
    return f"{x:,.0f}" if x >= 1 and float(x).is_integer() else f"{x:.3g}"


def _ticks_at_data(ax, most: int = 8) -> None:
    """A log axis whose data sit inside one decade has no labelled (major) tick: label the data's own x values
    instead when there are few of them (cache bytes, context lengths)."""
    import numpy as np

    xs = set()
    for line in ax.get_lines():
        xs.update(float(x) for x in np.asarray(line.get_xdata(), dtype=float) if np.isfinite(x) and x > 0)
    for coll in ax.collections:
        xs.update(float(x) for x in np.asarray(coll.get_offsets())[:, 0] if np.isfinite(x) and x > 0)
    if 0 < len(xs) <= most:
        ticks = sorted(xs)
        ax.set_xticks(ticks)
        ax.set_xticklabels([_compact(x) for x in ticks])


def _colors(names: list[str]) -> dict:
    plt = _plt()
    cmap = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")
    return {n: cmap(i % cmap.N) for i, n in enumerate(names)}


def _facet_grid(facets: list[str], width: float = 4.2, height: float = 3.4):
    """A grid of panels, one per facet (at most 4 columns), with room on the right for a shared legend."""
    plt = _plt()
    ncols = min(4, len(facets))
    nrows = math.ceil(len(facets) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols + 1.8, height * nrows + 0.6), squeeze=False)
    flat = list(axes.flat)
    for ax in flat[len(facets):]:
        ax.set_visible(False)
    return fig, flat[: len(facets)]


def _shared_legend(fig, colors: dict, title: str) -> None:
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=c, marker="o", label=n) for n, c in colors.items()]
    fig.legend(handles=handles, loc="center right", title=title, fontsize=8, title_fontsize=8, frameon=False)


def _sort_key(text: str):
    """Facets and series in natural order ('N=4' before 'N=16')."""
    import re

    return [(0, float(t), "") if re.fullmatch(r"-?\d+(\.\d+)?", t) else (1, 0.0, t) for t in re.split(r"[=\s]+", text)]


def _faceted_plot(items: list[dict], draw, *, xlabel: str, ylabel: str, title: str, path: Path,
                  xscale: str | None = None, xbase: int = 10) -> bool:
    """One panel per facet of `items` (jobs, with 'facet' and 'series'), `draw(ax, job, color)` per job,
    one colour per series and one shared legend; the same layout for every faceted plot of the report."""
    facets = sorted({j["facet"] for j in items}, key=_sort_key)
    colors = _colors(sorted({j["series"] for j in items}, key=_sort_key))
    fig, axes = _facet_grid(facets)
    for ax, facet in zip(axes, facets):
        for j in items:
            if j["facet"] == facet:
                draw(ax, j, colors[j["series"]])
        if xscale:
            ax.set_xscale(xscale, base=xbase)
            ax.xaxis.set_minor_formatter(_no_labels())  # minor log ticks labelled "3x10^2 4x10^2" overlap
            _ticks_at_data(ax)
        ax.set_title(facet, fontsize=9)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    _shared_legend(fig, colors, "series")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1 - 1.8 / fig.get_figwidth(), 1))
    fig.savefig(path, dpi=100)
    _plt().close(fig)
    return True


def plot_curves(best: list[dict], metric: str, path: Path) -> bool:
    """The ranking metric vs step, best lr per variant: one panel per facet (the swept settings other than
    the colour key), one colour per series (mixer, or the first other swept key), one shared legend."""
    best = [j for j in best if j["curves"].get(metric)]
    if not best:
        return False

    def draw(ax, j, color):
        pts = j["curves"][metric]
        ax.plot([s for s, _ in pts], [v for _, v in pts], color=color, lw=1.2, marker="." if len(pts) < 30 else None)

    return _faceted_plot(best, draw, xlabel="step", ylabel=metric, path=path,
                         title=f"{metric} vs step (best learning rate per variant)")


def plot_acc_vs_cache(best: list[dict], metric: str, path: Path) -> bool:
    """The recall / memory trade-off: metric vs analytic cache bytes per token, one panel per facet,
    colours per series (a legend instead of point labels, so nothing overlaps)."""
    pts = [j for j in best if _finite(j["metrics"].get(metric)) and _finite(j["metrics"].get("cache/bytes_per_token"))]
    if not pts:
        return False
    return _faceted_plot(
        pts, lambda ax, j, c: ax.scatter(j["metrics"]["cache/bytes_per_token"], j["metrics"][metric], color=c, s=30),
        xlabel="cache/bytes_per_token", ylabel=metric, xscale="log", path=path,
        title=f"{metric} vs inference cache (best learning rate per variant)")


def plot_tokens_per_sec(best: list[dict], path: Path) -> bool:
    pts = [j for j in best if _finite(j["metrics"].get("perf/tokens_per_sec"))]
    if not pts:
        return False
    pts.sort(key=lambda j: (_sort_key(j["facet"]), _sort_key(j["series"])))
    colors = _colors(sorted({j["series"] for j in pts}, key=_sort_key))
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 0.24 * len(pts) + 1.6))
    labels = [f"{j['series']} | {j['facet']}" if j["facet"] != "all" else j["series"] for j in pts]
    ax.barh(range(len(pts)), [j["metrics"]["perf/tokens_per_sec"] for j in pts],
            color=[colors[j["series"]] for j in pts])
    ax.set_yticks(range(len(pts)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("perf/tokens_per_sec (training)")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def plot_lengths(best: list[dict], metric: str, path: Path) -> bool:
    """Length extrapolation (eval.context_lengths): the metric at every evaluated length, the training
    length included, a line per series, a panel per facet."""
    import re

    def points(j):
        pts = {int(m.group(1)): v for k, v in j["metrics"].items()
               if (m := re.fullmatch(re.escape(metric) + r"@(\d+)", k)) and _finite(v)}
        L = (j["summary"].get("data") or {}).get("seq_len") or j["summary"].get("context_len")
        if pts and L and _finite(j["metrics"].get(metric)):
            pts[int(L)] = j["metrics"][metric]
        return sorted(pts.items())

    rows = [dict(j, length_points=points(j)) for j in best]
    rows = [j for j in rows if len(j["length_points"]) > 1]
    if not rows:
        return False

    def draw(ax, j, color):
        pts = j["length_points"]
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", color=color)

    return _faceted_plot(rows, draw, xlabel="evaluation context length", ylabel=metric, xscale="log", xbase=2,
                         path=path, title=f"{metric} vs context length (trained at data.seq_len)")


def _pairs(j: dict):
    data = j["summary"].get("data") or {}
    return data.get("num_kv_pairs", (j["config"].get("data") or {}).get("num_kv_pairs"))


def _mqar_jobs(jobs: list[dict], extra: str | None = None) -> list[dict]:
    return [j for j in jobs if (j["summary"].get("data") or {}).get("name") == "mqar" and j["status"] == "ok"
            and _finite(j["metrics"].get("val/acc")) and _pairs(j) is not None
            and (extra is None or _finite(j["metrics"].get(extra)))]


def _width(j: dict):
    return (j["summary"].get("model") or {}).get("d_model")


def plot_mqar_difficulty(jobs: list[dict], path: Path) -> bool:
    """Best val/acc (over every other swept setting, i.e. best-of-lr) vs pairs, a line per series (mixer,
    or e.g. n_kv_heads=2 in the kv_heads sweep), a panel per width, one shared legend."""
    mq = _mqar_jobs(jobs)
    if not mq:
        return False
    widths = sorted({_width(j) for j in mq}, key=lambda w: w or 0)
    colors = _colors(sorted({j["line"] for j in mq}, key=_sort_key))
    fig, axes = _facet_grid([f"d_model={w}" for w in widths], width=4.6, height=3.8)
    for ax, w in zip(axes, widths):
        best: dict[str, dict[int, float]] = {}
        for j in mq:
            if _width(j) == w:
                by_n = best.setdefault(j["line"], {})
                n = int(_pairs(j))
                by_n[n] = max(j["metrics"]["val/acc"], by_n.get(n, -1.0))
        for line, by_n in best.items():
            ns = sorted(by_n)
            ax.plot(ns, [by_n[n] for n in ns], marker="o", color=colors[line])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("key-value pairs (N)", fontsize=8)
        ax.set_ylabel("val/acc (best lr)", fontsize=8)
        ax.set_title(f"MQAR, d_model={w}", fontsize=9)
        ax.set_ylim(-0.02, 1.02)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    _shared_legend(fig, colors, "series")
    fig.tight_layout(rect=(0, 0, 1 - 1.8 / fig.get_figwidth(), 1))
    fig.savefig(path, dpi=100)
    _plt().close(fig)
    return True


def plot_recall_vs_state(jobs: list[dict], path: Path) -> bool:
    """Zoology's headline view (Arora et al. 2023, Fig. 2): MQAR accuracy vs the state a mixer holds at the
    task's context (`cache/bytes_at_ctx`, measured by a real prefill), a line per series through its widths,
    a panel per number of key-value pairs. Best learning rate per (series, N, d_model)."""
    mq = _mqar_jobs(jobs, "cache/bytes_at_ctx")
    if not mq:
        return False
    best: dict[tuple, dict] = {}  # (N, line, d_model) -> the best job
    for j in mq:
        key = (int(_pairs(j)), j["line"], _width(j))
        if key not in best or j["metrics"]["val/acc"] > best[key]["metrics"]["val/acc"]:
            best[key] = j
    ns = sorted({k[0] for k in best})
    colors = _colors(sorted({k[1] for k in best}, key=_sort_key))
    fig, axes = _facet_grid([f"N={n}" for n in ns], width=4.4, height=3.8)
    for ax, n in zip(axes, ns):
        for line, color in colors.items():
            pts = sorted((j["metrics"]["cache/bytes_at_ctx"], j["metrics"]["val/acc"])
                         for (kn, kl, _), j in best.items() if kn == n and kl == line)
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", color=color)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(_no_labels())
        ax.set_xlabel("state size: cache/bytes_at_ctx (bytes)", fontsize=8)
        ax.set_ylabel("val/acc (best lr)", fontsize=8)
        ax.set_title(f"MQAR, N={n} key-value pairs", fontsize=9)
        ax.set_ylim(-0.02, 1.02)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    _shared_legend(fig, colors, "series")
    fig.suptitle("recall vs state size (points: model widths)", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1 - 1.8 / fig.get_figwidth(), 1))
    fig.savefig(path, dpi=100)
    _plt().close(fig)
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
        ("curves.png", plot_curves(best, metric, plots_dir / "curves.png")),
        ("acc_vs_cache.png", plot_acc_vs_cache(best, metric, plots_dir / "acc_vs_cache.png")),
        ("tokens_per_sec.png", plot_tokens_per_sec(best, plots_dir / "tokens_per_sec.png")),
        ("mqar_difficulty.png", plot_mqar_difficulty(jobs, plots_dir / "mqar_difficulty.png")),
        ("recall_vs_state.png", plot_recall_vs_state(jobs, plots_dir / "recall_vs_state.png")),
        ("lengths.png", plot_lengths(best, metric, plots_dir / "lengths.png")),
    ]:
        if ok:
            plots[name] = plots_dir / name

    write_csv(jobs, root / "report.csv")
    n_ok = sum(j["status"] == "ok" for j in jobs)
    command = _sweep_command(root)
    extra = [("best lr", lambda j: j["lr"]), ("lrs", lambda j: j["n_lr"])]
    seeds = max(j["n_seeds"] for j in best) > 1
    if seeds:  # mean over seeds of the best lr, with the spread of the ranking metric
        extra += [("seeds", lambda j: j["n_seeds"]), (f"{metric} std", lambda j: j["spread"].get(metric))]
    best_md = markdown_table(best, cols, extra=extra)
    all_md = markdown_table(jobs, cols)
    md = [f"# Sweep report: {root.name}", ""]
    if command:
        md += [f"Command: `{command}`", ""]
    md += [f"{len(jobs)} jobs, {n_ok} ok, {len(jobs) - n_ok} failed or incomplete. Ranking metric: `{metric}`"
           + (" (best-of-lr rows: means over seeds, with the standard deviation)." if seeds else "."), "",
           "## Best learning rate per variant", "", best_md, "", lengths_md(best, metric), "## All jobs", "", all_md,
           "", failures_md(jobs)]
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
    rest.append(f"hydra.sweep.dir={root}")  # the rerun that skips finished jobs goes into the same dir
    return (f"attnzoo-sweep {sweep} " if sweep else "attnzoo-train -m ") + " ".join(rest)


def _html_table(rows: list[dict], cols: list[str], best: bool, table_id: str) -> str:
    head = ["job", "variant" if best else "overrides", "mixer", "status"] + (["best lr", "lrs"] if best else ["layers"]) + cols
    out = [f"<input class='filter' data-table='{table_id}' placeholder='filter rows: any text, e.g. gqa or num_kv_pairs=16'/>",
           f"<table id='{table_id}'><thead><tr>" + "".join(f"<th title='click to sort'>{html.escape(h)}</th>" for h in head)
           + "</tr></thead><tbody>"]
    for j in rows:
        cls = "" if j["status"] == "ok" else " class='failed'"
        cells = [j["job"], j["variant"] if best else j["label"], j["mixer"], j["status"]]
        cells += [_fmt(j["lr"]), str(j["n_lr"])] if best else [layers_text(j)]
        vals = [None] * len(cells) + [j["metrics"].get(c) for c in cols]
        spread = j.get("spread", {}) if best else {}
        cells += [_fmt(j["metrics"].get(c)) + (f" ± {_fmt(spread[c])}" if c in spread else "") for c in cols]
        tds = "".join(f"<td{'' if v is None or not _finite(v) else f' data-v={v!r}'}>{html.escape(str(c))}</td>"
                      for c, v in zip(cells, vals))
        out.append(f"<tr{cls}>{tds}</tr>")
    return "\n".join(out + ["</tbody></table>"])


def _svg_scatter(best: list[dict], metric: str, width: int = 760, height: int = 440) -> str:
    """An interactive (offline, no library) scatter of the ranking metric vs cache bytes per token: one
    circle per variant, coloured by series; hover shows the job's overrides and metrics; the table filters
    also dim the circles that do not match."""
    pts = [j for j in best if _finite(j["metrics"].get(metric)) and _finite(j["metrics"].get("cache/bytes_per_token"))
           and j["metrics"]["cache/bytes_per_token"] > 0]
    if not pts:
        return ""
    from matplotlib.colors import to_hex

    colors = {k: to_hex(v) for k, v in _colors(sorted({j["series"] for j in pts}, key=_sort_key)).items()}
    xs = [math.log10(j["metrics"]["cache/bytes_per_token"]) for j in pts]
    ys = [j["metrics"][metric] for j in pts]
    x0, x1 = math.floor(min(xs)), math.ceil(max(xs)) if max(xs) > math.floor(min(xs)) else math.floor(min(xs)) + 1
    y0, y1 = min(0.0, min(ys)), max(ys) * 1.05 if max(ys) > 0 else 1.0
    L, R, T, B = 60, 170, 20, 45
    sx = lambda x: L + (x - x0) / (x1 - x0) * (width - L - R)  # noqa: E731
    sy = lambda y: height - B - (y - y0) / ((y1 - y0) or 1) * (height - T - B)  # noqa: E731
    parts = [f"<svg id='scatter' width='{width}' height='{height}' font-size='11' font-family='sans-serif'>",
             f"<rect x='{L}' y='{T}' width='{width - L - R}' height='{height - T - B}' fill='none' stroke='#999'/>"]
    for e in range(x0, x1 + 1):
        parts.append(f"<line x1='{sx(e):.1f}' x2='{sx(e):.1f}' y1='{T}' y2='{height - B}' stroke='#eee'/>"
                     f"<text x='{sx(e):.1f}' y='{height - B + 15}' text-anchor='middle'>1e{e}</text>")
    for k in range(6):
        y = y0 + (y1 - y0) * k / 5
        parts.append(f"<line x1='{L}' x2='{width - R}' y1='{sy(y):.1f}' y2='{sy(y):.1f}' stroke='#eee'/>"
                     f"<text x='{L - 6}' y='{sy(y) + 4:.1f}' text-anchor='end'>{y:.3g}</text>")
    parts.append(f"<text x='{(L + width - R) / 2}' y='{height - 8}' text-anchor='middle'>cache/bytes_per_token (log)</text>"
                 f"<text transform='translate(14,{(T + height - B) / 2}) rotate(-90)' text-anchor='middle'>{html.escape(metric)}</text>")
    for j, x, y in zip(pts, xs, ys):
        tip = "\n".join([f"job {j['job']}: {j['label']}"] + [f"{k} = {_fmt(v)}" for k, v in j["metrics"].items()
                                                             if k in MD_METRICS or k == "cache/bytes_at_ctx"])
        parts.append(f"<circle class='pt' data-text='{html.escape(j['label'] + ' ' + j['mixer'] + ' ' + j['job'])}' "
                     f"cx='{sx(x):.1f}' cy='{sy(y):.1f}' r='5' fill='{colors[j['series']]}' fill-opacity='0.8' "
                     f"stroke='#333' stroke-width='0.5'><title>{html.escape(tip)}</title></circle>")
    for i, (name, c) in enumerate(colors.items()):
        yy = T + 8 + 15 * i
        parts.append(f"<circle cx='{width - R + 14}' cy='{yy}' r='5' fill='{c}'/>"
                     f"<text x='{width - R + 24}' y='{yy + 4}'>{html.escape(name)}</text>")
    return "\n".join(parts + ["</svg>"])


_JS = """
document.querySelectorAll('input.filter').forEach(inp => inp.addEventListener('input', () => {
  const q = inp.value.toLowerCase().split(/\\s+/).filter(Boolean);
  const match = t => q.every(w => t.toLowerCase().includes(w));
  document.querySelectorAll('#' + inp.dataset.table + ' tbody tr').forEach(tr => {
    tr.style.display = match(tr.textContent) ? '' : 'none'; });
  if (inp.dataset.table === 'best') document.querySelectorAll('circle.pt').forEach(c => {
    c.style.opacity = match(c.dataset.text) ? 1 : 0.08; });
}));
// each header sorts its own table by its own column: th.cellIndex (the position in its row), not the index
// among every th of the page (which pointed past the last column of any table after the first)
document.querySelectorAll('th').forEach(th => th.addEventListener('click', () => {
  const i = th.cellIndex, body = th.closest('table').querySelector('tbody');
  const asc = th.dataset.asc !== '1'; th.dataset.asc = asc ? '1' : '0';
  const key = tr => { const td = tr.children[i]; if (!td) return '';
    return td.dataset.v !== undefined ? parseFloat(td.dataset.v) : td.textContent; };
  [...body.rows].sort((a, b) => { const x = key(a), y = key(b);
    const r = (typeof x === 'number' && typeof y === 'number') ? x - y : String(x).localeCompare(String(y), undefined, {numeric: true});
    return asc ? r : -r; }).forEach(tr => body.appendChild(tr));
}));
"""


def _lengths_html(best: list[dict], metric: str) -> str:
    lengths, rows = length_rows(best, metric)
    if not rows:
        return ""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in length_head(metric, lengths))
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c.replace(chr(92), ''))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<h2>Length extrapolation</h2><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _html(title, command, jobs, best, cols, plots, metric) -> str:
    imgs = "".join(
        f"<h3>{html.escape(name)}</h3><img src='data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}'/>"
        for name, p in plots.items()
    )
    fails = "".join(f"<li>job {html.escape(j['job'])} ({html.escape(j['label'])}): {html.escape(j['error'])}</li>"
                    for j in jobs if j["status"] != "ok")
    scatter = _svg_scatter(best, metric)
    return f"""<!doctype html><html><head><meta charset='utf-8'><title>attnzoo sweep {html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1400px}} table{{border-collapse:collapse;font-size:12px}}
td,th{{border:1px solid #ccc;padding:3px 6px}} th{{cursor:pointer;background:#f4f4f4;position:sticky;top:0}}
tr.failed td{{background:#fdd}} img{{max-width:100%}} input.filter{{width:30em;margin:6px 0;padding:3px}}
td[data-v]{{text-align:right;font-variant-numeric:tabular-nums}}</style></head><body>
<h1>Sweep report: {html.escape(title)}</h1>
<p>Command: <code>{html.escape(command)}</code></p>
<p>{len(jobs)} jobs; ranking metric <code>{html.escape(metric)}</code>. Click a column header to sort; type in a
filter box to keep matching rows (the scatter follows the first table's filter); hover a point for its job.</p>
{f"<h2>{html.escape(metric)} vs cache (best learning rate per variant)</h2>{scatter}" if scatter else ""}
<h2>Best learning rate per variant</h2>{_html_table(best, cols, True, "best")}
{_lengths_html(best, metric)}<h2>All jobs</h2>{_html_table(jobs, cols, False, "all")}
{f'<h2>Failed jobs</h2><ul>{fails}</ul>' if fails else ''}
<h2>Plots</h2>{imgs}
<script>{_JS}</script>
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
