"""Timing helpers shared by the benchmark subcommands, and what they ask a mixer class."""
from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from attnzoo.config.registry import MIXERS


def windowed(mixer: str) -> bool:
    """The mixer is sliding-window attention (its class's kernel family): the benchmarks set its window."""
    return MIXERS.get(mixer).cls.kernel_family == "window"


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_fn(fn: Callable[[], object], *, warmup: int = 2, min_time: float = 0.5, max_iters: int = 1000, device="cpu") -> float:
    """Median seconds per call of `fn` after `warmup` calls, repeating until `min_time` has elapsed."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    start = time.perf_counter()
    while (time.perf_counter() - start < min_time or len(times) < 3) and len(times) < max_iters:
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(worker: Callable, args: tuple, nprocs: int) -> None:
    """`worker(rank, *args)` on `nprocs` processes (torch.multiprocessing.start_processes, joined; a rank's exception
    re-raised here): forked from the fork server DDP's workers come from (training/launch.py: it imported torch and
    attnzoo once and never computes), so each rank skips the ~4 s of imports a fresh interpreter pays on a 2-core
    machine; spawned fresh where the platform has no fork server or ATTNZOO_WORKER_START=spawn. A measurement of a
    process's own RSS needs a fresh one (bench/memory.py keeps torch's spawn)."""
    import torch.multiprocessing as mp

    from attnzoo.training.launch import _fork_context, start_method

    method = start_method()
    if method == "forkserver":
        _fork_context()  # the server that preloads the training stack, if it is not running yet
        # the server's environment and directory are those of its start: each rank takes on the caller's
        worker, args = _as_started_here, (worker, dict(os.environ), os.getcwd(), *args)
    mp.start_processes(worker, args=args, nprocs=nprocs, join=True, start_method=method)


def _as_started_here(rank: int, worker: Callable, env: dict, cwd: str, *args) -> None:
    """A rank forked from the fork server made what a process spawned by the caller would be
    (`launch.become_fresh_process`: its environment, directory, thread count, start method); then
    `worker(rank, *args)`."""
    from attnzoo.training.launch import become_fresh_process

    become_fresh_process(env, cwd)
    worker(rank, *args)


def spawn_ranks(worker: Callable, world: int, spec, prefix: str = "attnzoo-") -> list[dict]:
    """`worker(rank, world, port, spec, out)` on `world` processes (`start_ranks`); each rank writes its row as JSON
    to `out + f".{rank}"`. Returns the rows in rank order."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        out = str(Path(tmp) / "rank")
        start_ranks(worker, (world, free_port(), spec, out), world)
        return [json.loads(Path(out + f".{r}").read_text()) for r in range(world)]
