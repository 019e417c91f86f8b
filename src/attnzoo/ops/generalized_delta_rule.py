"""The generalized delta rule: a diagonal-plus-low-rank (DPLR) state transition with a decay per key channel, as
RWKV-7 "Goose" uses it (Peng et al. 2025, arXiv:2503.14456), in three forms: per-token recurrence (the reference),
chunkwise-parallel (WY / UT form: training and prefill) and a one-token step (decode).

Per head, with state S of shape (d_k, d_v) (the project's delta-rule layout: o_t = S_t^T q_t), a log-decay g_t <= 0
per key channel (w_t = exp(g_t)) and two key-sized vectors a_t, b_t:

    S_t = (diag(w_t) + b_t a_t^T) S_{t-1} + k_t v_t^T,        o_t = scale * S_t^T q_t.

The paper writes the same rule on the transposed (d_v, d_k) state, S_t = S_{t-1} (diag(w_t) + a_t b_t^T) + v_t k_t^T.
RWKV-7 takes a_t = -kk_t (its L2-normalised "removal key") and b_t = kk_t * lr_t (lr_t in (0, 1) per channel, the
in-context learning rate), so the transition is diag(w_t) - (lr_t * kk_t) kk_t^T; q is its receptance r, scale 1.
Both the decay and the removal act on S_{t-1} (Gated DeltaNet instead decays first, then reads the decayed state);
w = 1, a = -k, b = beta k and the write beta k v^T would be DeltaNet. fla's `chunk_dplr_delta_rule` /
`chunk_rwkv7` compute this rule with the same (K, V) state on (B, T, H, D) tensors.

Layout is heads-first: q, k, a, b, g (B, H, T, Dk), v (B, H, T, Dv), state (B, H, Dk, Dv). Inputs are computed in
their own dtype; callers pass fp32 or fp64.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from attnzoo.ops.delta_rule import decay_exp, scan_chunk_states, solve_unit_lower


def generalized_delta_rule_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, g: torch.Tensor,
    state: torch.Tensor, scale: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: q, k, a, b, g (B, H, Dk), v (B, H, Dv), state (B, H, Dk, Dv) -> (o (B, H, Dv), state)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    removal = torch.einsum("bhk,bhkv->bhv", a, state)  # a_t^T S_{t-1}: what the low-rank part reads
    state = state * g.exp()[..., None] + b[..., :, None] * removal[..., None, :] + k[..., :, None] * v[..., None, :]
    return torch.einsum("bhk,bhkv->bhv", q * scale, state), state


def generalized_delta_rule_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, g: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None, scale: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: `generalized_delta_rule_step` over every token -> (o (B, H, T, Dv), final state (B, H, Dk, Dv))."""
    B, H, T, Dk = k.shape
    state = initial_state if initial_state is not None else k.new_zeros(B, H, Dk, v.shape[-1])
    outs = []
    for t in range(T):
        o, state = generalized_delta_rule_step(*(x[:, :, t] for x in (q, k, v, a, b, g)), state, scale)
        outs.append(o)
    return torch.stack(outs, dim=2), state


def chunk_generalized_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, g: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None, scale: Optional[float] = None, chunk_size: int = 16,
    resets: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunkwise-parallel form (WY / UT representation), any T; same result as the recurrence. `resets` (B, N chunks)
    bool: the state is zero entering the chunks marked True (packed documents laid out chunk-aligned,
    packing.Documents.chunk_layout).

    Within a chunk of C tokens (local positions r, s; G_r = sum_{j<=r} g_j the cumulative log-decay from the chunk
    start through r, G_{r-1} the one before r; S_0 the state entering the chunk; x * e^{G} scales channel-wise), the
    low-rank read u_r = S_{r-1}^T a_r of every token unrolls to

        S_r = e^{G_r} S_0 + sum_{s<=r} e^{G_r - G_s} (k_s v_s^T + b_s u_s^T),
        u_r = S_0^T (a_r e^{G_{r-1}}) + sum_{s<r} [A_ak]_rs v_s + sum_{s<r} [A_ab]_rs u_s,
        [A_xy]_rs = sum_d x_rd y_sd e^{G_{r-1,d} - G_sd}  (s < r),

    a unit-lower triangular system: u = U + W S_0 with [U | W] = (I - A_ab)^{-1} [A_ak V | a e^{G_{r-1}}] (the
    UT transform; fla's naive `dplr_chunkwise` forms the same inverse row by row). Then, with
    [A_qy]_rs = sum_d q_rd y_sd e^{G_rd - G_sd} (s <= r) and Kd, Bd = k, b * e^{G_C - G_s}:

        o = (Q e^{G}) S_0 + A_qk V + A_qb u,
        S_next = M S_0 + Kd^T V + Bd^T U,   M = diag(e^{G_C}) + Bd^T W.

    Every exponent is a difference G_r - G_s (s <= r), G_{r-1} - G_s (s < r), G_C - G_s, G_r or G_{r-1}, all <= 0
    (the other triangle masked to -inf before the exp), so strong decays underflow to 0 and never overflow. The four
    score matrices share one (C, C, Dk) decay tensor per chunk (a decay per key channel: short chunks, gla's form;
    the strict ones read its row r - 1). All but the chunk-to-chunk hand-over run for all chunks at once; the
    hand-over is affine in S, one (Dk x Dk) @ (Dk x Dv) product per chunk."""
    B, H, T, Dk = k.shape
    Dv = v.shape[-1]
    scale = Dk**-0.5 if scale is None else scale
    C = max(1, min(chunk_size, T))
    pad = (-T) % C
    if pad:  # zero k, v, a, b and g (no decay, no write, no removal) leave the state untouched: the final state is exact
        q, k, v, a, b, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, a, b, g))
    N = (T + pad) // C
    q, k, a, b, g = (x.reshape(B, H, N, C, Dk) for x in (q * scale, k, a, b, g))
    v = v.reshape(B, H, N, C, Dv)
    G = g.cumsum(-2)  # (B, H, N, C, Dk): log-decay from the chunk start through r
    Gx = F.pad(G[..., :-1, :], (0, 0, 1, 0))  # ... through r - 1 (exclusive, exactly 0 at the chunk start)

    # one decay tensor serves all four score matrices, laid out (s, r, d) so that each key position s is one matmul's
    # batch: E[s, r] = e^{G_r - G_s} (s <= r). The strict ones, e^{G_{r-1} - G_s} (s < r), are its row r - 1: read by
    # a shifted one token up, their rows shifted back down (row 0 empty)
    causal = torch.ones(C, C, dtype=torch.bool, device=k.device).triu()  # [s, r]: s <= r
    E = decay_exp(G[..., None, :, :] - G[..., :, None, :], causal[..., None])  # (B, H, N, C_s, C_r, Dk)
    a_next = F.pad(a[..., 1:, :], (0, 0, 0, 1))  # a_{r+1} at r (zero past the chunk end)
    left = torch.stack([q, a_next], dim=-3)  # (B, H, N, 2, C_r, Dk)
    X = (left[..., None, :, :, :] * E[..., :, None, :, :]).flatten(-3, -2)  # (B, H, N, C_s, 2 C_r, Dk)
    # A[s, r, :] = sum_d left_rd E_srd [k | b]_sd: per key position s one (2 C, Dk) @ (Dk, 2)
    scores = (X @ torch.stack([k, b], dim=-1)).unflatten(-2, (2, C)).transpose(-4, -2)  # (.., C_r, 2, C_s, 2)
    A_qk, A_qb = scores[..., 0, :, 0], scores[..., 0, :, 1]  # (B, H, N, C_r, C_s)
    A_ak, A_ab = (F.pad(scores[..., :-1, 1, :, j], (0, 0, 1, 0)) for j in (0, 1))

    # the UT transform: (I - A_ab) [U | W] = [A_ak V | a e^{G_{r-1}}] (A_ab strictly lower)
    UW = solve_unit_lower(-A_ab, torch.cat([A_ak @ v, a * decay_exp(Gx)], dim=-1))
    U, W = UW.split([Dv, Dk], dim=-1)

    # chunk-to-chunk hand-over S_next = M S + c, the coefficients for all chunks at once
    to_end = decay_exp(G[..., -1:, :] - G)  # (B, H, N, C, Dk): decay from s to the chunk end
    BdUW = (b * to_end).transpose(-1, -2) @ UW  # (B, H, N, Dk, Dv + Dk): [Bd^T U | Bd^T W]
    c = (k * to_end).transpose(-1, -2) @ v + BdUW[..., :Dv]
    M = torch.diag_embed(decay_exp(G[..., -1, :])) + BdUW[..., Dv:]
    S0, S = scan_chunk_states(M, c, initial_state, resets)

    u = U + W @ S0  # (B, H, N, C, Dv): every token's low-rank read
    o = (q * decay_exp(G)) @ S0 + A_qk @ v + A_qb @ u
    return o.reshape(B, H, N * C, Dv)[:, :, :T], S.reshape(B, H, Dk, Dv)
