"""HGRN2 (Qin, Yang, Sun, Shen, Li, Sun & Zhong 2024, "HGRN2: Gated Linear RNNs with State Expansion",
arXiv:2404.07904), as fla's `HGRN2Attention` layer builds it:

    f_t = lb + (1 - lb) sigmoid(W_f x_t)          the forget gate, per key channel (lb: `lower_bound`)
    S_t = diag(f_t) S_{t-1} + (1 - f_t) i_t^T,    o_t = d_k^-1/2 S_t^T swish(W_q x_t),    i_t = W_i x_t,

HGRN's element-wise recurrence widened to a d_k x d_v state per head (the "state expansion"): the input gate is
tied to the forget gate as the key (k = 1 - f), HGRN's output gate became the query. Then one RMSNorm over all
heads' outputs together (fla's `g_norm` over the hidden size, not per head; no extra output gate) and the output
projection. Gated linear attention with g = log f per key channel (mixers/gla.py, ops/gated_linear_attention.py);
the q and k scale d_k^-1/2 is fla's `chunk_gla` default. `impl="reference"` runs the per-token recurrence.

fla's HGRN2 model also learns a lower bound per layer (`lower_bounds`, a model-level parameter: softmax over the
layers, cumulated, 0 for the first layer) so that upper layers forget more slowly. A mixer here is one layer, so
the bound is a fixed `lower_bound` (0 = off: fla's first layer and its `use_lower_bound=False`).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from attnzoo.config.registry import register_mixer
from attnzoo.mixers.gla import GatedLinearMixer
from attnzoo.mixers.recurrent_base import GatedRMSNorm
from attnzoo.mixers.configs import HGRN2Config  # noqa: F401 (torch-free: config checks)


@register_mixer("hgrn2", HGRN2Config)
class HGRN2(GatedLinearMixer):
    hf_missing = "HGRN2 has no transformers causal-LM counterpart (fla's HGRN2Attention layer is its reference)"
    # the fused projection's key slot carries the forget gate's logits, not a key an attention layer could seed
    linearize_target = False

    def layout(self, cfg: HGRN2Config, model_cfg) -> dict:
        h = cfg.n_heads or model_cfg.n_heads
        dk = cfg.head_dim or model_cfg.head_dim
        dv = cfg.v_head_dim or dk
        # qkv = [q | f | i]: the key slot holds the forget gate's logits (k = 1 - f is tied to it)
        return dict(n_qk_heads=h, n_v_heads=h, qk_dim=dk, v_dim=dv, state_shape=(dk, dv),
                    conv_size=cfg.conv_size, conv_bias=cfg.conv_bias, activation="none",
                    output_norm=False, output_gate=False, norm_eps=cfg.norm_eps)

    def __init__(self, cfg: HGRN2Config, model_cfg, layer_idx: int):
        super().__init__(cfg, model_cfg, layer_idx)
        if cfg.use_output_norm:  # over all heads together (fla's g_norm), not RecurrentMixer's per-head norm
            self.norm = GatedRMSNorm(self.n_v_heads * self.v_dim, cfg.norm_eps)

    def log_forget(self, f: torch.Tensor) -> torch.Tensor:
        """log f = log(lb + (1 - lb) sigmoid(f)) <= 0 from the forget logits f, in f's dtype (fla's logaddexp form)."""
        g = F.logsigmoid(f)
        lb = self.cfg.lower_bound
        return g if lb == 0 else torch.logaddexp(g.new_tensor(math.log(lb)), math.log1p(-lb) + g)

    def mix(self, q, f, v, x, state, mode, resets=None):
        g = self.log_forget(f)  # (B, T, H, Dk)
        # q = swish(W_q x); k = 1 - f, exactly -expm1(log f)
        return self.gated(F.silu(q), -torch.expm1(g), v, g.transpose(1, 2), x, state, mode, resets)

    def _output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """One RMSNorm over the heads' outputs together (B, T, 1, H Dv), then o_proj."""
        return super()._output(o.reshape(*o.shape[:2], 1, -1), x)
