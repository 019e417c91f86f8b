"""Timing helpers shared by the benchmark subcommands, and what they ask a mixer class."""
from __future__ import annotations

import time
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
