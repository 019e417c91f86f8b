"""Gated Linear Attention (Yang, Wang, Shen, Panda & Kim 2023, "Gated Linear Attention Transformers with
Hardware-Efficient Training", arXiv:2312.06635), as fla's `GatedLinearAttention` layer builds it:

    S_t = diag(alpha_t) S_{t-1} + k_t v_t^T,    o_t = d_k^-1/2 S_t^T q_t,
    alpha_t = sigmoid(W_2 W_1 x_t + b)^(1/16)   (log alpha_t = logsigmoid(.) / 16, one per key channel),

a data-dependent forget gate per key channel through a low-rank projection (d_model -> 16 -> H d_k), then a
per-head RMSNorm on the output gated by SiLU(W_g x) and the output projection. `GatedLinearMixer` holds what GLA,
RetNet (mixers/retnet.py), HGRN2 (mixers/hgrn2.py) and Mamba-2 (mixers/mamba2.py) share: the forms of the one op
they reduce to (ops/gated_linear_attention.py) on a per-step log-decay the subclass computes (`log_decay`, or its own
`mix` through `gated`), the layer's sizes from its config (`layout`). `impl="reference"` runs the per-token recurrence.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from attnzoo.config.registry import register_mixer
from attnzoo.mixers.recurrent_base import RecurrentMixer, upcast
from attnzoo.ops.gated_linear_attention import (chunk_gated_linear_attention, gated_linear_attention_recurrent,
                                                gated_linear_attention_step)
from attnzoo.mixers.configs import GLAConfig  # noqa: F401 (torch-free: config checks)


class GatedLinearMixer(RecurrentMixer):
    """Gated linear attention on a log-decay per step (`log_decay`, subclass): the shared build, `mix` and forms."""

    # fla's chunk_gla (a decay per key channel) / chunk_simple_gla (one per head) on CUDA in fp16 / bf16 where
    # model.impl allows (RecurrentMixer.recur, ops/dispatch.py); the torch forms everywhere else
    kernel_family = "linear"

    # q's scale in the op: None = d_k^-1/2 (GLA, RetNet, HGRN2 as fla runs them); Mamba-2's SSD reads unscaled (1.0)
    scale: Optional[float] = None

    @classmethod
    def mup_qk_grows(cls, cfg) -> bool:  # a per-head (Mamba-2: per-group; HGRN2: whole) output norm divides it out
        return not getattr(cfg, "use_output_norm", True)

    def __init__(self, cfg, model_cfg, layer_idx: int):
        super().__init__(cfg, model_cfg, layer_idx)
        self.chunk_size = cfg.chunk_size
        self.build(**self.layout(cfg, model_cfg))
        self.scale = self.mup_qk_scale(model_cfg, self.qk_dim, self.scale)

    def layout(self, cfg, model_cfg) -> dict:
        """`build`'s arguments from the config: n_heads heads of d_k = head_dim, d_v = v_head_dim (null: the model's
        head size), the conv, q/k/v activation and output norm / gate as configured."""
        h = cfg.n_heads or model_cfg.n_heads
        dk = cfg.head_dim or model_cfg.head_dim  # resolved by config.resolve_model
        dv = cfg.v_head_dim or dk
        return dict(n_qk_heads=h, n_v_heads=h, qk_dim=dk, v_dim=dv, state_shape=(dk, dv),
                    conv_size=cfg.conv_size, conv_bias=cfg.conv_bias, activation=cfg.qkv_activation,
                    output_norm=cfg.use_output_norm, output_gate=cfg.use_gate, norm_eps=cfg.norm_eps)

    @classmethod
    def linearize_sizes(cls, n_heads: int, head_dim: int) -> dict:
        return {"n_heads": n_heads, "head_dim": head_dim, "v_head_dim": head_dim}

    def log_decay(self, x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """The log-decay g <= 0 of each token, (B, H, T, Dk) per key channel or (B, H, T, 1) per head, in q's
        dtype; x (B, T, d_model) the mixer input, q (B, T, H, Dk)."""
        raise NotImplementedError

    def mix(self, q, k, v, x, state, mode, resets=None):
        return self.gated(q, k, v, self.log_decay(x, q), x, state, mode, resets)

    def gated(self, q, k, v, g, x, state, mode, resets=None):
        """The op on q, k (B, T, H, Dk), v (B, T, H, Dv) and log-decays g (B, H, T, Dg) in the form `mode` asks
        (`recur`) -> (o (B, T, H, Dv), final state)."""
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        state = None if state is None else state.to(q.dtype)
        o, state = self.recur(mode, x, state, resets, q, k, v, g)
        return o.transpose(1, 2), state

    # the forms of gated linear attention (ops/gated_linear_attention.py); g (B, H, T, Dg) log-decays
    def step_op(self, q, k, v, g, *, state):
        return gated_linear_attention_step(q, k, v, g, state, self.scale)

    def recurrent_op(self, q, k, v, g, *, state):
        return gated_linear_attention_recurrent(q, k, v, g, state, self.scale)

    def chunk_op(self, q, k, v, g, *, state, resets=None):
        return chunk_gated_linear_attention(q, k, v, g, state, self.scale, self.chunk_size, resets)

    def fla_op(self, q, k, v, g, *, state, dtype):
        from attnzoo.ops.fla_kernels import fla_chunk_gated_linear_attention  # fla / triton: imported on CUDA only

        return fla_chunk_gated_linear_attention(q, k, v, g, state, self.scale, dtype)

    def op_flops_per_token(self, context_len: int) -> float:
        """Chunkwise form per head, chunk C = min(chunk_size, L), per token: 2 C (Dk + Dv) + 4 Dk Dv (the causal
        decayed scores and their product with V, the chunk's write K^T V and the read Q S; the decays elementwise)."""
        C = max(1, min(self.chunk_size, context_len))
        dk, dv = self.state_shape
        return self.n_v_heads * (2 * C * (dk + dv) + 4 * dk * dv)


@register_mixer("gla", GLAConfig)
class GLA(GatedLinearMixer):
    hf_missing = "Gated Linear Attention has no transformers causal-LM counterpart (fla's layer is its reference)"

    def __init__(self, cfg: GLAConfig, model_cfg, layer_idx: int):
        super().__init__(cfg, model_cfg, layer_idx)
        self.gk_proj = nn.Sequential(nn.Linear(self.d_model, cfg.gate_low_rank_dim, bias=False),
                                     nn.Linear(cfg.gate_low_rank_dim, self.n_qk_heads * self.qk_dim, bias=True))

    def log_decay(self, x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        B, T, H, Dk = q.shape
        gk = upcast(self.gk_proj(x)).reshape(B, T, H, Dk)  # q is upcast too: the same dtype
        return (F.logsigmoid(gk) / self.cfg.gate_logit_normalizer).transpose(1, 2)
