"""Causal linear attention (Katharopoulos et al. 2020, "Transformers are RNNs") in three forms:
per-token recurrence (reference), chunkwise-parallel (training and prefill) and a one-token step (decode).

Per head, with feature-mapped queries/keys (the caller applies phi):

    S_t = S_{t-1} + k_t v_t^T,        o_t = scale * S_t^T q_t.

Normalisation (o_t / (q_t . sum_{s<=t} k_s)) is left to the caller: it appends a column of ones to v,
so the last output column is the denominator and the state carries the key sum as its last column.
Layout is heads-first: q, k (B, H, T, Dk), v (B, H, T, Dv), state (B, H, Dk, Dv).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def linear_attention_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor, scale: Optional[float] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: q, k (B, H, Dk), v (B, H, Dv), state (B, H, Dk, Dv) -> (o (B, H, Dv), state)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    state = state + k[..., :, None] * v[..., None, :]
    return torch.einsum("bhk,bhkv->bhv", q * scale, state), state


def linear_attention_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: `linear_attention_step` over every token -> (o (B, H, T, Dv), final state)."""
    B, H, T, Dk = k.shape
    state = initial_state if initial_state is not None else k.new_zeros(B, H, Dk, v.shape[-1])
    outs = []
    for t in range(T):
        o, state = linear_attention_step(q[:, :, t], k[:, :, t], v[:, :, t], state, scale)
        outs.append(o)
    return torch.stack(outs, dim=2), state


def chunk_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    chunk_size: int = 64,
    resets: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunkwise form, any T: within a chunk a causal (Q K^T) V; across chunks the state entering chunk i
    is S_0 + sum_{j<i} K_j^T V_j, an exclusive cumulative sum, so there is no loop at all.
    `resets` (B, N chunks) bool: the state is zero entering the chunks marked True (then the sum runs from the
    last reset, and S_0 counts only before the first). The segmented sum adds only its own segment's chunks (a
    0/1 segment matrix times the chunk contributions), never a global prefix sum minus its value at the reset:
    a packed document's outputs do not depend on an earlier document's numbers, not even by rounding."""
    B, H, T, Dk = k.shape
    Dv = v.shape[-1]
    scale = Dk**-0.5 if scale is None else scale
    C = max(1, min(chunk_size, T))
    pad = (-T) % C
    if pad:  # zero keys/values add nothing to the state
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    N = (T + pad) // C
    q = (q * scale).reshape(B, H, N, C, Dk)
    k = k.reshape(B, H, N, C, Dk)
    v = v.reshape(B, H, N, C, Dv)
    kv = k.transpose(-1, -2) @ v  # (B, H, N, Dk, Dv): each chunk's contribution
    S0 = kv.new_zeros(B, H, 1, Dk, Dv) if initial_state is None else initial_state[:, :, None].to(kv.dtype)
    if resets is None:
        starts = torch.cat([S0, S0 + kv.cumsum(2)], dim=2)  # state before chunk 0..N
    else:  # segmented: the state before chunk i sums chunks last(i) .. i-1, last(i) = its last reset (or 0)
        idx = torch.arange(N + 1, device=kv.device)
        marks = torch.cat([resets, resets.new_zeros(B, 1)], dim=1)  # (B, N + 1): a reset entering chunk i
        last = torch.where(marks, idx, torch.zeros_like(idx)).cummax(dim=1).values  # (B, N + 1)
        j = idx[:N]
        segment = (j[None, None, :] >= last[:, :, None]) & (j[None, None, :] < idx[None, :, None])  # (B, N + 1, N)
        starts = torch.einsum("bij,bhjkv->bhikv", segment.to(kv.dtype), kv)  # other segments' chunks times exact 0
        before_any = marks.cumsum(1)[:, None, :, None, None] == 0  # S_0 only up to the first reset
        starts = starts + torch.where(before_any, S0, torch.zeros_like(S0))
    o = q @ starts[:, :, :-1] + (q @ k.transpose(-1, -2)).tril() @ v
    return o.reshape(B, H, N * C, Dv)[:, :, :T], starts[:, :, -1]
