"""µP's coordinate check for every registered mixer (docs/mup.md, "The coordinate check, every mixer").

For each mixer: `attnzoo-bench mup_coord`'s measurement (attnzoo.bench.mup_coord.coord_check) on the default
decoder with `model/mixer=<name>` and the mixer's own defaults, standard parametrization against µP. Writes
<out>/mup_coord_mixers.json, a markdown table (<out>/mup_coord_mixers.md) and a figure (<out>/mup_coord_mixers.png:
each mixer's mean exponent of the residual-stream and logits updates, standard vs µP).

    .venv/bin/python scripts/mup_coord_mixers.py --out docs/mup                 # every mixer, 2 seeds, 10 steps
    .venv/bin/python scripts/mup_coord_mixers.py --out /tmp/m --mixers rwkv7 --seeds 1 --steps 4
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

SIZES = ("logits update", "hidden update")  # what an update does to the activations: µP's subject


def mixer_names() -> list[str]:
    """Every `model/mixer=` option of conf/ (what a user composes)."""
    return sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "conf" / "model" / "mixer").glob("*.yaml"))


def table(results: dict) -> list[str]:
    head = ["mixer", "standard: logits update", "standard: residual update", "µP: logits update",
            "µP: residual update", "µP flat (both), standard grows (either)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| `{name}` | {r['error']} |" + " |" * (len(head) - 2))
            continue
        cells = []
        for param in ("standard", "mup"):
            for k in SIZES:
                e = r[param]["exponents"][k]
                cells.append(f"{sum(e) / len(e):+.2f} ({min(e):+.2f}..{max(e):+.2f})")
        grows = any(sum(e) / len(e) > 0.5 for e in (r["standard"]["exponents"][k] for k in SIZES))
        ok = all(r["mup"]["flat"][k] for k in SIZES) and grows
        lines.append(f"| `{name}` | " + " | ".join(cells) + f" | {'yes' if ok else 'no'} |")
    return lines


def figure(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = [n for n, r in results.items() if "error" not in r]
    fig, axes = plt.subplots(1, len(SIZES), figsize=(12, 0.38 * len(names) + 1.6), sharey=True)
    y = np.arange(len(names))
    for ax, k in zip(axes, SIZES):
        for off, param, color in ((-0.18, "standard", "tab:red"), (0.18, "mup", "tab:blue")):
            exps = [results[n][param]["exponents"][k] for n in names]
            mean = [sum(e) / len(e) for e in exps]
            lo = [m - min(e) for m, e in zip(mean, exps)]
            hi = [max(e) - m for m, e in zip(mean, exps)]
            ax.barh(y + off, mean, height=0.34, color=color, xerr=[lo, hi], error_kw={"lw": 0.8, "alpha": 0.6},
                    label="µP" if param == "mup" else "standard")
        for x, style in ((0, "-"), (0.5, ":"), (-0.5, ":"), (1, "--")):
            ax.axvline(x, color="grey", lw=0.8, ls=style)
        ax.set_title(f"{'residual stream' if k == 'hidden update' else 'logits'} update: exponent a (size ~ width^a)",
                     fontsize=10)
        ax.set_xlabel("mean exponent a over the steps (line: min..max)")
    axes[0].set_yticks(y, names)
    axes[0].invert_yaxis()
    axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle("µP coordinate check, every mixer (widths 32..256): µP predicts a = 0, the standard "
                 "parametrization with Adam a >= 1; flat: |a| < 0.5 (dotted)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for the JSON, table and figure")
    p.add_argument("--mixers", nargs="+", default=None, help="default: every registered mixer")
    p.add_argument("--widths", type=int, nargs="+", default=[32, 64, 128, 256])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--table-only", action="store_true", help="rewrite the table and figure from the JSON")
    args = p.parse_args(argv)
    import torch

    from attnzoo.bench.mup_coord import coord_check

    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "mup_coord_mixers.json"
    results = json.loads(path.read_text())["mixers"] if path.exists() else {}
    for name in [] if args.table_only else args.mixers or mixer_names():
        t0 = time.perf_counter()
        try:
            r = coord_check(args.widths, steps=args.steps, seeds=args.seeds, lr=args.lr,
                            overrides=[f"model/mixer={name}"])
        except Exception as e:  # noqa: BLE001 - one mixer's failure is reported in its row, the rest still run
            r = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        r["seconds"] = round(time.perf_counter() - t0, 1)
        results[name] = r
        print(name, r.get("error") or {p: {k: round(sum(e) / len(e), 2) for k, e in r[p]["exponents"].items()}
                                       for p in ("standard", "mup")}, f"{r['seconds']} s", flush=True)
        path.write_text(json.dumps({"widths": args.widths, "steps": args.steps, "seeds": args.seeds, "lr": args.lr,
                                    "mixers": results}, indent=1))
    lines = table(results)
    (out / "mup_coord_mixers.md").write_text("\n".join(lines) + "\n")
    figure(results, out / "mup_coord_mixers.png")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
