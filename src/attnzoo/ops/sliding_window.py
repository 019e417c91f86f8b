"""Sliding-window (band) attention in O(T * W) instead of O(T^2): queries in blocks, each block over its band.

Reference form: `attention_reference` with `attention_mask(..., window=W)` (ops/attention.py) — the same
band, written out over all T x T scores. The fast form cuts the queries into blocks of `block` rows; a
block of queries [s, e) can only see keys [s - W + 1, e), so each SDPA call holds (e - s) x (e - s + W - 1)
scores. Mask semantics follow Mistral / transformers / fla: query t sees keys t-W+1 .. t.
"""
from __future__ import annotations

from typing import Optional

import torch

from attnzoo.ops.attention import attention_sdpa


def sliding_window_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    window: int,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    block: Optional[int] = None,
) -> torch.Tensor:
    """q (B, H, Tq, D) are the last Tq of the Tk keys in k/v (B, Hkv, Tk, D[v]). Returns (B, H, Tq, Dv).

    `block` is the number of query rows per SDPA call; one call when Tq <= 2 * block, where blocking would not
    save work. A block of b rows scores b + W - 1 keys per query against ~W needed. Default max(W // 2, 64):
    ~1.5x the needed keys. Measured on this CPU (`attnzoo-bench sliding_window`, docs/attention.md): W/2 blocks
    beat W blocks (2x the keys) by 1.1-1.45x forward and 1.1-1.3x forward+backward at W = 512 / 1024, while W/4
    blocks (1.25x the keys) are no faster than W/2 and slower in backward: below ~256 rows a call's fixed cost and
    the kernel's own tiling outweigh the keys saved.
    """
    Tq, Tk = q.shape[2], k.shape[2]
    block = block or max(window // 2, 64)
    if Tq <= 2 * block:
        return attention_sdpa(q, k, v, causal=True, window=window, scale=scale, dropout_p=dropout_p)
    off = Tk - Tq  # key index of query 0
    outs = []
    for s in range(0, Tq, block):
        e = min(s + block, Tq)
        ks = max(0, off + s - window + 1)  # first key any query of this block can see
        # the block's queries are the last (e - s) of keys [ks, off + e): attention_sdpa's convention
        outs.append(
            attention_sdpa(
                q[:, :, s:e], k[:, :, ks : off + e], v[:, :, ks : off + e],
                causal=True, window=window, scale=scale, dropout_p=dropout_p,
            )
        )
    return torch.cat(outs, dim=2)
