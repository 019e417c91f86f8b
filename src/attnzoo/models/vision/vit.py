"""ViT (Dosovitskiy et al. 2021, arXiv:2010.11929): an image as a sequence of patch tokens, global attention.

    image (B, C, S, S) ──conv p x p, stride p──> (B, N, d), N = (S/p)^2 ──[CLS] + learned positions──>
    [ pre-norm block: bidirectional attention (a zoo mixer, causal=false) -> MLP ] x n_layers ──LayerNorm──> (B, 1+N, d)

The blocks are the decoder's `model.Block` (the zoo's mixer and FFN, pre-norm residuals) with a mixer whose
`causal` is false: every patch attends to every patch. Equal to transformers' `ViTModel.last_hidden_state`
with weights copied (tests/test_vision.py).
"""
from __future__ import annotations

import torch
from torch import nn

from attnzoo.config.schema import ModelConfig, layer_mixer_configs
from attnzoo.models.decoder import Block
from attnzoo.layers.norm import build_norm
from attnzoo.models.vision.options import VisionOptions


class PatchEmbedding(nn.Module):
    """(B, C, S, S) -> (B, (S/p)^2, d): a p x p convolution with stride p, patches in row-major order."""

    def __init__(self, channels: int, d_model: int, patch_size: int):
        super().__init__()
        self.proj = nn.Conv2d(channels, d_model, kernel_size=patch_size, stride=patch_size)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.proj(images).flatten(2).transpose(1, 2)  # (B, d, S/p, S/p) -> (B, N, d)

    def flops_per_patch(self) -> float:
        return 2.0 * self.proj.in_channels * self.proj.kernel_size[0] ** 2 * self.proj.out_channels


class ViTEncoder(nn.Module):
    """`forward(images (B, C, S, S)) -> (B, n_tokens, d_model)`: [CLS] first when `cls_token`, then the patches."""

    def __init__(self, cfg: ModelConfig, vis: VisionOptions, cls_token: bool = True):
        super().__init__()
        self.cfg = cfg
        self.patch = PatchEmbedding(vis.channels, cfg.d_model, vis.patch_size)
        self.n_patches = (vis.image_size // vis.patch_size) ** 2
        self.cls = nn.Parameter(torch.zeros(1, 1, cfg.d_model)) if cls_token else None
        self.n_tokens = self.n_patches + (1 if cls_token else 0)
        self.pos = nn.Parameter(torch.zeros(1, self.n_tokens, cfg.d_model))
        self.drop = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
        self.layer_mixers = layer_mixer_configs(cfg)
        self.blocks = nn.ModuleList(Block(cfg, mc, i) for i, mc in enumerate(self.layer_mixers))
        self.norm = build_norm(cfg.norm, cfg.d_model) if cfg.norm_position == "pre" else nn.Identity()
        self.d_out = cfg.d_model
        nn.init.trunc_normal_(self.pos, std=0.02)
        if self.cls is not None:
            nn.init.trunc_normal_(self.cls, std=0.02)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        h = self.patch(images)  # (B, N, d)
        if self.cls is not None:
            h = torch.cat([self.cls.expand(h.shape[0], -1, -1), h], dim=1)  # (B, 1+N, d)
        h = self.drop(h + self.pos)
        positions = torch.arange(h.shape[1], device=h.device)
        for block in self.blocks:
            h = block(h, positions)
        return self.norm(h)

    @property
    def mixers(self) -> list:
        return [b.mixer for b in self.blocks]

    def flops_per_image(self) -> float:
        """Patch embedding + every block over n_tokens tokens (attention over all n_tokens keys)."""
        per_token = sum(b.mixer.flops_per_token(self.n_tokens) + (b.ffn.flops_per_token() if b.has_ffn else 0.0)
                        for b in self.blocks)
        return self.n_patches * self.patch.flops_per_patch() + self.n_tokens * per_token
