"""Kimi Delta Attention (`kda`; Kimi Team 2025, "Kimi Linear: An Expressive, Efficient Attention Architecture",
arXiv:2510.26692): the gated delta rule of Gated DeltaNet with a decay per key channel instead of one per head,

    S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T,    o_t = d_k^-1/2 S_t^T q_t,
    log alpha_t = -exp(A_log_h) * softplus(W_f x_t + dt_bias)   (W_f low-rank: d_model -> r -> H d_k; per channel)

(GDN's Diag(alpha_t) is alpha_t I). The layer is transformers' `KimiLinearDeltaAttention` (tested against it): q, k,
v through one short causal conv + SiLU, q and k L2-normalised, beta = sigmoid(W_b x) per head, output = RMSNorm(o) *
sigmoid(W_g x) with W_g low-rank (d_model -> r -> H d_v), then o_proj. The rule is the generalized (diagonal plus
low-rank) delta rule of ops/generalized_delta_rule.py, which RWKV-7 runs:

    S_t = (diag(w_t) + b_t a_t^T) S_{t-1} + k'_t v_t^T   with   w = alpha, a = alpha * k, b = -beta k, k' = beta k,

so its three forms (the per-token recurrence as the reference, the chunkwise WY / UT form, the one-token step) and
its context-parallel scan and packing resets serve KDA unchanged; fla-core's `naive_recurrent_kda` /
`naive_chunk_kda` are the independent check (tests/test_kda.py). Where ops/dispatch.py picks fla (CUDA, or a CPU under
Triton's interpreter), the chunk form is fla's own `chunk_kda` on the raw (q, k, v, g, beta) (Gated DeltaNet-2 below:
`chunk_gdn2` with its erase / write gates): the same rule, tested equal under the interpreter (tests/interp).

Whole models: KDA layers with MLA layers (NoPE) and DeepSeek-V3's MoE import from and export to transformers'
`KimiLinearForCausalLM` (interop/hf; its layer_types <-> model.pattern, as Qwen3-Next's), or every layer KDA.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from attnzoo.config.registry import register_mixer
from attnzoo.mixers.base import HF_KIMI_DELTA_ATTENTION
from attnzoo.mixers.configs import GDN2Config, KDAConfig
from attnzoo.mixers.deltanet import DeltaNet
from attnzoo.mixers import recurrent_base
from attnzoo.mixers.recurrent_base import l2norm, upcast
from attnzoo.ops.generalized_delta_rule import (chunk_generalized_delta_rule, generalized_delta_rule_recurrent,
                                                generalized_delta_rule_step)


def kda_as_generalized(k: torch.Tensor, beta: torch.Tensor, g: torch.Tensor) -> tuple:
    """KDA's (k, beta, log-decay g) -> the generalized rule's (k', a, b): k' = beta k, a = e^g k, b = -beta k.
    k, g (..., Dk), beta (...)."""
    beta = beta[..., None]
    return beta * k, g.exp() * k, -beta * k


@register_mixer("kda", KDAConfig)
class KimiDeltaAttention(DeltaNet):
    gated = False  # DeltaNet's per-head gate is not built: the per-channel one is below
    kernel_family = "linear"  # fla's chunk_kda where dispatch picks fla (fla_kernel on KDAConfig)
    linearize_target = False
    hf_layer = HF_KIMI_DELTA_ATTENTION  # Kimi Linear's KDA layers (interop/hf: KimiLinearForCausalLM)

    @classmethod
    def hf_mixer_config(cls, c: dict) -> dict:
        """Kimi Linear's KDA layers: linear_attn_config's num_heads / head_dim / short_conv_kernel_size (transformers
        prefers them to its linear_num_heads / linear_head_dim / linear_conv_kernel_dim) for q, k and v alike, forget
        and output gates of rank head_dim, a short conv without bias activated by hidden_act (SiLU), a sigmoid-gated
        RMSNorm of eps rms_norm_eps."""
        lac = c.get("linear_attn_config") or {}
        pick = lambda key, flat: lac[key] if key in lac else c[flat]  # noqa: E731
        h, d = pick("num_heads", "linear_num_heads"), pick("head_dim", "linear_head_dim")
        return {"name": "kda", "n_heads": h, "n_v_heads": h, "head_dim": d, "v_head_dim": d, "gate_low_rank_dim": d,
                "conv_size": pick("short_conv_kernel_size", "linear_conv_kernel_dim"), "conv_bias": False,
                "qkv_activation": "silu", "allow_neg_eigval": False, "use_output_norm": True, "use_gate": True,
                "norm_eps": c["rms_norm_eps"]}

    def __init__(self, cfg: KDAConfig, model_cfg, layer_idx: int):
        super().__init__(cfg, model_cfg, layer_idx)
        h, hv, dk, dv = cfg.sizes(model_cfg)
        r = cfg.gate_low_rank_dim or dk
        self.f_proj = nn.Sequential(nn.Linear(self.d_model, r, bias=False), nn.Linear(r, hv * dk, bias=False))
        lo, hi = cfg.A_init_range
        self.A_log = nn.Parameter(torch.empty(hv).uniform_(lo, hi).log())  # one rate per head, as Kimi Linear
        lo, hi = cfg.dt_init_range
        dt = torch.exp(torch.empty(hv * dk).uniform_(math.log(lo), math.log(hi)))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus, per key channel
        for p in (self.A_log, self.dt_bias):
            p._no_weight_decay = True
        if cfg.use_gate:  # low-rank output gate (Kimi Linear's g_a_proj, g_b_proj), sigmoid in the norm
            self.g_proj = nn.Sequential(nn.Linear(self.d_model, r, bias=False), nn.Linear(r, hv * dv, bias=False))
        if self.norm is not None:
            self.norm.act = torch.sigmoid

    def gate(self, x: torch.Tensor) -> torch.Tensor:
        """log-decay per key channel, g = -exp(A_log_h) * softplus(W_f x + dt_bias) <= 0: (B, T, Hv, Dk) in >= fp32."""
        f = upcast(self.f_proj(x)) + self.dt_bias.to(upcast(x).dtype)
        f = f.unflatten(-1, (self.n_v_heads, self.state_shape[0]))
        return -self.A_log.to(f.dtype).exp()[:, None] * F.softplus(f)

    def mix(self, q, k, v, x, state, mode, resets=None):
        q, k = l2norm(q), l2norm(k)
        g = self.gate(x)  # (B, T, Hv, Dk)
        if self.group > 1:  # grouped values: consecutive value heads share a q/k head
            q, k = q.repeat_interleave(self.group, dim=2), k.repeat_interleave(self.group, dim=2)
        state = None if state is None else state.to(q.dtype)
        if mode == "chunk" and resets is None and recurrent_base.mixer_kernel(self, x) == "fla":
            q, k, v, g = (t.transpose(1, 2) for t in (q, k, v, g))
            o, state = self.fla_chunk(q, k, v, g, x, state)
            return o.transpose(1, 2), state
        kw, vw, a, b = self.rule_inputs(k, v, x, g)
        q, kw, vw, a, b, g = (t.transpose(1, 2) for t in (q, kw, vw, a, b, g))
        o, state = self.recur(mode, x, state, resets, q, kw, vw, a, b, g)
        return o.transpose(1, 2), state

    def beta(self, x: torch.Tensor) -> torch.Tensor:
        """The write strength per value head, sigmoid(W_b x) (x 2 with allow_neg_eigval): (B, T, Hv) in >= fp32."""
        beta = torch.sigmoid(upcast(self.b_proj(x)))
        return 2 * beta if self.cfg.allow_neg_eigval else beta

    def rule_inputs(self, k, v, x, g) -> tuple:
        """The generalized rule's write key, value and low-rank pair (B, T, Hv, D) from KDA's beta per head."""
        kw, a, b = kda_as_generalized(k, self.beta(x), g)
        return kw, v, a, b

    # the generalized delta rule's forms (ops/generalized_delta_rule.py) on k' = beta k, a, b, g (B, H, T, Dk)
    def step_op(self, q, k, v, a, b, g, *, state):
        return generalized_delta_rule_step(q, k, v, a, b, g, state)

    def recurrent_op(self, q, k, v, a, b, g, *, state):
        return generalized_delta_rule_recurrent(q, k, v, a, b, g, state)

    def chunk_op(self, q, k, v, a, b, g, *, state, resets=None):
        return chunk_generalized_delta_rule(q, k, v, a, b, g, state, chunk_size=self.chunk_size, resets=resets)

    def fla_op(self, q, k, v, a, b, g, *, state, dtype):
        raise NotImplementedError("kda's fla path is fla_chunk on the raw inputs (mix), not the generalized rule")

    def fla_chunk(self, q, k, v, g, x, state):
        """fla's own kernel (chunk_kda) on heads-first q, k, v and log-decay g (B, H, T, D) with this layer's beta."""
        from attnzoo.ops.fla_kernels import fla_chunk_kda  # fla / triton: imported where fla runs only

        beta = self.beta(x).transpose(1, 2)
        return fla_chunk_kda(q, k, v, g, beta, state, dtype=recurrent_base.compute_dtype(x))

    def op_flops_per_token(self, context_len: int) -> float:
        """The generalized rule's chunkwise form per value head (as RWKV-7's; C = min(chunk_size, L)), per token:
        10 C Dk + 8 C Dv + 8 Dk Dv + 2 Dk^2 + 2 Dk^2 Dv / C + C^2/3."""
        C = max(1, min(self.chunk_size, context_len))
        dk, dv = self.state_shape
        per_head = 10 * C * dk + 8 * C * dv + 8 * dk * dv + 2 * dk * dk + 2 * dk * dk * dv / C + C * C / 3
        return self.n_v_heads * per_head

    def layer_shape(self) -> dict:
        out = super().layer_shape()
        out["decay"] = "per key channel"
        return out


def gdn2_as_generalized(k: torch.Tensor, erase: torch.Tensor, write: torch.Tensor, v: torch.Tensor,
                        g: torch.Tensor) -> tuple:
    """GDN-2's (k, erase gate (..., Dk), write gate (..., Dv), v, log-decay g (..., Dk)) -> the generalized rule's
    (k', v', a, b): the write k (write * v)^T, the removal -k ((erase * k * e^g)^T S). KDA: erase = write = beta."""
    return k, write * v, erase * g.exp() * k, -k


@register_mixer("gdn2", GDN2Config)
class GatedDeltaNet2(KimiDeltaAttention):
    """Gated DeltaNet-2 (`gdn2`; fla-core's ops/gdn2): KDA whose scalar beta becomes two channel-wise gates,

        S_t = (I - k_t (b_t * k_t)^T) Diag(alpha_t) S_{t-1} + k_t (w_t * v_t)^T,

    an erase gate b_t per key channel (what the write removes) and a write gate w_t per value channel (how much of
    each value channel is written); b = w = beta is KDA, and a scalar decay then Gated DeltaNet. The gates here are
    b = sigmoid(W_b x) (x 2 with `allow_neg_eigval`: fla's "typical range [0, 2]") and w = sigmoid(W_w x), each a
    full d_model -> H d projection: our choice (the layer of the GDN-2 release is not in fla-core 0.6.0, only its
    ops), said in docs/linear_mixers.md. The rule runs on the generalized delta rule (gdn2_as_generalized); where
    dispatch picks fla, on fla's own `chunk_gdn2`."""

    hf_layer = None  # not KDA's: KimiLinearForCausalLM has no erase / write gates
    hf_missing = "transformers has no Gated DeltaNet-2 counterpart"

    def __init__(self, cfg: GDN2Config, model_cfg, layer_idx: int):
        super().__init__(cfg, model_cfg, layer_idx)
        self.b_proj = nn.Linear(self.d_model, self.n_v_heads * self.state_shape[0], bias=False)  # erase, per key channel
        self.w_proj = nn.Linear(self.d_model, self.n_v_heads * self.v_dim, bias=False)  # write, per value channel

    def gates(self, x: torch.Tensor) -> tuple:
        """(erase (B, T, Hv, Dk), write (B, T, Hv, Dv)) in >= fp32: sigmoid(W_b x) (x 2 with allow_neg_eigval),
        sigmoid(W_w x)."""
        B, T = x.shape[:2]
        erase = torch.sigmoid(upcast(self.b_proj(x))).reshape(B, T, self.n_v_heads, self.state_shape[0])
        write = torch.sigmoid(upcast(self.w_proj(x))).reshape(B, T, self.n_v_heads, self.v_dim)
        return 2 * erase if self.cfg.allow_neg_eigval else erase, write

    def rule_inputs(self, k, v, x, g) -> tuple:
        """KDA's with the erase gate per key channel and the write gate per value channel."""
        return gdn2_as_generalized(k, *self.gates(x), v, g)

    def fla_chunk(self, q, k, v, g, x, state):
        """fla's own kernel (chunk_gdn2) on heads-first q, k, v, g (B, H, T, D) with this layer's two gates."""
        from attnzoo.ops.fla_kernels import fla_chunk_gdn2  # fla / triton: imported where fla runs only

        erase, write = (t.transpose(1, 2) for t in self.gates(x))
        return fla_chunk_gdn2(q, k, v, g, erase, write, state, dtype=recurrent_base.compute_dtype(x))

    def layer_shape(self) -> dict:
        out = super().layer_shape()
        out["gates"] = "erase per key channel, write per value channel"
        return out
