"""`attnzoo-bench memory`: peak memory and tokens/s of the decoder LM's training step (forward + backward of
LitLM's training loss) with activation checkpointing (trainer.activation_checkpointing) and chunked
cross-entropy (trainer.ce_chunk_tokens), alone and together, against the plain step.

Each configuration runs in a fresh process (spawned), on the same weights and tokens:
- peak MiB (tensors): the most bytes held at once by tensor storages created during one forward + backward
  (activations, saved tensors, logits, gradients; weights and inputs excluded), counted storage by storage at the
  dispatcher (`bench.mixers.PeakMemory`, exact and independent of the allocator; an op's internal scratch space
  that never becomes a tensor is not seen) on CPU, `torch.cuda.max_memory_allocated` on GPU;
- peak MiB (RSS): the process's high-water mark (ru_maxrss) after its first step minus its RSS before it (what
  the OS saw, allocator slack included; CPU only);
- tokens/s: batch x seq_len / the fastest of --steps timed steps after one warm-up (the least disturbed by other
  load), no optimizer step (the same in every configuration).
The loss column shows that every configuration computes the same loss.
"""
from __future__ import annotations

import contextlib
import json
import resource
import tempfile
import time
from pathlib import Path

import torch

HELP = "training-step peak memory and tokens/s: activation checkpointing and chunked cross-entropy vs the plain step"
MIB = 2**20
CONFIGS = {  # name -> trainer options
    "baseline": {},
    "activation checkpointing": {"activation_checkpointing": True},
    "chunked CE": {"ce_chunk_tokens": None},  # None: --ce-chunk-tokens
    "both": {"activation_checkpointing": True, "ce_chunk_tokens": None},
}
QUICK = {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "seq_len": 64, "batch": 2, "vocab": 512,
         "ce_chunk_tokens": 32, "steps": 1}


def add_arguments(p) -> None:
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-layers", type=int, default=8)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--n-kv-heads", type=int, default=2)
    p.add_argument("--mixer", default="gqa")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--ce-chunk-tokens", type=int, default=1024, help="trainer.ce_chunk_tokens of the chunked rows")
    p.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])
    p.add_argument("--steps", type=int, default=3, help="timed steps per configuration (after one warm-up)")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--in-process", action="store_true",
                   help="run every configuration in this process (no RSS column; tests)")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _worker(_rank: int, spec: dict, out_path: str) -> None:
    from attnzoo.training.lit_lm import LitLM
    from attnzoo.bench.mixers import peak_bytes

    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    torch.manual_seed(0)
    lit = LitLM({"model": spec["model"], "trainer": spec["trainer"]}, vocab_size=spec["vocab"]).to(device).train()
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, spec["vocab"], (spec["batch"], spec["seq_len"]), generator=g).to(device) for _ in range(2))
    amp = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if spec["precision"] == "bf16-mixed" \
        else contextlib.nullcontext
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    losses = []

    def step():
        lit.model.zero_grad(set_to_none=True)
        with amp():
            loss = lit._loss((x, y))[0]
        loss.backward()
        sync()
        losses.append(float(loss.detach()))

    base = _rss_bytes()
    step()  # the first step in this process: its high-water mark is the RSS column
    own = device.type == "cpu" and spec["own_process"]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base if own else None
    peak = peak_bytes(step, device)
    times = []
    for _ in range(spec["steps"]):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    Path(out_path).write_text(json.dumps({"peak": peak, "rss": rss, "seconds": min(times), "loss": losses[0]}))


def measure(spec: dict) -> dict:
    """One configuration in a fresh process (its RSS high-water mark is its own), or in this one."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="attnzoo-bench-memory-") as tmp:
        out = Path(tmp) / "row.json"
        if spec["own_process"]:
            mp.spawn(_worker, args=(spec, str(out)), nprocs=1, join=True)
        else:
            threads = torch.get_num_threads()
            try:
                _worker(0, spec, str(out))
            finally:
                torch.set_num_threads(threads)
        return json.loads(out.read_text())


def run(args) -> dict:
    if args.ce_chunk_tokens < 1:
        raise ValueError(f"--ce-chunk-tokens: must be >= 1, got {args.ce_chunk_tokens}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = {"d_model": args.d_model, "n_layers": args.n_layers, "n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads,
             "mixer": {"name": args.mixer}, "max_seq_len": max(args.seq_len, 64)}
    rows = []
    for name in args.configs:
        trainer = {k: (args.ce_chunk_tokens if v is None else v) for k, v in CONFIGS[name].items()}
        spec = {"model": model, "trainer": trainer, "vocab": args.vocab, "batch": args.batch, "seq_len": args.seq_len,
                "precision": args.precision, "steps": args.steps, "threads": torch.get_num_threads(), "device": device,
                "own_process": not args.in_process}
        r = measure(spec)
        ckpt = "true" if trainer.get("activation_checkpointing") else "false"
        rows.append({"config": name, "activation_checkpointing": ckpt,
                     "ce_chunk_tokens": trainer.get("ce_chunk_tokens", 0), "peak MiB (tensors)": r["peak"] / MIB,
                     "peak MiB (RSS)": None if r["rss"] is None else r["rss"] / MIB,
                     "tokens/s": args.batch * args.seq_len / r["seconds"], "step s": r["seconds"], "loss": r["loss"]})
    base = next((r for r in rows if r["config"] == "baseline"), rows[0])
    for r in rows:
        r["peak vs baseline"] = r["peak MiB (tensors)"] / base["peak MiB (tensors)"]
        r["tokens/s vs baseline"] = r["tokens/s"] / base["tokens/s"]
    tokens = args.batch * args.seq_len
    logits_mib = tokens * args.vocab * 4 / MIB
    notes = [
        f"model: {args.mixer} d_model={args.d_model} n_layers={args.n_layers} "
        f"heads={args.n_heads}/{args.n_kv_heads}kv, "
        f"swiglu, rope, rmsnorm, tied embeddings; vocab {args.vocab}; batch {args.batch} x seq_len {args.seq_len} "
        f"random tokens; {args.precision}; device={device}, threads={torch.get_num_threads()}; "
        f"{'all rows in one process' if args.in_process else 'one process per row'}.",
        f"One forward + backward of LitLM's training loss, no optimizer step. The fp32 logits of this batch are "
        f"{logits_mib:,.1f} MiB (F.cross_entropy also keeps their log-softmax and makes their gradient); a chunk of "
        f"{args.ce_chunk_tokens} tokens is {args.ce_chunk_tokens * args.vocab * 4 / MIB:,.1f} MiB.",
        "peak MiB (tensors): bytes of tensor storages live at once during the step (weights and inputs excluded; "
        "parameter gradients included), counted per storage at the dispatcher. peak MiB (RSS): ru_maxrss after the "
        "process's first step minus its RSS before it. tokens/s: the fastest of "
        f"{args.steps} timed steps after one warm-up.",
    ]
    return {"title": "Memory: activation checkpointing and chunked cross-entropy (training step)", "rows": rows,
            "notes": notes,
            "columns": ["config", "activation_checkpointing", "ce_chunk_tokens", "peak MiB (tensors)",
                        "peak vs baseline", "peak MiB (RSS)", "tokens/s", "tokens/s vs baseline", "step s", "loss"]}
