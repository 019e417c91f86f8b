"""Gated DeltaProduct (`gated_deltaproduct`; Siems, Carstensen, Zela, Hutter, Pontil, Grazzi 2025, arXiv:2502.10297):
Gated DeltaNet whose every token takes `num_householder` (n_h) delta-rule steps, each with its own key, value and beta,
after one decay (ops/delta_product.py): the transition is a product of n_h generalized Householder matrices, which
tracks states (permutations) one Householder step cannot. n_h = 1 is Gated DeltaNet.

The layer is fla's `GatedDeltaProduct`: q (H d_k), k (H n_h d_k) and v (H_v n_h d_v) projections through one short
conv + SiLU, q and every k_{t,j} L2-normalised, beta = sigmoid(W_b x) per head and step (x 2 with
`allow_neg_eigval`), the Mamba-2 decay g = -exp(A_log) softplus(W_a x + dt_bias) per head, gated RMSNorm output.
The chunkwise form runs the delta rule over the T n_h sub-steps (chunks of chunk_size tokens), decode the token's
n_h sub-steps from the cached state; the reference loops over tokens and steps. Where ops/dispatch.py picks fla (CUDA
in fp16 / bf16, or a CPU under Triton's interpreter), the chunk form is fla's `chunk_gated_delta_product` (tested equal
under the interpreter: tests/interp); no context-parallel form (refused in one line).
"""
from __future__ import annotations

import torch
from torch import nn

from attnzoo.config.registry import register_mixer
from attnzoo.mixers.configs import GatedDeltaProductConfig
from attnzoo.mixers.deltanet import GatedDeltaNet
from attnzoo.mixers.recurrent_base import l2norm, upcast
from attnzoo.ops.delta_product import chunk_delta_product, delta_product_reference, delta_product_substeps


@register_mixer("gated_deltaproduct", GatedDeltaProductConfig)
class GatedDeltaProduct(GatedDeltaNet):
    kernel_family = "linear"  # fla's chunk_gated_delta_product where dispatch picks fla (16-bit)
    hf_layer = None
    hf_missing = "transformers has no DeltaProduct counterpart"
    linearize_target = False

    def __init__(self, cfg: GatedDeltaProductConfig, model_cfg, layer_idx: int):
        self.n_householder = cfg.num_householder
        super().__init__(cfg, model_cfg, layer_idx)
        n, h, hv = self.n_householder, self.n_qk_heads, self.n_v_heads
        dk, dv = self.qk_dim, self.v_dim
        # k and v (and beta) carry n_h steps per token: the fused projection and its conv widened
        self.qkv_dims = [h * dk, h * dk * n, hv * dv * n]
        self.qkv = nn.Linear(self.d_model, sum(self.qkv_dims), bias=False)
        if self.conv is not None:
            self.conv = type(self.conv)(sum(self.qkv_dims), cfg.conv_size, cfg.conv_bias, None)
        self.b_proj = nn.Linear(self.d_model, hv * n, bias=False)

    def _heads(self, qkv):
        """q (B, T, H, Dk), k (B, T, H, n, Dk), v (B, T, Hv, n, Dv) in >= fp32."""
        B, T, _ = qkv.shape
        if self.activation == "silu":
            qkv = torch.nn.functional.silu(qkv)
        q, k, v = upcast(qkv).split(self.qkv_dims, dim=-1)
        n = self.n_householder
        return (q.reshape(B, T, self.n_qk_heads, self.qk_dim), k.reshape(B, T, self.n_qk_heads, n, self.qk_dim),
                v.reshape(B, T, self.n_v_heads, n, self.v_dim))

    def mix(self, q, k, v, x, state, mode, resets=None):
        q, k = l2norm(q), l2norm(k)
        B, T = x.shape[:2]
        beta = torch.sigmoid(upcast(self.b_proj(x))).reshape(B, T, self.n_v_heads, self.n_householder)
        if self.cfg.allow_neg_eigval:
            beta = 2 * beta
        g = self.gate(x)  # (B, T, Hv)
        if self.group > 1:
            q, k = q.repeat_interleave(self.group, dim=2), k.repeat_interleave(self.group, dim=2)
        q, k, v, beta, g = (t.transpose(1, 2) for t in (q, k, v, beta, g))
        state = None if state is None else state.to(q.dtype)
        o, state = self.recur(mode, x, state, resets, q, k, v, beta, g)
        return o.transpose(1, 2), state

    def step_op(self, q, k, v, beta, g, *, state):
        # one token (time dropped): its n_h sub-steps from the cached state
        o, state = delta_product_substeps(*(t.unsqueeze(2) for t in (q, k, v, beta, g)), initial_state=state)
        return o[:, :, 0], state

    def recurrent_op(self, q, k, v, beta, g, *, state):
        return delta_product_reference(q, k, v, beta, g, state)

    def chunk_op(self, q, k, v, beta, g, *, state, resets=None):
        return chunk_delta_product(q, k, v, beta, g, state, chunk_size=self.chunk_size, resets=resets)

    def fla_op(self, q, k, v, beta, g, *, state, dtype):
        from attnzoo.ops.fla_kernels import fla_chunk_gated_delta_product  # fla / triton: where fla runs only

        return fla_chunk_gated_delta_product(q, k, v, beta, g, state, dtype=dtype)

    def op_flops_per_token(self, context_len: int) -> float:
        """The chunkwise delta rule over n_h sub-steps per token, chunks of C' = n_h min(chunk_size, L) sub-steps:
        n_h x DeltaNet's per-step count at chunk C' (the queries of all but the last sub-step are zero rows the
        matmuls still multiply)."""
        n = self.n_householder
        C = n * max(1, min(self.chunk_size, context_len))
        dk, dv = self.state_shape
        per_step = 6 * C * dk + 4 * C * dv + C * C / 3 + 2 * dk * (dk + dv) + 4 * dk * dv + 2 * dk * dk * dv / C
        return self.n_v_heads * n * per_step

    def layer_shape(self) -> dict:
        out = super().layer_shape()
        out["householder_steps"] = self.n_householder
        return out
