"""The µTransfer figure and table from a finished `attnzoo-sweep mup_transfer` (docs/mup.md): final val/loss against
the learning rate, one curve per width, standard parametrization beside µP, and the best learning rate per width.

    .venv/bin/python scripts/mup_transfer.py multirun/mup_transfer_<date>_<time> [--out docs/mup]

Writes <out>/mup_transfer.png and <out>/mup_transfer.json, and prints the markdown tables. A job whose loss is not
finite (a learning rate the width diverged at) is a missing point on its curve and never the best.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

PARAMETRIZATIONS = ("standard", "mup")


def load(sweep: Path) -> tuple[dict, set]:
    """{parametrization: {width: {lr: val/loss}}} from the jobs' summary.json files, and the µP base widths seen."""
    out: dict = {p: {} for p in PARAMETRIZATIONS}
    bases = set()
    for path in sorted(sweep.glob("*/summary.json")):
        s = json.loads(path.read_text())
        if s.get("status") != "ok":
            continue
        c = s["config"]
        loss = s["metrics"].get("val/loss", float("nan"))
        out[c["model"]["parametrization"]].setdefault(c["model"]["d_model"], {})[c["optim"]["lr"]] = loss
        if c["model"]["parametrization"] == "mup":
            bases.add(c["model"]["mup_base_width"])
    return out, bases


def best(curve: dict) -> tuple[float, float]:
    """(lr, val/loss) of the lowest finite loss; (nan, nan) for a width without one (not run yet, or all diverged)."""
    finite = {lr: v for lr, v in curve.items() if math.isfinite(v)}
    if not finite:
        return math.nan, math.nan
    lr = min(finite, key=finite.get)
    return lr, finite[lr]


def tables(losses: dict) -> str:
    widths = sorted({w for p in PARAMETRIZATIONS for w in losses[p]})
    lrs = sorted({lr for p in PARAMETRIZATIONS for w in losses[p] for lr in losses[p][w]})
    lines = ["| width | " + " | ".join(f"best lr ({p})" for p in PARAMETRIZATIONS) + " | " +
             " | ".join(f"val/loss at it ({p})" for p in PARAMETRIZATIONS) + " |",
             "|---" * (1 + 2 * len(PARAMETRIZATIONS)) + "|"]
    for w in widths:
        b = [best(losses[p].get(w, {})) for p in PARAMETRIZATIONS]
        lines.append(f"| {w} | " + " | ".join(f"{lr:g}" for lr, _ in b) + " | " +
                     " | ".join(f"{v:.4f}" for _, v in b) + " |")
    lines += ["", "| parametrization | width | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " |",
              "|---" * (2 + len(lrs)) + "|"]
    for p in PARAMETRIZATIONS:
        for w in sorted(losses[p]):
            cells = []
            for lr in lrs:
                v = losses[p][w].get(lr)
                cells.append("" if v is None else ("diverged" if not math.isfinite(v) else
                             (f"**{v:.4f}**" if lr == best(losses[p][w])[0] else f"{v:.4f}")))
            lines.append(f"| {p} | {w} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(losses: dict, path: Path, bases: set) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    widths = sorted({w for p in PARAMETRIZATIONS for w in losses[p]})
    colors = plt.cm.viridis(np.linspace(0, 0.85, len(widths)))
    finite = [v for p in PARAMETRIZATIONS for w in losses[p] for v in losses[p][w].values() if math.isfinite(v)]
    lo = min(finite)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.3), sharey=True)
    for ax, p in zip(axes, PARAMETRIZATIONS):
        for w, color in zip(widths, colors):
            curve = losses[p].get(w, {})
            lrs = sorted(lr for lr in curve if math.isfinite(curve[lr]))
            if not lrs:
                continue
            ax.plot(lrs, [curve[lr] for lr in lrs], marker="o", color=color, label=f"width {w}")
            b_lr, b_v = best(curve)
            ax.plot([b_lr], [b_v], marker="*", ms=14, color=color, markeredgecolor="black")
        ax.set_xscale("log")
        ax.set_xlabel("optim.lr")
        base = f" (base width {', '.join(map(str, sorted(bases)))})" if bases else ""
        ax.set_title({"standard": "standard parametrization", "mup": f"µP{base}"}[p])
        ax.grid(True, which="both", alpha=0.3)
        ax.set_ylim(lo - 0.05, min(max(finite), lo + 1.0))
    axes[0].set_ylabel("val/loss after training")
    axes[1].legend(fontsize=8)
    fig.suptitle("learning-rate transfer across widths (★ the best lr of each width)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep", type=Path, help="the sweep directory (hydra.sweep.dir)")
    ap.add_argument("--out", type=Path, default=None, help="folder for the PNG and JSON (default: the sweep dir)")
    args = ap.parse_args()
    losses, bases = load(args.sweep)
    if not any(losses.values()):
        raise SystemExit(f"{args.sweep}: no finished mup_transfer jobs (*/summary.json with status ok)")
    out = args.out or args.sweep
    png = plot(losses, out / "mup_transfer.png", bases)
    best_lr = {p: {w: best(c)[0] for w, c in sorted(losses[p].items())} for p in PARAMETRIZATIONS}
    best_lr = {p: {w: lr for w, lr in b.items() if math.isfinite(lr)} for p, b in best_lr.items()}
    (out / "mup_transfer.json").write_text(json.dumps(
        {"val_loss": {p: {str(w): {str(lr): v for lr, v in sorted(c.items())} for w, c in sorted(losses[p].items())}
                      for p in PARAMETRIZATIONS},
         "best_lr": {p: {str(w): lr for w, lr in b.items()} for p, b in best_lr.items()}}, indent=1))
    print(tables(losses))
    print(f"\nwrote {png} and {out / 'mup_transfer.json'}")


if __name__ == "__main__":
    main()
