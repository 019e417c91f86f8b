"""Gated DeltaProduct (Siems et al. 2025, "DeltaProduct: Improving State-Tracking in Linear RNNs via Householder
Products", arXiv:2502.10297): per token, one decay and then n_h delta-rule steps with their own keys, values and
betas, so the state transition is a product of n_h generalized Householder matrices,

    S <- alpha_t S;   S <- S + beta_{t,j} k_{t,j} (v_{t,j} - S^T k_{t,j})^T  for j = 1 .. n_h;   o_t = scale S^T q_t.

The fast forms run it as the delta rule of ops/delta_rule.py over the n_h sub-steps of every token laid out in time
(length T n_h; the decay on each token's first sub-step, the query on its last, the other sub-steps' outputs
dropped), as fla's chunkwise form does; the reference loops over tokens and sub-steps. Layout heads-first: q (B, H, T,
Dk), k (B, H, T, n, Dk), v (B, H, T, n, Dv), beta (B, H, T, n), g (B, H, T) or None, state (B, H, Dk, Dv).
"""
from __future__ import annotations

from typing import Optional

import torch

from attnzoo.ops.delta_rule import chunk_delta_rule, delta_rule_recurrent


def expand_substeps(q, k, v, beta, g):
    """Per-token inputs -> the delta rule's over T n sub-steps: k, v, beta flattened in time; g on each token's first
    sub-step (0 elsewhere: no decay), q on its last (0 elsewhere: outputs not read)."""
    B, H, T, n, Dk = k.shape
    qx = torch.zeros(B, H, T, n, Dk, dtype=q.dtype, device=q.device)
    qx[:, :, :, -1] = q
    gx = None
    if g is not None:
        gx = torch.zeros(B, H, T, n, dtype=g.dtype, device=g.device)
        gx[:, :, :, 0] = g
        gx = gx.flatten(2, 3)
    return qx.flatten(2, 3), k.flatten(2, 3), v.flatten(2, 3), beta.flatten(2, 3), gx


def chunk_delta_product(q, k, v, beta, g=None, initial_state=None, scale: Optional[float] = None,
                        chunk_size: int = 16, resets: Optional[torch.Tensor] = None):
    """The chunkwise delta rule over the sub-steps, `chunk_size` tokens (chunk_size n sub-steps) per chunk, so the
    `resets` of chunk-aligned packed documents (B, T / chunk_size) mark the same chunks. -> (o (B, H, T, Dv), state)."""
    n = k.shape[3]
    o, state = chunk_delta_rule(*expand_substeps(q, k, v, beta, g), initial_state, scale=scale,
                                chunk_size=chunk_size * n, resets=resets)
    return o[:, :, n - 1::n], state


def delta_product_substeps(q, k, v, beta, g=None, initial_state=None, scale: Optional[float] = None):
    """The delta rule's per-token recurrence over the sub-steps (decode: a token's n sub-steps)."""
    n = k.shape[3]
    o, state = delta_rule_recurrent(*expand_substeps(q, k, v, beta, g), initial_state, scale=scale)
    return o[:, :, n - 1::n], state


def delta_product_reference(q, k, v, beta, g=None, initial_state=None, scale: Optional[float] = None):
    """Written out: for every token the decay, then each Householder step, then the read."""
    B, H, T, n, Dk = k.shape
    scale = Dk ** -0.5 if scale is None else scale
    S = initial_state if initial_state is not None else k.new_zeros(B, H, Dk, v.shape[-1])
    outs = []
    for t in range(T):
        if g is not None:
            S = S * g[:, :, t].exp()[..., None, None]
        for j in range(n):
            kj, vj, bj = k[:, :, t, j], v[:, :, t, j], beta[:, :, t, j]
            err = vj - torch.einsum("bhk,bhkv->bhv", kj, S)  # what the state predicts for kj, subtracted
            S = S + bj[..., None, None] * kj[..., :, None] * err[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t] * scale, S))
    return torch.stack(outs, dim=2), S
