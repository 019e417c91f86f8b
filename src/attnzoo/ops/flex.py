"""flex_attention block masks (torch.nn.attention.flex_attention) for the attention mixers' CUDA fast path.

A BlockMask records, per tile of 128 queries x 128 keys, whether it is empty (skipped), full (no mask work)
or partial (the mask evaluated per element), so a band of W keys costs O(T * W) work instead of O(T^2).
Queries sit at the last Tq of the Tk key positions (offset = Tk - Tq), as in ops/attention.py:

    causal          key j <= query i
    sliding window  i - W < j <= i                 (Mistral / transformers / fla; DESIGN section 3)
    + sinks         or j < S (StreamingLLM), still causal   (ops: tested; the mixer's sink forward is torch)

MoBA / NSA have no mask here: their per-query top-k blocks are data dependent, recomputed every call from
q . mean(K), so they are not a static block mask (a mask_mod over the selection tensor would rebuild an
O(T^2) mask per layer per call, the torch path's cost); they stay on torch (ops/dispatch.py).

Masks are cached per (lengths, window, sinks, device): moving a model to another device builds new ones. The
mask lookup is kept out of a compiled model's graph (`torch.compiler.disable`): traced, Dynamo would skip the
cache and rebuild the mask in every step.
On CUDA flex_attention runs compiled (one fused Triton kernel, forward and backward). On CPU, torch 2.13
runs only its forward, unfused (all scores materialised): "FlexAttention does not support backward on CPU",
so the dispatcher never picks it there; the CPU tests use it for the forward only.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch


def band_mask_mod(window: Optional[int] = None, sinks: int = 0, offset: int = 0):
    """mask_mod(b, h, q_idx, kv_idx) -> bool: causal, within `window` keys (None: no window) or a sink."""

    def mask_mod(b, h, q_idx, kv_idx):
        qpos = q_idx + offset
        keep = kv_idx <= qpos
        if window is not None:
            near = qpos - kv_idx < window
            keep = keep & ((kv_idx < sinks) | near) if sinks else keep & near
        return keep

    return mask_mod


@lru_cache(maxsize=64)
def _block_mask(q_len: int, kv_len: int, window: Optional[int], sinks: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    mod = band_mask_mod(window, sinks, kv_len - q_len)
    # compiled mask construction on CUDA (no (Tq, Tk) mask in memory); plain on CPU (no C++ compile in tests).
    # Never made of inference tensors: a mask first built in validation (inference mode) is cached and then
    # used by training, whose backward must save it.
    with torch.inference_mode(False):
        return create_block_mask(mod, B=None, H=None, Q_LEN=q_len, KV_LEN=kv_len, device=device,
                                 _compile=device.startswith("cuda"))


@torch.compiler.disable  # the cache is the point: traced by Dynamo (model compile=true) it would be bypassed
def block_mask(q_len: int, kv_len: int, *, window: Optional[int] = None, sinks: int = 0,
               device: torch.device | str = "cpu"):
    """The BlockMask of the band (causal when window is None) for q_len queries over kv_len keys."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _block_mask(q_len, kv_len, window, sinks, str(device))


@lru_cache(maxsize=None)
def _compiled_flex(backend: str = "inductor"):
    """flex_attention compiled once for every length: `dynamic=None` (automatic dynamic shapes) compiles the first
    length statically and the next one with symbolic lengths, which then serves every length (a graph per length
    with dynamic=False hit Dynamo's recompile limit after 8 lengths, and flex then ran eagerly, materialising the
    T x T scores). Grad mode and dtype are guards: a run in one dtype compiles at most 4 graphs (train /
    validation x static / dynamic), under the limit."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=None, backend=backend)


def flex_attend(q, k, v, mask, *, scale: Optional[float] = None) -> torch.Tensor:
    """flex_attention of q (B, H, Tq, D) over k/v (B, Hkv, Tk, D) under `mask`; GQA as the torch path (query
    head h reads KV head h // (H / Hkv)). Compiled on CUDA, eager elsewhere (CPU: forward only)."""
    if q.device.type == "cuda":
        fn = _compiled_flex()
    else:
        from torch.nn.attention.flex_attention import flex_attention as fn
    return fn(q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def flex_sliding_window(q, k, v, *, window: int, sinks: int = 0, scale: Optional[float] = None) -> torch.Tensor:
    """Sliding-window attention (with `sinks` always-visible first keys) through flex_attention: q (B, H, Tq, D)
    are the last Tq of the Tk keys in k/v (B, Hkv, Tk, D). Reference: `attention_reference` with
    `attention_mask(..., window=W)` (plus the sink columns, as mixers.attention.sink_window_attention)."""
    mask = block_mask(q.shape[2], k.shape[2], window=window, sinks=sinks, device=q.device)
    return flex_attend(q, k, v, mask, scale=scale)


def flex_causal(q, k, v, *, scale: Optional[float] = None) -> torch.Tensor:
    """Causal attention through flex_attention (the dense softmax mixers use SDPA; this is its cross-check)."""
    return flex_attend(q, k, v, block_mask(q.shape[2], k.shape[2], device=q.device), scale=scale)
