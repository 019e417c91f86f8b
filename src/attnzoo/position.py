"""Positional information: RoPE (applied inside mixers to q/k), sinusoidal and learned absolute embeddings."""
from __future__ import annotations

import math

import torch
from torch import nn

from .config import PositionConfig


class RotaryEmbedding(nn.Module):
    """Rotary position embedding, rotate-half (GPT-NeoX / Llama) layout.

    Only the first `rotary_dim` channels of each head rotate (partial rotary); the rest pass through.
    `forward(x, positions)`: x (B, H, T, D), positions (T,) or (B, T) absolute token positions.
    """

    def __init__(self, head_dim: int, theta: float = 10000.0, rotary_fraction: float = 1.0):
        super().__init__()
        rot = int(head_dim * rotary_fraction)
        self.rotary_dim = rot - rot % 2
        self.theta = theta
        inv_freq = 1.0 / (theta ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float32) / self.rotary_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq  # (..., T, rot/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (..., T, rot)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        if positions.dim() == 2:  # (B, T, rot) -> (B, 1, T, rot)
            cos, sin = cos[:, None], sin[:, None]
        return cos, sin

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos_sin=None) -> torch.Tensor:
        cos, sin = cos_sin if cos_sin is not None else self.cos_sin(positions, x.dtype)
        r = self.rotary_dim
        if r == x.shape[-1]:
            return x * cos + rotate_half(x) * sin
        x_rot, x_pass = x[..., :r], x[..., r:]
        return torch.cat([x_rot * cos + rotate_half(x_rot) * sin, x_pass], dim=-1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def sinusoidal_table(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...) (Vaswani et al. 2017). Returns (T, dim)."""
    half = torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device)
    div = torch.exp(-math.log(10000.0) * half / dim)
    angles = positions.to(torch.float32)[:, None] * div[None, :]
    pe = torch.zeros(positions.shape[0], dim, device=positions.device)
    pe[:, 0::2] = torch.sin(angles)
    pe[:, 1::2] = torch.cos(angles[:, : dim // 2])
    return pe


class AbsolutePosition(nn.Module):
    """Additive absolute position embedding (sinusoidal or learned); identity for rope/none."""

    def __init__(self, cfg: PositionConfig, d_model: int, max_seq_len: int):
        super().__init__()
        self.kind = cfg.name
        self.d_model = d_model
        self.max_seq_len = max_seq_len
        self.table = nn.Embedding(max_seq_len, d_model) if cfg.name == "learned" else None

    def forward(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.kind == "learned":
            if int(positions.max()) >= self.max_seq_len:
                raise ValueError(
                    f"position {int(positions.max())} exceeds model.max_seq_len={self.max_seq_len} (learned positions)"
                )
            return h + self.table(positions)
        if self.kind == "sinusoidal":
            return h + sinusoidal_table(positions.reshape(-1), self.d_model).view(*positions.shape, -1).to(h.dtype)
        return h
