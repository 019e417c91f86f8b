"""`attnzoo-bench delta`: tokens/s of the gated delta rule's chunkwise form vs its per-token recurrence vs
transformers' Qwen3-Next `torch_chunk_gated_delta_rule`, forward and forward+backward, in one run.

Same inputs for every form: B=1, H heads, d_k = d_v = D, L2-normalised q/k, beta = sigmoid(randn),
g = logsigmoid(randn) (fla's test convention, about -0.8 per token), fp32, chunk 64 for both chunk forms.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from attnzoo.ops.delta_rule import chunk_delta_rule, delta_rule_recurrent

HELP = "gated delta rule: chunkwise vs recurrent vs transformers' torch_chunk_gated_delta_rule (tokens/s)"


QUICK = {"lengths": [64, 128], "heads": 2, "head_dim": 16, "chunk_size": 32, "num_threads": 1, "min_time": 0.02,
         "recurrent_max_len": 128}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--num-threads", type=int, default=2, help="torch.set_num_threads for this benchmark")
    p.add_argument("--min-time", type=float, default=0.4, help="seconds of repeats per measurement")
    p.add_argument("--recurrent-max-len", type=int, default=2048, help="skip the slow recurrence above this T (keeps the default run short)")
    p.add_argument(
        "--flush-denormal", action=argparse.BooleanOptionalAction, default=True,
        help="torch.set_flush_denormal for every form (decays make subnormal floats, 10-100x slower on x86)",
    )


def _hf_chunk():
    try:
        from transformers.models.qwen3_next import modeling_qwen3_next as m
    except ImportError:
        return None
    fn = m.torch_chunk_gated_delta_rule
    return getattr(fn, "__wrapped__", fn)


def best_of_interleaved(calls: dict, min_time: float, slow=frozenset()) -> dict:
    """Seconds per call of each form: one warm-up each, then rounds that call every form once in turn
    (so load from other processes hits all forms alike) until `min_time` has passed for the fast forms;
    the best round per form is reported. `slow` forms (the per-token recurrence) run 2 rounds only."""
    for fn in calls.values():
        fn()
    best = {n: float("inf") for n in calls}
    start, rounds = time.perf_counter(), 0
    while rounds < 3 or time.perf_counter() - start < min_time * len(calls):
        for n, fn in calls.items():
            if n in slow and rounds >= 2:
                continue
            t0 = time.perf_counter()
            fn()
            best[n] = min(best[n], time.perf_counter() - t0)
        rounds += 1
        if rounds >= 200:
            break
    return best


def run(args) -> dict:
    torch.set_num_threads(args.num_threads)
    torch.set_flush_denormal(args.flush_denormal)
    hf = _hf_chunk()
    H, D, C = args.heads, args.head_dim, args.chunk_size
    rows = []
    for T in args.lengths:
        gen = torch.Generator().manual_seed(T)
        q = F.normalize(torch.randn(1, H, T, D, generator=gen), dim=-1)
        k = F.normalize(torch.randn(1, H, T, D, generator=gen), dim=-1)
        v = torch.randn(1, H, T, D, generator=gen)
        beta = torch.sigmoid(torch.randn(1, H, T, generator=gen))
        g = F.logsigmoid(torch.randn(1, H, T, generator=gen))
        ours = (q, k, v, beta, g)
        # transformers takes (B, T, H, D): hand it contiguous tensors in its own layout
        theirs = [x.transpose(1, 2).contiguous() for x in (q, k, v, g, beta)]

        forms = {"chunk": lambda *a: chunk_delta_rule(*a, chunk_size=C)[0]}
        if T <= args.recurrent_max_len:
            forms["recurrent"] = lambda *a: delta_rule_recurrent(*a)[0]
        if hf is not None:
            forms["transformers"] = lambda q_, k_, v_, g_, b_: hf(q_, k_, v_, g=g_, beta=b_, chunk_size=C)[0]

        for mode in ("fwd", "fwd+bwd"):
            calls = {}
            for name, fn in forms.items():
                xs = theirs if name == "transformers" else ours
                if mode == "fwd":
                    def call(fn=fn, xs=xs):
                        with torch.no_grad():
                            fn(*xs)
                else:
                    leaves = [x.clone().requires_grad_() for x in xs]

                    def call(fn=fn, leaves=leaves):
                        fn(*leaves).sum().backward()
                calls[name] = call
            secs = best_of_interleaved(calls, args.min_time, slow={"recurrent"})
            row = {"T": T, "mode": mode, **{f"{n} tok/s": T / s for n, s in secs.items()}}
            if "transformers tok/s" in row:
                row["chunk / transformers"] = row["chunk tok/s"] / row["transformers tok/s"]
            if "recurrent tok/s" in row:
                row["chunk / recurrent"] = row["chunk tok/s"] / row["recurrent tok/s"]
            rows.append(row)
            print({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}, flush=True)

    columns = ["T", "mode", "chunk tok/s", "recurrent tok/s", "transformers tok/s", "chunk / transformers", "chunk / recurrent"]
    return {
        "title": f"Gated delta rule, B=1 H={H} d_k=d_v={D} chunk={C}, fp32, {args.num_threads} threads",
        "columns": columns,
        "rows": rows,
        "notes": [
            "chunk = attnzoo.ops.delta_rule.chunk_delta_rule; recurrent = delta_rule_recurrent (per-token loop); "
            "transformers = Qwen3-Next torch_chunk_gated_delta_rule (the pure-torch fallback).",
            f"flush_denormal={args.flush_denormal} for every form. Best of interleaved rounds (>= {args.min_time}s per "
            "form) after one warm-up; the recurrence: best of 2 rounds.",
            "transformers unavailable: column empty." if hf is None else "",
        ],
    }
