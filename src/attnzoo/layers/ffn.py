"""Position-wise feed-forward networks (`model/ffn`): mlp (ReLU/GELU), swiglu, none (identity).

FFN contract: `forward(x) -> y` on (B, T, d_model); `flops_per_token()`; `active_params()`.
An FFN that adds a loss term (MoE) exposes it as `self.aux_loss` after each forward; the model sums them.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from attnzoo.config.registry import register_ffn
from attnzoo.layers.ffn_configs import MLPConfig, SwiGLUConfig, NoFFNConfig  # noqa: F401 (torch-free: config checks)


def hidden_size(d_model: int, d_ff: Optional[int], mult: float, multiple_of: int) -> int:
    if d_ff:
        return int(d_ff)
    h = int(d_model * mult)
    return multiple_of * ((h + multiple_of - 1) // multiple_of)


@register_ffn("mlp", MLPConfig)
class MLP(nn.Module):
    """Linear -> ReLU/GELU -> Linear, as in the original Transformer (ReLU) and GPT-2 (GELU)."""

    def __init__(self, cfg: MLPConfig, d_model: int):
        super().__init__()
        self.hidden = hidden_size(d_model, cfg.d_ff, cfg.hidden_mult, cfg.multiple_of)
        self.up = nn.Linear(d_model, self.hidden, bias=cfg.bias)
        self.down = nn.Linear(self.hidden, d_model, bias=cfg.bias)
        self.act = nn.GELU(approximate="tanh") if cfg.activation == "gelu" else nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))

    def flops_per_token(self) -> float:
        return 2.0 * 2 * self.up.in_features * self.hidden


@register_ffn("swiglu", SwiGLUConfig)
class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) (Shazeer 2020, Llama). gate and up are one fused matmul."""

    def __init__(self, cfg: SwiGLUConfig, d_model: int):
        super().__init__()
        self.hidden = hidden_size(d_model, cfg.d_ff, cfg.hidden_mult, cfg.multiple_of)
        self.gate_up = nn.Linear(d_model, 2 * self.hidden, bias=cfg.bias)
        self.down = nn.Linear(self.hidden, d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)

    def flops_per_token(self) -> float:
        return 2.0 * 3 * self.gate_up.in_features * self.hidden


@register_ffn("none", NoFFNConfig)
class NoFFN(nn.Module):
    """Identity FFN: blocks are mixer-only (Zoology-style recall models). The block skips the residual add."""

    is_identity = True

    def __init__(self, cfg: NoFFNConfig, d_model: int):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)

    def flops_per_token(self) -> float:
        return 0.0


def build_ffn(cfg, model, layer_idx: int) -> nn.Module:
    """Build layer `layer_idx`'s FFN. A class may define `build(cfg, model, layer_idx)` to vary by layer
    (e.g. MoE's first-k-dense layers); otherwise it is constructed as `cls(cfg, model.d_model)`."""
    from attnzoo.config.registry import FFNS

    cls = FFNS.get(cfg.name).cls
    if hasattr(cls, "build"):
        return cls.build(cfg, model, layer_idx)
    return cls(cfg, model.d_model)
