"""Causal linear attention (Katharopoulos et al. 2020, "Transformers are RNNs"): softmax(q k^T) replaced
by phi(q) phi(k)^T, so the past is a (Df x Dv) state per head.

Feature maps phi (per head, on the q/k projections of size `feature_dim`):
- identity: phi(x) = x (plain linear attention; unnormalised, as in fla's default / TransNormer).
- elu:      phi(x) = elu(x) + 1 (Katharopoulos et al. 2020), positive so normalisation is safe.
- relu:     phi(x) = relu(x) (e.g. Qin et al. 2022, cosFormer's base map; Kasai et al. 2021).
- taylor2:  phi(x) = [1, x / d^{1/4}, vec(x x^T) / (sqrt(2) d^{1/2})], so phi(q).phi(k) =
            1 + q.k/sqrt(d) + (q.k)^2 / (2d), the 2nd-order Taylor expansion of exp(q.k/sqrt(d))
            (Based, Arora et al. 2024; Zhang et al. 2024 "Hedgehog" baseline). Df = 1 + d + d^2, so keep
            feature_dim small (Based uses 16).
normalize: o_t = sum_s (phi_t.phi_s) v_s / (sum_s phi_t.phi_s + eps). Options shared with the delta-rule
mixers: short conv on q/k/v, per-head RMSNorm, SiLU output gate.
"""
from __future__ import annotations


import torch
import torch.nn.functional as F

from attnzoo.ops.linear_attention import chunk_linear_attention, linear_attention_recurrent, linear_attention_step
from attnzoo.config.registry import register_mixer
from attnzoo.mixers.recurrent_base import RecurrentMixer
from attnzoo.mixers.configs import FEATURE_MAPS, LinearAttentionConfig  # noqa: F401 (torch-free: config checks)

def feature_dim_out(feature_map: str, d: int) -> int:
    return 1 + d + d * d if feature_map == "taylor2" else d


def feature_map(x: torch.Tensor, name: str) -> torch.Tensor:
    """phi over the last dim of x (..., d) -> (..., Df)."""
    if name == "elu":
        return F.elu(x) + 1
    if name == "relu":
        return F.relu(x)
    if name == "taylor2":
        d = x.shape[-1]
        x2 = (x[..., :, None] * x[..., None, :]).flatten(-2) / (2**0.5 * d**0.5)
        return torch.cat([torch.ones_like(x[..., :1]), x / d**0.25, x2], dim=-1)
    return x


@register_mixer("linear_attention", LinearAttentionConfig)
class LinearAttention(RecurrentMixer):
    hf_missing = "linear attention (no softmax) has no transformers causal-LM counterpart"

    @classmethod
    def mup_qk_grows(cls, cfg) -> bool:  # the normaliser or the output norm divides the scale out
        return not (cfg.normalize or cfg.use_output_norm)

    def __init__(self, cfg: LinearAttentionConfig, model_cfg, layer_idx: int):
        super().__init__(cfg, model_cfg, layer_idx)
        h = cfg.n_heads or model_cfg.n_heads
        d = model_cfg.head_dim  # resolved by config.resolve_model
        fd, dv = cfg.feature_dim or d, cfg.head_dim or d
        self.chunk_size, self.normalize, self.eps = cfg.chunk_size, cfg.normalize, cfg.norm_eps
        self.phi_dim = feature_dim_out(cfg.feature_map, fd)
        default_scale = 1.0 if cfg.feature_map == "taylor2" else fd**-0.5
        self.scale = self.mup_qk_scale(model_cfg, fd, default_scale if cfg.scale is None else cfg.scale, cfg.scale)
        self.build(
            n_qk_heads=h, n_v_heads=h, qk_dim=fd, v_dim=dv,
            state_shape=(self.phi_dim, dv + int(cfg.normalize)),  # + the key-sum column when normalising
            conv_size=cfg.conv_size, conv_bias=cfg.conv_bias, activation=cfg.qkv_activation,
            output_norm=cfg.use_output_norm, output_gate=cfg.use_gate, norm_eps=cfg.norm_eps,
        )

    @classmethod
    def linearize_sizes(cls, n_heads: int, head_dim: int) -> dict:
        return {"n_heads": n_heads, "feature_dim": head_dim, "head_dim": head_dim}

    def mix(self, q, k, v, x, state, mode, resets=None):
        q, k = feature_map(q, self.cfg.feature_map), feature_map(k, self.cfg.feature_map)
        if self.normalize:  # a ones column: the last output column is the denominator phi(q) . sum phi(k)
            v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        state = None if state is None else state.to(q.dtype)
        o, state = self.recur(mode, x, state, resets, q, k, v)
        if self.normalize:
            o = o[..., :-1] / (o[..., -1:] + self.eps)
        return o.transpose(1, 2), state

    # the forms of causal linear attention (ops/linear_attention.py), on the feature-mapped q, k
    def step_op(self, q, k, v, *, state):
        return linear_attention_step(q, k, v, state, self.scale)

    def recurrent_op(self, q, k, v, *, state):
        return linear_attention_recurrent(q, k, v, state, self.scale)

    def chunk_op(self, q, k, v, *, state, resets=None):
        return chunk_linear_attention(q, k, v, state, self.scale, self.chunk_size, resets=resets)

    def fla_op(self, q, k, v, *, state, dtype):
        from attnzoo.ops.fla_kernels import fla_chunk_linear_attention  # fla / triton: imported on CUDA only

        return fla_chunk_linear_attention(q, k, v, state, self.scale, self.chunk_size, dtype=dtype)

    def op_flops_per_token(self, context_len: int) -> float:
        """Chunkwise form per head, chunk C = min(chunk_size, L), state Df x Dv' (Dv' = Dv + 1 when
        normalising), per token: 2 C (Df + Dv') + 4 Df Dv' (causal QK^T and its product with V, K^T V,
        Q S)."""
        C = max(1, min(self.chunk_size, context_len))
        df, dv = self.state_shape
        return self.n_v_heads * (2 * C * (df + dv) + 4 * df * dv)
