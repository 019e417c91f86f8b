"""`attnzoo-bench train`: framework overhead and MFU of the training step.

For each precision, in one process and one run:
- `bare`: the model, data, AdamW (same param groups, betas, eps, weight decay), LR schedule, gradient
  clipping and autocast of the attnzoo run, in a plain PyTorch loop;
- `attnzoo`: `attnzoo.training.run.train(cfg)` itself (Lightning Trainer, our callbacks, CSV logging, checkpoint
  at the end), read back from its `perf/tokens_per_sec`.
Both warm up for `--steps` optimizer steps and then time `--steps` more the same way ThroughputMonitor
does (wall clock from the first timed batch's start to the last batch's end; data loading included).
MFU = tokens/s x analytic train FLOPs/token / the dense matmul peak of the same dtype measured in this
process (`attnzoo.models.flops.measure_matmul_peak`, the number `train()` is also given).
"""
from __future__ import annotations

import contextlib
import itertools
import tempfile
import time
from pathlib import Path

# torch is imported where the work starts: `attnzoo-bench train --mixer nope` is refused in Python's start time
HELP = "training-step tokens/s: full attnzoo path (Lightning) vs a bare PyTorch loop, and MFU vs measured matmul peak"
PRECISIONS = ("32-true", "bf16-mixed")


def add_arguments(p) -> None:
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-layers", type=int, default=6)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--n-kv-heads", type=int, default=2)
    p.add_argument("--mixer", default="gqa")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="timed optimizer steps (after as many warm-up steps)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per row, order reversed every other repeat (ABBA); the fastest is kept")
    p.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    p.add_argument("--compile", action="store_true", help="add a row with torch.compile (compile=true)")
    p.add_argument("--fused-adamw", action="store_true",
                   help="add rows with AdamW(fused=True) patched in for both paths (LitLM uses fused=False)")
    p.add_argument("--overrides", nargs="*", default=[], help="extra Hydra overrides for both paths")
    p.add_argument("--quick", action="store_true", help="tiny sizes for tests (seconds)")


def quick(args) -> None:
    """Shrink a parsed namespace to a few seconds' work (tests)."""
    args.d_model, args.n_layers, args.n_heads, args.n_kv_heads = 32, 2, 4, 2
    args.seq_len, args.batch, args.steps = 32, 4, 2
    args.overrides = [*args.overrides, "data.tokenizer=char", "data.max_chars=20000"]


def base_overrides(args, precision: str, out: Path) -> list[str]:
    """Hydra overrides for a run of exactly 2 x steps optimizer steps, no validation, decode or sampling."""
    return [
        f"model.d_model={args.d_model}", f"model.n_layers={args.n_layers}", f"model.n_heads={args.n_heads}",
        f"model.n_kv_heads={args.n_kv_heads}", f"model/mixer={args.mixer}", f"model.max_seq_len={max(args.seq_len, 64)}",
        f"data.seq_len={args.seq_len}", f"data.batch_size={args.batch}",
        f"trainer.max_steps={2 * args.steps}", f"trainer.val_check_interval={2 * args.steps}",
        "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false", f"trainer.precision={precision}",
        "callbacks.save_best=false", "perf.measure_decode=false", "sample.max_new_tokens=0",
        f"paths.output_dir={out}", *args.overrides,
    ]


def compose(overrides: list[str]):
    from attnzoo.api import load_config

    cfg = load_config(overrides)
    # load_config appends paths.output_dir=. (no Hydra run dir); ours must win
    cfg.paths.output_dir = [o.split("=", 1)[1] for o in overrides if o.startswith("paths.output_dir=")][-1]
    return cfg


@contextlib.contextmanager
def throughput_window(steps: int):
    """train() builds ThroughputMonitor with its default 10-step window; time the last `steps` instead."""
    from attnzoo.training import trainer

    original = trainer.ThroughputMonitor

    class Windowed(original):
        def __init__(self, *a, **kw):
            super().__init__(*a, **{**kw, "window": steps})

    trainer.ThroughputMonitor = Windowed  # where build_trainer looks it up
    try:
        yield
    finally:
        trainer.ThroughputMonitor = original


@contextlib.contextmanager
def fused_adamw():
    """torch.optim.AdamW with fused=True (one multi-tensor kernel, CPU and CUDA) wherever it is built."""
    import torch

    original = torch.optim.AdamW

    class FusedAdamW(original):
        def __init__(self, params, *a, **kw):
            super().__init__(params, *a, **{**kw, "fused": True})

    torch.optim.AdamW = FusedAdamW
    try:
        yield
    finally:
        torch.optim.AdamW = original


def attnzoo_run(overrides: list[str], steps: int) -> dict:
    """`train()` on the composed config; returns its final metrics (perf/tokens_per_sec of the last window)."""
    from attnzoo.training.run import train

    with throughput_window(steps):
        return train(compose(overrides))


def bare_run(overrides: list[str], steps: int) -> dict:
    """The same model, data and optimizer as `train()` builds, stepped in a plain loop."""
    import lightning as L
    import torch
    import torch.nn.functional as F

    from omegaconf import OmegaConf

    from attnzoo.config.schema import OptimConfig, SchedulerConfig
    from attnzoo.training.config_checks import validate
    from attnzoo.data import build_datamodule
    from attnzoo.training.lit_lm import LitLM, param_groups
    from attnzoo.training.schedules import lr_lambda

    cfg = compose(overrides)
    parts = validate(cfg)
    run, data_cfg = parts["run"], parts["data"]
    L.seed_everything(run.seed, workers=True, verbose=False)
    dm = build_datamodule(data_cfg, cache_dir=run.paths.cache_dir, seed=run.seed)
    dm.setup("fit")
    container = OmegaConf.to_container(cfg, resolve=True)
    device = torch.device("cuda" if run.trainer.accelerator in ("gpu", "cuda") else "cpu")
    model = LitLM(container, vocab_size=dm.vocab_size).model.to(device)  # same construction and init as train()
    model.train()
    # the optimizer and schedule of LitLM.configure_optimizers, from the same config sections
    o = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(OptimConfig), container.get("optim", {})))
    s = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(SchedulerConfig), container.get("scheduler", {})))
    opt = torch.optim.AdamW(param_groups(model, o.weight_decay), lr=o.lr, betas=tuple(o.betas), eps=o.eps, fused=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(s, run.trainer.max_steps, model.cfg.d_model))
    clip = run.trainer.gradient_clip_val
    prec = run.trainer.precision
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if prec.startswith("bf16") else contextlib.nullcontext
    V = model.cfg.vocab_size
    tokens, t0 = 0, None
    batches = itertools.chain.from_iterable(iter(dm.train_dataloader()) for _ in itertools.count())
    for step in range(2 * steps):
        x, y = (t.to(device, non_blocking=True) for t in next(batches)[:2])
        if step == steps:
            t0 = time.perf_counter()
        with autocast():
            logits = model(x)
            loss = F.cross_entropy(logits.float().view(-1, V), y.reshape(-1))
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step >= steps:
            tokens += x.numel()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return {"perf/tokens_per_sec": tokens / dt, "perf/step_ms": 1000 * dt / steps, "train/loss": float(loss.detach())}


def run(args) -> dict:
    if args.quick:
        quick(args)
    compose(base_overrides(args, args.precisions[0], Path(tempfile.gettempdir())))  # refused before any work
    import torch

    from attnzoo.models.flops import measure_matmul_peak, peak_flops, precision_dtype

    rows, notes = [], []
    device = "cuda" if any(o in ("trainer=gpu", "trainer=ddp") for o in args.overrides) else "cpu"
    with tempfile.TemporaryDirectory(prefix="attnzoo-bench-train-") as tmp:
        for prec in args.precisions:
            dtype = precision_dtype(prec)
            peak = measure_matmul_peak(dtype, "cpu", 1024, 1.0) if device == "cpu" else peak_flops(device, dtype)[0]
            variants = ["bare", "attnzoo"]
            # Lightning's AMP plugin refuses gradient clipping with a fused optimizer (it assumes the optimizer
            # unscales fp16 gradients itself), so under bf16-mixed the fused rows are fp32 only
            variants += ["bare+fused-adamw", "attnzoo+fused-adamw"] if args.fused_adamw and prec == "32-true" else []
            variants += ["attnzoo+compile"] if args.compile else []
            res = {}
            for rep in range(args.repeats):
                for name in variants if rep % 2 == 0 else variants[::-1]:
                    ov = base_overrides(args, prec, Path(tmp) / f"{prec}-{name}-{rep}") + [f"perf.peak_flops={peak}"]
                    if "compile" in name:
                        ov.append("compile=true")
                    with fused_adamw() if "fused-adamw" in name else contextlib.nullcontext():
                        m = bare_run(ov, args.steps) if name.startswith("bare") else attnzoo_run(ov, args.steps)
                    if name not in res or m["perf/tokens_per_sec"] > res[name]["perf/tokens_per_sec"]:
                        res[name] = m
            fpt = res["attnzoo"]["perf/flops_per_token"]  # the bare rows' model is the same
            for name, m in res.items():
                tps = m["perf/tokens_per_sec"]
                rows.append({
                    "precision": prec, "path": name, "tokens/s": tps, "step ms": m["perf/step_ms"],
                    "vs bare": tps / res["bare"]["perf/tokens_per_sec"], "GFLOP/s": tps * fpt / 1e9,
                    "peak GFLOP/s": peak / 1e9, "MFU": tps * fpt / peak,
                })
    notes.append(
        f"model: {args.mixer} d_model={args.d_model} n_layers={args.n_layers} heads={args.n_heads}/{args.n_kv_heads}kv, "
        f"swiglu, rope, rmsnorm; data=text seq_len={args.seq_len} batch={args.batch}; {args.steps} warm-up + "
        f"{args.steps} timed steps per run, best of {args.repeats} run(s) per row; threads={torch.get_num_threads()}."
    )
    notes.append("peak = best n=1024 dense matmul of the row's dtype measured in this process (bf16-mixed: bf16 matmul).")
    return {"title": "Training step: attnzoo (Lightning) vs bare PyTorch, MFU", "columns": COLUMNS, "rows": rows,
            "notes": notes}


COLUMNS = ["precision", "path", "tokens/s", "step ms", "vs bare", "GFLOP/s", "peak GFLOP/s", "MFU"]

