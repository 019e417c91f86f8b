"""The cooldown study's table and figure, from its runs (docs/recipes.md#the-cpu-study-cooldowns-vs-cosine).

    .venv/bin/python scripts/cooldown_study.py --stable runs/stable --cooldowns multirun/cooldown [...] \
        --cosine multirun/cosine [...] --out docs/cooldown [--extra NAME=RUN_DIR ...]

Reads each run's summary.json (final val/loss, budget, FLOPs) and csv/metrics.csv (val/loss by step), and writes
OUT/study.json, OUT/study.md (one row per budget: the stable run at the branch step, the cooldown, cosine from
scratch) and OUT/curves.png (val/loss vs training FLOPs: the stable run, each cooldown, each cosine run).
"""
from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path


def run_record(run: Path) -> dict:
    s = json.loads((run / "summary.json").read_text())
    cfg = s["config"]
    with open(run / "csv" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    curve = {int(r["step"]): float(r["val/loss"]) for r in rows if r.get("val/loss")}
    flops = {int(r["step"]): float(r["train/flops"]) for r in rows if r.get("train/flops")}
    return {"dir": str(run), "steps": cfg["trainer"]["max_steps"], "scheduler": cfg["scheduler"]["name"],
            "lr": cfg["optim"]["lr"], "branch_from": cfg.get("branch_from"), "val/loss": s["metrics"]["val/loss"],
            "train/flops": s["metrics"].get("train/flops") or s["length"]["flops"], "curve": curve,
            "flops_per_step": (max(flops.values()) / (max(flops) + 1)) if flops else None}


def jobs(sweep: Path) -> list[dict]:
    return [run_record(p.parent) for p in sweep.glob("*/summary.json")]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stable", type=Path, required=True)
    ap.add_argument("--cooldowns", type=Path, nargs="+", required=True, help="sweep dir(s) of the cooldown jobs")
    ap.add_argument("--cosine", type=Path, nargs="+", required=True, help="sweep dir(s) of the cosine jobs")
    ap.add_argument("--extra", nargs="*", default=[], help="NAME=RUN_DIR: more runs for the table (ablations)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    stable = run_record(a.stable)
    cooldowns = sorted((r for d in a.cooldowns for r in jobs(d)), key=lambda r: r["steps"])
    cosine = sorted((r for d in a.cosine for r in jobs(d)), key=lambda r: r["steps"])
    by_steps = {c["steps"]: c for c in cosine}
    rows = []
    for cd in cooldowns:
        # the stable run's validation after its step checkpoint at the branch point (CSV steps are 0-based)
        branch = max(s for s in stable["curve"] if s < cd["steps"] - round(0.2 * cd["steps"]))
        cos = by_steps.get(cd["steps"])
        rows.append({"budget steps": cd["steps"], "train FLOPs": cd["train/flops"],
                     "stable at branch": stable["curve"][branch], "branch step": branch + 1,
                     "wsd cooldown": cd["val/loss"], "cosine": cos["val/loss"] if cos else None,
                     "cooldown - cosine": cd["val/loss"] - cos["val/loss"] if cos else None})
    extra = {}
    for item in a.extra:
        name, path = item.rsplit("=", 1)
        r = run_record(Path(path))
        extra[name] = {k: r[k] for k in ("steps", "scheduler", "lr", "val/loss", "train/flops")}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "study.json").write_text(json.dumps({"rows": rows, "extra": extra,
                                                  "stable": {k: stable[k] for k in ("dir", "steps", "lr")}}, indent=2))
    lines = ["| budget (steps) | training FLOPs | stable run at the branch step | WSD cooldown (20%, 1-sqrt) | "
             "cosine (to 10%) from scratch | cooldown - cosine |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['budget steps']} | {r['train FLOPs']:.3g} | {r['stable at branch']:.3f} (step "
                     f"{r['branch step']}) | {r['wsd cooldown']:.3f} | "
                     + (f"{r['cosine']:.3f} | {r['cooldown - cosine']:+.3f} |" if r["cosine"] is not None else "- | - |"))
    if extra:
        lines += ["", "| ablation run | steps | schedule | lr | val/loss |", "|---|---|---|---|---|"]
        lines += [f"| {n} | {e['steps']} | {e['scheduler']} | {e['lr']:g} | {e['val/loss']:.3f} |"
                  for n, e in extra.items()]
    (a.out / "study.md").write_text("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    per = stable["flops_per_step"]

    def plot(r, **kw):
        steps = sorted(r["curve"])
        ax.plot([(s + 1) * per / 1e12 for s in steps], [r["curve"][s] for s in steps], **kw)

    plot(stable, color="0.5", lw=1.5, label="stable (WSD without decay)")
    for i, cd in enumerate(cooldowns):
        plot(cd, color="C0", lw=2, marker="o", ms=3, label="WSD cooldowns (20%, 1-sqrt)" if i == 0 else None)
    for i, cos in enumerate(cosine):
        plot(cos, color="C3", lw=1, ls="--", label="cosine from scratch" if i == 0 else None)
    ax.set_xlabel("training FLOPs (x 1e12)")
    ax.set_ylabel("val/loss")
    ax.set_ylim(top=min(6.0, ax.get_ylim()[1]))
    ax.grid(alpha=0.3)
    ax.legend(title="schedule")
    ax.set_title("One stable run + cooldowns vs cosine runs of each budget")
    fig.tight_layout()
    fig.savefig(a.out / "curves.png", dpi=110)
    print(f"wrote {a.out / 'study.json'}, {a.out / 'study.md'}, {a.out / 'curves.png'}")


if __name__ == "__main__":
    main()
