"""Timing helpers shared by the benchmark subcommands, and what they ask a mixer class."""
from __future__ import annotations

import json
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


def spawn_ranks(worker: Callable, world: int, spec, prefix: str = "attnzoo-") -> list[dict]:
    """`worker(rank, world, port, spec, out)` on `world` fresh processes (torch.multiprocessing); each rank writes its
    row as JSON to `out + f".{rank}"`. Returns the rows in rank order."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        out = str(Path(tmp) / "rank")
        mp.spawn(worker, args=(world, free_port(), spec, out), nprocs=world, join=True)
        return [json.loads(Path(out + f".{r}").read_text()) for r in range(world)]
