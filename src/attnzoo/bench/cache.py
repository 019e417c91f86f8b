"""`attnzoo-bench cache`: KV-cache memory (analytic and measured) and decode/prefill speed per attention mixer.

Every mixer runs in the same decoder (d_model, heads, layers, vocab), batch 1, fp32:
- analytic cache bytes per token and at 1k/4k/16k/64k context (`model.cache_bytes`);
- measured bytes (`cache.nbytes()`, the tensors really held) after a real prefill to each decode context;
- decode tokens/s at each context (prefill there, then time one-token steps); prefill tokens/s from empty.
"""
from __future__ import annotations

import time

import torch

from attnzoo.bench.common import windowed
from attnzoo.models.decoder import DecoderLM

HELP = "KV-cache bytes (analytic + measured) and decode/prefill tokens/s for mha/gqa/mqa/sliding_window/mla"
MIB = 2**20
ANALYTIC_CONTEXTS = (1024, 4096, 16384, 65536)


def add_arguments(p) -> None:
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--n-kv-heads", type=int, default=2, help="GQA / sliding-window KV heads")
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--window", type=int, default=512, help="sliding-window W")
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 4096], help="decode contexts (measured)")
    p.add_argument("--prefill-len", type=int, default=2048)
    p.add_argument("--decode-steps", type=int, default=24, help="timed one-token steps per context")
    p.add_argument("--mixers", nargs="+", default=["mha", "gqa", "mqa", "sliding_window", "mla", "local_global"])


QUICK = {"d_model": 64, "n_heads": 4, "n_kv_heads": 2, "n_layers": 4, "window": 32, "contexts": [64, 128],
         "prefill_len": 128, "decode_steps": 8}


def model_config(name: str, args) -> dict:
    cfg = {
        "d_model": args.d_model, "n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads, "n_layers": args.n_layers,
        "max_seq_len": max(args.contexts) + args.decode_steps + 8,
    }
    if name == "local_global":  # conf/model/local_global.yaml: 3 windowed layers to 1 global (fewer layers: n-1 to 1)
        pattern = ["local", "local", "local", "global"] if args.n_layers % 4 == 0 else ["local"] * (args.n_layers - 1) + ["global"]
        return {**cfg, "pattern": pattern if args.n_layers > 1 else ["global"],
                "mixers": {"local": {"name": "sliding_window", "window": args.window}, "global": {"name": "gqa"}}}
    mixer = {"name": name, "window": args.window} if windowed(name) else {"name": name}
    return {**cfg, "mixer": mixer}


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@torch.inference_mode()
def measure(models: dict, args, gen: torch.Generator) -> dict:
    """Timings for every model, interleaved: each round visits every mixer in turn, so a burst of load
    from other processes slows all of them alike instead of whichever mixer happened to be running."""
    V, rounds = args.vocab, 4
    tokens = lambda n: torch.randint(0, V, (1, n), generator=gen)  # noqa: E731
    out = {name: {} for name in models}
    idx, step = tokens(args.prefill_len), tokens(1)
    for m in models.values():
        m(tokens(64))  # warm up kernels
    prefill = {name: [] for name in models}
    for _ in range(2):
        for name, m in models.items():
            prefill[name].append(_seconds(lambda: m(idx)))
    caches = {name: m.new_cache(1, max(args.contexts) + args.decode_steps + 2) for name, m in models.items()}
    for ctx in sorted(args.contexts):
        times = {name: [] for name in models}
        for name, m in models.items():
            cache = caches[name]
            if ctx > cache.seq_len:
                m(tokens(ctx - cache.seq_len), cache=cache)  # continue the prefill up to ctx
            out[name][f"meas MiB@{ctx}"] = cache.nbytes() / MIB
            if cache.nbytes() != m.cache_bytes(cache.seq_len):
                raise RuntimeError(f"{name}: measured {cache.nbytes()} != analytic {m.cache_bytes(cache.seq_len)} bytes")
            m(step, cache=cache)  # one untimed step
        for r in range(rounds):
            for name, m in models.items():
                n = args.decode_steps // rounds + (r < args.decode_steps % rounds)
                times[name] += [_seconds(lambda: m(step, cache=caches[name])) for _ in range(n)]
        for name in models:
            # lower-quartile step: other processes only ever slow a step down, so this is the steadier figure
            t = sorted(times[name])
            out[name][f"decode tok/s@{ctx}"] = 1.0 / t[len(t) // 4]
    for name in models:
        out[name]["prefill tok/s"] = args.prefill_len / min(prefill[name])
    return out


def run(args) -> dict:
    if getattr(args, "threads", None) is None:
        # batch-1 decode of a small model is op-overhead bound: one thread is faster and far steadier than
        # OpenMP hand-offs on a small shared CPU; `attnzoo-bench --threads N cache` overrides
        torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    models, rows = {}, []
    for name in args.mixers:
        torch.manual_seed(0)
        models[name] = model = DecoderLM(model_config(name, args), vocab_size=args.vocab).eval()
        row = {"mixer": name, "KiB/token": model.cache_bytes(1) / 1024}
        for L in ANALYTIC_CONTEXTS:
            row[f"MiB@{L // 1024}k"] = model.cache_bytes(L) / MIB
        row["GFLOP/tok@4k"] = model.flops_per_token(4096) / 1e9
        rows.append(row)
    measured = measure(models, args, gen)
    for row in rows:
        row.update(measured[row["mixer"]])
    ctxs = sorted(args.contexts)
    columns = ["mixer", "KiB/token"] + [f"MiB@{L // 1024}k" for L in ANALYTIC_CONTEXTS] + ["GFLOP/tok@4k"]
    columns += [f"meas MiB@{c}" for c in ctxs] + [f"decode tok/s@{c}" for c in ctxs] + ["prefill tok/s"]
    hd = args.d_model // args.n_heads
    notes = [
        f"d_model={args.d_model}, n_heads={args.n_heads} (head_dim {hd}), n_kv_heads={args.n_kv_heads} (gqa, "
        f"sliding_window), n_layers={args.n_layers}, W={args.window}, vocab={args.vocab}, batch 1, fp32, "
        f"{torch.get_num_threads()} threads; MLA defaults: kv_lora_rank={4 * hd}, qk_rope_head_dim={hd // 2}.",
        "KiB/token: cache bytes per token of context (for sliding_window, until the context reaches W). "
        "MiB@Nk: analytic `model.cache_bytes(N)`. meas MiB@N: `cache.nbytes()` after a real prefill to N "
        "(asserted equal to the analytic bytes).",
        f"decode tok/s@N: 1 / lower-quartile time of {args.decode_steps} one-token steps after a prefill to N, "
        f"mixers interleaved in rounds "
        f"(batch 1; includes the LM head). prefill tok/s: best of two {args.prefill_len}-token forwards from empty.",
    ]
    return {"title": "KV-cache memory and decode speed per attention mixer", "columns": columns, "rows": rows,
            "notes": notes}
