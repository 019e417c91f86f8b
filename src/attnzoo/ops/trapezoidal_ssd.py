"""Mamba-3's recurrence (Lahoti, Li, Chen, Wang, Bick, Kolter, Dao & Gu 2026, "Mamba-3: Improved Sequence Modeling
using State Space Principles", arXiv:2603.15569): an SSD state whose input integral is discretised by the
exponential-trapezoidal rule and whose transition is complex (a rotation of the state's channel pairs), with R
inputs and outputs per head (MIMO; R = 1 is SISO). Three forms: the per-token recurrence in complex numbers (the
reference), chunkwise-parallel (training and prefill) and a one-token step (decode).

Per head, with a real state H of shape (N, P) whose first A channel pairs (2j, 2j+1), j < A, read as complex numbers
h_j = H_2j + i H_2j+1 (the other N - 2A channels stay real), and per token t a log-decay g_t = dt_t A_t <= 0
(alpha_t = e^{g_t}), the trapezoid's weights gamma_t = lambda_t dt_t (this token) and w_t = (1 - lambda_t) dt_t (the
previous token), rotation angles psi_t (A of them) and R keys k_{t,r}, queries q_{t,r} (N) and values v_{t,r} (P):

    H_t = e^{g_t - i psi_t} (H_{t-1} + w_t sum_r k_{t-1,r} v_{t-1,r}^T) + gamma_t sum_r k_{t,r} v_{t,r}^T,
    y_{t,r} = Re(conj(q_{t,r})^T H_t)        (= q_{t,r}^T H_t on the real channels),

k and q complexified the same way. lambda = 1 is the exponential-Euler rule of Mamba-2 (w = 0) and psi = 0 a real
state: the two together are Mamba-2's SSD without its conv (tests/test_mamba3.py). The previous token's term enters
decayed by alpha_t and rotated by psi_t, as the state does.

The chunkwise form is the "RoPE trick" of the paper: with phi_t = sum_{s<=t} psi_s, rotating every q_t and k_t by
+phi_t (the same 2x2 rotation on each pair) turns the complex transition into Mamba-2's scalar decay, q~_t . k~_s =
q_t^T Rot(phi_s - phi_t) k_s; the previous-token term of token s+1 is folded into k_s's weight, gamma_s + w_{s+1}
(decayed from s on like k_s's own term, as alpha_{s+1} carries it), except on the diagonal, where token t has not yet
seen w_{t+1}: its weight there is gamma_t. Angles and decays are cumulated within each chunk only; the state handed
from chunk to chunk is H itself (rotated back by the chunk's total angle), so no angle grows with the sequence.

Layout is heads-first: q, k (B, H, T, R, N), v (B, H, T, R, P), g, gamma, w (B, H, T), psi (B, H, T, A) with 2A <= N;
the state is the tuple (H (B, H, N, P), the last token's k (B, H, R, N), its v (B, H, R, P)): what the next token's
trapezoid term reads. Inputs are computed in their own dtype; callers pass fp32 or fp64.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from attnzoo.ops.delta_rule import decay_exp

State = tuple  # (H (B, H, N, P), k_prev (B, H, R, N), v_prev (B, H, R, P))


def rotate_pairs(x: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """x (..., N) with its channel pairs (2j, 2j+1), j < A, rotated by angle (..., A) (broadcast against x's leading
    dims): (a, b) -> (a cos - b sin, a sin + b cos); the channels from 2A on unchanged."""
    A = angle.shape[-1]
    if A == 0:
        return x
    a, b = x[..., : 2 * A].unflatten(-1, (A, 2)).unbind(-1)
    cos, sin = angle.cos(), angle.sin()
    rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat((rotated, x[..., 2 * A:].expand(*rotated.shape[:-1], -1)), dim=-1)


def rotate_state(S: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """S (..., N, P) with the pairs of its N rows rotated by angle (..., A)."""
    return rotate_pairs(S.transpose(-1, -2), angle[..., None, :]).transpose(-1, -2)


def outer_sum(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """sum_r k_r v_r^T: k (..., R, N), v (..., R, P) -> (..., N, P), elementwise (no matmul: one token's write)."""
    return (k[..., :, None] * v[..., None, :]).sum(-3)


def trapezoidal_ssd_step(q, k, v, g, gamma, w, psi, state: State) -> tuple[torch.Tensor, State]:
    """One token: q, k (B, H, R, N), v (B, H, R, P), g, gamma, w (B, H), psi (B, H, A) -> (y (B, H, R, P), state),
    the transition in real arithmetic (the pairs rotated by -psi)."""
    S, k_prev, v_prev = state
    S = g.exp()[..., None, None] * (S + w[..., None, None] * outer_sum(k_prev, v_prev))
    S = rotate_state(S, -psi) + gamma[..., None, None] * outer_sum(k, v)
    return q @ S, (S, k, v)


def _complex(x: torch.Tensor, A: int, dim: int = -1) -> torch.Tensor:
    """Real (..., N) along `dim` -> complex (..., N - A): the pairs (2j, 2j+1), j < A, as 2j + i 2j+1; the rest real."""
    x = x.movedim(dim, -1)
    a, b = x[..., : 2 * A].unflatten(-1, (A, 2)).unbind(-1)
    rest = x[..., 2 * A:]
    z = torch.cat((torch.complex(a, b), torch.complex(rest, torch.zeros_like(rest))), dim=-1)
    return z.movedim(-1, dim)


def _real(z: torch.Tensor, A: int, dim: int = -1) -> torch.Tensor:
    """The inverse of `_complex`."""
    z = z.movedim(dim, -1)
    pairs = torch.stack((z[..., :A].real, z[..., :A].imag), dim=-1).flatten(-2)
    return torch.cat((pairs, z[..., A:].real), dim=-1).movedim(-1, dim)


def trapezoidal_ssd_recurrent(q, k, v, g, gamma, w, psi, state: Optional[State] = None) -> tuple[torch.Tensor, State]:
    """Reference: the recurrence of the module docstring token by token, the state complex (the paper's complex SSM
    written out: each pair one complex channel, its transition e^{g - i psi}) -> (y (B, H, T, R, P), final state)."""
    B, H, T, R, N = k.shape
    P, A = v.shape[-1], psi.shape[-1]
    if state is None:
        state = (k.new_zeros(B, H, N, P), k.new_zeros(B, H, R, N), v.new_zeros(B, H, R, P))
    S, k_prev, v_prev = state
    h = _complex(S.to(k.dtype), A, dim=-2)  # (B, H, N - A, P)
    kc, qc = _complex(k, A), _complex(q, A)  # (B, H, T, R, N - A)
    kc_prev, v_prev = _complex(k_prev.to(k.dtype), A), v_prev.to(v.dtype)
    # each complex channel's phase per token: -psi on the pairs, 0 on the real channels
    phase = F.pad(-psi, (0, N - 2 * A))  # (B, H, T, N - A)
    ys = []
    for t in range(T):
        kv_prev = (kc_prev[..., :, :, None] * v_prev[..., :, None, :]).sum(-3)  # sum_r k_{t-1,r} v_{t-1,r}^T
        kv = (kc[:, :, t, :, :, None] * v[:, :, t, :, None, :]).sum(-3)
        transition = torch.polar(g[:, :, t, None].exp().expand_as(phase[:, :, t]), phase[:, :, t])
        h = transition[..., None] * (h + w[:, :, t, None, None] * kv_prev) + gamma[:, :, t, None, None] * kv
        ys.append((qc[:, :, t, :, :, None].conj() * h[:, :, None]).sum(-2).real)  # (B, H, R, P)
        kc_prev, v_prev = kc[:, :, t], v[:, :, t]
    return torch.stack(ys, dim=2), (_real(h, A, dim=-2), _real(kc_prev, A), v_prev)


def chunk_trapezoidal_ssd(
    q, k, v, g, gamma, w, psi, state: Optional[State] = None, chunk_size: int = 64,
    resets: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, State]:
    """Chunkwise-parallel form, any T; the recurrence's result. `resets` (B, T / chunk_size) bool: the state
    (and with it the previous token's term) is zero entering the marked chunks (packed documents laid out
    chunk-aligned, packing.Documents.chunk_layout).

    Within a chunk of C tokens (local t, s; G_t the cumulative log-decay and phi_t the cumulative angle from the
    chunk start; q~, k~ rotated by phi; u_s = gamma_s + w_{s+1} the weight of k_s with the next token's trapezoid
    term, w_T = 0 after the last token; S_0 = H entering the chunk, plus w of the chunk's first token times the
    previous token's k v^T):

        y_{t,r} = e^{G_t} q~_{t,r}^T S_0 + sum_{s<=t, r'} (q~_{t,r} . k~_{s,r'}) e^{G_t - G_s} W_ts v_{s,r'},
            W_ts = u_s (s < t), gamma_t (s = t);
        S_next = Rot(-phi_C) (e^{G_C} S_0 + sum_{s, r} u_s e^{G_C - G_s} k~_{s,r} v_{s,r}^T).

    Every exponent is a difference G_t - G_s (s <= t), G_C - G_s or G_t, all <= 0: strong decays underflow to 0 and
    never overflow. The scores are one (C R, C R) matmul per chunk (tokens' ranks side by side, the causal mask and
    weights per token); everything but the chunk-to-chunk hand-over runs for all chunks at once."""
    B, H, T, R, N = k.shape
    P, A = v.shape[-1], psi.shape[-1]
    u = gamma + F.pad(w[..., 1:], (0, 1))  # k_s's weight: its own gamma and the next token's previous-token term
    if state is None:
        S = k.new_zeros(B, H, N, P)
    else:  # the first token's previous-token term, read from the state (before its decay, like H)
        S = state[0].to(k.dtype) + w[..., 0, None, None] * outer_sum(state[1].to(k.dtype), state[2].to(v.dtype))
    C = max(1, min(chunk_size, T))
    pad = (-T) % C
    if pad:  # zero k, v, weights, decay and angle: the state passes through the padding unchanged
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
        g, gamma, u = (F.pad(t, (0, pad)) for t in (g, gamma, u))
        psi = F.pad(psi, (0, 0, 0, pad))
    n = (T + pad) // C
    q, k = q.reshape(B, H, n, C, R, N), k.reshape(B, H, n, C, R, N)
    v = v.reshape(B, H, n, C * R, P)
    G = g.reshape(B, H, n, C).cumsum(-1)  # log-decay from the chunk start through t
    phi = psi.reshape(B, H, n, C, A).cumsum(-2)  # angle from the chunk start through t
    gamma, u = gamma.reshape(B, H, n, C), u.reshape(B, H, n, C)
    qr = rotate_pairs(q, phi[..., None, :]).reshape(B, H, n, C * R, N)
    kr = rotate_pairs(k, phi[..., None, :]).reshape(B, H, n, C * R, N)

    future = torch.ones(C, C, dtype=torch.bool, device=k.device).triu(1)
    diagonal = torch.eye(C, dtype=torch.bool, device=k.device)
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(future, float("-inf")).exp()  # (B, H, n, C, C)
    W = decay * torch.where(diagonal, gamma[..., :, None], u[..., None, :])
    scores = (qr @ kr.transpose(-1, -2)).view(B, H, n, C, R, C, R) * W[..., :, None, :, None]
    y = scores.view(B, H, n, C * R, C * R) @ v  # (B, H, n, C R, P)

    qd = qr * decay_exp(G).repeat_interleave(R, -1)[..., None]  # decay from the chunk start to t
    kd = kr * (u * decay_exp(G[..., -1:] - G)).repeat_interleave(R, -1)[..., None]  # from s to the chunk end
    writes = (kd.transpose(-1, -2) @ v).unbind(2)  # each chunk's write (B, H, N, P)
    decays = decay_exp(G[..., -1]).unbind(2)  # (B, H) per chunk
    turns = (-phi[..., -1, :]).unbind(2)  # the chunk's total angle, undone on the handed-over state

    # the hand-over S_next = Rot(-phi_C)(e^{G_C} S + write); unbind, not [:, :, i] (autograd adds a zero per index)
    keep = None if resets is None else (~resets).to(k.dtype).unbind(1)  # (B,) per chunk
    starts = []
    for i in range(n):
        if keep is not None:
            S = S * keep[i][:, None, None, None]
        starts.append(S)
        S = rotate_state(decays[i][..., None, None] * S + writes[i], turns[i])
    y = y + qd @ torch.stack(starts, dim=2)  # (B, H, n, C R, P)
    y = y.reshape(B, H, n * C, R, P)[:, :, :T]
    last = T - 1
    return y, (S, k.reshape(B, H, n * C, R, N)[:, :, last], v.reshape(B, H, n * C, R, P)[:, :, last])
