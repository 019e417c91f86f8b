"""Which kernel runs one mixer call: this package's torch ops, fla's Triton kernels, or flex_attention.

`model.impl` (auto | torch | fla | flex) is the request; each call resolves it with `choose_kernel` from the
mixer's family (its class's `kernel_family`, narrowed per layer by `Mixer.dispatch_family`), the input's
device and compute dtype, and what is installed. Nothing is cached on a module,
so a model built on the CPU and moved to a GPU (or back) picks its kernels anew on the next call.

    family          mixers                              CPU     CUDA, auto                      explicit fla / flex
    softmax         mha gqa mqa                         torch   torch (SDPA: flash in fp16/bf16) torch / torch
    window          sliding_window (no sinks, dropout)  torch   flex if available, else torch    torch / flex
    block_sparse    moba nsa                            torch   torch                            torch / torch
    linear          linear_attention deltanet           torch   fla in fp16/bf16 if available,   fla (fp32: torch)
                    gated_deltanet (key size <= 256)            else torch                       / torch
    latent          mla                                 torch   torch                            torch / torch
    other           everything else (sinks, wide keys)  torch   torch                            torch / torch

- `torch` is always this package's torch path (on CUDA, SDPA picks its flash backend for fp16/bf16 itself).
- An explicit `fla` / `flex` that cannot run where the call is (no CUDA there, or the library / triton
  missing) is a `ConfigError` naming `model.impl` and what is allowed on this machine, raised before any
  work (`check_request` at the start of a run, `choose_kernel` at a call). An explicit request that does not
  apply to a layer (`fla` for gqa, `flex` for deltanet) runs that layer on torch, so one request serves a
  hybrid; summary.json's `model.kernels` says what each layer ran.
- fla runs in fp16/bf16 only: its chunk delta rule refuses fp32 and fla tests its chunk kernels in
  fp16/bf16, so fp32 (and fp64) calls run the torch chunk form.
- MoBA / NSA stay on torch: their per-query top-k blocks are data dependent (recomputed every call from
  q . mean(K)), not a static block mask; fla's kernels for them need flash-attn (and NSA a GQA group >= 16).
- The probes never import triton on a machine without CUDA (`torch.cuda.is_available()` first; DESIGN 6.7).
- Decode steps (one token with a cache) and the reference forms (`mixer.impl = "reference"`) always run torch.
"""
from __future__ import annotations

from importlib.util import find_spec
from typing import Any

import torch

from attnzoo.config.schema import IMPLS
from attnzoo.config.errors import ConfigError, check_choice

BACKENDS = ("torch", "fla", "flex")

# the kernel families (a mixer class's `kernel_family`): softmax attention, a sliding window, block-sparse
# attention, linear recurrences, latent (MLA) attention, and everything else
FAMILY_NAMES = ("softmax", "window", "block_sparse", "linear", "latent", "other")

FLA_DTYPES = (torch.float16, torch.bfloat16)
FLEX_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FLA_MAX_KEY_DIM = 256  # fla's chunk kernels: "current kernel does not support head dimension larger than 256"


_PROBED: dict[str, bool] = {}  # probe results, once per process (what is installed does not change)


def _once(name: str, probe) -> bool:
    if name not in _PROBED:
        _PROBED[name] = probe()
    return _PROBED[name]


def _probe_fla() -> bool:
    if not torch.cuda.is_available():  # first: a CPU machine never imports triton
        return False
    if find_spec("triton") is None or find_spec("fla") is None:
        return False
    try:
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


# assume_constant_result: under torch.compile (compile=true) the probe runs once, eagerly, and its answer is a
# constant of the graph (no find_spec / import traced, no graph break)
@torch.compiler.assume_constant_result
def fla_available() -> bool:
    """fla's Triton kernels can run on this machine: a CUDA device, triton and fla-core importable."""
    return _once("fla", _probe_fla)


@torch.compiler.assume_constant_result
def flex_available() -> bool:
    """flex_attention can run (forward and backward) on this machine's CUDA device: it compiles Triton kernels."""
    return _once("flex", _probe_flex)


def allowed_here(device_type: str, *, fla_ok: bool, flex_ok: bool) -> list[str]:
    """The model.impl values that can run on `device_type` given what is installed."""
    out = ["auto", "torch"]
    if device_type == "cuda":
        out += (["fla"] if fla_ok else []) + (["flex"] if flex_ok else [])
    return out


def _refuse(requested: str, device_type: str, fla_ok: bool, flex_ok: bool) -> ConfigError:
    need = ("a CUDA device with fla-core and triton (pip install -e '.[gpu]')" if requested == "fla"
            else "a CUDA device with triton (flex_attention compiles Triton kernels; no CPU backward)")
    where = "this machine" if device_type == "cuda" else f"{device_type} (no CUDA here)"
    return ConfigError(f"{requested} needs {need}, not {where}; allowed here: "
                       f"{', '.join(allowed_here(device_type, fla_ok=fla_ok, flex_ok=flex_ok))}", field="model.impl")


def choose_kernel(requested: str, family: str, device_type: str, dtype: torch.dtype, *,
                  fla_ok: bool, flex_ok: bool) -> str:
    """The backend ("torch" | "fla" | "flex") of one call: the table in this module's docstring.
    Pure: availability is passed in (fla_ok / flex_ok: the library can run on this machine's CUDA device)."""
    check_choice(requested, "model.impl", IMPLS)
    check_choice(family, "family", FAMILY_NAMES)
    if requested == "torch":
        return "torch"
    if (requested == "fla" and not (device_type == "cuda" and fla_ok)) or \
            (requested == "flex" and not (device_type == "cuda" and flex_ok)):
        raise _refuse(requested, device_type, fla_ok, flex_ok)
    if device_type != "cuda":
        return "torch"
    if family == "linear" and requested in ("auto", "fla") and fla_ok and dtype in FLA_DTYPES:
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


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the call computes in: autocast's when it is on for x's device, else x's own."""
    dt = x.device.type
    if torch.is_autocast_enabled(dt):
        return torch.get_autocast_dtype(dt)
    return x.dtype


def layer_kernel(mixer: Any, device_type: str, dtype: torch.dtype) -> str:
    """The backend `mixer`'s training / prefill call takes on `device_type` computing in `dtype`."""
    requested = getattr(mixer, "kernel_request", "auto")
    if device_type != "cuda" and requested in ("auto", "torch"):
        return "torch"  # every CPU call: no probe, no import
    return choose_kernel(requested, family_of(mixer), device_type, dtype, fla_ok=fla_available(),
                         flex_ok=flex_available())


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


def check_request(requested: str, device_type: str) -> None:
    """At the start of a run: an explicit fla / flex that cannot run on the run's device is refused in one
    line before anything is built (the calls would refuse it too, after the data is prepared)."""
    check_choice(requested, "model.impl", IMPLS)
    if requested in ("fla", "flex"):
        choose_kernel(requested, "other", device_type, torch.float32, fla_ok=fla_available(), flex_ok=flex_available())
