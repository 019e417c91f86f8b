"""`attnzoo-bench context_parallel`: context parallelism (parallel.py) on N gloo processes of this machine.

Two parts, both in fresh worker processes started with torch.multiprocessing:

- `--check`: equivalence. For every mixer case (CASES) and layout, each rank builds the same seeded model,
  runs the full sequence in-process (the reference), then its shard under `parallel.sharded`; outputs are
  gathered and unsharded, parameter gradients summed over the ranks, and both compared with the reference
  (max |difference| / max(1, max |reference|)) in float64 and float32 (`tolerance`: 1e-10 in float64; in float32
  FP32_FACTOR x the reference's own float32-vs-float64 gap, measured on the same weights and inputs).
- timing (default): one model at a long context, forward + backward on the full sequence in one process
  and on N ranks; tokens/s per rank, the exposed communication share of the step, and the peak resident
  memory each process gained during its first step (ru_maxrss after it minus the RSS before it).
"""
from __future__ import annotations

import json
import os
import resource
import tempfile
import time
from pathlib import Path

import torch

from attnzoo.bench.common import free_port, spawn_ranks, start_ranks

HELP = "context parallelism: equivalence per mixer (--check) or tokens/s, comm share and peak memory per rank"

_BASE = {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn": {"name": "swiglu"}, "max_seq_len": 4096}


def _case(suffix: str = "", **section) -> tuple[str, dict]:
    """(label, model section) of one case: the label is the mixer's name and what the case adds (`suffix`)."""
    return section["mixer"]["name"] + suffix, section


# tiny decoder configs (model section dicts) per mixer; the hybrid mixes all three families per layer
CASES: dict[str, dict] = dict([
    _case(mixer={"name": "mha"}),
    _case(mixer={"name": "gqa"}),
    _case(mixer={"name": "mqa"}),
    _case("+conv3", mixer={"name": "gqa", "conv_size": 3}),
    _case("+alibi", mixer={"name": "gqa"}, position={"name": "alibi"}),
    _case("+learned", mixer={"name": "gqa"}, position={"name": "learned"}),
    _case(" W5", mixer={"name": "sliding_window", "window": 5}),
    _case(" W5 + 2 sinks", mixer={"name": "sliding_window", "window": 5, "sink_tokens": 2}),
    _case(mixer={"name": "mla"}),
    _case(mixer={"name": "linear_attention", "chunk_size": 4}),
    _case("+conv3", mixer={"name": "linear_attention", "chunk_size": 4, "conv_size": 3, "qkv_activation": "silu"}),
    _case(mixer={"name": "deltanet", "chunk_size": 4}),
    _case(mixer={"name": "gated_deltanet", "chunk_size": 4}),
    _case(mixer={"name": "gla", "chunk_size": 4}),
    _case(mixer={"name": "retnet", "chunk_size": 4}),
    _case(mixer={"name": "hgrn2", "chunk_size": 4}),
    _case(mixer={"name": "mamba2", "chunk_size": 4, "d_state": 8, "n_groups": 2}),
    _case("+conv3", mixer={"name": "rwkv7", "chunk_size": 4, "conv_size": 3}),
    ("hybrid gdn/gqa/swa", {"n_layers": 3, "pattern": ["gdn", "attn", "swa"],
                            "mixers": {"gdn": {"name": "gated_deltanet", "chunk_size": 4}, "attn": {"name": "gqa"},
                                       "swa": {"name": "sliding_window", "window": 6}}}),
])
VOCAB = 61


def model_cfg(case: str) -> dict:
    return {**_BASE, **CASES[case]}


_free_port = free_port  # the name the tests and the fsdp bench import


WORKER_TIMEOUT_S = 300  # a worker stuck in a collective exits with its traceback instead of hanging the caller


def _init(rank: int, world: int, port: int, threads: int) -> None:
    import faulthandler

    import torch.distributed as dist

    faulthandler.dump_traceback_later(WORKER_TIMEOUT_S, exit=True)

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref.double()).abs().max() / max(1.0, float(ref.abs().max())))


FP32_FACTOR = 10.0  # a float32 row may round up to 10x its one-process reference's own float32 rounding


def tolerance(row: dict) -> tuple[float, float]:
    """(output, gradient) tolerances of a `check_case` row: 1e-10 in float64; in float32 FP32_FACTOR x the
    one-process reference's float32-vs-float64 gap (at least one float32 rounding), never a fixed number that
    holds on one CPU only. A real sharding bug (a missing hop, a wrong offset) moves the outputs by O(0.1)."""
    if row.get("dtype") == "float64":
        return 1e-10, 1e-10
    eps = float(torch.finfo(torch.float32).eps)
    return FP32_FACTOR * max(row["fp32 gap"], eps), FP32_FACTOR * max(row["fp32 grad gap"], eps)


def check_case(case: str, layout_name: str, dtype: torch.dtype, seq_len: int, batch: int, group,
               impl: str = "fast") -> dict:
    """One equivalence check on this rank (collective: every rank of `group` calls it with the same args)."""
    import torch.distributed as dist

    from attnzoo.models.decoder import DecoderLM
    from attnzoo.distributed.context_parallel import ContextParallel, check_layout, sharded

    size, rank = dist.get_world_size(group), dist.get_rank(group)
    cfg = model_cfg(case)
    lay = check_layout(seq_len, size, layout_name, _min_segment(cfg))
    torch.manual_seed(0)
    model = DecoderLM(cfg, vocab_size=VOCAB).to(dtype)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, VOCAB, (batch, seq_len), generator=g)
    w = torch.randn(batch, seq_len, VOCAB, generator=g, dtype=dtype)
    ref = model(idx)
    (ref * w).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    gaps = {}
    if dtype != torch.float64:  # the reference's own rounding: the same weights and inputs in float64
        model64 = DecoderLM(cfg, vocab_size=VOCAB).double()
        model64.load_state_dict(model.state_dict())
        ref64 = model64(idx)
        (ref64 * w.double()).sum().backward()
        grads64 = dict(model64.named_parameters())
        gaps = {"fp32 gap": _rel_err(ref.detach(), ref64.detach()),
                "fp32 grad gap": max(_rel_err(g, grads64[n].grad) for n, g in ref_grads.items())}
    cp = ContextParallel(group, lay)
    cp.impl = impl
    with sharded(cp):
        out = model(lay.shard(idx, rank), positions=lay.positions(rank))
    (out * lay.shard(w, rank)).sum().backward()
    parts = [torch.empty_like(out) for _ in range(size)]
    dist.all_gather(parts, out.detach().contiguous(), group=group)
    full = lay.unshard(parts)
    grad_err, worst = 0.0, ""
    for n, p in model.named_parameters():
        if n not in ref_grads:
            continue
        gsum = p.grad.clone()
        dist.all_reduce(gsum, group=group)
        e = _rel_err(gsum, ref_grads[n])
        if e >= grad_err:
            grad_err, worst = e, n
    return {"mixer": case, "layout": layout_name, "ring": impl, "dtype": str(dtype).removeprefix("torch."), "ranks": size,
            "seq_len": seq_len, "out err": _rel_err(full, ref.detach()), "grad err": grad_err, "worst grad": worst,
            "hops": max(cp._hops.values(), default=None), **gaps}


def _min_segment(cfg: dict) -> int:
    """The longest short-conv tail of the model (segments must be at least that long)."""
    from attnzoo.config.registry import MIXERS

    mixers = [m for m in [cfg.get("mixer")] + list((cfg.get("mixers") or {}).values()) if m]

    def conv(m: dict) -> int:  # given, else its config's default
        return int(m.get("conv_size", getattr(MIXERS.get(m["name"]).config_cls(), "conv_size", 0)))

    return max([1] + [conv(m) - 1 for m in mixers])


def _check_worker(rank: int, world: int, port: int, jobs: list, out_path: str) -> None:
    import torch.distributed as dist

    from attnzoo.config.errors import ConfigError

    _init(rank, world, port, 1)
    group = dist.new_group(list(range(world)))
    rows = []
    for case, layout, dtype_name, seq_len, batch, *impl in jobs:
        try:
            rows.append(check_case(case, layout, getattr(torch, dtype_name), seq_len, batch, group, *impl))
        except ConfigError as e:  # a refusal (a length that does not split: every rank alike, before any exchange)
            rows.append({"mixer": case, "layout": layout, "dtype": dtype_name, "ranks": world, "seq_len": seq_len,
                         "error": f"{type(e).__name__}: {str(e).splitlines()[0]}"})
    if rank == 0:
        Path(out_path).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def run_check(world: int, jobs: list) -> list[dict]:
    """Run equivalence jobs [(case, layout, dtype name, seq_len, batch[, ring impl])] on `world` gloo processes."""
    with tempfile.TemporaryDirectory(prefix="attnzoo-cp-") as tmp:
        out = Path(tmp) / "rows.json"
        start_ranks(_check_worker, (world, _free_port(), jobs, str(out)), world)
        return json.loads(out.read_text())


# ----------------------------------------------------------------------------- timing
def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _time_worker(rank: int, world: int, port: int, spec: dict, out_path: str) -> None:
    import torch.distributed as dist

    from attnzoo.models.decoder import DecoderLM
    from attnzoo.distributed.context_parallel import ContextParallel, check_layout, sharded

    if world > 1:
        _init(rank, world, port, spec["threads"])
        group = dist.new_group(list(range(world)))
        lay = check_layout(spec["seq_len"], world, spec["layout"], _min_segment(spec["model"]))
        cp = ContextParallel(group, lay)
    else:
        torch.set_num_threads(spec["threads"])
        cp = lay = None
        group = None
    torch.manual_seed(0)
    model = DecoderLM(spec["model"], vocab_size=spec["vocab"])
    idx = torch.randint(0, spec["vocab"], (1, spec["seq_len"]), generator=torch.Generator().manual_seed(1))
    x, pos = (idx, None) if cp is None else (lay.shard(idx, rank), lay.positions(rank))

    def step():
        with sharded(cp):
            out = model(x, positions=pos)
        out.float().logsumexp(-1).mean().backward()

    base = _rss_bytes()
    step()  # the first step: its peak is the memory measured
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    if cp is not None:
        dist.barrier(group)
        cp.comm_seconds = 0.0
    t0 = time.perf_counter()
    for _ in range(spec["steps"]):
        step()
    if cp is not None:
        dist.barrier(group)
    dt = time.perf_counter() - t0
    row = {"rank": rank, "seconds/step": dt / spec["steps"], "tokens/s": x.numel() * spec["steps"] / dt,
           "peak MiB": peak / 2**20, "comm share": (cp.comm_seconds / dt) if cp is not None else 0.0}
    Path(out_path + f".{rank}").write_text(json.dumps(row))
    if cp is not None:
        dist.destroy_process_group()


def run_timing(world: int, spec: dict) -> list[dict]:
    return spawn_ranks(_time_worker, world, spec, "attnzoo-cp-")


# ----------------------------------------------------------------------------- CLI
def add_arguments(p) -> None:
    p.add_argument("--check", action="store_true", help="equivalence per mixer instead of timing")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="process counts (check) / CP size (timing)")
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--mixers", nargs="+", default=["gqa", "gated_deltanet"], help="timing: mixer cases")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--layout", default="auto", help="auto (as training picks it) | zigzag | contiguous")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--threads", dest="threads_per_rank", type=int, default=1, help="torch threads per process")


QUICK = {"seq_len": 256, "steps": 1}


def run(args) -> dict:
    from attnzoo.distributed.context_parallel import resolve_layout

    if args.check:
        rows = []
        for world in args.ranks:
            seq = 48 if world <= 2 else 96  # 2N segments of >= 6 tokens for every conv tail
            jobs = [(c, lay, dt, seq, 2, impl) for c in CASES for lay in ("zigzag", "contiguous")
                    for dt in ("float64", "float32") for impl in ("fast", "reference")]
            rows += run_check(world, jobs)
        for r in rows:
            ok = "error" not in r and r["out err"] <= tolerance(r)[0] and r["grad err"] <= tolerance(r)[1]
            r["equal"] = "yes" if ok else "NO"
        return {"name": "context_parallel_check", "title": "Context parallelism: sharded forward/backward vs one process",
                "rows": rows,
                "columns": ["mixer", "layout", "ring", "dtype", "ranks", "seq_len", "out err", "grad err", "worst grad", "equal"],
                "notes": ["err: max |sharded - single process| / max(1, max |single process|); outputs gathered, "
                          "gradients summed over ranks; tolerance 1e-10 (float64); float32: 10x the one-process "
                          "reference's own float32-vs-float64 gap (same metric)."]}
    rows = []
    for mixer in args.mixers:
        cfg = {**model_cfg(mixer), "d_model": args.d_model, "n_layers": args.n_layers,
               "max_seq_len": max(args.seq_len, 2048)}
        if "mixers" not in cfg:
            cfg["mixer"] = {k: v for k, v in cfg["mixer"].items() if k != "chunk_size"}  # the mixer's default chunks
        names = [m["name"] for m in ([cfg["mixer"]] if "mixer" in cfg else []) + list((cfg.get("mixers") or {}).values())]
        layout = resolve_layout(args.layout, names)
        spec = {"model": cfg, "seq_len": args.seq_len, "vocab": 256, "steps": args.steps, "layout": layout,
                "threads": args.threads_per_rank}
        one = run_timing(1, spec)[0]
        rows.append({"mixer": mixer, "layout": "-", "ranks": 1, "rank": 0, "tokens/rank": args.seq_len, **one})
        for world in args.ranks:
            for r in run_timing(world, spec):
                rows.append({"mixer": mixer, "layout": layout, "ranks": world, "tokens/rank": args.seq_len // world, **r,
                             "peak vs 1 process": r["peak MiB"] / one["peak MiB"]})
    return {"title": f"Context parallelism on CPU: {args.seq_len} tokens, forward + backward", "rows": rows,
            "columns": ["mixer", "layout", "ranks", "rank", "tokens/rank", "seconds/step", "tokens/s", "comm share", "peak MiB",
                        "peak vs 1 process"],
            "notes": [f"d_model={args.d_model} n_layers={args.n_layers} batch 1, layout {args.layout}, "
                      f"{args.threads_per_rank} thread(s) per process, gloo; {args.steps} timed steps after one "
                      "untimed (whose peak is the memory column: ru_maxrss after it minus the RSS before it); "
                      "comm share: exposed communication time / step time."]}
