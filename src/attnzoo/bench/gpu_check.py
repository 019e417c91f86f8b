"""`attnzoo-bench gpu_check`: every GPU fast path against its torch reference, outputs and gradients.

Mixer cases build one mixer (fp32 weights, seed 0) and run three times on the same input and output
gradient: the reference (the same weights on the torch path in fp32, TF32 off), the fast path (model.impl
auto under autocast in the case's dtype) and the baseline (the torch path under the same autocast: what the
dtype alone costs). Op cases call the fast op and the torch op on the same inputs (initial states and
final states included). Compared: the output (and final state) and the gradients of the input, of every
parameter (or op input), by relative RMS error ||fast - ref|| / ||ref|| (fla's tests' measure); the worst
gradient is named. A case passes when the fast kernel really ran (a spy on it: a silent fallback to torch
fails) and each error is within its tolerance, max(bound of the dtype, 2 x the baseline's error), printed
beside it. Exit status 1 when any case fails (the JSON and markdown are written first).

  fla   linear_attention, deltanet, gated_deltanet (+ grouped value heads), gla, retnet, hgrn2, mamba2, rwkv7 as
        mixers; the three delta-rule / linear ops with states
  flex  sliding_window as a mixer (bf16, fp32); the sink and causal block masks as ops
  sdpa  gqa in bf16 under SDPA's flash backend only (sdpa_kernel raises if flash cannot take the call)
MoBA / NSA have no fast path (ops/dispatch.py): nothing to check.

Without a CUDA device the command refuses in one line. `--device cpu` runs the same harness on the CPU
(tests): the fast side is the torch path, the reference the mixers' slow reference forms, the fla cases are
skipped and the flex ops run forward only (torch 2.13 has no flex backward on CPU).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

HELP = "GPU fast paths (fla, flex_attention, SDPA flash) vs their torch references: outputs and gradients"

# rel-RMS bounds per compute dtype (output, gradients); the tolerance is max(bound, 2 x the baseline's error)
BOUNDS = {"bf16": (0.02, 0.04), "fp16": (0.005, 0.01), "fp32": (2e-3, 4e-3)}
CPU_BOUNDS = (1e-4, 1e-3)  # --device cpu: fp32 fast torch forms vs the reference forms
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def add_arguments(p) -> None:
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cuda: the fast paths (needs a GPU); cpu: the harness on the torch paths (tests)")
    p.add_argument("--seq-len", type=int, default=None, help="T (default: 1000 on cuda, 40 on cpu; not a multiple of 64 on purpose)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--d-model", type=int, default=None, help="default: 256 on cuda (4 heads of 64), 32 on cpu")
    p.add_argument("--window", type=int, default=None, help="sliding_window W (default: 128 on cuda, 16 on cpu)")
    p.add_argument("--cases", nargs="+", default=None, help="only these case names (default: all)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (seconds)")


@dataclass
class Sizes:
    batch: int
    T: int
    d_model: int
    n_heads: int = 4
    n_kv_heads: int = 2
    window: int = 128


def rel_err(fast: torch.Tensor, ref: torch.Tensor) -> float:
    """||fast - ref|| / ||ref|| in fp64 (0 when both are 0)."""
    a, b = fast.detach().double(), ref.detach().double()
    den = b.norm().item()
    num = (a - b).norm().item()
    return num / den if den > 0 else num


def worst(fast: dict, ref: dict) -> tuple[float, str]:
    """The largest rel_err over the named tensors both dicts hold, and its name."""
    errs = [(rel_err(fast[k], ref[k]), k) for k in ref if ref[k] is not None and fast.get(k) is not None]
    return max(errs) if errs else (0.0, "")


def tolerance(bound: float, baseline: Optional[float]) -> float:
    return bound if baseline is None else max(bound, 2.0 * baseline)


@contextlib.contextmanager
def spy(module, name: str):
    """Count calls of module.<name> (the mixers import the fast ops at call time, so they get the wrapper)."""
    original = getattr(module, name)
    calls = [0]

    def wrapper(*a, **kw):
        calls[0] += 1
        return original(*a, **kw)

    setattr(module, name, wrapper)
    try:
        yield calls
    finally:
        setattr(module, name, original)


@contextlib.contextmanager
def no_tf32():
    """A plain fp32 reference: TF32 off for matmuls and convolutions while it runs."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def autocast(device: torch.device, dtype: torch.dtype):
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


# ------------------------------------------------------------------------------------------ mixer cases
def build_mixer(mixer_cfg: dict, s: Sizes, device: torch.device):
    from attnzoo.models.decoder import DecoderLM

    torch.manual_seed(0)
    cfg = {"d_model": s.d_model, "n_heads": s.n_heads, "n_kv_heads": s.n_kv_heads, "n_layers": 1,
           "max_seq_len": max(s.T, 64), "mixer": mixer_cfg}
    return DecoderLM(cfg, vocab_size=64).blocks[0].mixer.to(device)


def run_mixer(mixer, x: torch.Tensor, dy: torch.Tensor, *, request: str, dtype: torch.dtype, impl: str = "fast"):
    """One forward + backward: (output, final state None, {"x": dx, parameter name: grad})."""
    mixer.kernel_request, mixer.impl = request, impl
    mixer.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_(True)
    with autocast(x.device, dtype):
        y = mixer(xi, positions=torch.arange(x.shape[1], device=x.device))
    (y.float() * dy).sum().backward()
    grads = {"x": xi.grad, **{n: p.grad for n, p in mixer.named_parameters()}}
    return y.float().detach(), grads


def mixer_case(mixer_cfg: dict, kernel: str, dtype_name: str, *, flash: bool = False) -> Callable:
    def run(ctx: "Context") -> dict:
        from attnzoo.bench.common import windowed

        s, device = ctx.sizes, ctx.device
        mixer_cfg_ = {**mixer_cfg, "window": s.window} if windowed(mixer_cfg["name"]) else mixer_cfg
        mixer = build_mixer(mixer_cfg_, s, device).train()
        g = torch.Generator(device="cpu").manual_seed(1)
        x = torch.randn(s.batch, s.T, s.d_model, generator=g).to(device)
        dy = torch.randn(s.batch, s.T, s.d_model, generator=g).to(device)
        dtype = DTYPES[dtype_name]
        if device.type == "cpu":  # the harness itself: fast torch form vs the slow reference form, fp32
            ref_y, ref_g = run_mixer(mixer, x, dy, request="torch", dtype=torch.float32, impl="reference")
            y, grads = run_mixer(mixer, x, dy, request="auto", dtype=torch.float32)
            return {"ran": True, "out": (rel_err(y, ref_y), None), "grad": (*worst(grads, ref_g), None),
                    "bounds": CPU_BOUNDS}
        with no_tf32():
            ref_y, ref_g = run_mixer(mixer, x, dy, request="torch", dtype=torch.float32)
        base = None
        if dtype != torch.float32:
            base_y, base_g = run_mixer(mixer, x, dy, request="torch", dtype=dtype)
            base = (rel_err(base_y, ref_y), worst(base_g, ref_g)[0])
        with fast_path_spy(kernel, flash) as calls:
            y, grads = run_mixer(mixer, x, dy, request="auto", dtype=dtype)
        gerr, gname = worst(grads, ref_g)
        return {"ran": calls[0] > 0, "out": (rel_err(y, ref_y), None if base is None else base[0]),
                "grad": (gerr, gname, None if base is None else base[1]), "bounds": BOUNDS[dtype_name]}

    return run


@contextlib.contextmanager
def fast_path_spy(kernel: str, flash: bool):
    """Counts calls of the fast path `kernel` names (SDPA flash: forced by sdpa_kernel, counted as ran)."""
    if kernel == "fla":
        from attnzoo.ops import fla_kernels

        names = ("fla_chunk_delta_rule", "fla_chunk_linear_attention", "fla_chunk_gated_linear_attention",
                 "fla_chunk_generalized_delta_rule")
        with contextlib.ExitStack() as stack:
            counts = [stack.enter_context(spy(fla_kernels, n)) for n in names]
            calls = [0]
            yield calls
            calls[0] = sum(c[0] for c in counts)
            return
    if kernel == "flex":
        from attnzoo.ops import flex

        with spy(flex, "flex_sliding_window") as calls:
            yield calls
        return
    if flash:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # raises when flash cannot take the call
            yield [1]
        return
    yield [1]


# ------------------------------------------------------------------------------------------ op cases
def _grads(tensors: dict) -> dict:
    return {k: v.grad for k, v in tensors.items()}


def _leaves(tensors: dict) -> dict:
    return {k: (None if v is None else v.detach().clone().requires_grad_(True)) for k, v in tensors.items()}


def op_case(kind: str, dtype_name: str) -> Callable:
    """fla ops with initial and final states, flex masks: fast op vs torch op on the same inputs."""

    def run(ctx: "Context") -> dict:
        from attnzoo.ops.delta_rule import chunk_delta_rule
        from attnzoo.ops.linear_attention import chunk_linear_attention

        s, device = ctx.sizes, ctx.device
        dtype = DTYPES[dtype_name] if device.type == "cuda" else torch.float32  # cpu: the harness in fp32
        g = torch.Generator(device="cpu").manual_seed(2)
        B, T, H, D = s.batch, s.T, s.n_heads, s.d_model // s.n_heads
        rnd = lambda *shape: torch.randn(*shape, generator=g).to(device)  # noqa: E731
        if kind.startswith("flex"):
            from attnzoo.mixers.attention import sink_window_attention
            from attnzoo.ops import flex

            Hkv = s.n_kv_heads
            ins = {"q": rnd(B, H, T, D), "k": rnd(B, Hkv, T, D), "v": rnd(B, Hkv, T, D)}
            sinks = 4 if kind == "flex_sinks" else 0
            window = s.window if kind == "flex_sinks" else T  # causal = a window of every key
            backward = device.type == "cuda"  # no flex backward on CPU (torch 2.13)

            def reference(t):
                return sink_window_attention(t["q"], t["k"], t["v"], q_start=0, key_start=0, window=window,
                                             sinks=sinks, reference=True)

            def fast(t):
                with autocast(device, dtype):
                    if kind == "flex_sinks":
                        return flex.flex_sliding_window(*(t[n].to(dtype) for n in "qkv"), window=window, sinks=sinks)
                    return flex.flex_causal(*(t[n].to(dtype) for n in "qkv"))

            return compare_ops(fast, reference, ins, dtype_name, backward=backward, device=device)
        if device.type != "cuda":
            return {"skip": "needs CUDA with fla-core + triton"}
        from attnzoo.ops import fla_kernels

        if kind == "fla_linear":
            Df = D
            ins = {"q": torch.nn.functional.elu(rnd(B, H, T, Df)) + 1, "k": torch.nn.functional.elu(rnd(B, H, T, Df)) + 1,
                   "v": torch.cat([rnd(B, H, T, D), torch.ones(B, H, T, 1, device=device)], -1),
                   "h0": 0.1 * rnd(B, H, Df, D + 1)}

            def reference(t):
                return chunk_linear_attention(t["q"], t["k"], t["v"], t["h0"])

            def fast(t):
                return fla_kernels.fla_chunk_linear_attention(t["q"], t["k"], t["v"], t["h0"], dtype=dtype)
        else:
            from attnzoo.mixers.recurrent_base import l2norm

            ins = {"q": l2norm(rnd(B, H, T, D)), "k": l2norm(rnd(B, H, T, D)), "v": rnd(B, H, T, D),
                   "beta": torch.sigmoid(rnd(B, H, T)), "h0": 0.1 * rnd(B, H, D, D)}
            if kind == "fla_gated_delta":
                ins["g"] = -torch.exp(torch.tensor(0.5)) * torch.nn.functional.softplus(rnd(B, H, T))

            def reference(t):
                return chunk_delta_rule(t["q"], t["k"], t["v"], t["beta"], t.get("g"), t["h0"])

            def fast(t):
                return fla_kernels.fla_chunk_delta_rule(t["q"], t["k"], t["v"], t["beta"], t.get("g"), t["h0"], dtype=dtype)
        return compare_ops(fast, reference, ins, dtype_name, backward=True, device=device)

    return run


def compare_ops(fast: Callable, reference: Callable, ins: dict, dtype_name: str, *, backward: bool,
                device: torch.device) -> dict:
    """Run both on copies of `ins`; outputs may be a tensor or (o, final state); loss = <out, d_out>."""

    def go(fn, wrap):
        t = _leaves(ins) if backward else {k: v.detach() for k, v in ins.items()}
        with wrap():
            with torch.enable_grad() if backward else torch.no_grad():
                out = fn(t)
            outs = out if isinstance(out, tuple) else (out,)
            outs = [o.float() for o in outs]
            if backward:
                douts = [torch.randn(o.shape, generator=torch.Generator().manual_seed(4 + i)).to(device)
                         for i, o in enumerate(outs)]
                sum((o * d).sum() for o, d in zip(outs, douts)).backward()
        return outs, (_grads(t) if backward else {})

    ref_outs, ref_grads = go(reference, no_tf32 if device.type == "cuda" else contextlib.nullcontext)
    outs, grads = go(fast, contextlib.nullcontext)
    out_err = max(rel_err(o, r) for o, r in zip(outs, ref_outs))
    gerr, gname = worst(grads, ref_grads) if backward else (0.0, "(forward only)")
    bounds = BOUNDS[dtype_name] if device.type == "cuda" else CPU_BOUNDS
    return {"ran": True, "out": (out_err, None), "grad": (gerr, gname, None), "bounds": bounds}


# ------------------------------------------------------------------------------------------ the list
@dataclass
class Case:
    name: str
    kernel: str  # the backend the fast side must take on CUDA (cpu: torch)
    dtype: str
    run: Callable = field(repr=False)


CASES = [
    Case("fla/linear_attention", "fla", "bf16", mixer_case({"name": "linear_attention"}, "fla", "bf16")),
    Case("fla/deltanet", "fla", "bf16", mixer_case({"name": "deltanet"}, "fla", "bf16")),
    Case("fla/gated_deltanet", "fla", "bf16", mixer_case({"name": "gated_deltanet"}, "fla", "bf16")),
    Case("fla/gated_deltanet-gva", "fla", "bf16",
         mixer_case({"name": "gated_deltanet", "n_heads": 2, "n_v_heads": 4}, "fla", "bf16")),
    Case("fla/gla", "fla", "bf16", mixer_case({"name": "gla"}, "fla", "bf16")),
    Case("fla/retnet", "fla", "bf16", mixer_case({"name": "retnet"}, "fla", "bf16")),
    Case("fla/hgrn2", "fla", "bf16", mixer_case({"name": "hgrn2"}, "fla", "bf16")),
    Case("fla/mamba2", "fla", "bf16", mixer_case({"name": "mamba2"}, "fla", "bf16")),
    Case("fla/rwkv7", "fla", "bf16", mixer_case({"name": "rwkv7"}, "fla", "bf16")),
    Case("fla/op-delta_rule-states", "fla", "bf16", op_case("fla_delta", "bf16")),
    Case("fla/op-gated_delta_rule-states", "fla", "bf16", op_case("fla_gated_delta", "bf16")),
    Case("fla/op-linear_attention-states", "fla", "bf16", op_case("fla_linear", "bf16")),
    Case("flex/sliding_window", "flex", "bf16", mixer_case({"name": "sliding_window"}, "flex", "bf16")),
    Case("flex/sliding_window-fp32", "flex", "fp32", mixer_case({"name": "sliding_window"}, "flex", "fp32")),
    Case("flex/op-sinks", "flex", "bf16", op_case("flex_sinks", "bf16")),
    Case("flex/op-causal", "flex", "bf16", op_case("flex_causal", "bf16")),
    Case("sdpa-flash/gqa", "torch", "bf16", mixer_case({"name": "gqa"}, "torch", "bf16", flash=True)),
]


@dataclass
class Context:
    device: torch.device
    sizes: Sizes


def check_case(case: Case, ctx: Context) -> dict:
    """One row: the case's errors, tolerances and status (ok | FAIL | skip | error: first line)."""
    row = {"case": case.name, "kernel": case.kernel if ctx.device.type == "cuda" else "torch",
           "dtype": case.dtype if ctx.device.type == "cuda" else "fp32"}
    t0 = time.perf_counter()
    try:
        res = case.run(ctx)
    except Exception as e:  # one broken path must not hide the others
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return {**row, "status": f"error: {type(e).__name__}: {first[:200]}", "seconds": time.perf_counter() - t0}
    if "skip" in res:
        return {**row, "status": f"skip ({res['skip']})", "seconds": time.perf_counter() - t0}
    (out_err, out_base), (gerr, gname, gbase) = res["out"], res["grad"]
    out_tol, grad_tol = tolerance(res["bounds"][0], out_base), tolerance(res["bounds"][1], gbase)
    ok = res["ran"] and out_err <= out_tol and gerr <= grad_tol
    status = "ok" if ok else ("FAIL (fast kernel did not run)" if not res["ran"] else "FAIL")
    return {**row, "ran": "yes" if res["ran"] else "no", "out err": out_err, "out tol": out_tol, "out base": out_base,
            "grad err": gerr, "grad tol": grad_tol, "grad base": gbase, "worst grad": gname, "status": status,
            "seconds": time.perf_counter() - t0}


COLUMNS = ["case", "kernel", "dtype", "ran", "out err", "out tol", "out base", "grad err", "grad tol", "grad base",
           "worst grad", "status", "seconds"]


def sizes_for(args) -> Sizes:
    cuda = args.device == "cuda" and not args.quick
    return Sizes(batch=args.batch, T=args.seq_len or (1000 if cuda else 40), d_model=args.d_model or (256 if cuda else 32),
                 window=args.window or (128 if cuda else 16))


def run(args) -> dict:
    from attnzoo.config.errors import ConfigError

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("no CUDA device is visible; allowed here: --device cpu (the harness on the torch paths)",
                          field="--device")
    device = torch.device(args.device)
    ctx = Context(device, sizes_for(args))
    cases = [c for c in CASES if not args.cases or c.name in args.cases]
    if args.cases and len(cases) != len(args.cases):
        known = ", ".join(c.name for c in CASES)
        raise ConfigError(f"unknown case in {args.cases}; allowed: {known}", field="--cases")
    rows = []
    for case in cases:
        row = check_case(case, ctx)
        rows.append(row)
        print(f"gpu_check {row['case']:<34} {row['status']}", flush=True)
    failed = [r["case"] for r in rows if not (r["status"] == "ok" or r["status"].startswith("skip"))]
    s = ctx.sizes
    notes = [
        f"device={device.type}" + (f" ({torch.cuda.get_device_name(0)})" if device.type == "cuda" else "") +
        f"; batch={s.batch} T={s.T} d_model={s.d_model} heads={s.n_heads}/{s.n_kv_heads}kv W={s.window}.",
        "errors: ||fast - ref|| / ||ref|| (fp64); ref = the torch path in fp32 (TF32 off) on the same weights and "
        "inputs; base = the torch path in the case's dtype; tol = max(bound, 2 x base), bounds (out, grad): " +
        ", ".join(f"{k} {v[0]:g}/{v[1]:g}" for k, v in BOUNDS.items()) + (f"; cpu {CPU_BOUNDS[0]:g}/{CPU_BOUNDS[1]:g}"),
        "ran: the fast kernel was called (a spy on it); sdpa-flash runs under sdpa_kernel(FLASH_ATTENTION) only.",
        "MoBA / NSA: torch only (data-dependent per-query block selection; docs/gpu.md).",
        f"result: {len(rows) - len(failed)} of {len(rows)} ok or skipped" + (f"; FAILED: {', '.join(failed)}" if failed else ""),
    ]
    return {"title": "GPU fast paths vs torch references (outputs and gradients)", "columns": COLUMNS, "rows": rows,
            "notes": notes, "exit_code": 1 if failed else 0}
