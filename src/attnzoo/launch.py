"""Per-job DDP worker launch, so Hydra multirun and DDP compose.

Lightning's default DDP launcher re-runs `sys.argv` for ranks > 0. Under `-m` that child re-runs the
whole sweep and pairs with the parent job by job; one failing job or a change of world size desyncs
everything after it (pytorch-lightning #11300, #18175). Instead, a job that asks for DDP on one node
writes its fully resolved config into its own output dir and starts `world_size` fresh worker
processes on it (`python -m attnzoo.worker <job.yaml>`), with the torch.distributed environment set
(MASTER_ADDR/PORT, WORLD_SIZE, NODE_RANK, LOCAL_RANK). Lightning sees LOCAL_RANK and does not launch
anything itself. The job waits for its workers, so jobs stay isolated: the next job starts with fresh
processes, and a failing worker fails only its own job.

Processes started by torchrun or SLURM (multi-node) are detected from the environment and run as is.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

WORKER_ENV = "ATTNZOO_WORKER"


def launched_externally() -> bool:
    env = os.environ
    if env.get(WORKER_ENV) or "LOCAL_RANK" in env or "TORCHELASTIC_RUN_ID" in env:
        return True
    return int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env


def processes_to_launch(trainer_cfg) -> int:
    """How many local worker processes this job must start itself (0: run in this process)."""
    strategy = str(trainer_cfg.strategy or "auto")
    if launched_externally() or not strategy.startswith("ddp") or strategy == "ddp_spawn" or trainer_cfg.num_nodes > 1:
        return 0
    devices = trainer_cfg.devices
    if isinstance(devices, (list, tuple)) or (hasattr(devices, "__len__") and not isinstance(devices, str)):
        n = len(devices)
    elif devices in (-1, "-1", "auto"):
        import torch

        n = torch.cuda.device_count() if trainer_cfg.accelerator in ("gpu", "cuda", "auto") else (os.cpu_count() or 1)
    else:
        n = int(devices)
    return n if n > 1 else 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_workers(container: dict, out: Path, n: int, timeout: float | None = None) -> None:
    """Run the job on `n` local worker processes; raise RuntimeError (naming the rank and its log) on failure."""
    launch_dir = out / "launch"
    launch_dir.mkdir(parents=True, exist_ok=True)
    job = launch_dir / "job.yaml"
    OmegaConf.save(OmegaConf.create(container), job)
    port = _free_port()
    procs, logs = [], []
    threads = max(1, (os.cpu_count() or 1) // n)
    for rank in range(n):
        env = dict(os.environ)
        env.update({WORKER_ENV: "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(n),
                    "NODE_RANK": "0", "LOCAL_RANK": str(rank), "RANK": str(rank), "OMP_NUM_THREADS": str(threads)})
        if rank == 0:
            log, stdout = None, None  # rank 0 prints the progress bar and the summary
        else:
            log = launch_dir / f"rank{rank}.log"
            stdout = open(log, "w")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, "-m", "attnzoo.worker", str(job)], env=env,
                                      stdout=stdout, stderr=subprocess.STDOUT if stdout else None))
    start = time.time()
    failed = None
    while True:
        codes = [p.poll() for p in procs]
        bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if bad and failed is None:
            failed = bad[0]
            time.sleep(2)  # let the other ranks notice and exit on their own, then stop them
            for p in procs:
                if p.poll() is None:
                    p.kill()
        if all(c is not None for c in [p.poll() for p in procs]):
            break
        if timeout and time.time() - start > timeout:
            for p in procs:
                p.kill()
            failed = failed or (-1, "timeout")
        time.sleep(0.2)
    if failed:
        rank, code = failed
        where = logs[rank] if rank >= 0 and logs[rank] else "the output above"
        raise RuntimeError(f"DDP worker rank {rank} exited with code {code}; see {where}")

