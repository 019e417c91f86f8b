"""How long a sweep of FLOP budgets will take on this machine, from measured step times, without running it.

    .venv/bin/python scripts/sweep_time.py scaling                    # the CPU study (sweeps/scaling.yaml)
    .venv/bin/python scripts/sweep_time.py scaling debug=smoke        # its smoke form
    .venv/bin/python scripts/sweep_time.py scaling model.n_layers=2,4 --workers 1 --json out.json

Every job of a budget sweep trains its model for ceil(budget / FLOPs per step) steps. So for each job *shape* (the
grid's values other than trainer.max_flops: mixer or pattern x size) this runs the job's own config briefly, twice
(trainer.max_steps = --probe's two lengths, validation at the end only) and once more without the end-of-run
validation: the difference of the two lengths is the CPU time of one optimizer step (data, forward, backward,
AdamW, logging), the rest of the short run its fixed cost (building, the final validation, the checkpoint), the
third run's shortfall the cost of one validation. A job of budget C then costs

    fixed + steps(C) x per_step + floor(steps(C) / trainer.val_check_interval) x validation

CPU seconds, not wall seconds, so that other processes on a shared machine do not inflate the figures (on an idle
machine, one thread per job, they are the wall time). The sweep's wall time is the jobs dealt out in grid order to
`--workers` workers (attnzoo-sweep runs two side by side on a 2-core machine), each taking the next job when it
finishes one, plus one process start per worker. Printed: per shape, the measured tokens/s, per-step and fixed
costs; per budget, the jobs' steps and CPU time; the total.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Transformer
from omegaconf import open_dict

from attnzoo.cli.sweep import smoke_overlay
from attnzoo.config.paths import CONF_DIR, sweeps_dir
from attnzoo.training.run import train

BUDGET = "trainer.max_flops"


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def compose_job(name: str, overrides: list[str]):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=[f"hydra.searchpath=[file://{sweeps_dir().parent}]", f"+sweeps={name}",
                                           *smoke_overlay(name, overrides), *overrides], return_hydra_config=True)


def grid(name: str, overrides: list[str]) -> list[dict[str, str]]:
    """The sweep's jobs in the order the basic sweeper makes them (the first key varies slowest); a grid key on the
    command line replaces the file's values, as attnzoo-sweep does."""
    fixed = [o for o in overrides if not _is_sweep(o)]
    params = {k: str(v) for k, v in compose_job(name, fixed).hydra.sweeper.params.items()}
    for o in overrides:
        if _is_sweep(o) or o.split("=", 1)[0] in params:
            params[o.split("=", 1)[0]] = o.split("=", 1)[1]
    parser = OverridesParser.create()
    values = {k: [str(x) for x in parser.parse_override(f"{k}={v}").sweep_iterator(Transformer.encode)]
              if parser.parse_override(f"{k}={v}").is_sweep_override() else [v] for k, v in params.items()}
    return [dict(zip(values, combo)) for combo in itertools.product(*values.values())]


def _is_sweep(o: str) -> bool:
    try:
        return "=" in o and OverridesParser.create().parse_override(o).is_sweep_override()
    except Exception:  # noqa: BLE001 - not an override Hydra's grammar knows (e.g. a flag): not a grid key
        return False


def probe(name: str, fixed: list[str], shape: dict[str, str], steps: int, out: Path, validate: bool) -> tuple[float, dict]:
    """CPU seconds of one short run of the shape's config, and its summary.json."""
    cfg = compose_job(name, [*fixed, *[f"{k}={v}" for k, v in shape.items()]])
    with open_dict(cfg):
        del cfg["hydra"]
        cfg.paths.output_dir = str(out)
        cfg.trainer.max_flops = None
        cfg.trainer.max_steps = steps
        cfg.trainer.val_check_interval = 10 ** 6  # the end-of-run validation only
        cfg.trainer.enable_progress_bar = False
        cfg.callbacks.save_best = False
        if not validate:
            cfg.trainer.limit_val_batches = 0
    start = cpu_seconds()
    train(cfg)
    return cpu_seconds() - start, json.loads((out / "summary.json").read_text())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("sweep")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--workers", type=int, default=2, help="jobs side by side (attnzoo-sweep: 2 on 2 cores)")
    ap.add_argument("--probe", default="10,40", help="the two short runs' lengths in steps")
    ap.add_argument("--out", default="/tmp/attnzoo_sweep_time", help="where the short runs write")
    ap.add_argument("--json", help="also write the estimate here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # as each job of a 2-worker sweep on 2 cores (attnzoo-sweep sets OMP_NUM_THREADS)
    s1, s2 = (int(v) for v in args.probe.split(","))
    fixed = [o for o in args.overrides if not _is_sweep(o)]
    jobs = grid(args.sweep, args.overrides)
    if not all(BUDGET in j for j in jobs):
        sys.exit(f"sweep_time: {args.sweep} does not sweep {BUDGET}; it estimates budget sweeps")
    start = time.time()
    t0 = cpu_seconds()
    first = {k: v for k, v in jobs[0].items() if k != BUDGET}
    probe(args.sweep, fixed, first, 1, Path(args.out) / "warmup", True)  # once: the tokenizer, the corpus cache
    shapes: dict[tuple, dict] = {}
    for job in jobs:
        shape = {k: v for k, v in job.items() if k != BUDGET}
        key = tuple(sorted(shape.items()))
        if key in shapes:
            continue
        tag = "_".join(v.strip("[]").replace(",", "-") for v in shape.values())
        a, summary = probe(args.sweep, fixed, shape, s1, Path(args.out) / f"{tag}_a", True)
        b, _ = probe(args.sweep, fixed, shape, s2, Path(args.out) / f"{tag}_b", True)
        c, _ = probe(args.sweep, fixed, shape, s1, Path(args.out) / f"{tag}_c", False)
        per_step = max(b - a, 1e-9) / (s2 - s1)
        length = summary["length"]
        shapes[key] = {"shape": shape, "per_step_s": per_step, "fixed_s": max(a - s1 * per_step, 0.0),
                       "validation_s": max(a - c, 0.0), "tokens_per_step": length["tokens_per_step"],
                       "flops_per_step": length["tokens_per_step"] * length["flops_per_token"],
                       "tokens_per_s": length["tokens_per_step"] / per_step,
                       "params_non_embedding": summary["metrics"].get("params/non_embedding")}
        print(f"{tag:28s} {shapes[key]['tokens_per_s']:9,.0f} tokens/s  {1000 * per_step:7.1f} ms/step  fixed "
              f"{shapes[key]['fixed_s']:5.1f} s  validation {shapes[key]['validation_s']:5.1f} s", flush=True)
    probing = time.time() - start, cpu_seconds() - t0
    fixed_cfg = compose_job(args.sweep, fixed)
    vci = fixed_cfg.trainer.val_check_interval
    costs = []
    for job in jobs:
        sh = shapes[tuple(sorted((k, v) for k, v in job.items() if k != BUDGET))]
        steps = max(1, math.ceil(float(job[BUDGET]) / sh["flops_per_step"]))
        vals = steps // vci if isinstance(vci, int) else 0
        costs.append({**job, "steps": steps, "cpu_s": sh["fixed_s"] + steps * sh["per_step_s"] + vals * sh["validation_s"]})
    workers = [0.0] * args.workers
    for c in costs:  # each job to the worker that frees first, in grid order
        workers[workers.index(min(workers))] += c["cpu_s"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)  # a fresh worker's start: the interpreter, attnzoo's imports
    subprocess.run([sys.executable, "-c", "import attnzoo.training.run"], check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    start_s = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    wall = max(workers) + start_s
    for budget in dict.fromkeys(c[BUDGET] for c in costs):
        mine = [c for c in costs if c[BUDGET] == budget]
        print(f"{BUDGET}={budget}: {len(mine)} jobs, {min(c['steps'] for c in mine):,}-{max(c['steps'] for c in mine):,} "
              f"steps, {sum(c['cpu_s'] for c in mine) / 60:.1f} CPU minutes")
    total = sum(c["cpu_s"] for c in costs)
    print(f"{len(costs)} jobs: {total / 60:.1f} CPU minutes; on {args.workers} workers about {wall / 60:.1f} minutes "
          f"(a worker's start {start_s:.1f} s); measured in {probing[0] / 60:.1f} minutes ({probing[1] / 60:.1f} CPU)")
    if args.json:
        Path(args.json).write_text(json.dumps({"sweep": args.sweep, "overrides": args.overrides, "workers": args.workers,
                                               "shapes": list(shapes.values()), "jobs": costs, "cpu_s": total,
                                               "wall_s": wall, "worker_start_s": start_s}, indent=1))


if __name__ == "__main__":
    main()
