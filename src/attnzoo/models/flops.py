"""FLOPs accounting and the hardware peak for MFU (the conventions: README, "Metrics"; mixers/base.py).

Model FLOPs are analytic (a multiply-add = 2 FLOPs): each mixer's and FFN's `flops_per_token(context)`,
plus the LM head `2 * d_model * vocab`. Training = 3x forward (backward = 2x forward).
MFU = achieved model FLOP/s / peak FLOP/s, where the peak is a dense matmul measured on CPU (once per machine,
torch version, thread count and dtype: kept in `<paths.cache_dir>/matmul_peak.json`), or a table of dense (not
2:4-sparse) datasheet figures on GPU; `perf.peak_flops` overrides both.
"""
from __future__ import annotations

import json
import os
import platform
import re
import time
from functools import lru_cache
from pathlib import Path

import torch

# Dense tensor-core peaks (FLOP/s) from vendor datasheets, without 2:4 sparsity. fp32 = tf32 tensor cores
# where the framework uses them (torch's default matmul precision is "highest" = no tf32, so fp32 entries
# are the non-tensor-core FP32 rate). Each row is matched by the whole of `torch.cuda.get_device_name()` (a
# regular expression over the names the driver reports): a substring match took "NVIDIA L40" for the L4 and
# gave an H100 PCIe the SXM's peak. An unlisted name (A10G, RTX A6000, ...) gets its matmul peak measured.
GPU_PEAKS = {
    "H200": (r"NVIDIA H200( 141GB HBM3e)?", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),  # SXM
    "H200 NVL": (r"NVIDIA H200 NVL", {"bf16": 835e12, "fp16": 835e12, "fp32": 60e12}),
    "H100 SXM": (r"NVIDIA H100( 80GB HBM3| SXM5 80GB)?", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),
    "H100 PCIe": (r"NVIDIA H100 PCIe", {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12}),
    "H100 NVL": (r"NVIDIA H100 NVL", {"bf16": 835e12, "fp16": 835e12, "fp32": 60e12}),
    "A100": (r"NVIDIA A100(-SXM4-40GB|-SXM4-80GB|-PCIE-40GB| 80GB PCIe|-SXM-80GB)?",
             {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}),
    "L40S": (r"NVIDIA L40S", {"bf16": 362e12, "fp16": 362e12, "fp32": 91.6e12}),
    "L40": (r"NVIDIA L40", {"bf16": 181e12, "fp16": 181e12, "fp32": 90.5e12}),
    "L4": (r"NVIDIA L4", {"bf16": 121e12, "fp16": 121e12, "fp32": 30.3e12}),
    "A10": (r"NVIDIA A10", {"bf16": 125e12, "fp16": 125e12, "fp32": 31.2e12}),
    "RTX 4090": (r"NVIDIA GeForce RTX 4090", {"bf16": 165e12, "fp16": 165e12, "fp32": 82.6e12}),
}


def datasheet_peak(device_name: str, dtype: torch.dtype) -> tuple[float, str] | None:
    """(dense peak FLOP/s, 'datasheet:<row>') for a `torch.cuda.get_device_name()` string, or None if unlisted."""
    for key, (pattern, table) in GPU_PEAKS.items():
        if re.fullmatch(pattern, device_name.strip()):
            return table[_dtype_key(dtype)], f"datasheet:{key}"
    return None


def precision_dtype(precision: str) -> torch.dtype:
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    return torch.float32


def _dtype_key(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


@lru_cache(maxsize=None)
def measure_matmul_peak(dtype: torch.dtype = torch.float32, device: str = "cpu", n: int = 1024, seconds: float = 0.4) -> float:
    """Best FLOP/s of an n x n x n matmul in `dtype` on `device`, over ~`seconds` of repeats. Where one such matmul
    alone would take longer than that (bf16 on a CPU without native bf16 matmuls: ~3 s at n = 1024 on one core), n is
    halved until it fits (down to 128): the slow path's FLOP/s hardly depend on the size, and a run's start does not
    wait 20 s for its MFU's denominator."""
    g = torch.Generator().manual_seed(0)  # its own generator: a run's random stream must not depend on the cache
    if not device.startswith("cuda"):
        probe = torch.randn(128, 128, generator=g).to(dtype=dtype)
        probe @ probe  # the first call pays one-time set-up
        t0 = time.perf_counter()
        probe @ probe
        per_flop = (time.perf_counter() - t0) / (2.0 * 128**3)
        while n > 128 and 6 * per_flop * 2.0 * n**3 > seconds:  # 6 matmuls: 2 warm-up, 4 timed
            n //= 2
    a = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(2):
        a @ b
    sync()
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        sync()
        best = min(best, (time.perf_counter() - t0) / 4)
    return 2.0 * n**3 / best


PEAK_CACHE = "matmul_peak.json"


def _processor_name() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what platform reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def peak_key(device: torch.device, dtype: torch.dtype) -> str:
    """What a measured peak depends on: the device's name, torch's version, the thread count (CPU) and the dtype."""
    if device.type == "cuda":
        return f"cuda | {torch.cuda.get_device_name(device)} | torch {torch.__version__} | {_dtype_key(dtype)}"
    return f"cpu | {_processor_name()} | torch {torch.__version__} | {torch.get_num_threads()} threads | {_dtype_key(dtype)}"


def cached_measurement(key: str, measure, cache_dir: str | os.PathLike | None) -> float:
    """`measure()` once per key and cache folder: later runs (a sweep's jobs, DDP ranks, every test run) read the
    first one's figure from `<cache_dir>/matmul_peak.json` instead of spending ~0.5 s on it each, and their MFUs
    share one denominator. A missing or unreadable file is measured again (and rewritten: one file replace, so
    ranks measuring at once leave one whole file). None: measured in this process only."""
    if cache_dir is None:
        return measure()
    path = Path(cache_dir).expanduser() / PEAK_CACHE
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    table = table if isinstance(table, dict) else {}
    try:
        value = float(table[key]["flops"])
        if value > 0 and value != float("inf"):  # NaN fails the first test
            return value
    except (ValueError, KeyError, TypeError):
        pass
    value = measure()
    try:
        table[key] = {"flops": value, "measured": time.strftime("%Y-%m-%d %H:%M:%S"),
                      "load": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{PEAK_CACHE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:  # a read-only cache folder: measured, not kept
        pass
    return value


def peak_flops(device: torch.device | str, dtype: torch.dtype, override: float | None = None,
               cache_dir: str | os.PathLike | None = None) -> tuple[float, str]:
    """(peak FLOP/s, where it came from) for one device. cache_dir: where a measured peak is kept (cached_measurement)."""
    if override:
        return float(override), "perf.peak_flops"
    device = torch.device(device)
    if device.type == "cuda":
        found = datasheet_peak(torch.cuda.get_device_name(device), dtype)
        if found is not None:
            return found
        n = 4096
    else:
        n = 1024
    return cached_measurement(peak_key(device, dtype), lambda: measure_matmul_peak(dtype, str(device), n=n),
                              cache_dir), "measured-matmul"


def train_flops_per_token(model, context_len: int) -> float:
    """Forward + backward model FLOPs per token: 3x the forward count."""
    return 3.0 * model.flops_per_token(context_len)
