"""Mamba-2 (Dao & Gu 2024, "Transformers are SSMs: Generalized Models and Efficient Algorithms Through Structured
State Space Duality", arXiv:2405.21060), as mamba_ssm's `Mamba2` and transformers' `Mamba2Mixer` build it:

    [z | xBC | dt_raw] = in_proj(u),    [x | B | C] = SiLU(conv1d(xBC))    (causal depthwise conv, its K-1 tail cached)
    dt = softplus(dt_raw + dt_bias),    A = -exp(A_log)                     (one scalar per head)
    h_t = exp(dt_t A) h_{t-1} + B_t (dt_t x_t)^T,    y_t = h_t^T C_t + D x_t   (per head: h is d_state x head_dim)
    out = o_proj(RMSNorm_groups(y * SiLU(z)))                               (the gated norm: gate first, per group)

the state-space duality (SSD) is gated linear attention with one data-dependent log-decay per head, g = dt A, read
unscaled: q = C, k = B (each of the n_groups shared by n_heads / n_groups heads), v = dt x
(ops/gated_linear_attention.py; mixers/gla.py's forms). Head h's state holds d_state x head_dim values; n_heads = expand d_model / head_dim.

Weights: the fused projection `qkv` is xBC's slice of in_proj laid out [C | B | x] (the [q | k | v] order of the
recurrent mixers), `g_proj` its z slice, `dt_proj` its dt slice, the conv is over the same [C | B | x] channels;
`o_proj` is out_proj. Initialisation as the paper's code: A = exp(A_log) ~ U[1, 16], softplus(dt_bias) ~ logU[0.001,
0.1] floored at 1e-4, D = 1; A_log, dt_bias and D are not weight-decayed (`_no_weight_decay`). `impl="reference"`
runs the per-token recurrence.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from attnzoo.config.registry import register_mixer
from attnzoo.mixers.gla import GatedLinearMixer
from attnzoo.mixers.recurrent_base import upcast
from attnzoo.mixers.configs import Mamba2Config  # noqa: F401 (torch-free: config checks)


def ssm_decay_init(n_heads: int, A_init_range, dt_init_range, dt_floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(A_log, dt_bias), each (n_heads,), as mamba_ssm's Mamba2: A ~ U(A_init_range); dt ~ logU(dt_init_range)
    floored at dt_floor, dt_bias = softplus^-1(dt) = dt + log(1 - e^-dt)."""
    lo, hi = A_init_range
    A_log = torch.empty(n_heads).uniform_(lo, hi).log()
    return A_log, dt_bias_init(n_heads, dt_init_range, dt_floor)


def dt_bias_init(n_heads: int, dt_init_range, dt_floor: float) -> torch.Tensor:
    """dt_bias (n_heads,) as mamba_ssm's Mamba2 / Mamba3: dt ~ logU(dt_init_range) floored at dt_floor,
    dt_bias = softplus^-1(dt) = dt + log(1 - e^-dt)."""
    lo, hi = dt_init_range
    dt = torch.exp(torch.rand(n_heads) * (math.log(hi) - math.log(lo)) + math.log(lo)).clamp(min=dt_floor)
    return dt + torch.log(-torch.expm1(-dt))


class GroupGatedRMSNorm(nn.Module):
    """Mamba-2's gated RMSNorm (mamba_ssm's RMSNormGated, norm_before_gate=False): y = x * silu(z), normalised by
    its RMS over each group of `group_size` channels, times a weight over all channels. Computed in >= fp32."""

    def __init__(self, dim: int, group_size: int, eps: float):
        super().__init__()
        self.group_size, self.eps = group_size, eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        y = (upcast(x) * F.silu(upcast(gate))).unflatten(-1, (-1, self.group_size))
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.flatten(-2) * self.weight.to(y.dtype)


@register_mixer("mamba2", Mamba2Config)
class Mamba2(GatedLinearMixer):
    # exported as a whole model only: every layer mamba2, no FFN -> transformers' Mamba2ForCausalLM (its model_type;
    # interop/hf/archs.py _check_mamba2); among other layers it has no counterpart
    hf_model_type = "mamba2"
    hf_missing = ("no transformers counterpart among other layers (exported only as Mamba2ForCausalLM: every layer "
                  "mamba2, model/ffn=none)")
    # q / k are B / C shared over groups of heads and v is dt x: no attention layer's q/k/v to seed them
    linearize_target = False
    scale = 1.0  # SSD reads the state unscaled: y_t = h_t^T C_t

    def layout(self, cfg: Mamba2Config, model_cfg) -> dict:
        h, p, n = cfg.sizes(model_cfg)
        # qkv = [C | B | x], SiLU after the conv; the output gate z is g_proj, its norm GroupGatedRMSNorm (below)
        return dict(n_qk_heads=cfg.n_groups, n_v_heads=h, qk_dim=n, v_dim=p, state_shape=(n, p),
                    conv_size=cfg.conv_size, conv_bias=cfg.conv_bias, activation="silu",
                    output_norm=False, output_gate=True, norm_eps=cfg.norm_eps)

    def __init__(self, cfg: Mamba2Config, model_cfg, layer_idx: int):
        super().__init__(cfg, model_cfg, layer_idx)
        h, inner = self.n_v_heads, self.n_v_heads * self.v_dim
        self.dt_proj = nn.Linear(self.d_model, h, bias=False)  # in_proj's dt slice
        A_log, dt_bias = ssm_decay_init(h, cfg.A_init_range, cfg.dt_init_range, cfg.dt_init_floor)
        self.A_log, self.dt_bias = nn.Parameter(A_log), nn.Parameter(dt_bias)
        self.D = nn.Parameter(torch.ones(h))  # the skip y += D x
        for p in (self.A_log, self.dt_bias, self.D):
            p._no_weight_decay = True
        self.norm = GroupGatedRMSNorm(inner, inner // cfg.n_groups, cfg.norm_eps)

    def mix(self, c, b, xs, x, state, mode, resets=None):
        """c, b (B, T, n_groups, N): C and B; xs (B, T, H, P): the SSM input x; x the mixer input (dt's)."""
        dt = F.softplus(upcast(self.dt_proj(x)) + self.dt_bias.to(xs.dtype))  # (B, T, H)
        g = -self.A_log.to(xs.dtype).exp() * dt  # log-decay dt * A <= 0
        group = self.n_v_heads // self.n_qk_heads
        c, b = c.repeat_interleave(group, dim=2), b.repeat_interleave(group, dim=2)  # head h reads group h // group
        y, state = self.gated(c, b, xs * dt[..., None], g.transpose(1, 2)[..., None], x, state, mode, resets)
        return y + self.D.to(xs.dtype)[:, None] * xs, state

    def _output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y (B, T, H, P) -> RMSNorm per group of y * silu(z) -> o_proj -> (B, T, d_model) in x's dtype."""
        y = self.norm(o.flatten(2), self.g_proj(x))
        return self.o_proj(y.to(x.dtype))
