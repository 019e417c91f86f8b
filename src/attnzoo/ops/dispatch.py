"""Which kernel runs one mixer call: this package's torch ops, fla's Triton kernels, or flex_attention.

`model.impl` (auto | torch | fla | flex) is the request; each call resolves it with `choose_kernel` from the
mixer's family (its class's `kernel_family`, narrowed per layer by `Mixer.dispatch_family`), the input's
device and compute dtype, and what is installed. Nothing is cached on a module,
so a model built on the CPU and moved to a GPU (or back) picks its kernels anew on the next call.

    family          mixers                              CPU     CUDA, auto                      explicit fla / flex
    softmax         mha gqa mqa                         torch   torch (SDPA: flash in fp16/bf16) torch / torch
    window          sliding_window (no sinks, dropout)  torch   flex if available, else torch    torch / flex
    block_sparse    moba nsa                            torch   torch                            torch / torch
    linear          linear_attention deltanet           torch   fla in fp16/bf16 if available    fla (see below)
                    gated_deltanet gla retnet hgrn2             and not gated off (below),       / torch
                    mamba2 rwkv7 (key size <= 256)              else torch
    latent          mla                                 torch   torch                            torch / torch
    other           everything else (sinks, wide keys)  torch   torch                            torch / torch

- `torch` is always this package's torch path (on CUDA, SDPA picks its flash backend for fp16/bf16 itself).
- An explicit `fla` / `flex` that cannot run where the call is (no CUDA there, or the library / triton
  missing) is a `ConfigError` naming `model.impl` and what is allowed on this machine, raised before any
  work (`check_request` at the start of a run, `choose_kernel` at a call). An explicit request that does not
  apply to a layer (`fla` for gqa, `flex` for deltanet) runs that layer on torch, so one request serves a
  hybrid; summary.json's `model.kernels` says what each layer ran.
- `auto` sends fla fp16/bf16 calls only (fla tests its chunk kernels in 16-bit; fp32 runs the torch chunk form).
  An explicit `fla` also runs fp32 through fla where the kernel takes it (every one but the plain delta rule,
  whose `chunk_delta_rule` asserts against fp32: DeltaNet's fp32 calls run torch); fp64 always runs torch.
- Each layer names the fla function it calls (`Mixer.fla_kernel`; FLA_KERNELS). fla refuses some of them at
  run time on some devices (`fla_gates`: today its gated `chunk_bwd_dqkwg` on Hopper with Triton in
  [3.4.0, 3.7.1), fla #640). There `auto` runs the layer on torch and the run says so in one line at its start
  (`gate_notices`); an explicit `fla` is refused in one line before any work.
- The Triton interpreter (`TRITON_INTERPRET=1`, ops/triton_interpreter.py) makes a CPU a device fla runs on:
  an explicit `fla` then runs there in fp32 / fp16 (bf16 is refused: numpy has none); `auto` stays torch.
- MoBA / NSA stay on torch: their per-query top-k blocks are data dependent (recomputed every call from
  q . mean(K)), not a static block mask; fla's kernels for them need flash-attn (and NSA a GQA group >= 16).
- The probes never import triton on a machine without CUDA unless the interpreter is on
  (`torch.cuda.is_available()` first; DESIGN 6.7).
- Decode steps (one token with a cache) and the reference forms (`mixer.impl = "reference"`) always run torch.
"""
from __future__ import annotations

from importlib.util import find_spec
from typing import Any, Optional

import torch

from attnzoo.config.schema import IMPLS
from attnzoo.config.errors import ConfigError, check_choice
from attnzoo.config.machine import allowed_here, kernel_refusal
from attnzoo.ops.triton_interpreter import accommodate, interpreting

BACKENDS = ("torch", "fla", "flex")

# the kernel families (a mixer class's `kernel_family`): softmax attention, a sliding window, block-sparse
# attention, linear recurrences, latent (MLA) attention, softmax attention with a forget gate (FoX), everything else
FAMILY_NAMES = ("softmax", "window", "block_sparse", "linear", "latent", "forgetting", "other")
FLA_FAMILIES = ("linear", "forgetting")  # the families whose layers fla serves (FLA_KERNELS)

FLA_DTYPES = (torch.float16, torch.bfloat16)
FLEX_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Inductor's flex_attention: "NYI: embedding dimension of the query, key, and value must be at least 16"
FLEX_MIN_HEAD_DIM = 16
FLA_MAX_KEY_DIM = 256  # fla's chunk kernels: "current kernel does not support head dimension larger than 256"
_16BIT_FP32 = (torch.float16, torch.bfloat16, torch.float32)

# The fla functions the layers call (a mixer class's `fla_kernel`): the compute dtypes each takes, and whether its
# backward runs fla's gated `chunk_bwd_dqkwg` (what fla's Hopper gate refuses; `fla_gates`).
FLA_KERNELS = {
    "chunk_delta_rule": (FLA_DTYPES, False),  # deltanet; asserts "does not support float32"
    "chunk_gated_delta_rule": (_16BIT_FP32, True),  # gated_deltanet
    "chunk_simple_gla": (_16BIT_FP32, False),  # linear_attention: no gate, so the ungated backward
    "chunk_simple_gla(g)": (_16BIT_FP32, True),  # retnet, mamba2: one log-decay per head
    "chunk_gla": (_16BIT_FP32, False),  # gla, hgrn2: a log-decay per key channel (fla's own chunk_gla backward)
    "chunk_dplr_delta_rule": (_16BIT_FP32, False),  # rwkv7
    "chunk_kda": (_16BIT_FP32, False),  # kda: its own chunk_kda_bwd (fla's KDA kernels, not chunk_bwd_dqkwg)
    "chunk_gdn2": (_16BIT_FP32, False),  # gdn2: its own backward (GDN-2's and KDA's kernels)
    "chunk_gated_delta_product": (FLA_DTYPES, True),  # gated_deltaproduct; asserts against fp32; GDN's backward
    "parallel_forgetting_attn": (_16BIT_FP32, False),  # fox: fla's flash-style attention with the forget-gate bias
}


_PROBED: dict[str, bool] = {}  # probe results, once per process (what is installed does not change)


def _once(name: str, probe) -> bool:
    if name not in _PROBED:
        _PROBED[name] = probe()
    return _PROBED[name]


def _probe_fla() -> bool:
    if not (torch.cuda.is_available() or interpreting()):  # first: a CPU machine never imports triton
        return False
    if find_spec("triton") is None or find_spec("fla") is None:
        return False
    try:
        if not torch.cuda.is_available():
            accommodate()  # the interpreter: before fla's kernel modules bind what it lacks
        import fla.ops.delta_rule  # noqa: F401
        import fla.ops.gated_delta_rule  # noqa: F401
        import fla.ops.simple_gla  # noqa: F401
        import fla.ops.gla  # noqa: F401
        import fla.ops.generalized_delta_rule  # noqa: F401
    except Exception:  # an fla / triton / driver mismatch: fall back to torch rather than fail the run
        return False
    return True


def _probe_flex() -> bool:
    if not torch.cuda.is_available():  # flex on CPU has no backward (torch 2.13): never chosen there
        return False
    if find_spec("triton") is None:
        return False
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def constant_result(fn):
    """`torch.compiler.assume_constant_result` without importing torch._dynamo (~2 s of every CLI start on a 2-core
    machine, issue 45): the mark it sets (torch/_dynamo/decorators.py), or the real decorator once Dynamo is loaded.
    tests/test_lean_imports.py checks the mark is still the one torch sets."""
    import sys

    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True
    return fn


# assume_constant_result: under torch.compile (compile=true) the probe runs once, eagerly, and its answer is a
# constant of the graph (no find_spec / import traced, no graph break)
@constant_result
def fla_available() -> bool:
    """fla's Triton kernels can run on this machine: a CUDA device, triton and fla-core importable."""
    return _once("fla", _probe_fla)


@constant_result
def flex_available() -> bool:
    """flex_attention can run (forward and backward) on this machine's CUDA device: it compiles Triton kernels."""
    return _once("flex", _probe_flex)


def fla_devices() -> tuple[str, ...]:
    """The device types fla's kernels run on in this process: CUDA, and the CPU under Triton's interpreter."""
    return ("cuda", "cpu") if interpreting() else ("cuda",)


def choose_kernel(requested: str, family: str, device_type: str, dtype: torch.dtype, *, fla_ok: bool, flex_ok: bool,
                  fla_devices: tuple = ("cuda",), fla_dtypes: tuple = FLA_DTYPES, fla_gate: Optional[str] = None) -> str:
    """The backend ("torch" | "fla" | "flex") of one call: the table in this module's docstring.
    Pure: availability is passed in (fla_ok / flex_ok: the library is installed and can run on this machine's
    devices; fla_devices: where fla runs (`fla_devices()`); fla_dtypes: the compute dtypes the layer's fla
    kernel takes (FLA_KERNELS); fla_gate: why fla refuses that kernel on this device, or None)."""
    check_choice(requested, "model.impl", IMPLS)
    check_choice(family, "family", FAMILY_NAMES)
    if requested == "torch":
        return "torch"
    if (requested == "fla" and not (device_type in fla_devices and fla_ok)) or \
            (requested == "flex" and not (device_type == "cuda" and flex_ok)):
        raise kernel_refusal(requested, device_type, allowed_here(device_type, fla_ok=fla_ok, flex_ok=flex_ok,
                                                                  fla_devices=fla_devices))
    if family in FLA_FAMILIES and requested == "fla":
        allowed = ", ".join(allowed_here(device_type, fla_ok=fla_ok, flex_ok=flex_ok, fla_devices=fla_devices))
        if fla_gate:
            raise ConfigError(f"fla cannot run this layer here: {fla_gate}; allowed here: "
                              f"{allowed.replace(', fla', '')}", field="model.impl")
        if device_type != "cuda" and dtype == torch.bfloat16:
            raise ConfigError("fla under the Triton interpreter computes in numpy, which has no bf16; allowed: "
                              "fp32 or fp16 (trainer.precision=32-true), or model.impl=torch", field="model.impl")
        return "fla" if dtype in fla_dtypes else "torch"
    if device_type != "cuda":
        return "torch"
    if family in FLA_FAMILIES and requested == "auto" and fla_ok and dtype in FLA_DTYPES and dtype in fla_dtypes \
            and not fla_gate:
        return "fla"
    if family == "window" and requested in ("auto", "flex") and flex_ok and dtype in FLEX_DTYPES:
        return "flex"
    return "torch"


def family_of(mixer: Any) -> str:
    """The dispatch family of a built mixer (`Mixer.dispatch_family`): its class's `kernel_family`, narrowed to
    "other" where the fast kernel does not cover this layer's settings (sinks or dropout in a sliding window:
    the sinks go through their own masked forward and flex has no dropout; key / feature sizes above fla's
    FLA_MAX_KEY_DIM)."""
    return mixer.dispatch_family()


def autocast_off(device_type: str):
    """A region computed in the tensors' own dtypes whatever autocast says outside it; nothing to turn off on a
    device without autocast (`meta`, where tests/test_host_sync.py runs the training step)."""
    import contextlib

    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the call computes in: autocast's when it is on for x's device, else x's own."""
    dt = x.device.type
    if torch.amp.is_autocast_available(dt) and torch.is_autocast_enabled(dt):
        return torch.get_autocast_dtype(dt)
    return x.dtype


def _version(v: str) -> tuple[int, ...]:
    """'3.6.0+git1234' -> (3, 6, 0): the leading numeric fields."""
    out = []
    for part in v.split("+")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


HOPPER_GATE = ("{fla} refuses its gated chunk_bwd_dqkwg backward on Hopper (sm_90) with Triton {triton} (wrong "
               "results with Triton >= 3.4.0 and < 3.7.1: fla issue #640); fix: Triton >= 3.7.1 (a torch build that "
               "ships it), or model.impl=torch")


def fla_gates(capability: Optional[tuple[int, int]], triton_version: Optional[str], fla_version: str = "",
              hopper_gate: bool = True) -> dict[str, str]:
    """{fla kernel (FLA_KERNELS): why fla refuses it} on a CUDA device of compute `capability` with this Triton.
    Pure (the probe passes the machine's facts in). fla 0.6.0's one such gate (fla/ops/common/chunk_o.py,
    `chunk_bwd_dqkwg`): g given, IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1 -> RuntimeError in
    the first backward; `hopper_gate`: the installed fla has that check. (tilelang, which fla's message also
    names, does not lift it in 0.6.0: the raise comes first.)"""
    if capability is None or triton_version is None or not hopper_gate or capability[0] != 9:
        return {}
    if not ((3, 4, 0) <= _version(triton_version) < (3, 7, 1)):
        return {}
    why = HOPPER_GATE.format(fla=f"fla {fla_version}".strip(), triton=triton_version)
    return {name: why for name, (_, gated) in FLA_KERNELS.items() if gated}


def _probe_gates() -> dict[str, str]:
    """fla_gates for this process's CUDA device (nothing off CUDA; no import of triton or fla: versions from
    their metadata, the gate's presence from fla's source file)."""
    if not torch.cuda.is_available() or find_spec("fla") is None:
        return {}
    from importlib.metadata import PackageNotFoundError, version

    try:
        triton_version, fla_version = version("triton"), version("fla-core")
    except PackageNotFoundError:
        return {}
    spec = find_spec("fla")
    src = next(iter(spec.submodule_search_locations or []), None)
    try:
        gate = "TRITON_ABOVE_3_7_1" in open(f"{src}/ops/common/chunk_o.py").read()
    except OSError:
        gate = True  # cannot tell: assume the released gate
    return fla_gates(torch.cuda.get_device_capability(), triton_version, fla_version, gate)


_GATES: dict[str, dict[str, str]] = {}


def fla_gate(kernel: Optional[str], device_type: str) -> Optional[str]:
    """Why fla refuses `kernel` on this process's `device_type` device, or None (probed once per process)."""
    if kernel is None or device_type != "cuda":
        return None
    if "cuda" not in _GATES:
        _GATES["cuda"] = _probe_gates()
    return _GATES["cuda"].get(kernel)


def layer_kernel(mixer: Any, device_type: str, dtype: torch.dtype) -> str:
    """The backend `mixer`'s training / prefill call takes on `device_type` computing in `dtype`."""
    requested = getattr(mixer, "kernel_request", "auto")
    if device_type != "cuda" and requested in ("auto", "torch"):
        return "torch"  # every CPU call: no probe, no import
    kernel = getattr(mixer, "fla_kernel", None)
    return choose_kernel(requested, family_of(mixer), device_type, dtype, fla_ok=fla_available(),
                         flex_ok=flex_available(), fla_devices=fla_devices(),
                         fla_dtypes=FLA_KERNELS.get(kernel, (FLA_DTYPES, False))[0],
                         fla_gate=fla_gate(kernel, device_type))


def gate_notices(model: Any, device_type: str, dtype: torch.dtype) -> list[str]:
    """One line per reason `auto` runs a linear layer on torch although fla is installed and would take it (a
    runtime gate of fla's on this device): what, why, the fix. Printed at the start of a run."""
    by_reason: dict[str, list[str]] = {}
    if device_type != "cuda" or dtype not in FLA_DTYPES or not fla_available():
        return []
    for i, m in enumerate(getattr(model, "mixers", [])):
        why = fla_gate(getattr(m, "fla_kernel", None), device_type)
        if why and getattr(m, "kernel_request", "auto") == "auto" and family_of(m) in FLA_FAMILIES:
            by_reason.setdefault(why, []).append(f"{i}:{getattr(getattr(m, 'cfg', None), 'name', type(m).__name__)}")
    return [f"attnzoo: layers {', '.join(layers)} run the torch chunk form, not fla: {why}"
            for why, layers in by_reason.items()]


def mixer_kernel(mixer: Any, x: torch.Tensor) -> str:
    """The backend of this call of `mixer` on x (the mixer input, or q), resolved now from x's device and
    compute dtype."""
    if x.device.type != "cuda" and getattr(mixer, "kernel_request", "auto") in ("auto", "torch"):
        return "torch"
    return layer_kernel(mixer, x.device.type, compute_dtype(x))


def model_kernels(model: Any, device_type: str, dtype: torch.dtype) -> list[str]:
    """Per layer (`model.mixers`), the backend its training call takes: summary.json's `model.kernels`."""
    return [layer_kernel(m, device_type, dtype) for m in getattr(model, "mixers", [])]


def precision_compute_dtype(precision: str) -> torch.dtype:
    """trainer.precision -> the dtype a mixer call computes in (autocast's for the mixed ones)."""
    p = str(precision)
    if p.startswith("bf16"):
        return torch.bfloat16
    if p.startswith("16"):
        return torch.float16
    if p.startswith("64"):
        return torch.float64
    return torch.float32


FSDP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def run_compute_dtype(trainer_cfg) -> tuple[torch.dtype, str]:
    """(the dtype a run's matmuls compute in, where it comes from): the one source for the MFU peak, the
    per-layer kernels (`model.kernels`), the kernel checks and summary.json's `compute_dtype`. Autocast's
    dtype for a mixed precision; else, under FSDP, `trainer.fsdp.param_dtype` (the dtype the weights are
    gathered and computed in, while `trainer.precision` keeps the fp32 master copy); else the parameters'."""
    precision = str(trainer_cfg.precision)
    if "mixed" in precision:
        return precision_compute_dtype(precision), "trainer.precision"
    fsdp = getattr(trainer_cfg, "fsdp", None)
    param_dtype = getattr(fsdp, "param_dtype", None) if str(getattr(trainer_cfg, "strategy", "")) == "fsdp" else None
    if param_dtype:
        return FSDP_DTYPES[str(param_dtype)], "trainer.fsdp.param_dtype"
    return precision_compute_dtype(precision), "trainer.precision"


def check_request(requested: str, device_type: str, dtype: torch.dtype = torch.float32,
                  fla_kernels: tuple = ()) -> None:
    """At the start of a run: an explicit fla / flex that cannot run on the run's device (computing in `dtype`),
    or an explicit fla for a layer whose fla kernel (`fla_kernels`: the layers' `fla_kernel`) fla refuses on this
    device, is refused in one line before anything is built (the calls would refuse it too, after the data is
    prepared)."""
    check_choice(requested, "model.impl", IMPLS)
    if requested in ("fla", "flex"):
        ok = dict(fla_ok=fla_available(), flex_ok=flex_available(), fla_devices=fla_devices())
        choose_kernel(requested, "other", device_type, torch.float32, **ok)
        if requested == "fla":
            for kernel in dict.fromkeys(k for k in fla_kernels if k):
                choose_kernel("fla", "linear", device_type, dtype, **ok, fla_gate=fla_gate(kernel, device_type),
                              fla_dtypes=FLA_KERNELS.get(kernel, (FLA_DTYPES, False))[0])
