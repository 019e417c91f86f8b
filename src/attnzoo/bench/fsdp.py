"""`attnzoo-bench fsdp`: FSDP2 (attnzoo/distributed/fsdp.py) on N gloo processes of this machine, against DDP and
one process.

Two parts, both in fresh worker processes started with torch.multiprocessing:

- `--check`: equivalence. For every case (CASES: gqa, mla, gated_deltanet, a hybrid, a MoE with the aux-loss-free
  bias), each rank builds the same seeded model in float64 and trains it `steps` AdamW steps on its rows of the same
  global batches, once sharded with `shard_model` (FSDP2) and once under DistributedDataParallel; the reference is the
  same model trained in one process on the whole batch (every rank computes it itself). Compared: the per-step loss
  (the mean over ranks) and every parameter after the last step (gathered whole), max |difference| / max(1, |ref|);
  float64, so the tolerance is 1e-10 — or, where a part computes in fp32 inside the float64 model (the MoE router),
  10x the gap between one process on the whole batch and one process accumulating the ranks' row splits.
- memory (default): one model, one training step (forward, backward, AdamW step) under DDP and under FSDP at each
  process count; per rank the bytes of the tensors each strategy keeps between steps: parameters, gradients and the
  optimizer state (each rank's own shards under FSDP: DTensor local parts), and the process's peak RSS.
"""
from __future__ import annotations

import json
import resource
import tempfile
from pathlib import Path

import torch

from attnzoo.bench.common import spawn_ranks, start_ranks
from attnzoo.bench.context_parallel import _free_port, _init

HELP = "FSDP2: loss/parameter equivalence with DDP and one process (--check), or per-rank memory at 1/2/4 processes"

_BASE = {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn": {"name": "swiglu"}}
CASES: dict[str, dict] = {
    "gqa x2": {**_BASE, "mixer": {"name": "gqa"}},
    "mla x2": {**_BASE, "mixer": {"name": "mla"}},
    "gated_deltanet x2": {**_BASE, "mixer": {"name": "gated_deltanet", "chunk_size": 4}},
    "hybrid gdn/gqa/swa": {**_BASE, "n_layers": 3, "pattern": ["gdn", "attn", "swa"],
                           "mixers": {"gdn": {"name": "gated_deltanet", "chunk_size": 4}, "attn": {"name": "gqa"},
                                      "swa": {"name": "sliding_window", "window": 6}}},
    "moe (aux-free bias)": {**_BASE, "mixer": {"name": "gqa"},
                            "ffn": {"name": "moe", "n_experts": 4, "top_k": 2, "bias_update_speed": 0.01,
                                    "aux_loss_coef": 0.0}},
}
VOCAB, SEQ, ROWS = 61, 16, 8  # ROWS: the global batch, split over the ranks


def _batches(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g) for _ in range(steps)]


def _train(model, batches, rank: int, world: int, group=None, accumulate: bool = False) -> list[float]:
    """AdamW steps on this rank's rows of each global batch (`accumulate`: one process computes every rank's rows in
    turn, summing their gradients: the same arithmetic as N ranks, in one process); the per-step loss averaged over
    the ranks."""
    import torch.distributed as dist
    import torch.nn.functional as F

    inner = getattr(model, "module", model)  # DDP wraps; FSDP2 shards in place
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for b in batches:
        total = 0.0
        for r in (range(world) if accumulate else [rank]):
            rows = b[r::world]
            logits = model(rows[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
            aux = inner.aux_loss()
            ((loss if aux is None else loss + aux) / (world if accumulate else 1)).backward()
            total = total + loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        inner.after_optimizer_step()  # MoE: the aux-loss-free bias from the load summed over every rank
        total = torch.as_tensor(total).clone()
        if group is not None:
            dist.all_reduce(total, group=group)
        losses.append(float(total) / world)
    return losses


def _err(a, ref) -> float:
    a, ref = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(ref, dtype=torch.float64)
    return float((a - ref).abs().max() / max(1.0, float(ref.abs().max())))


def _check_worker(rank: int, world: int, port: int, steps: int, out_path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from attnzoo.config.schema import FSDPConfig
    from attnzoo.distributed.fsdp import gather_full_model, shard_model
    from attnzoo.models.decoder import DecoderLM

    _init(rank, world, port, 1)
    mesh = init_device_mesh("cpu", (world,))
    group = dist.group.WORLD
    batches = _batches(steps)
    rows = []
    for case, cfg in CASES.items():
        def build():
            torch.manual_seed(0)
            return DecoderLM(cfg, vocab_size=VOCAB).double()

        ref_model = build()
        ref_losses = _train(ref_model, batches, 0, 1)
        ref = ref_model.state_dict()
        # the same steps in one process with the batch split as the ranks split it: how far rounding alone moves
        # the result when only the order of the sums changes (MoE routes in fp32 inside a float64 model)
        split_model = build()
        split_losses = _train(split_model, batches, 0, world, accumulate=True)
        order_gap = max(_err(split_losses, ref_losses),
                        max(_err(split_model.state_dict()[k], v) for k, v in ref.items()))
        sharded = shard_model(build(), mesh, FSDPConfig(param_dtype=None, reduce_dtype=None))
        fsdp_losses = _train(sharded, batches, rank, world, group)
        full = gather_full_model(sharded)  # collective; whole on rank 0
        ddp = DistributedDataParallel(build())
        ddp_losses = _train(ddp, batches, rank, world, group)
        if rank == 0:
            row = {"case": case, "ranks": world, "steps": steps,
                   "fsdp loss err": _err(fsdp_losses, ref_losses),
                   "fsdp param err": max(_err(full.state_dict()[k], v) for k, v in ref.items()),
                   "ddp loss err": _err(ddp_losses, ref_losses),
                   "ddp param err": max(_err(ddp.module.state_dict()[k], v) for k, v in ref.items()),
                   "order gap": order_gap, "tolerance": max(1e-10, 10 * order_gap)}
            if "expert_bias" in " ".join(ref):  # the bias moved, and moved alike
                row["bias moved"] = max(float(v.abs().max()) for k, v in ref.items() if k.endswith("expert_bias"))
            rows.append(row)
    if rank == 0:
        Path(out_path).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def run_check(world: int, steps: int = 3) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="attnzoo-fsdp-") as tmp:
        out = Path(tmp) / "rows.json"
        start_ranks(_check_worker, (world, _free_port(), steps, str(out)), world)
        return json.loads(out.read_text())


# ----------------------------------------------------------------------------- memory
def _local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard
    return t.numel() * t.element_size()


def _memory_worker(rank: int, world: int, port: int, spec: dict, out_path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from attnzoo.config.schema import FSDPConfig
    from attnzoo.distributed.fsdp import shard_model
    from attnzoo.models.decoder import DecoderLM

    device = torch.device(spec["device"], rank if spec["device"] == "cuda" else None)
    if device.type == "cuda":  # one GPU per rank, NCCL
        import os

        torch.cuda.set_device(device)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("nccl", rank=rank, world_size=world)
    else:
        _init(rank, world, port, spec["threads"])
    torch.manual_seed(0)
    model = DecoderLM(spec["model"], vocab_size=spec["vocab"]).to(device)
    if spec["strategy"] == "fsdp":
        mesh = init_device_mesh(device.type, (world,))
        model = shard_model(model, mesh, FSDPConfig(param_dtype=spec["param_dtype"]))
    else:
        model = DistributedDataParallel(model)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq_len"]), generator=g).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(x).float().logsumexp(-1).mean().backward()
    grads = sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    opt.step()
    params = sum(_local_bytes(p) for p in model.parameters())
    state = sum(_local_bytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    row = {"strategy": spec["strategy"], "ranks": world, "rank": rank, "params MiB": params / 2**20,
           "grads MiB": grads / 2**20, "optimizer MiB": state / 2**20, "total MiB": (params + grads + state) / 2**20,
           "peak RSS MiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "bytes/param": (params + grads + state) / sum(p.numel() for p in model.parameters())}
    if device.type == "cuda":  # everything the step allocated on the GPU, activations and gathered blocks included
        row["peak GPU MiB"] = torch.cuda.max_memory_allocated(device) / 2**20
    Path(out_path + f".{rank}").write_text(json.dumps(row))
    dist.barrier()
    dist.destroy_process_group()


def run_memory(world: int, spec: dict) -> list[dict]:
    return spawn_ranks(_memory_worker, world, spec, "attnzoo-fsdp-")


# ----------------------------------------------------------------------------- CLI
def add_arguments(p) -> None:
    p.add_argument("--check", action="store_true", help="equivalence per case instead of memory")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="process counts")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-layers", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=3, help="--check: AdamW steps compared")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="memory: gloo on CPU, or NCCL, a GPU per rank")
    p.add_argument("--param-dtype", default=None, choices=("bf16", "fp16", "fp32"),
                   help="memory, FSDP: the dtype of gathered weights (trainer.fsdp.param_dtype)")


QUICK = {"d_model": 64, "n_layers": 2, "seq_len": 32}


def run(args) -> dict:
    if args.check:
        rows = [r for world in args.ranks for r in run_check(world, args.steps)]
        for r in rows:
            r["equal"] = "yes" if max(v for k, v in r.items() if k.endswith("err")) <= r["tolerance"] else "NO"
        return {"name": "fsdp_check", "title": "FSDP2 and DDP vs one process (float64)", "rows": rows,
                "columns": ["case", "ranks", "steps", "fsdp loss err", "fsdp param err", "ddp loss err",
                            "ddp param err", "order gap", "tolerance", "equal"],
                "notes": ["err: max |N processes - one process| / max(1, max |one process|), per-step loss (mean over "
                          "ranks) and every parameter after the last AdamW step, in float64. Tolerance: 1e-10, or 10x "
                          "the order gap where that is larger: the same err between one process on the whole batch "
                          "and one process accumulating the ranks' row splits (the MoE router computes in fp32)."]}
    model = {"d_model": args.d_model, "n_layers": args.n_layers, "n_heads": max(1, args.d_model // 64),
             "mixer": {"name": "gqa"}, "ffn": {"name": "swiglu"}, "max_seq_len": args.seq_len}
    spec = {"model": model, "vocab": 8192, "seq_len": args.seq_len, "batch": 1, "threads": 1, "device": args.device,
            "param_dtype": args.param_dtype}
    rows = []
    for strategy in ("ddp", "fsdp"):
        for world in args.ranks:
            rows += [r for r in run_memory(world, {**spec, "strategy": strategy}) if r["rank"] == 0]
    base = {r["strategy"]: r["total MiB"] for r in rows if r["ranks"] == min(args.ranks)}
    for r in rows:
        r["vs 1 process"] = r["total MiB"] / base[r["strategy"]]
    return {"title": f"Per-rank training state, DDP vs FSDP2 (d_model={args.d_model}, {args.n_layers} layers)",
            "rows": rows,
            "columns": ["strategy", "ranks", "params MiB", "grads MiB", "optimizer MiB", "total MiB", "vs 1 process",
                        "bytes/param", "peak RSS MiB"] + (["peak GPU MiB"] if args.device == "cuda" else []),
            "notes": ["rank 0's bytes of the tensors kept between steps (fp32): parameters, gradients, AdamW's two "
                      "moments; FSDP: this rank's shards (DTensor local parts). The gathered weights of the block in "
                      "flight and the activations come on top; peak RSS includes the Python/torch runtime (~300 MiB)."]}
