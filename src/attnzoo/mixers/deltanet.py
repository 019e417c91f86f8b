"""DeltaNet and Gated DeltaNet: linear-time mixers whose matrix state is edited by the delta rule.

- `deltanet` (Schlag et al. 2021; Yang et al. 2024, "Parallelizing Linear Transformers with the Delta
  Rule over Sequence Length"): S_t = S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T.
- `gated_deltanet` (Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks"; Qwen3-Next's linear layers):
  S_t = alpha_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T with alpha_t = exp(g_t),
  g_t = -exp(A_log) * softplus(W_a x_t + dt_bias) <= 0 (Mamba-2 parameterisation), and value heads
  that may be a multiple of the q/k heads (grouped value attention, as Qwen3-Next).

Both: q/k/v through a short causal depthwise conv + SiLU, q/k L2-normalised, scale d_k^-1/2,
beta = sigmoid(W_beta x), per-head RMSNorm on the output, optionally gated by SiLU(W_g x)
(on by default for gated_deltanet, as in the paper). `impl="reference"` runs the per-token recurrence.
"""
from __future__ import annotations

import math
from dataclasses import field

import torch
import torch.nn.functional as F
from torch import nn

from attnzoo.ops.delta_rule import chunk_delta_rule, delta_rule_recurrent, delta_rule_step
from attnzoo.config.registry import register_mixer
from attnzoo.mixers.base import HF_LINEAR_ATTENTION
from attnzoo.mixers.recurrent_base import RecurrentMixer, l2norm, upcast
from attnzoo.mixers.configs import DeltaNetConfig, GatedDeltaNetConfig  # noqa: F401 (torch-free: config checks)


class DeltaNet(RecurrentMixer):
    gated = False
    hf_missing = ("ungated DeltaNet has no transformers causal-LM counterpart (Qwen3-Next's linear layers are "
                  "gated_deltanet)")

    @classmethod
    def mup_qk_grows(cls, cfg) -> bool:  # q and k are L2-normalised: q.k stays in [-1, 1] at any d (docs/mup.md)
        return False

    def __init__(self, cfg: DeltaNetConfig, model_cfg, layer_idx: int):
        super().__init__(cfg, model_cfg, layer_idx)
        h, hv, dk, dv = cfg.sizes(model_cfg)
        self.group = hv // h
        self.chunk_size = cfg.chunk_size
        self.build(
            n_qk_heads=h, n_v_heads=hv, qk_dim=dk, v_dim=dv, state_shape=(dk, dv),
            conv_size=cfg.conv_size, conv_bias=cfg.conv_bias, activation=cfg.qkv_activation,
            output_norm=cfg.use_output_norm, output_gate=cfg.use_gate, norm_eps=cfg.norm_eps,
        )
        self.b_proj = nn.Linear(self.d_model, hv, bias=False)  # beta
        if self.gated:
            self.a_proj = nn.Linear(self.d_model, hv, bias=False)  # per-token decay input
            lo, hi = cfg.A_init_range
            self.A_log = nn.Parameter(torch.empty(hv).uniform_(lo, hi).log())
            lo, hi = cfg.dt_init_range
            dt = torch.exp(torch.empty(hv).uniform_(math.log(lo), math.log(hi)))
            self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
            for p in (self.A_log, self.dt_bias):
                p._no_weight_decay = True  # fla convention: optimizers may skip decay on these

    @classmethod
    def linearize_sizes(cls, n_heads: int, head_dim: int) -> dict:
        return {"n_heads": n_heads, "n_v_heads": n_heads, "head_dim": head_dim, "v_head_dim": head_dim}

    def gate(self, x: torch.Tensor) -> torch.Tensor:
        """log-decay g = -exp(A_log) * softplus(W_a x + dt_bias) <= 0, (B, T, Hv) in >= fp32."""
        a = upcast(self.a_proj(x))
        return -self.A_log.to(a.dtype).exp() * F.softplus(a + self.dt_bias.to(a.dtype))

    def mix(self, q, k, v, x, state, mode, resets=None):
        q, k = l2norm(q), l2norm(k)
        beta = torch.sigmoid(upcast(self.b_proj(x)))  # (B, T, Hv)
        if self.cfg.allow_neg_eigval:
            beta = 2 * beta
        g = self.gate(x) if self.gated else None
        if self.group > 1:  # grouped values: consecutive value heads share a q/k head
            q, k = q.repeat_interleave(self.group, dim=2), k.repeat_interleave(self.group, dim=2)
        q, k, v, beta = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), beta.transpose(1, 2)
        g = None if g is None else g.transpose(1, 2)
        state = None if state is None else state.to(q.dtype)
        o, state = self.recur(mode, x, state, resets, q, k, v, beta, g)
        return o.transpose(1, 2), state

    # the delta rule's forms (ops/delta_rule.py); beta (B, H, T), g (B, H, T) log-decays or None (ungated)
    def step_op(self, q, k, v, beta, g, *, state):
        return delta_rule_step(q, k, v, beta, state, g)

    def recurrent_op(self, q, k, v, beta, g, *, state):
        return delta_rule_recurrent(q, k, v, beta, g, state)

    def chunk_op(self, q, k, v, beta, g, *, state, resets=None):
        return chunk_delta_rule(q, k, v, beta, g, state, chunk_size=self.chunk_size, resets=resets)

    def fla_op(self, q, k, v, beta, g, *, state, dtype):
        from attnzoo.ops.fla_kernels import fla_chunk_delta_rule  # fla / triton: imported on CUDA only

        return fla_chunk_delta_rule(q, k, v, beta, g, state, chunk_size=self.chunk_size, dtype=dtype)

    def op_flops_per_token(self, context_len: int) -> float:
        """Chunkwise UT/WY form per value head, chunk C = min(chunk_size, L), per token:
        6 C Dk + 4 C Dv + C^2/3 + 2 Dk (Dk + Dv) + 4 Dk Dv + 2 Dk^2 Dv / C
        (A and QK^T; T rhs; the inverse; Kd^T [U|W]; W S0, Q S0; the hand-over M S; P u)."""
        C = max(1, min(self.chunk_size, context_len))
        dk, dv = self.state_shape
        per_head = 6 * C * dk + 4 * C * dv + C * C / 3 + 2 * dk * (dk + dv) + 4 * dk * dv + 2 * dk * dk * dv / C
        return self.n_v_heads * per_head


class GatedDeltaNet(DeltaNet):
    gated = True
    hf_layer = HF_LINEAR_ATTENTION  # Qwen3-Next's linear layers

    @classmethod
    def hf_mixer_config(cls, c: dict) -> dict:
        """Qwen3-Next's linear_* fields: SiLU-activated short conv without bias, gated RMSNorm (eps rms_norm_eps)."""
        return {"name": "gated_deltanet", "n_heads": c["linear_num_key_heads"],
                "n_v_heads": c["linear_num_value_heads"], "head_dim": c["linear_key_head_dim"],
                "v_head_dim": c["linear_value_head_dim"], "conv_size": c["linear_conv_kernel_dim"],
                "conv_bias": False, "qkv_activation": "silu", "use_output_norm": True, "use_gate": True,
                "norm_eps": c["rms_norm_eps"]}


register_mixer("deltanet", DeltaNetConfig)(DeltaNet)
register_mixer("gated_deltanet", GatedDeltaNetConfig)(GatedDeltaNet)
