"""Multi-scale retention (Sun et al. 2023, "Retentive Network: A Successor to Transformer for Large Language
Models", arXiv:2307.08621), as fla's `MultiScaleRetention` layer builds it:

    S_t = gamma_h S_{t-1} + k_t v_t^T,    o_t = d_k^-1/2 S_t^T q_t,    gamma_h = 1 - 2^(-5-h) for head h = 0..H-1,

a fixed decay per head (the "multi-scale": head 0 forgets over ~32 tokens, head 7 over ~4k), q and k rotated by
the model's RoPE when `model.position` is rope (the paper's xPos is RoPE with a decay, which gamma already is;
other positions: no rotation, the decay orders the tokens), then a per-head RMSNorm gated by swish(W_g x) (the
paper's GroupNorm per head; fla's RMSNorm form) and the output projection. Gated linear attention with one
constant log-decay per head (mixers/gla.py, ops/gated_linear_attention.py). `impl="reference"` runs the
per-token recurrence.
"""
from __future__ import annotations

import math

import torch

from attnzoo.config.registry import register_mixer
from attnzoo.layers.position import rotary_from_config
from attnzoo.mixers.gla import GatedLinearMixer
from attnzoo.mixers.configs import RetNetConfig  # noqa: F401 (torch-free: config checks)


def retention_log_decays(n_heads: int) -> list[float]:
    """log gamma_h = log(1 - 2^(-5-h)), h = 0..n_heads-1 (RetNet; fla's MultiScaleRetention), in Python floats so
    each dtype rounds them once."""
    return [math.log1p(-(2.0 ** (-5.0 - h))) for h in range(n_heads)]


@register_mixer("retnet", RetNetConfig)
class RetNet(GatedLinearMixer):
    hf_missing = "RetNet's retention has no transformers causal-LM counterpart (fla's layer is its reference)"

    def __init__(self, cfg: RetNetConfig, model_cfg, layer_idx: int):
        super().__init__(cfg, model_cfg, layer_idx)
        self.log_gammas = retention_log_decays(self.n_qk_heads)
        # the decays as tensors, one per (dtype, device), each rounded once from the Python floats (a buffer would
        # be rounded twice under .float() + autocast); not in the state dict
        self._decays: dict = {}
        self.rope = rotary_from_config(model_cfg.position, self.qk_dim, model_cfg.max_seq_len)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        if self.rope is None:
            return q, k
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # RotaryEmbedding takes (B, H, T, D)
        cs = self.rope.cos_sin(positions, q.dtype)
        return self.rope(q, positions, cs).transpose(1, 2), self.rope(k, positions, cs).transpose(1, 2)

    def log_decay(self, x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        B, T, H, _ = q.shape
        g = self._decays.get((q.dtype, q.device))
        if g is None:  # made once per dtype and device, not in every forward (a host-to-device copy on GPU)
            g = self._decays[(q.dtype, q.device)] = torch.tensor(self.log_gammas, dtype=q.dtype, device=q.device)
        return g[None, :, None, None].expand(B, H, T, 1)
