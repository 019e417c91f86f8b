"""`attnzoo-bench sliding_window`: the blocked band kernel's waste (keys scored per query against the keys a
causal window needs) and its time, forward and forward+backward, for several query-block sizes; the default
block (ops/sliding_window.py) is marked."""
from __future__ import annotations

import torch

from attnzoo.ops.sliding_window import sliding_window_sdpa
from attnzoo.bench.mixers import best_seconds

HELP = "sliding-window band kernel: keys scored / keys needed and ms per call, by query-block size"

QUICK = {"windows": [16], "length": 256, "blocks": [1.0, 0.25], "repeats": 1}


def add_arguments(p) -> None:
    p.add_argument("--windows", type=int, nargs="+", default=[64, 512])
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--blocks", type=float, nargs="+", default=[1.0, 0.5, 0.25, 0.125],
                   help="query rows per call as a fraction of W (at least 16 rows)")
    p.add_argument("--repeats", type=int, default=5, help="best of this many calls after one warm-up")


def needed_keys(T: int, W: int) -> float:
    """Keys a causal window of W attends per query, averaged over positions 1..T."""
    W = min(W, T)
    return (W * (W + 1) / 2 + (T - W) * W) / T


def scored_keys(T: int, W: int, block: int) -> float:
    """Keys per query the blocked kernel scores (one call over everything when T <= 2 * block)."""
    if T <= 2 * block:
        return float(T)
    total = 0
    for s in range(0, T, block):
        e = min(s + block, T)
        total += (e - s) * (e - max(0, s - W + 1))
    return total / T


def run(args) -> dict:
    T, rows = args.length, []
    g = torch.Generator().manual_seed(0)
    for W in args.windows:
        q = torch.randn(1, args.heads, T, args.head_dim, generator=g, requires_grad=True)
        k = torch.randn(1, args.kv_heads, T, args.head_dim, generator=g, requires_grad=True)
        v = torch.randn(1, args.kv_heads, T, args.head_dim, generator=g, requires_grad=True)
        defaults = {"fwd": max(W // 2, 64), "fwd+bwd": max(W // 2, 64)}
        blocks = sorted({max(16, int(W * f)) for f in args.blocks} | set(defaults.values()), reverse=True)
        for b in blocks:
            def fwd(b=b):
                with torch.no_grad():
                    sliding_window_sdpa(q, k, v, window=W, block=b)

            def fwd_bwd(b=b):
                sliding_window_sdpa(q, k, v, window=W, block=b).sum().backward()
                q.grad = k.grad = v.grad = None

            ratio = scored_keys(T, W, b) / needed_keys(T, W)
            rows.append({"W": W, "block": b, "keys scored / needed": ratio,
                         "fwd ms": 1e3 * best_seconds(fwd, args.repeats), "fwd+bwd ms": 1e3 * best_seconds(fwd_bwd, args.repeats),
                         "default for": " + ".join(m for m, d in defaults.items() if d == b) or None})
    return {
        "title": f"Sliding-window band kernel, T={T}, {args.heads}/{args.kv_heads} heads, d_head {args.head_dim}, fp32",
        "columns": ["W", "block", "keys scored / needed", "fwd ms", "fwd+bwd ms", "default for"],
        "rows": rows,
        "notes": [f"threads={torch.get_num_threads()}; best of {args.repeats} calls after a warm-up. keys needed: "
                  "the causal window's average (min(W, t) over t = 1..T); scored: (b + W - 1) per query for a block "
                  "of b rows. The default block is max(W/2, 64)."],
    }
