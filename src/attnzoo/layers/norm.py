"""Normalisation layers chosen by `model/norm`."""
from __future__ import annotations

import torch
from torch import nn

from attnzoo.config.schema import NormConfig


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight (Zhang & Sennrich 2019), computed in at least fp32."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))  # at least fp32; fp64 stays fp64
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.to(xf.dtype)).to(x.dtype)


def build_norm(cfg: NormConfig, dim: int) -> nn.Module:
    if cfg.name == "rmsnorm":
        return RMSNorm(dim, cfg.eps)
    return nn.LayerNorm(dim, eps=cfg.eps)
