"""`attnzoo-bench ddp`: the same training step on 1 process and on 2 CPU processes with DDP (gloo).

Each row is a real `train()` run of 20 optimizer steps read back from its summary (`perf/tokens_per_sec`,
all ranks together, over the last 10-step window, the ThroughputMonitor default, which the DDP workers
use too). `trainer=ddp_cpu` starts 2 worker processes with cores/2 threads each (attnzoo.training.launch), so
the fair single-process baselines are 1 process x all threads and 1 process x cores/2 threads:
DDP efficiency = tokens/s per DDP process / tokens/s of one process with the same thread count.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from attnzoo.bench.train import attnzoo_run, base_overrides

HELP = "DDP overhead: tokens/s of the same step on 1 process vs 2 CPU processes (trainer=ddp_cpu)"
WINDOW = 10  # ThroughputMonitor's default window, the one the DDP worker processes use


def add_arguments(p) -> None:
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--n-kv-heads", type=int, default=2)
    p.add_argument("--mixer", default="gqa")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8, help="per process")
    p.add_argument("--overrides", nargs="*", default=[])
    p.add_argument("--quick", action="store_true", help="tiny sizes for tests (seconds)")


def quick(args) -> None:
    args.d_model, args.n_layers, args.n_heads, args.n_kv_heads, args.seq_len, args.batch = 32, 2, 4, 2, 32, 4
    args.overrides = [*args.overrides, "data.tokenizer=char", "data.max_chars=20000"]


def run(args) -> dict:
    if args.quick:
        quick(args)
    args.steps, args.precisions = WINDOW, ["32-true"]
    cores = os.cpu_count() or 1
    threads_before = torch.get_num_threads()
    rows = []
    with tempfile.TemporaryDirectory(prefix="attnzoo-bench-ddp-") as tmp:
        variants = [("cpu", 1, threads_before), ("cpu", 1, max(1, cores // 2)), ("ddp_cpu", 2, max(1, cores // 2))]
        for i, (trainer, procs, threads) in enumerate(variants):
            if trainer == "cpu" and i > 0 and threads == variants[0][2]:
                continue  # one core: the two single-process baselines are the same run
            ov = base_overrides(args, "32-true", Path(tmp) / f"{i}-{trainer}") + [f"trainer={trainer}"]
            torch.set_num_threads(threads)
            try:
                m = attnzoo_run(ov, WINDOW)
            finally:
                torch.set_num_threads(threads_before)
            tps = m["perf/tokens_per_sec"]
            rows.append({"trainer": trainer, "processes": procs, "threads/process": threads, "tokens/s (all)": tps,
                         "tokens/s per process": tps / procs, "step ms": m["perf/step_ms"]})
    base = {r["threads/process"]: r["tokens/s per process"] for r in rows if r["processes"] == 1}
    for r in rows:
        r["per process vs 1 process"] = r["tokens/s per process"] / base.get(r["threads/process"], float("nan"))
    notes = [
        f"model: {args.mixer} d_model={args.d_model} n_layers={args.n_layers} heads={args.n_heads}/{args.n_kv_heads}kv; "
        f"data=text seq_len={args.seq_len} batch={args.batch} per process; fp32; 20 steps, last {WINDOW} timed; "
        f"{cores} cores.",
        "per process vs 1 process: DDP tokens/s per process / one process with the same threads (1.0 = no DDP overhead).",
    ]
    return {"title": "DDP on CPU: 1 vs 2 processes", "rows": rows, "notes": notes,
            "columns": ["trainer", "processes", "threads/process", "tokens/s (all)", "tokens/s per process", "step ms",
                        "per process vs 1 process"]}
