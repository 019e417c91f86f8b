"""`attnzoo-bench gpu_check`: every GPU fast path against its torch reference, outputs and gradients.

Mixer cases build one mixer (fp32 weights, seed 0) and run three times on the same input and output
gradient: the reference (the same weights on the torch path in fp32, TF32 off), the fast path (model.impl
auto under autocast in the case's dtype) and the baseline (the torch path under the same autocast: what the
dtype alone costs). Op cases call the fast op and the torch op on the same inputs (initial states and
final states included). Compared: the output (and final state) and the gradients of the input, of every
parameter (or op input), by relative RMS error ||fast - ref|| / ||ref|| (fla's tests' measure); the worst
gradient is named. A case passes when the fast kernel really ran (a spy on it: a silent fallback to torch
fails) and each error is within its tolerance, max(bound of the dtype, 2 x the baseline's error), printed
beside it.

Fit for a short GPU rental (on a fresh machine the first call of each fla kernel compiles and autotunes it, 20-75 s
a mixer): each case runs twice, the first call timed on its own (`first s`: compile + autotune + one run) and the
second the check (`check s`); the cases run cheap first in a worker process that the parent kills at
`--case-limit` seconds per case (status `timeout`; a fresh worker takes the rest) or when `--budget` runs out
(the cases not reached: `not run`, never passed). Each row is streamed as its case ends: a JSON line appended to
OUT/gpu_check.jsonl, and OUT/gpu_check.{json,md} rewritten. Exit status 1 when a case failed, errored or timed out;
4 when all that ran passed but some did not run; 0 when every case is ok or skipped. `--quick`: every case at tiny
sizes.

  sdpa  gqa in bf16 under SDPA's flash backend only (sdpa_kernel raises if flash cannot take the call)
  flex  the causal and sink block masks as ops; sliding_window as a mixer (bf16, fp32)
  fla   the three delta-rule / linear ops with states; deltanet, gated_deltanet (+ grouped value heads),
        linear_attention, retnet, gla, hgrn2, mamba2, rwkv7 as mixers
MoBA / NSA have no fast path (ops/dispatch.py): nothing to check.

Without a CUDA device the command refuses in one line. `--device cpu` runs the same harness on the CPU
(tests): the fast side is the torch path, the reference the mixers' slow reference forms, the fla cases are
skipped and the flex ops run forward only (torch 2.13 has no flex backward on CPU).
"""
from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from attnzoo.bench import _isolated as isolated

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
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes, every case (cuda: T 200, d_model 128; the compile and autotune stay)")
    p.add_argument("--case-limit", type=float, default=90.0,
                   help="seconds per case, first call and check together (default 90): past it the case is killed "
                        "and recorded as timeout")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for all cases (default: none); the cases it does not reach are recorded as not run")


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


# cheap first: on a fresh machine the cost of a case is its kernels' compile and autotune (one mixer of fla: 20-75 s),
# so SDPA and flex (one compile each) come first, then fla's three ops (the kernels the mixers reuse, compiled once
# in the worker process), then the fla mixers, mamba2 and rwkv7 (the longest autotunes) last
CASES = [
    Case("sdpa-flash/gqa", "torch", "bf16", mixer_case({"name": "gqa"}, "torch", "bf16", flash=True)),
    Case("flex/op-causal", "flex", "bf16", op_case("flex_causal", "bf16")),
    Case("flex/op-sinks", "flex", "bf16", op_case("flex_sinks", "bf16")),
    Case("flex/sliding_window", "flex", "bf16", mixer_case({"name": "sliding_window"}, "flex", "bf16")),
    Case("flex/sliding_window-fp32", "flex", "fp32", mixer_case({"name": "sliding_window"}, "flex", "fp32")),
    Case("fla/op-delta_rule-states", "fla", "bf16", op_case("fla_delta", "bf16")),
    Case("fla/op-gated_delta_rule-states", "fla", "bf16", op_case("fla_gated_delta", "bf16")),
    Case("fla/op-linear_attention-states", "fla", "bf16", op_case("fla_linear", "bf16")),
    Case("fla/deltanet", "fla", "bf16", mixer_case({"name": "deltanet"}, "fla", "bf16")),
    Case("fla/gated_deltanet", "fla", "bf16", mixer_case({"name": "gated_deltanet"}, "fla", "bf16")),
    Case("fla/gated_deltanet-gva", "fla", "bf16",
         mixer_case({"name": "gated_deltanet", "n_heads": 2, "n_v_heads": 4}, "fla", "bf16")),
    Case("fla/linear_attention", "fla", "bf16", mixer_case({"name": "linear_attention"}, "fla", "bf16")),
    Case("fla/retnet", "fla", "bf16", mixer_case({"name": "retnet"}, "fla", "bf16")),
    Case("fla/gla", "fla", "bf16", mixer_case({"name": "gla"}, "fla", "bf16")),
    Case("fla/hgrn2", "fla", "bf16", mixer_case({"name": "hgrn2"}, "fla", "bf16")),
    Case("fla/mamba2", "fla", "bf16", mixer_case({"name": "mamba2"}, "fla", "bf16")),
    Case("fla/rwkv7", "fla", "bf16", mixer_case({"name": "rwkv7"}, "fla", "bf16")),
]


@dataclass
class Context:
    device: torch.device
    sizes: Sizes
    threads: int = 1  # torch's intra-op threads in the worker (the parent's, e.g. attnzoo-bench --threads)


def first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {((str(e).strip().splitlines() or [type(e).__name__])[0])[:200]}"


def base_row(case: Case, ctx: Context) -> dict:
    cuda = ctx.device.type == "cuda"
    return {"case": case.name, "kernel": case.kernel if cuda else "torch", "dtype": case.dtype if cuda else "fp32"}


def check_case(case: Case, ctx: Context, on_first: Callable[[float], None] = lambda seconds: None) -> dict:
    """One row: the case run twice, the first call timed on its own (`first s`: the kernels' compile and autotune on
    a fresh machine, plus one run) and the second call the check (`check s`; its errors, tolerances and status:
    ok | FAIL | skip | error: first line). `on_first(seconds)` is told when the first call ends."""
    row = base_row(case, ctx)
    t0 = time.perf_counter()
    first_s = None
    try:
        res = case.run(ctx)
        first_s = time.perf_counter() - t0
        on_first(first_s)
        if "skip" in res:
            return {**row, "status": f"skip ({res['skip']})", "first s": first_s}
        t1 = time.perf_counter()
        res = case.run(ctx)
        check_s = time.perf_counter() - t1
    except Exception as e:  # one broken path must not hide the others
        spent = time.perf_counter() - t0
        return {**row, "status": f"error: {first_line(e)}", "first s": spent if first_s is None else first_s,
                "check s": None if first_s is None else spent - first_s}
    (out_err, out_base), (gerr, gname, gbase) = res["out"], res["grad"]
    out_tol, grad_tol = tolerance(res["bounds"][0], out_base), tolerance(res["bounds"][1], gbase)
    ok = res["ran"] and out_err <= out_tol and gerr <= grad_tol
    status = "ok" if ok else ("FAIL (fast kernel did not run)" if not res["ran"] else "FAIL")
    return {**row, "ran": "yes" if res["ran"] else "no", "out err": out_err, "out tol": out_tol, "out base": out_base,
            "grad err": gerr, "grad tol": grad_tol, "grad base": gbase, "worst grad": gname, "status": status,
            "first s": first_s, "check s": check_s}


COLUMNS = ["case", "kernel", "dtype", "ran", "out err", "out tol", "out base", "grad err", "grad tol", "grad base",
           "worst grad", "status", "first s", "check s"]


# ------------------------------------------------------------------------------------------ the runner
# bench/_isolated.py: the cases run in a worker process the parent kills at --case-limit or when --budget runs out
START_METHOD = isolated.START_METHOD


class Stream:
    """The results as they come: OUT/gpu_check.jsonl gets each row as a JSON line when its case ends, and
    OUT/gpu_check.{json,md} are rewritten after each row (the cases not ended yet listed as `not run yet`), so a
    machine lost mid-check leaves every row it finished."""

    def __init__(self, out: Path, argv: list, cases: list, ctx: Context, notes: Callable[[list], list]):
        self.out, self.argv, self.ctx, self.notes = Path(out), argv, ctx, notes
        self.cases, self.rows = cases, []
        self.out.mkdir(parents=True, exist_ok=True)
        self.jsonl = self.out / "gpu_check.jsonl"
        self.jsonl.write_text("")

    def __call__(self, row: dict) -> None:
        from attnzoo.bench.cli import write_result

        self.rows.append(row)
        with self.jsonl.open("a") as f:
            f.write(json.dumps(row, default=str) + "\n")
        done = {r["case"] for r in self.rows}
        waiting = [{**base_row(c, self.ctx), "status": "not run yet"} for c in self.cases if c.name not in done]
        write_result("gpu_check", result(self.rows + waiting, self.notes(self.rows)), self.out, self.argv)


def result(rows: list, notes: list) -> dict:
    return {"title": "GPU fast paths vs torch references (outputs and gradients)", "columns": COLUMNS, "rows": rows,
            "notes": notes}


def outcome(rows: list) -> tuple[str, int]:
    """The summary line and the exit status: 1 when a case failed, errored or timed out; 4 when all that ran
    passed but some did not run (an incomplete check never passes); 0 when every case is ok or skipped."""
    def kind(status: str) -> str:
        return next((k for k in ("ok", "skip", "timeout", "not run") if status.startswith(k)), "failed")

    kinds = [kind(r["status"]) for r in rows]
    counts = ", ".join(f"{kinds.count(k)} {k}" for k in ("ok", "skip", "failed", "timeout", "not run") if k in kinds)
    bad = [r["case"] for r, k in zip(rows, kinds) if k in ("failed", "timeout")]
    line = f"result: {counts} of {len(rows)} cases" + (f"; FAILED: {', '.join(bad)}" if bad else "")
    return line, (1 if bad else 4 if "not run" in kinds else 0)


def sizes_for(args) -> Sizes:
    """--quick: tiny sizes (a CPU's harness sizes; on CUDA 4 heads of 32, the smallest fla's kernels take well)."""
    if args.device == "cuda":
        T, d, W = (200, 128, 32) if args.quick else (1000, 256, 128)
    else:
        T, d, W = 40, 32, 16
    return Sizes(batch=args.batch, T=args.seq_len or T, d_model=args.d_model or d, window=args.window or W)


def run(args) -> dict:
    from attnzoo.config.errors import ConfigError

    if args.case_limit <= 0:
        raise ConfigError(f"must be > 0 seconds, got {args.case_limit:g}", field="--case-limit")
    if args.budget is not None and args.budget <= 0:
        raise ConfigError(f"must be > 0 seconds, got {args.budget:g}; allowed: omit it for no limit", field="--budget")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("no CUDA device is visible; allowed here: --device cpu (the harness on the torch paths)",
                          field="--device")
    device = torch.device(args.device)
    ctx = Context(device, sizes_for(args), torch.get_num_threads())
    cases = [c for c in CASES if not args.cases or c.name in args.cases]
    if args.cases and len(cases) != len(args.cases):
        known = ", ".join(c.name for c in CASES)
        raise ConfigError(f"unknown case in {args.cases}; allowed: {known}", field="--cases")
    s = ctx.sizes
    head = [
        f"device={device.type}" + (f" ({torch.cuda.get_device_name(0)})" if device.type == "cuda" else "") +
        f"; batch={s.batch} T={s.T} d_model={s.d_model} heads={s.n_heads}/{s.n_kv_heads}kv W={s.window}"
        f"{' (--quick)' if args.quick else ''}; per case <= {args.case_limit:g} s"
        + (f", all cases <= {args.budget:g} s (--budget)" if args.budget else "") + ".",
        "errors: ||fast - ref|| / ||ref|| (fp64); ref = the torch path in fp32 (TF32 off) on the same weights and "
        "inputs; base = the torch path in the case's dtype; tol = max(bound, 2 x base), bounds (out, grad): " +
        ", ".join(f"{k} {v[0]:g}/{v[1]:g}" for k, v in BOUNDS.items()) + (f"; cpu {CPU_BOUNDS[0]:g}/{CPU_BOUNDS[1]:g}"),
        "first s: the case's first call (on a fresh machine: the kernels' compile and autotune, then one run); "
        "check s: the second call, whose errors are the check. Cases run in order in a worker process, killed at "
        "the per-case limit (timeout) or when the budget runs out (the cases after it: not run).",
        "ran: the fast kernel was called (a spy on it); sdpa-flash runs under sdpa_kernel(FLASH_ATTENTION) only.",
        "MoBA / NSA: torch only (data-dependent per-query block selection; docs/gpu.md).",
    ]

    def notes(rows: list) -> list:
        return head + [outcome(rows)[0]]

    stream = Stream(args.out, getattr(args, "argv", []), cases, ctx, notes)

    def on_row(row: dict) -> None:
        times = "  ".join(f"{k} {row[k]:.1f}" for k in ("first s", "check s") if row.get(k) is not None)
        print(f"gpu_check {row['case']:<34} {row['status']}" + (f"  ({times})" if times else ""), flush=True)
        stream(row)

    rows = isolated.run_cases(__name__, [c.name for c in cases], ctx, case_limit=args.case_limit, budget=args.budget,
                              row_of=lambda name: base_row(next(c for c in cases if c.name == name), ctx), on_row=on_row)
    line, code = outcome(rows)
    return {**result(rows, head + [line]), "exit_code": code}
