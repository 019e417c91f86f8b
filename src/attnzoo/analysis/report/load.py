"""Reading a sweep: its job directories, each job's own files, and what varies across the jobs.

A job directory holds `.hydra/overrides.yaml` or `summary.json`; `load_job` reads summary.json (status, final
metrics, the resolved config), csv/metrics.csv (curves) and the overrides. A *variant* is a job's swept
overrides minus `optim.lr` and `seed`; `best_per_variant` keeps its best learning rate (Zoology's best-of-lr),
averaged over seeds when seeds are swept.
"""
from __future__ import annotations

import csv
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import yaml

# overrides that identify the sweep or the machinery, not the variant
_FIXED_PREFIXES = ("+sweeps=", "sweeps=", "+sweeps/", "hydra.", "paths.", "debug=", "logger=", "trainer.accelerator", "trainer.devices")
_LR_KEYS = ("optim.lr", "seed")
AXIS_KEYS = ("data.num_kv_pairs", "model.d_model")  # the axes / panels of the MQAR plots


# ----------------------------------------------------------------------------- loading


def job_dirs(root: Path) -> list[Path]:
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


def annotate(jobs: list[dict]) -> dict[str, str]:
    """Adds 'label' (the overrides that vary across jobs), 'variant' (label minus lr/seed), 'mixer', 'lr', and
    the plots' groupings: 'series' (the colour: the swept mixer, else the first other swept key), 'facet' (the
    panel: the other swept settings) and 'line' (an MQAR plot's line: all but pairs and width). Returns the
    legend titles, the swept keys behind them: {'series': 'model/mixer', 'line': 'model/mixer'}."""
    values: dict[str, set] = {}
    order: dict[str, int] = {}  # keys in the order the overrides name them (a set's order differs per process)
    for j in jobs:
        for o in j["overrides"]:
            values.setdefault(_ov_key(o), set()).add(o)
            order.setdefault(_ov_key(o), len(order))
    varying = {k for k, v in values.items() if len(v) > 1 or sum(1 for j in jobs if any(_ov_key(o) == k for o in j["overrides"])) < len(jobs)}
    keys = sorted((k for k in varying if k not in _LR_KEYS and not any(o.startswith(_FIXED_PREFIXES) for o in values[k])),
                  key=order.__getitem__)
    # the colour of a series: the swept mixer if it varies, else the first other swept key (kv heads, window...)
    color_key = "model/mixer" if "model/mixer" in keys else next((k for k in keys if k not in AXIS_KEYS), None)
    for j in jobs:
        sweep_ov = [_written(o) for o in j["overrides"] if not o.startswith(_FIXED_PREFIXES)]
        label = [o for o in sweep_ov if _ov_key(o) in varying] or sweep_ov
        j["label"] = " ".join(label) or j["job"]
        j["variant"] = " ".join(o for o in label if _ov_key(o) not in _LR_KEYS) or "all"
        j["mixer"] = mixer_name(j)
        j["lr"] = (j["config"].get("optim") or {}).get("lr")
        if j["lr"] is None:  # no resolved config (a job that failed early): its optim.lr override
            j["lr"] = next((_number(o.split("=", 1)[1]) for o in j["overrides"] if _ov_key(o) == "optim.lr"), None)
        var = [o for o in label if _ov_key(o) not in _LR_KEYS]
        j["swept"], j["variant_overrides"] = label, var  # the page's table views: one per swept value
        j["series"] = " ".join(_short(o) for o in var if _ov_key(o) == color_key) or j["mixer"]
        j["facet"] = " ".join(_short(o) for o in var if _ov_key(o) != color_key) or "all"
        # MQAR plots put pairs and width on their axes: a line is everything else that varies
        j["line"] = " ".join(_short(o) for o in var if _ov_key(o) not in AXIS_KEYS) or j["mixer"]
    line_keys = [k for k in keys if k not in AXIS_KEYS]
    return {"series": color_key or "mixer", "line": ", ".join(line_keys) or "mixer"}


def _number(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


def _written(o: str) -> str:
    """An override with its number as the sweep file writes it: 'trainer.max_flops=2000000000000.0' (how Hydra
    records 2e12) -> 'trainer.max_flops=2e12'."""
    key, eq, value = o.partition("=")
    return f"{key}={as_written(value)}" if eq else o


def as_written(text: str) -> str:
    """A number as a sweep file writes it, the shorter of it and its shortest form: '2000000000000.0' (how Hydra
    records 2e12) -> '2e12', '2.5e+11' -> '2.5e11', '64.0' -> '64'; '1e-3' and '0.001' stay (a legend entry,
    a panel title, a table's overrides). Anything that is not a float literal unchanged."""
    if not re.fullmatch(r"[-+]?(\d+\.\d*|\.\d+|\d+(\.\d*)?[eE][-+]?\d+)", text.strip()):
        return text
    v = float(text)
    mantissa, _, exp = next(f"{v:.{p}g}" for p in range(1, 18) if float(f"{v:.{p}g}") == v).partition("e")
    short = mantissa + (f"e{int(exp)}" if exp else "")
    return short if len(short) < len(text) else text


def _short(o: str) -> str:
    """'model/mixer=gqa' -> 'gqa'; 'model.n_kv_heads=2' -> 'n_kv_heads=2'; 'model.pattern="gdn;gqa"' ->
    'pattern=gdn;gqa' (labels that fit a legend)."""
    key, _, value = o.lstrip("+~").partition("=")
    value = value.strip("'\"")
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
    means, with `spread` = {metric: sample std over seeds} and `n_seeds` (one run: no spread); `runs` are the
    seeds' jobs (their curves average into the row's)."""
    key, higher = primary_metric(jobs)
    groups: dict[str, list[dict]] = {}
    for j in jobs:
        groups.setdefault(j["variant"], []).append(j)
    best = []
    for members in groups.values():
        ok = [j for j in members if j["status"] == "ok" and finite(j["metrics"].get(key))]
        n_lr = len({str(j["lr"]) for j in members})
        if not ok:
            best.append({**members[0], "n_lr": n_lr, "n_seeds": 1, "spread": {}, "runs": members[:1]})
            continue
        by_lr: dict[str, list[dict]] = {}
        for j in ok:
            by_lr.setdefault(str(j["lr"]), []).append(j)
        pick = (max if higher else min)(by_lr.values(), key=lambda runs: mean_std([r["metrics"][key] for r in runs])[0])
        first = max(pick, key=lambda j: j["metrics"][key]) if higher else min(pick, key=lambda j: j["metrics"][key])
        row = {**first, "n_lr": n_lr, "n_seeds": len(pick), "spread": {}, "runs": pick}
        if len(pick) > 1:
            keys = [k for k in first["metrics"] if all(finite(r["metrics"].get(k)) for r in pick)]
            stats = {k: mean_std([r["metrics"][k] for r in pick]) for k in keys}
            row["metrics"] = {k: m for k, (m, _) in stats.items()}
            row["spread"] = {k: s for k, (_, s) in stats.items()}
        best.append(row)
    return best


def mean_std(values: list[float]) -> tuple[float, float]:
    """The mean and the sample standard deviation (0 for one value) of the seeds' runs."""
    m = sum(values) / len(values)
    return m, (sum((v - m) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else 0.0


def finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)
