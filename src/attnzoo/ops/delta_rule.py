"""The (gated) delta rule in three forms on the same inputs: per-token recurrence (the reference),
chunkwise-parallel UT/WY form (training and prefill), and a one-token step (decode).

Per head, with state S of shape (d_k, d_v), L2-normalised q_t/k_t (done by the caller), beta_t in (0, 1)
and an optional log-decay g_t <= 0 (Gated DeltaNet, Yang, Kautz & Hatamizadeh 2024):

    S'  = exp(g_t) S_{t-1}                         decay first,
    S_t = S' + beta_t k_t (v_t - S'^T k_t)^T        then the delta-rule write reads the decayed state,
    o_t = scale * S_t^T q_t                         and the output reads the updated state.

Without g this is DeltaNet (Schlag et al. 2021; Yang et al. 2024, "Parallelizing Linear Transformers
with the Delta Rule over Sequence Length"). Layout is heads-first: q, k (B, H, T, Dk), v (B, H, T, Dv),
beta and g (B, H, T), state (B, H, Dk, Dv). Inputs are computed in their own dtype; callers pass fp32.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from attnzoo.ops.dispatch import autocast_off


class _UnitLowerSolve(torch.autograd.Function):
    """X = (I + tril_{-1}(A))^{-1} rhs through the explicit inverse, with a matmul-only backward.

    torch's own solve_triangular is slow on CPU for row-major batches (it copies to column-major per
    matrix: 5-200x slower than a bmm of the same size, measured with torch 2.13 + MKL), and its backward
    solves again. The inverse is formed once by the transposed right-hand solve, whose row-major inputs
    already are the column-major matrices LAPACK wants; everything else is bmm:
        dR = T^T dX,   dA = -tril_{-1}(dR X^T)   with T = (I + L)^{-1}.
    """

    @staticmethod
    def forward(ctx, A: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
        C = A.shape[-1]
        eye = torch.eye(C, dtype=A.dtype, device=A.device).expand(A.shape)
        # X^T (I + L)^T = I  <=>  X = (I + L)^{-1}; unitriangular reads only the strict triangle
        T = torch.linalg.solve_triangular(A.mT, eye, upper=True, unitriangular=True, left=False).mT
        X = T @ rhs
        ctx.save_for_backward(T, X)
        return X

    @staticmethod
    def backward(ctx, dX: torch.Tensor):
        T, X = ctx.saved_tensors
        dX = dX.to(T.dtype)  # bf16 when the matmul after the solve ran under autocast
        dR = T.mT @ dX
        dA = -(dR @ X.mT).tril(-1)
        return dA, dR


def solve_unit_lower(A: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """X with (I + tril_{-1}(A)) X = rhs, batched over leading dims; A (..., C, C), rhs (..., C, D).
    Only the strict lower triangle of A is read (the UT transform of the delta rule).
    Under bf16 / fp16 autocast A may arrive in that dtype (its matmul ran there), but triangular solves exist
    in fp32 / fp64 only ("triangular_solve_cpu" not implemented for 'BFloat16'), and the solve's own matmuls
    must not mix dtypes with it: under autocast the solve runs in fp32 (or fp64) with autocast off."""
    low = (torch.float16, torch.bfloat16)
    if torch.is_autocast_enabled(A.device.type) or A.dtype in low or rhs.dtype in low:
        dtype = torch.promote_types(torch.promote_types(A.dtype, rhs.dtype), torch.float32)
        with autocast_off(A.device.type):
            return solve_unit_lower(A.to(dtype), rhs.to(dtype))
    if torch.is_grad_enabled() and (A.requires_grad or rhs.requires_grad):
        return _UnitLowerSolve.apply(A, rhs)
    # inference: solve directly (no inverse, no extra matmul), same transposed right-hand form
    return torch.linalg.solve_triangular(A.mT, rhs.mT, upper=True, unitriangular=True, left=False).mT


def decay_exp(log_decay: torch.Tensor, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """exp of a cumulative log-decay (<= 0), flushing values below exp(log(tiny) / 3) to exactly 0.

    Why: with strong gates e^{G} gets tiny, and products of tiny factors inside the matmuls fall into
    subnormal floats, which x86 CPUs process 10-100x slower. A factor below the cut is < 1e-12 (fp32) /
    1e-102 (fp64) of the always-present diagonal term, far under the dtype's resolution, and a product
    of up to three kept factors stays normal. Products with small data can still be subnormal: for CPU
    training speed also set `torch.set_flush_denormal(True)` (the benchmark does, for every form).
    `keep` (bool) masks further entries to 0 (e.g. the non-causal triangle)."""
    cut = math.log(torch.finfo(log_decay.dtype).tiny) / 3
    drop = log_decay < cut
    if keep is not None:
        drop = drop | ~keep
    return log_decay.masked_fill(drop, float("-inf")).exp()


def delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    g: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: q, k (B, H, Dk), v (B, H, Dv), beta/g (B, H), state (B, H, Dk, Dv) -> (o (B, H, Dv), state)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if g is not None:
        state = state * g.exp()[..., None, None]
    read = torch.einsum("bhk,bhkv->bhv", k, state)  # what the state already predicts for k_t
    state = state + k[..., :, None] * (beta[..., None] * (v - read))[..., None, :]
    o = torch.einsum("bhk,bhkv->bhv", q * scale, state)
    return o, state


def delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: Optional[torch.Tensor] = None,
    initial_state: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: `delta_rule_step` over every token. Returns (o (B, H, T, Dv), final state (B, H, Dk, Dv))."""
    B, H, T, Dk = k.shape
    state = initial_state if initial_state is not None else k.new_zeros(B, H, Dk, v.shape[-1])
    outs = []
    for t in range(T):
        o, state = delta_rule_step(
            q[:, :, t], k[:, :, t], v[:, :, t], beta[:, :, t], state, None if g is None else g[:, :, t], scale
        )
        outs.append(o)
    return torch.stack(outs, dim=2), state


def chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: Optional[torch.Tensor] = None,
    initial_state: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    chunk_size: int = 64,
    resets: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunkwise-parallel form (UT/WY representation), any T. Same signature and result as the recurrence.
    `resets` (B, N chunks) bool: the state is zero entering the chunks marked True (packed documents laid out
    chunk-aligned, packing.Documents.chunk_layout: each chunk holds one document's tokens).

    Within a chunk of C tokens (local positions r, s; G_r = sum_{j<=r} g_j the in-chunk cumulative
    log-decay; S_0 the state entering the chunk), the delta-rule writes unroll to

        S_r = e^{G_r} S_0 + sum_{s<=r} e^{G_r - G_s} k_s u_s^T,
        (I + tril_{-1}(diag(beta) (K K^T * D))) u = diag(beta) (V - e^{G} K S_0),   D_rs = e^{G_r - G_s},

    so u = U - W S_0 with [U | W] = solve(I + ..., [beta V | beta e^{G} K])  (the UT transform).
    Everything except the chunk-to-chunk state hand-over is computed for all chunks at once
    (batched matmuls and one batched triangular solve). The hand-over is affine in S:

        S_next = M S + b,   M = e^{G_C} I - Kd^T W,   b = Kd^T U,   Kd = e^{G_C - G} K,

    so the only Python loop is one (Dk x Dk) @ (Dk x Dv) product per chunk. Outputs then read the
    chunk-start states in one batch: o = e^{G} Q S_0 + (Q K^T * D)_{causal} u.
    Decays are only ever exponentiated as differences G_r - G_s (s <= r), G_C - G_s, or G_r itself,
    all <= 0, so strong gates (g ~ -30 per token) underflow to 0 instead of overflowing.
    """
    B, H, T, Dk = k.shape
    Dv = v.shape[-1]
    scale = Dk**-0.5 if scale is None else scale
    C = max(1, min(chunk_size, T))
    pad = (-T) % C
    if pad:
        # zero k, v, beta and g leave the state untouched, so the final state is exact
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        beta = F.pad(beta, (0, pad))
        g = None if g is None else F.pad(g, (0, pad))
    N = (T + pad) // C
    q = (q * scale).reshape(B, H, N, C, Dk)
    k = k.reshape(B, H, N, C, Dk)
    v = v.reshape(B, H, N, C, Dv)
    beta = beta.reshape(B, H, N, C, 1)
    kb = k * beta

    kt = k.transpose(-1, -2)
    A = kb @ kt  # (B, H, N, C, C): beta_r k_r . k_s; only the strict lower triangle is used
    P = q @ kt  # q_r . k_s, causal part used
    if g is not None:
        G = g.reshape(B, H, N, C).cumsum(-1)
        future = torch.ones(C, C, dtype=torch.bool, device=k.device).triu(1)
        # mask before exp: above the diagonal G_r - G_s > 0 and could overflow. In place (two passes
        # over the largest elementwise tensor); the differences telescope along the UT transform, so
        # they need no flush of tiny values (decay_exp) here.
        D = (G[..., :, None] - G[..., None, :]).masked_fill_(future, float("-inf")).exp_()
        A = A * D
        P = P * D
        eG = decay_exp(G)[..., None]  # (B, H, N, C, 1): decay from chunk start to r
        rhs = torch.cat([v * beta, kb * eG], dim=-1)
        kd = k * decay_exp(G[..., -1:] - G)[..., None]  # decay from s to chunk end
        chunk_decay = decay_exp(G[..., -1])  # (B, H, N)
        qd = q * eG
    else:
        rhs = torch.cat([v * beta, kb], dim=-1)
        kd, chunk_decay, qd = k, None, q
        P = P.tril()
    UW = solve_unit_lower(A, rhs)
    U, W = UW.split([Dv, Dk], dim=-1)

    # chunk-to-chunk hand-over S_next = M S + b, the coefficients for all chunks in one matmul
    Mb = kd.transpose(-1, -2) @ UW  # (B, H, N, Dk, Dv + Dk)
    b, KW = Mb.split([Dv, Dk], dim=-1)
    eye = torch.eye(Dk, dtype=k.dtype, device=k.device)
    M = (eye if chunk_decay is None else chunk_decay[..., None, None] * eye) - KW
    S0, S = scan_chunk_states(M, b, initial_state, resets)

    u = U - W @ S0
    o = qd @ S0 + P @ u  # (B, H, N, C, Dv)
    o = o.reshape(B, H, N * C, Dv)[:, :, :T]
    return o, S.reshape(B, H, Dk, Dv)


def scan_chunk_states(M: torch.Tensor, c: torch.Tensor, initial_state: Optional[torch.Tensor] = None,
                      resets: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The one sequential part of a chunkwise form: the state entering each chunk under S_next = M_i S + c_i.
    M (B, H, N, Dk, Dk), c (B, H, N, Dk, Dv) per chunk; resets (B, N) bool zero the state entering a chunk (a packed
    document starts there). Returns (the N entering states (B, H, N, Dk, Dv), the final state (B*H, Dk, Dv))."""
    B, H, N, Dk, Dv = c.shape
    # unbind, not M[:, i]: indexing in a loop makes autograd add N full-size zero tensors in backward
    Ms = M.reshape(B * H, N, Dk, Dk).unbind(1)
    cs = c.reshape(B * H, N, Dk, Dv).unbind(1)
    S = c.new_zeros(B * H, Dk, Dv) if initial_state is None else initial_state.reshape(B * H, Dk, Dv).to(c.dtype)
    keep = None if resets is None else (~resets).to(c.dtype).repeat_interleave(H, dim=0).unbind(1)  # (B*H,) per chunk
    starts = []
    for i in range(N):
        if keep is not None:
            S = S * keep[i][:, None, None]
        starts.append(S)
        S = torch.baddbmm(cs[i], Ms[i], S)
    return torch.stack(starts, dim=1).reshape(B, H, N, Dk, Dv), S
