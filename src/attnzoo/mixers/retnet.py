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
from dataclasses import dataclass
from typing import Optional

import torch

from attnzoo.config.errors import ConfigError, check_choice
from attnzoo.config.registry import register_mixer
from attnzoo.layers.position import rotary_from_config
from attnzoo.mixers.base import validate_conv
from attnzoo.mixers.gla import GatedLinearMixer


@dataclass
class RetNetConfig:
    name: str = "retnet"
    n_heads: Optional[int] = None  # null: model.n_heads (head h decays by 1 - 2^(-5-h))
    head_dim: Optional[int] = None  # d_k (null: model head_dim)
    v_head_dim: Optional[int] = None  # d_v (null: head_dim; the paper and fla's layer: 2 x head_dim)
    chunk_size: int = 64
    conv_size: int = 0  # short causal depthwise conv on q/k/v (fla's use_short_conv, off by default); 0 = off
    conv_bias: bool = False
    qkv_activation: str = "none"  # after the conv: silu (fla's, with its conv) | none
    use_output_norm: bool = True  # per-head RMSNorm on the output (the paper's GroupNorm)
    use_gate: bool = True  # swish output gate: norm(o) * silu(W_g x)
    norm_eps: float = 1e-5  # fla's

    def validate(self, model, field: str) -> None:
        check_choice(self.qkv_activation, f"{field}.qkv_activation", ("silu", "none"))
        if self.chunk_size < 1:
            raise ConfigError(f"must be >= 1, got {self.chunk_size}", field=f"{field}.chunk_size")
        validate_conv(self, field)


def retention_log_decays(n_heads: int) -> list[float]:
    """log gamma_h = log(1 - 2^(-5-h)), h = 0..n_heads-1 (RetNet; fla's MultiScaleRetention), in Python floats so
    each dtype rounds them once."""
    return [math.log1p(-(2.0 ** (-5.0 - h))) for h in range(n_heads)]


@register_mixer("retnet", RetNetConfig)
class RetNet(GatedLinearMixer):
    hf_missing = "RetNet's retention has no transformers causal-LM counterpart (fla's layer is its reference)"
    fla_kernel = "chunk_simple_gla(g)"  # one log-decay per head

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
