"""SIGKILL / resume trials per stateful feature: the score table of docs/reliability.md.

For each feature: one uninterrupted reference run, then N trials of (start the same run through the CLI,
SIGKILL it — the whole process group, DDP workers included — once its last.ckpt reaches a random step,
resume with `attnzoo-train --resume RUN_DIR`). A trial passes when the resumed run finishes, every
train/loss logged from the checkpoint step on equals the reference's (abs 1e-6), its final val/loss equals
the reference's, and metrics.csv still holds the steps before the kill.

    .venv/bin/python scripts/kill_resume.py --trials 10 --out docs/bench/kill_resume.json
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SMOKE = ["debug=smoke", "trainer.max_steps=120", "trainer.val_check_interval=100", "callbacks.checkpoint_every_n_steps=2",
         "callbacks.save_best=false", "trainer.limit_val_batches=2", "perf.measure_decode=false", "sample.max_new_tokens=0"]
TEXT = ["data.tokenizer=char", "data.max_chars=200000", "data.batch_size=8", "optim.lr=3e-3"]
FEATURES = {
    "text (GQA, char tokenizer)": TEXT,
    "mqar (experiment=mqar)": ["experiment=mqar", "callbacks.early_stop=null"],
    "gated_deltanet": TEXT + ["model/mixer=gated_deltanet"],
    "moe (aux loss + aux-loss-free bias)": TEXT + ["model/ffn=moe", "model.ffn.n_experts=4", "model.ffn.top_k=2",
                                                   "model.ffn.bias_update_speed=0.01", "model.ffn.aux_loss_coef=0.01"],
    "encdec (data=reversal)": ["model=encdec", "data=reversal"],
    "ddp_cpu (2 processes)": TEXT + ["trainer=ddp_cpu"],
    "fsdp_cpu (2 processes, sharded checkpoints)": TEXT + ["trainer=fsdp_cpu"],
}


def run_cli(args, env, **kw):
    return subprocess.Popen([sys.executable, "-m", "attnzoo.cli.train", *args], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, **kw)


def ckpt_step(path: Path) -> int:
    try:
        meta = path / "meta.pt" if path.is_dir() else path  # a sharded checkpoint (trainer=fsdp): its meta.pt
        return int(torch.load(meta, weights_only=True, map_location="cpu")["global_step"])
    except Exception:  # noqa: BLE001 - absent, or being replaced right now
        return -1


def read_metrics(run: Path) -> tuple[dict, float | None]:
    rows = list(csv.DictReader(open(run / "csv" / "metrics.csv")))
    train = {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}
    summary = json.loads((run / "summary.json").read_text())
    return train, summary.get("metrics", {}).get("val/loss")


def trial(feature: list, work: Path, ref: tuple, env: dict, rng: random.Random) -> dict:
    run = work / "killed"
    shutil.rmtree(run, ignore_errors=True)
    target = rng.randrange(4, 100, 2)
    p = run_cli(feature + SMOKE + [f"hydra.run.dir={run}"], env)
    start = time.time()
    while ckpt_step(run / "checkpoints" / "last.ckpt") < target and p.poll() is None and time.time() - start < 300:
        time.sleep(0.05)
    time.sleep(rng.random() * 0.05)  # land anywhere in the next step or two, a checkpoint write included
    if p.poll() is None:  # it may have finished first (a target past its last checkpoint)
        os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    killed_at = ckpt_step(run / "checkpoints" / "last.ckpt")
    r = subprocess.run([sys.executable, "-m", "attnzoo.cli.train", "--resume", str(run)], env=env, capture_output=True,
                       text=True, timeout=600)
    if r.returncode != 0:
        return {"ok": False, "killed_at": killed_at, "why": (r.stdout + r.stderr).strip().splitlines()[-40:]}
    train, val = read_metrics(run)
    ref_train, ref_val = ref
    after = [s for s in ref_train if s >= killed_at]
    same = all(s in train and abs(train[s] - ref_train[s]) <= 1e-6 for s in after)
    kept = all(s in train for s in ref_train if s < killed_at)
    ok = same and kept and val is not None and abs(val - ref_val) <= 1e-6 and killed_at < 120
    return {"ok": ok, "killed_at": killed_at, "target": target, "losses_equal": same, "history_kept": kept,
            "val_loss": val, "ref_val_loss": ref_val}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--features", nargs="*", default=list(FEATURES))
    ap.add_argument("--out", default="bench_results/kill_resume.json")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    results = {}
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.features:
            feature = FEATURES[name]
            work = Path(tmp) / name.split()[0]
            cache = [f"paths.cache_dir={Path(tmp) / 'cache'}"]
            ref_dir = work / "ref"
            r = subprocess.run([sys.executable, "-m", "attnzoo.cli.train", *feature, *SMOKE, *cache, f"hydra.run.dir={ref_dir}"],
                               env=env, capture_output=True, text=True, timeout=600)
            if r.returncode != 0:
                raise SystemExit(f"{name}: the reference run failed:\n{r.stderr[-3000:]}")
            ref = read_metrics(ref_dir)
            trials = [trial(feature + cache, work, ref, env, rng) for _ in range(args.trials)]
            results[name] = {"passed": sum(t["ok"] for t in trials), "trials": trials}
            print(f"{name}: {results[name]['passed']}/{args.trials} "
                  f"(killed at steps {[t['killed_at'] for t in trials]})", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"trials": args.trials, "seed": args.seed, "wall_seconds": time.time() - t0,
                               "max_steps": 120, "results": results}, indent=2))
    lines = ["| feature | passed | killed at (checkpoint step) |", "|---|---|---|"]
    lines += [f"| {k} | {v['passed']}/{args.trials} | {', '.join(str(t['killed_at']) for t in v['trials'])} |"
              for k, v in results.items()]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
