"""Swin Transformer (Liu et al. 2021, arXiv:2103.14030): attention inside local windows, shifted every
second block, patch merging between stages.

    image ──p x p patches──> LayerNorm ──> stage 0: [W-MSA block, SW-MSA block] x depth/2 ──patch merge──> stage 1 ...

- W-MSA: the (G x G) patch grid is cut into (w x w) windows; each token attends to the w^2 tokens of its own
  window, with a learned relative position bias B[h, (dy, dx)], one table of (2w-1)^2 entries per head.
- SW-MSA: the grid is first rolled by (-w/2, -w/2) (cyclic shift), so the new windows straddle the old
  borders; tokens that landed in one window from different sides of the image must not attend to each
  other: `shifted_window_mask` allows only pairs from the same region (3 regions per axis: [0, G-w),
  [G-w, G-s), [G-s, G)). The output is rolled back.
- Patch merging: each 2x2 group of tokens -> concat (4C) -> LayerNorm -> Linear(4C, 2C): half the grid, twice
  the width.
- A window as large as the grid (late stages of small images) is clipped to the grid and not shifted, as
  Swin and transformers do.

Equal to transformers' `SwinModel.last_hidden_state` with weights copied (tests/test_vision.py).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from attnzoo.config.schema import ModelConfig
from attnzoo.layers.ffn import build_ffn
from attnzoo.layers.norm import build_norm
from attnzoo.models.vision.options import VisionOptions
from attnzoo.models.vision.vit import PatchEmbedding


def window_partition(x: torch.Tensor, w: int) -> torch.Tensor:
    """(B, G, G, C) -> (B, nW, w*w, C), windows in row-major order, tokens row-major inside each."""
    B, H, W, C = x.shape
    x = x.view(B, H // w, w, W // w, w, C).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(B, (H // w) * (W // w), w * w, C)


def window_reverse(windows: torch.Tensor, w: int, H: int, W: int) -> torch.Tensor:
    """(B, nW, w*w, C) -> (B, H, W, C), the inverse of window_partition."""
    B, C = windows.shape[0], windows.shape[-1]
    x = windows.view(B, H // w, W // w, w, w, C).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(B, H, W, C)


def relative_position_index(w: int) -> torch.Tensor:
    """(w*w, w*w) long: the bias-table row of each (query, key) pair in a window, (dy + w-1) * (2w-1) + (dx + w-1)."""
    coords = torch.stack(torch.meshgrid(torch.arange(w), torch.arange(w), indexing="ij")).flatten(1)  # (2, w*w)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (w - 1)  # (w*w, w*w, 2), each in [0, 2w-2]
    return rel[..., 0] * (2 * w - 1) + rel[..., 1]


def shifted_window_mask(H: int, W: int, w: int, shift: int) -> torch.Tensor:
    """(nW, w*w, w*w) bool, True where a query may attend to a key, for windows of the grid rolled by -shift.

    Each grid position gets a region id from its row band and column band ([0, H-w), [H-w, H-shift),
    [H-shift, H)); after the roll, tokens of one window may come from different regions (opposite image
    borders), and only same-region pairs are allowed."""
    def bands(n: int) -> torch.Tensor:
        i = torch.arange(n)
        return (i >= n - w).long() + (i >= n - shift).long()

    region = (bands(H)[:, None] * 3 + bands(W)[None, :])[None, :, :, None]  # (1, H, W, 1)
    win = window_partition(region, w)[0, :, :, 0]  # (nW, w*w)
    return win[:, :, None] == win[:, None, :]


class WindowAttention(nn.Module):
    """Multi-head self-attention inside each window, with the learned relative position bias.

    `forward(x (B, nW, w*w, C), mask (nW, w*w, w*w) bool | None) -> (B, nW, w*w, C)`."""

    def __init__(self, dim: int, n_heads: int, window: int, qkv_bias: bool = True):
        super().__init__()
        self.n_heads, self.head_dim, self.window = n_heads, dim // n_heads, window
        self.n_kv_heads = n_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)  # fused [q | k | v]
        self.o_proj = nn.Linear(dim, dim)
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * window - 1) ** 2, n_heads))
        nn.init.trunc_normal_(self.relative_position_bias_table, std=0.02)
        self.register_buffer("rel_index", relative_position_index(window), persistent=False)
        self.name = "window_attention"

    def bias(self) -> torch.Tensor:
        N = self.window**2
        return self.relative_position_bias_table[self.rel_index.view(-1)].view(N, N, -1).permute(2, 0, 1)  # (H, N, N)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        B, nW, N, C = x.shape
        q, k, v = self.qkv(x).view(B, nW, N, 3, self.n_heads, self.head_dim).permute(3, 0, 1, 4, 2, 5)  # (B, nW, H, N, D) each
        bias = self.bias()[None, None]  # (1, 1, H, N, N)
        if mask is not None:
            bias = bias.masked_fill(~mask[None, :, None], float("-inf"))  # (1, nW, H, N, N)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype))  # (B, nW, H, N, D)
        return self.o_proj(y.transpose(2, 3).reshape(B, nW, N, C))

    def flops_per_token(self) -> float:
        d = self.qkv.in_features
        return 2.0 * d * 4 * d + 2.0 * 2 * d * self.window**2  # qkv + o_proj, QK^T and PV over w^2 keys

    def layer_shape(self) -> dict:
        return {"mixer": "window_attention", "n_heads": self.n_heads, "n_kv_heads": self.n_heads,
                "head_dim": self.head_dim, "window": self.window}


class SwinBlock(nn.Module):
    """Pre-norm: h + attn(norm(h)) in (shifted) windows, then h + ffn(norm(h)). `forward(h (B, G*G, C))`."""

    def __init__(self, cfg: ModelConfig, grid: int, window: int, shift: int, layer_idx: int):
        super().__init__()
        if grid <= window:  # one window covers the grid: clip it, nothing to shift
            window, shift = grid, 0
        self.grid, self.window, self.shift = grid, window, shift
        self.norm1 = build_norm(cfg.norm, cfg.d_model)
        self.mixer = WindowAttention(cfg.d_model, cfg.n_heads, window)
        self.norm2 = build_norm(cfg.norm, cfg.d_model)
        self.ffn = build_ffn(cfg.ffn, cfg, layer_idx)
        self.drop = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
        mask = shifted_window_mask(grid, grid, window, shift) if shift else None
        self.register_buffer("mask", mask, persistent=False)

    def _attn(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        G, w, s = self.grid, self.window, self.shift
        x = x.view(B, G, G, C)
        if s:
            x = torch.roll(x, shifts=(-s, -s), dims=(1, 2))
        y = window_reverse(self.mixer(window_partition(x, w), self.mask), w, G, G)
        if s:
            y = torch.roll(y, shifts=(s, s), dims=(1, 2))
        return y.reshape(B, N, C)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.drop(self._attn(self.norm1(h)))
        return h + self.drop(self.ffn(self.norm2(h)))

    def flops_per_token(self) -> float:
        return self.mixer.flops_per_token() + self.ffn.flops_per_token()


class PatchMerging(nn.Module):
    """(B, G*G, C) -> (B, (G/2)^2, 2C): 2x2 neighbours concatenated as [(0,0), (1,0), (0,1), (1,1)], LayerNorm, Linear."""

    def __init__(self, dim: int, grid: int):
        super().__init__()
        self.grid = grid
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        B, N, C = h.shape
        x = h.view(B, self.grid, self.grid, C)
        x = torch.cat([x[:, r::2, c::2] for c in range(2) for r in range(2)], dim=-1)  # (B, G/2, G/2, 4C)
        return self.reduction(self.norm(x.reshape(B, -1, 4 * C)))

    def flops_per_token(self) -> float:
        """Per output token."""
        return 2.0 * self.reduction.in_features * self.reduction.out_features


class SwinEncoder(nn.Module):
    """`forward(images (B, C, S, S)) -> (B, (G / 2^(stages-1))^2, d_model * 2^(stages-1))` after a final LayerNorm."""

    def __init__(self, cfg: ModelConfig, vis: VisionOptions):
        super().__init__()
        self.cfg = cfg
        self.patch = PatchEmbedding(vis.channels, cfg.d_model, vis.patch_size)
        self.patch_norm = build_norm(cfg.norm, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
        grid = vis.image_size // vis.patch_size
        self.n_patches = grid * grid
        self.stages, self.merges = nn.ModuleList(), nn.ModuleList()
        self.stage_tokens = []
        idx = 0
        for s, (depth, heads) in enumerate(zip(vis.depths, vis.stage_heads)):
            width = cfg.d_model * 2**s
            scfg = dataclasses.replace(cfg, d_model=width, n_heads=heads, n_kv_heads=heads, head_dim=width // heads)
            blocks = []
            for i in range(depth):
                blocks.append(SwinBlock(scfg, grid, vis.window_size, 0 if i % 2 == 0 else vis.window_size // 2, idx))
                idx += 1
            self.stages.append(nn.ModuleList(blocks))
            self.stage_tokens.append(grid * grid)
            if s < len(vis.depths) - 1:
                self.merges.append(PatchMerging(width, grid))
                grid //= 2
        self.d_out = cfg.d_model * 2 ** (len(vis.depths) - 1)
        self.n_tokens = grid * grid
        self.norm = build_norm(cfg.norm, self.d_out)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.patch_norm(self.patch(images)))
        for s, blocks in enumerate(self.stages):
            for block in blocks:
                h = block(h)
            if s < len(self.merges):
                h = self.merges[s](h)
        return self.norm(h)

    @property
    def mixers(self) -> list:
        return [b.mixer for blocks in self.stages for b in blocks]

    @property
    def blocks(self) -> list:
        return [b for blocks in self.stages for b in blocks]

    def flops_per_image(self) -> float:
        total = self.n_patches * self.patch.flops_per_patch()
        for s, blocks in enumerate(self.stages):
            total += self.stage_tokens[s] * sum(b.flops_per_token() for b in blocks)
            if s < len(self.merges):
                total += self.stage_tokens[s] // 4 * self.merges[s].flops_per_token()
        return total
