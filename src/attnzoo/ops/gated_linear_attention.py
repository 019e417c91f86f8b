"""Gated linear attention with a per-step log-decay (GLA, Yang et al. 2023; RetNet's retention, Sun et al. 2023,
is the case of one constant decay per head) in three forms: per-token recurrence (the reference), chunkwise-parallel
(training and prefill) and a one-token step (decode).

Per head, with state S of shape (d_k, d_v) and a log-decay g_t <= 0 per key channel (or one per head):

    S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T,        o_t = scale * S_t^T q_t.

GLA: g_t = logsigmoid(W_g x_t) / 16 per key channel; RetNet: g = log(1 - 2^(-5-h)) for head h, every token.
Layout is heads-first: q, k (B, H, T, Dk), v (B, H, T, Dv), g (B, H, T, Dg) with Dg = Dk (a decay per key
channel) or Dg = 1 (one per head, broadcast over the key channels), state (B, H, Dk, Dv). Inputs are computed in
their own dtype; callers pass fp32 or fp64.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from attnzoo.ops.delta_rule import decay_exp


def gated_linear_attention_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, state: torch.Tensor,
    scale: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: q, k (B, H, Dk), v (B, H, Dv), g (B, H, Dg), state (B, H, Dk, Dv) -> (o (B, H, Dv), state)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    state = state * g.exp()[..., None] + k[..., :, None] * v[..., None, :]
    return torch.einsum("bhk,bhkv->bhv", q * scale, state), state


def gated_linear_attention_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None, scale: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: `gated_linear_attention_step` over every token -> (o (B, H, T, Dv), final state)."""
    B, H, T, Dk = k.shape
    state = initial_state if initial_state is not None else k.new_zeros(B, H, Dk, v.shape[-1])
    outs = []
    for t in range(T):
        o, state = gated_linear_attention_step(q[:, :, t], k[:, :, t], v[:, :, t], g[:, :, t], state, scale)
        outs.append(o)
    return torch.stack(outs, dim=2), state


def chunk_gated_linear_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None, scale: Optional[float] = None, chunk_size: int = 64,
    resets: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunkwise-parallel form, any T; same result as the recurrence. `resets` (B, N chunks) bool: the state is zero
    entering the chunks marked True (packed documents laid out chunk-aligned, packing.Documents.chunk_layout).

    Within a chunk of C tokens (local positions r, s; G_r = sum_{j<=r} g_j the cumulative log-decay relative to the
    chunk start; S_0 the state entering the chunk):

        o_r = (q_r * e^{G_r}) S_0 + sum_{s<=r} (sum_d q_rd k_sd e^{G_rd - G_sd}) v_s,
        S_next = diag(e^{G_C}) S_0 + sum_s (k_s * e^{G_C - G_s}) v_s^T.

    Every exponent is a difference G_r - G_s with s <= r, G_C - G_s or G_r itself, all <= 0 (masked to -inf
    before the exp above the diagonal), so strong decays underflow to 0 and never overflow (fla's naive chunk form
    splits the same way). With one decay per head (Dg = 1) the causal decay matrix is (C, C) and the scores one
    matmul Q K^T; per key channel it is (C, C, Dk) and each query's scores one matrix-vector product. Everything
    but the chunk-to-chunk state hand-over runs for all chunks at once; the hand-over is one elementwise
    multiply-add per chunk."""
    B, H, T, Dk = k.shape
    Dv, Dg = v.shape[-1], g.shape[-1]
    scale = Dk**-0.5 if scale is None else scale
    C = max(1, min(chunk_size, T))
    pad = (-T) % C
    if pad:  # zero k, v and g (no decay) leave the state untouched, so the final state is exact
        q, k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
    N = (T + pad) // C
    q = (q * scale).reshape(B, H, N, C, Dk)
    k = k.reshape(B, H, N, C, Dk)
    v = v.reshape(B, H, N, C, Dv)
    G = g.reshape(B, H, N, C, Dg).cumsum(-2)  # (B, H, N, C, Dg): log-decay from the chunk start through r

    future = torch.ones(C, C, dtype=torch.bool, device=k.device).triu(1)
    D = (G[..., :, None, :] - G[..., None, :, :]).masked_fill_(future[..., None], float("-inf")).exp_()  # (C, C, Dg)
    if Dg == 1:  # one decay per head: (Q K^T * D)
        A = (q @ k.transpose(-1, -2)) * D[..., 0]
    else:  # per key channel: A_rs = sum_d q_rd (k_sd D_rsd), one matrix-vector product per query
        A = ((k[..., None, :, :] * D) @ q[..., :, :, None])[..., 0]
    qd = q * decay_exp(G)  # decay from the chunk start to r
    kd = k * decay_exp(G[..., -1:, :] - G)  # decay from s to the chunk end
    b = kd.transpose(-1, -2) @ v  # (B, H, N, Dk, Dv): each chunk's write
    chunk_decay = decay_exp(G[..., -1, :]).expand(B, H, N, Dk)[..., None]  # (B, H, N, Dk, 1)

    # the hand-over S_next = diag(e^{G_C}) S + b; unbind, not [:, :, i] (autograd adds a zero tensor per index)
    decays, writes = chunk_decay.unbind(2), b.unbind(2)
    S = k.new_zeros(B, H, Dk, Dv) if initial_state is None else initial_state.to(k.dtype)
    keep = None if resets is None else (~resets).to(k.dtype).unbind(1)  # (B,) per chunk
    starts = []
    for i in range(N):
        if keep is not None:
            S = S * keep[i][:, None, None, None]
        starts.append(S)
        S = S * decays[i] + writes[i]
    S0 = torch.stack(starts, dim=2)  # (B, H, N, Dk, Dv)

    o = qd @ S0 + A @ v  # (B, H, N, C, Dv)
    return o.reshape(B, H, N * C, Dv)[:, :, :T], S
