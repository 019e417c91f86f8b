"""`attnzoo-bench mixers`: every registered mixer's speed and memory against sequence length.

Each mixer is built alone at the same width (d_model, n_heads, n_kv_heads; its own config defaults
otherwise) and run on x (batch, T, d_model):
- fwd: tokens/s of a no-grad forward (the prefill path);
- fwd+bwd: tokens/s of forward + backward to the input and weights (the training path);
- peak MiB: the most bytes held at once by tensors created during one forward + backward (inputs and
  weights excluded), tracked per allocation on CPU (PeakMemory below) or by the CUDA allocator on GPU.
A mixer's sweep stops at the first length where one fwd+bwd call takes longer than --max-call-seconds.
Writes mixers.png next to the JSON: the three quantities against T, log-log, one line per mixer.
"""
from __future__ import annotations

import time
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

HELP = "every registered mixer: forward and forward+backward tokens/s and peak memory vs sequence length (+ PNG)"
MIB = 2**20


def add_arguments(p) -> None:
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--n-kv-heads", type=int, default=2)
    p.add_argument("--window", type=int, default=512, help="sliding_window W")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    p.add_argument("--mixers", nargs="+", default=None, help="default: every registered mixer")
    p.add_argument("--max-call-seconds", type=float, default=2.0, help="stop a mixer's sweep past this fwd+bwd time")
    p.add_argument("--impl", default="auto", choices=["auto", "torch", "fla", "flex"],
                   help="model.impl: the kernels (ops/dispatch.py; fla / flex need CUDA)")
    p.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"],
                   help="bf16-mixed: forward and backward under bf16 autocast (the fla kernels run in bf16 only)")
    p.add_argument("--quick", action="store_true", help="tiny sizes for tests (seconds)")
    p.add_argument("--compile", action="store_true", help="add a torch.compile (inductor) row per mixer and length")


def quick(args) -> None:
    args.d_model, args.n_heads, args.n_kv_heads, args.window, args.lengths = 32, 4, 2, 16, [32, 64]


class PeakMemory(TorchDispatchMode):
    """Peak bytes of live tensor storages created inside the `with` block (CPU has no allocator stats).

    Every op output's storage is counted once when it first appears and released by a weakref finalizer
    when the storage dies; views share their base's storage and so are not double counted."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._seen: set = set()

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                st = t.untyped_storage()
                key, n = st.data_ptr(), st.nbytes()
                if n and key not in self._seen:
                    self._seen.add(key)
                    self.live += n
                    weakref.finalize(st, self._free, key, n)
        self.peak = max(self.peak, self.live)
        return out


def build_mixer(name: str, args, max_len: int):
    from attnzoo.bench.common import windowed
    from attnzoo.models.decoder import DecoderLM

    mixer = {"name": name, "window": args.window} if windowed(name) else {"name": name}
    cfg = {"d_model": args.d_model, "n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads, "n_layers": 1,
           "max_seq_len": max_len, "mixer": mixer, "impl": getattr(args, "impl", "auto")}
    return DecoderLM(cfg, vocab_size=256).blocks[0].mixer


def best_seconds(fn, repeats: int = 2) -> float:
    """One untimed warm-up call, then the fastest of `repeats` (the least disturbed by other load)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def peak_bytes(fn, device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(device) - base
    with PeakMemory() as pm:
        fn()
    return pm.peak


def autocast_of(args, device):
    """bf16-mixed: the forward (and so the backward) under bf16 autocast, as Lightning's precision plugin runs it."""
    import contextlib

    if getattr(args, "precision", "32-true") == "bf16-mixed":
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def measure(mixer, T: int, args, device) -> dict:
    mixer.zero_grad(set_to_none=True)
    x = torch.randn(args.batch, T, args.d_model, device=device, requires_grad=True)
    pos = torch.arange(T, device=device)
    amp = autocast_of(args, device)

    def fwd():
        with torch.no_grad(), amp():
            mixer(x, positions=pos)

    def fwd_bwd():
        with amp():
            y = mixer(x, positions=pos)
        y.float().sum().backward()
        x.grad = None
        mixer.zero_grad(set_to_none=True)

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t_fb = best_seconds(lambda: (fwd_bwd(), sync()))
    t_f = best_seconds(lambda: (fwd(), sync()))
    tokens = args.batch * T
    return {"fwd tokens/s": tokens / t_f, "fwd+bwd tokens/s": tokens / t_fb, "fwd+bwd ms": 1000 * t_fb,
            "peak MiB": peak_bytes(fwd_bwd, device) / MIB}


def run(args) -> dict:
    from attnzoo.ops.dispatch import layer_kernel, precision_compute_dtype
    from attnzoo.config.registry import MIXERS

    if args.quick:
        quick(args)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    names = args.mixers or MIXERS.names()
    rows, skipped = [], []
    for name in names:
        torch.manual_seed(0)
        mixer = build_mixer(name, args, max(args.lengths)).to(device).train()
        kernel = layer_kernel(mixer, device.type, precision_compute_dtype(getattr(args, "precision", "32-true")))
        compiled = torch.compile(mixer) if getattr(args, "compile", False) else None
        for T in sorted(args.lengths):
            r = measure(mixer, T, args, device)
            rows.append({"mixer": name, "kernel": kernel, "T": T, **r})
            if compiled is not None:  # the same weights under torch.compile; compile time falls in the warm-up
                rc = measure(compiled, T, args, device)
                rows.append({"mixer": name + " compiled", "kernel": kernel, "T": T, **rc,
                             "compiled / eager": rc["fwd+bwd tokens/s"] / r["fwd+bwd tokens/s"]})
            if r["fwd+bwd ms"] / 1000 > args.max_call_seconds and T != max(args.lengths):
                skipped.append(f"{name} beyond T={T}")
                break
    plot = plot_rows(rows, Path(args.out) / "mixers.png") if getattr(args, "out", None) else None
    notes = [
        f"d_model={args.d_model} heads={args.n_heads}/{args.n_kv_heads}kv batch={args.batch}, "
        f"{'bf16 autocast' if getattr(args, 'precision', '32-true') == 'bf16-mixed' else 'fp32'}, "
        f"model.impl={getattr(args, 'impl', 'auto')} (kernel: what each mixer ran, ops/dispatch.py), one mixer layer "
        f"(no FFN/norm), sliding_window W={args.window}, other fields at their config defaults; device={device.type}, "
        f"threads={torch.get_num_threads()}.",
        "peak MiB: tensors created during one forward+backward (activations, saved tensors, gradients), not weights/input.",
    ]
    if skipped:
        notes.append(f"stopped past --max-call-seconds={args.max_call_seconds}: " + "; ".join(skipped))
    if plot:
        notes.append(f"![mixers]({plot.name})")
    return {"title": "Mixers: tokens/s and peak memory vs sequence length", "rows": rows, "notes": notes,
            "columns": ["mixer", "kernel", "T", "fwd tokens/s", "fwd+bwd tokens/s", "fwd+bwd ms", "peak MiB"] +
            (["compiled / eager"] if getattr(args, "compile", False) else []), "plot": str(plot)}


def plot_rows(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    keys = ["fwd tokens/s", "fwd+bwd tokens/s", "peak MiB"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for name in dict.fromkeys(r["mixer"] for r in rows):
        rs = [r for r in rows if r["mixer"] == name]
        for ax, k in zip(axes, keys):
            ax.plot([r["T"] for r in rs], [r[k] for r in rs], marker="o", label=name)
    for ax, k in zip(axes, keys):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T")
        ax.set_title(k)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
