"""Positional information: RoPE (applied inside mixers to q/k) with the length-extension scalings
(position interpolation, dynamic NTK, YaRN, Llama-3), sinusoidal and learned absolute embeddings."""
from __future__ import annotations

import math

import torch
from torch import nn

from attnzoo.config.schema import ROPE_SCALINGS, PositionConfig


SCALINGS = ROPE_SCALINGS


def rope_frequencies(dim: int, theta: float, scaling: str = "none", factor: float = 1.0,
                     original_max_len: int | None = None, seq_len: int | None = None, beta_fast: float = 32.0,
                     beta_slow: float = 1.0, low_freq_factor: float = 1.0,
                     high_freq_factor: float = 4.0, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, float]:
    """(inverse frequencies (dim/2,), factor on cos/sin) of RoPE over `dim` rotating channels, under a
    context-extension scaling (the same definitions as transformers' ROPE_INIT_FUNCTIONS; tested equal):

      none     theta^(-2i/dim)
      linear   position interpolation (Chen et al. 2023): every frequency / factor
      dynamic  NTK-aware (bloc97 / emozilla): theta grows with the current length L beyond the original L0,
               theta' = theta (factor L / L0 - (factor - 1))^(dim / (dim - 2)); unchanged for L <= L0
      yarn     Peng et al. 2023: high frequencies (more than beta_fast turns over L0) kept, low ones (fewer
               than beta_slow turns) interpolated, a linear ramp between; cos/sin scaled by 0.1 ln(factor) + 1
      llama3   Llama 3.1: wavelengths longer than L0 / low_freq_factor interpolated, shorter than
               L0 / high_freq_factor kept, smoothly blended in between
    """
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype) / dim  # dtype: fp32 as transformers (fp64: tests)
    if scaling == "dynamic":
        L = max(seq_len or original_max_len, original_max_len)
        theta = theta * ((factor * L / original_max_len) - (factor - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / (theta ** exponent)
    if scaling in ("none", "dynamic"):
        return inv_freq, 1.0
    if scaling == "linear":
        return inv_freq / factor, 1.0
    if scaling == "yarn":
        def turns_dim(turns: float) -> float:  # the channel pair that turns `turns` times over L0
            return dim * math.log(original_max_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

        low, high = max(math.floor(turns_dim(beta_fast)), 0), min(math.ceil(turns_dim(beta_slow)), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=dtype) - low) / ((high - low) or 0.001)).clamp(0, 1)
        keep = 1 - ramp  # 1: extrapolate (the original frequency), 0: interpolate (frequency / factor)
        inv_freq = inv_freq / factor * (1 - keep) + inv_freq * keep
        return inv_freq, (0.1 * math.log(factor) + 1.0) if factor > 1 else 1.0
    if scaling == "llama3":
        wavelen = 2 * math.pi / inv_freq
        low_wavelen, high_wavelen = original_max_len / low_freq_factor, original_max_len / high_freq_factor
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (original_max_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    raise ValueError(f"model.position.scaling: got {scaling!r}; allowed: {', '.join(SCALINGS)}")


def rotary_from_config(pos: PositionConfig, head_dim: int, max_seq_len: int, rotary_fraction: float | None = None):
    """The RotaryEmbedding a mixer builds from `model.position` (None unless position is rope)."""
    if pos.name != "rope":
        return None
    return RotaryEmbedding(head_dim, pos.theta, pos.rotary_fraction if rotary_fraction is None else rotary_fraction,
                           scaling=pos.scaling, factor=pos.factor, original_max_len=pos.original_max_len or max_seq_len,
                           beta_fast=pos.beta_fast, beta_slow=pos.beta_slow, low_freq_factor=pos.low_freq_factor,
                           high_freq_factor=pos.high_freq_factor)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding, rotate-half (GPT-NeoX / Llama) layout.

    Only the first `rotary_dim` channels of each head rotate (partial rotary); the rest pass through.
    `forward(x, positions)`: x (B, H, T, D), positions (T,) or (B, T) absolute token positions.
    `scaling` (with `factor`, `original_max_len` and its own knobs): a context-extension method, see
    `rope_frequencies`. `dynamic` recomputes the frequencies from the largest position in each call, as
    transformers does: a cache prefilled below the original length and extended beyond it holds keys rotated
    by the old frequencies (cached decode then differs from a full forward past the original length).
    """

    def __init__(self, head_dim: int, theta: float = 10000.0, rotary_fraction: float = 1.0, scaling: str = "none",
                 factor: float = 1.0, original_max_len: int | None = None, **knobs):
        super().__init__()
        rot = int(head_dim * rotary_fraction)
        self.rotary_dim = rot - rot % 2
        self.theta = theta
        self.scaling, self.factor, self.original_max_len, self.knobs = scaling, factor, original_max_len, knobs
        inv_freq, self.attention_factor = rope_frequencies(self.rotary_dim, theta, scaling, factor, original_max_len,
                                                           **knobs)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq
        if self.scaling == "dynamic":
            L = int(positions.max()) + 1 if positions.numel() else 1
            if L > self.original_max_len:
                inv_freq = rope_frequencies(self.rotary_dim, self.theta, "dynamic", self.factor, self.original_max_len,
                                            seq_len=L)[0].to(inv_freq.device)
        freqs = positions.to(torch.float32)[..., None] * inv_freq  # (..., T, rot/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (..., T, rot)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:  # YaRN: cos/sin scaled (both q and k: logits by factor^2)
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        cos, sin = cos.to(dtype), sin.to(dtype)
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
            # checked without reading the positions on the host (no sync in a GPU step, nothing that stops a
            # compiled decode from capturing): on CPU it raises here, on GPU as a device-side assert
            torch._assert_async(positions.max() < self.max_seq_len,
                                f"a position exceeds model.max_seq_len={self.max_seq_len} (learned positions)")
            return h + self.table(positions)
        if self.kind == "sinusoidal":
            return h + sinusoidal_table(positions.reshape(-1), self.d_model).view(*positions.shape, -1).to(h.dtype)
        return h
