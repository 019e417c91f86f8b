"""What this machine can run, asked without importing torch (issue 45: a GPU preset on a CPU machine is refused
before torch's import, ~1.7 s on a 2-core machine). Each answer is certain where it says "no"; otherwise only
torch can tell, and the caller asks it (`torch.cuda.is_available()`).

Nothing here initialises CUDA: the driver library is only looked up (dlopen), so a process that forks DDP
workers afterwards stays fork-safe.
"""
from __future__ import annotations

import ast
import ctypes
import os
import sys
from functools import lru_cache
from importlib.util import find_spec
from pathlib import Path
from typing import Optional

from attnzoo.config.errors import ConfigError


@lru_cache(maxsize=1)
def torch_build() -> Optional[dict]:
    """torch's build facts (`torch/version.py`: __version__, cuda, hip), read as text without importing torch;
    None when they cannot be read (then torch decides)."""
    try:
        spec = find_spec("torch")
        root = Path(next(iter(spec.submodule_search_locations)))  # type: ignore[union-attr]
        tree = ast.parse((root / "version.py").read_text())
    except (AttributeError, StopIteration, OSError, SyntaxError, ValueError, ImportError):
        return None
    facts: dict = {}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        value = getattr(node, "value", None)
        if isinstance(target, ast.Name) and isinstance(value, ast.Constant):
            facts[target.id] = value.value
    return facts if "__version__" in facts else None


def _loadable(library: str) -> bool:
    try:
        ctypes.CDLL(library)
    except OSError:
        return False
    return True


def no_cuda_reason() -> Optional[str]:
    """Why `torch.cuda.is_available()` is certainly False in this process (a CPU build of torch; no NVIDIA driver
    for a CUDA build; CUDA_VISIBLE_DEVICES set empty), or None when only torch can tell (a ROCm build, a
    non-Linux platform, a driver present)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return "CUDA_VISIBLE_DEVICES is empty"
    build = torch_build()
    if build is None:
        return None
    if not build.get("cuda") and not build.get("hip"):
        return f"torch {build['__version__']} is a CPU build"
    if build.get("cuda") and not build.get("hip") and sys.platform.startswith("linux") \
            and not _loadable("libcuda.so.1"):
        return "no NVIDIA driver (libcuda.so.1 cannot be loaded)"
    return None


def cuda_available() -> bool:
    """`torch.cuda.is_available()`, without importing torch where the answer is certainly no."""
    if no_cuda_reason():
        return False
    import torch

    return torch.cuda.is_available()


def allowed_here(device_type: str, *, fla_ok: bool, flex_ok: bool, fla_devices: tuple = ("cuda",)) -> list[str]:
    """The model.impl values that can run on `device_type` given what is installed (ops/dispatch.py)."""
    out = ["auto", "torch"]
    if device_type in fla_devices and fla_ok:
        out.append("fla")
    if device_type == "cuda" and flex_ok:
        out.append("flex")
    return out


def kernel_refusal(requested: str, device_type: str, allowed: list[str]) -> ConfigError:
    """The one line for an explicit model.impl=fla|flex that cannot run on `device_type` (`allowed`: what can)."""
    need = ("a CUDA device (or TRITON_INTERPRET=1 on a CPU) with fla-core and triton (pip install -e '.[gpu]')"
            if requested == "fla" else "a CUDA device with triton (flex_attention compiles Triton kernels; no CPU backward)")
    where = "this machine" if device_type == "cuda" else f"{device_type} (no CUDA here)"
    return ConfigError(f"{requested} needs {need}, not {where}; allowed here: {', '.join(allowed)}", field="model.impl")
