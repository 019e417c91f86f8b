"""`attnzoo-bench mup_coord`: µP's coordinate check (Yang et al. 2022, arXiv:2203.03466, Fig. 5; the `mup`
package's get_coord_data / plot_coord_data), standard parametrization against model.parametrization=mup.

The same decoder LM at several widths (d_model; heads fixed, so the head size grows with it), each trained a few
AdamW steps by the run's own optimizer groups (LitLM.configure_optimizers: µP's per-layer learning rates and weight
decay) on the embedded corpus at one learning rate, no gradient clipping. Before every step, on one fixed probe batch,
it records the mean |coordinate| of the logits and of every block's output (the residual stream), and the mean
|change since step 0| of each (the update's size in activations). Averaged over seeds.

What the check reads: the exponent a of each size against the width (the least-squares slope of log size on log
width, per step). Under µP every layer's activations and their updates stay the same size as the width grows (a = 0);
under the standard parametrization with Adam an update moves a weight's every entry by about the learning rate, and
a layer sums d of them coherently, so the updates grow like the width (a = 1; the logits grow at init too, like
sqrt(d)). `flat` is |mean of a over the steps| < 1/2: nearer 0 than 1 (the per-step range is reported beside it:
the narrowest widths deviate most, finite-width effects). Writes mup_coord.png beside the JSON.
"""
from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from attnzoo.api import load_config
# the data modules and LitLM (Lightning) are imported where a run uses them: `attnzoo-bench mup_coord --help` and its
# refusals cost torch's import only

HELP = "µP coordinate check: activation and update sizes vs width for the first steps, standard vs mup (PNG + JSON)"
QUICK = {"widths": [32, 64], "steps": 2, "seeds": 1, "seq_len": 32, "batch_size": 4}
METRICS = ("logits", "logits update", "hidden", "hidden update")  # hidden: the last block's output
PARAMETRIZATIONS = ("standard", "mup")
FLAT = 0.5  # |mean exponent| below: nearer µP's 0 than the standard parametrization's 1


def add_arguments(p) -> None:
    p.add_argument("--widths", type=int, nargs="+", default=[32, 64, 128, 256], help="d_model values")
    p.add_argument("--base-width", type=int, default=None, help="model.mup_base_width (default: the smallest width)")
    p.add_argument("--steps", type=int, default=10, help="AdamW steps per run")
    p.add_argument("--seeds", type=int, default=3, help="runs per width, averaged")
    p.add_argument("--lr", type=float, default=1e-2, help="optim.lr, the same for every width and parametrization")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--override", action="append", default=[],
                   help="an attnzoo-train override (repeatable), e.g. model/mixer=gated_deltanet model.n_layers=4")


def run_once(container: dict, vocab_size: int, batches: list, seed: int) -> dict:
    """One model trained len(batches) - 1 steps; the sizes on batches[0] before each step and after the last."""
    torch.manual_seed(seed)
    from attnzoo.training.lit_lm import LitLM

    lit = LitLM(container, vocab_size=vocab_size)
    model = lit.model.train()
    conf = lit.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    probe = batches[0][0]
    outputs: list = []
    hooks = [b.register_forward_hook(lambda mod, inp, out: outputs.append(out.detach())) for b in model.blocks]
    first = None
    sizes: dict = {k: [] for k in METRICS}
    sizes["blocks"] = []
    for step in range(len(batches)):
        outputs.clear()
        with torch.no_grad():
            logits = model(probe)
        hidden = list(outputs)
        if first is None:
            first = (logits, hidden)
        sizes["logits"].append(logits.abs().mean().item())
        sizes["logits update"].append((logits - first[0]).abs().mean().item())
        sizes["hidden"].append(hidden[-1].abs().mean().item())
        sizes["hidden update"].append((hidden[-1] - first[1][-1]).abs().mean().item())
        sizes["blocks"].append([h.abs().mean().item() for h in hidden])
        if step == len(batches) - 1:
            break
        x, y = batches[step][0], batches[step][1]
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    for h in hooks:
        h.remove()
    return sizes


def exponent(widths: list[int], values: list[float]) -> float:
    """The least-squares slope of log(value) on log(width): value ~ width^a."""
    return float(np.polyfit(np.log(widths), np.log(values), 1)[0])


def coord_check(widths: list[int], *, steps: int = 10, seeds: int = 3, lr: float = 1e-2, base_width: int | None = None,
                seq_len: int = 64, batch_size: int = 8, overrides: list[str] = ()) -> dict:
    """The measurement: {parametrization: {"sizes": {metric: [[size at step t for t] per width]}, "exponents":
    {metric: [a at step t, t = 1..steps]}, "flat": {metric: |mean a| < FLAT}}}, plus the setup."""
    widths = sorted(widths)
    base = base_width or widths[0]
    cfg = load_config([*overrides, "scheduler=constant", "scheduler.warmup_steps=1", f"optim.lr={lr}",
                       f"data.seq_len={seq_len}", f"data.batch_size={batch_size}", "trainer.gradient_clip_val=null"])
    from attnzoo.data import build_datamodule

    dm = build_datamodule(cfg.data, cache_dir=cfg.paths.cache_dir, seed=cfg.seed)
    dm.setup("fit")
    loader = iter(dm.train_dataloader())
    batches = [next(loader) for _ in range(steps + 1)]
    container = OmegaConf.to_container(cfg, resolve=True)
    out: dict = {"widths": widths, "base_width": base, "steps": steps, "seeds": seeds, "lr": lr,
                 "seq_len": seq_len, "batch_size": batch_size, "vocab_size": dm.vocab_size,
                 "overrides": list(overrides),
                 "model": {k: container["model"][k] for k in ("n_layers", "n_heads", "n_kv_heads", "init_std")} |
                 {"mixer": container["model"]["mixer"]["name"], "ffn": container["model"]["ffn"]["name"]}}
    for param in PARAMETRIZATIONS:
        per_width = []
        for w in widths:
            c = copy.deepcopy(container)
            c["model"].update(d_model=w, parametrization=param, mup_base_width=base if param == "mup" else None)
            runs = [run_once(c, dm.vocab_size, batches, seed) for seed in range(seeds)]
            per_width.append({k: np.mean([r[k] for r in runs], axis=0).tolist() for k in (*METRICS, "blocks")})
        sizes = {k: [pw[k] for pw in per_width] for k in (*METRICS, "blocks")}
        exps = {k: [exponent(widths, [sizes[k][i][t] for i in range(len(widths))]) for t in range(1, steps + 1)]
                for k in METRICS}
        out[param] = {"sizes": sizes, "exponents": exps,
                      "flat": {k: abs(sum(exps[k]) / len(exps[k])) < FLAT for k in METRICS},
                      "spread": {k: max(s[-1] for s in sizes[k]) / min(s[-1] for s in sizes[k]) for k in METRICS}}
    return out


def plot(result: dict, path: Path) -> Path:
    """One row per parametrization, one panel per size: size against width (log-log), one line per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    widths, steps = result["widths"], result["steps"]
    fig, axes = plt.subplots(2, len(METRICS), figsize=(4.2 * len(METRICS), 7.5), sharex=True)
    colors = plt.cm.viridis(np.linspace(0, 0.9, steps + 1))
    for row, param in enumerate(PARAMETRIZATIONS):
        sizes, exps = result[param]["sizes"], result[param]["exponents"]
        for col, k in enumerate(METRICS):
            ax = axes[row, col]
            for t in range(0 if "update" not in k else 1, steps + 1):
                ax.plot(widths, [sizes[k][i][t] for i in range(len(widths))], marker="o", ms=3, color=colors[t],
                        label=f"step {t}" if col == 0 and t in (0, 1, steps) else None)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            name = "µP" if param == "mup" else "standard"
            ax.set_title(f"{name}: {k}\nexponent {min(exps[k]):+.2f}..{max(exps[k]):+.2f}", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            if row == 1:
                ax.set_xlabel("width (d_model)")
        axes[row, 0].set_ylabel("mean |coordinate|")
        axes[row, 0].legend(fontsize=7)
    m = result["model"]
    fig.suptitle(f"coordinate check: {m['mixer']} + {m['ffn']}, {m['n_layers']} layers, {m['n_heads']} heads, "
                 f"AdamW lr {result['lr']:g}, base width {result['base_width']}, {result['seeds']} seeds", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(args) -> dict:
    from attnzoo.config.errors import ConfigError

    if len(args.widths) < 2 or min(args.widths) < 1:
        raise ConfigError(f"got {args.widths}; allowed: two or more positive widths", field="--widths")
    if args.steps < 1 or args.seeds < 1:
        raise ConfigError(f"got --steps {args.steps} --seeds {args.seeds}; allowed: >= 1 each", field="--steps")
    result = coord_check(args.widths, steps=args.steps, seeds=args.seeds, lr=args.lr, base_width=args.base_width,
                         seq_len=args.seq_len, batch_size=args.batch_size, overrides=args.override)
    path = plot(result, Path(args.out) / "mup_coord.png")
    rows = []
    for param in PARAMETRIZATIONS:
        for k in METRICS:
            exps = result[param]["exponents"][k]
            rows.append({"parametrization": param, "size": k, "exponent (min)": min(exps),
                         "exponent (max)": max(exps), "exponent (mean)": sum(exps) / len(exps),
                         "widest / narrowest (last step)": result[param]["spread"][k],
                         "flat": "yes" if result[param]["flat"][k] else "no"})
    notes = [f"widths {result['widths']}, base width {result['base_width']}, {result['steps']} AdamW steps at lr "
             f"{result['lr']:g} (no clipping), {result['seeds']} seeds, batch {result['batch_size']} x "
             f"{result['seq_len']} tokens of the embedded corpus; exponent a: size ~ width^a fitted at each step 1.."
             f"{result['steps']}; flat: |mean a| < {FLAT} (µP predicts 0, the standard parametrization 1 for the "
             f"updates).", f"![coordinate check]({path.name})"]
    return {"title": "µP coordinate check", "columns": list(rows[0]), "rows": rows, "notes": notes,
            "result": result, "plot": str(path), "finite": all(math.isfinite(r["exponent (mean)"]) for r in rows)}
