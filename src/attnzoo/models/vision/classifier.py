"""Image classifiers (model=vit | model=swin): an image encoder, a pooled image vector, a linear head.

Accounting follows the decoder's conventions with the patch token as the token: `perf/tokens_per_sec` counts
input patches, `flops_per_token` is the forward FLOPs of one image divided by its patches (patch embedding,
every block, patch merging, the head), and there is no decode cache (`cache_bytes` 0).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from attnzoo.models.vision.options import VisionOptions, split_config
from attnzoo.models.vision.swin import SwinEncoder
from attnzoo.models.vision.vit import ViTEncoder


@dataclass(frozen=True)
class LayerKind:
    """What a layer is, for summaries (`describe_model` reads `.name` of each entry of `layer_mixers`)."""

    name: str


def build_encoder(enc_cfg, vis: VisionOptions, cls_token: bool = True) -> nn.Module:
    """The image encoder named by model.vision.encoder: `forward(images) -> (B, n_tokens, d_out)`."""
    if vis.encoder == "swin":
        return SwinEncoder(enc_cfg, vis)
    return ViTEncoder(enc_cfg, vis, cls_token=cls_token)


def encoder_layers(encoder: nn.Module) -> list:
    if isinstance(encoder, SwinEncoder):
        return [LayerKind("swin_window")] * len(encoder.mixers)
    return list(encoder.layer_mixers)


def init_vision_weights(module: nn.Module) -> None:
    """ViT / Swin: trunc-normal(0.02) weights, zero biases, unit LayerNorms."""
    if isinstance(module, (nn.Linear, nn.Conv2d)):
        nn.init.trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


class ImageClassifier(nn.Module):
    """`forward(images (B, C, S, S)) -> logits (B, n_classes)`. `vocab_size` = the number of classes."""

    def __init__(self, cfg: Any, vocab_size: Optional[int] = None, image_size: Optional[int] = None,
                 channels: Optional[int] = None):
        super().__init__()
        setup = split_config(cfg, vocab_size, image_size, channels)
        self.cfg, self.vision = setup.model, setup.vision
        if self.vision.image_size is None or self.vision.channels is None:
            raise ValueError("model.vision.image_size / channels: not set; build the model for a data module")
        self.encoder = build_encoder(self.cfg, self.vision, cls_token=self.vision.pool == "cls")
        self.layer_mixers = encoder_layers(self.encoder)
        self.head = nn.Linear(self.encoder.d_out, self.cfg.vocab_size)
        self.apply(init_vision_weights)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        h = self.encoder(images)  # (B, n_tokens, d)
        pooled = h[:, 0] if self.vision.pool == "cls" and self.vision.encoder == "vit" else h.mean(dim=1)
        return self.head(pooled)

    @property
    def mixers(self) -> list:
        return self.encoder.mixers

    @property
    def tokens_per_image(self) -> int:
        """Input patch tokens per image (what perf/tokens_per_sec counts)."""
        return self.encoder.n_patches

    def num_params(self, trainable_only: bool = False) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    def active_params(self) -> int:
        return self.num_params()

    def cache_bytes(self, context_len: int, batch: int = 1, dtype: torch.dtype = torch.float32, **kw) -> int:
        return 0  # a classifier reads its whole image once: nothing is cached

    def flops_per_token(self, context_len: int = 0) -> float:
        """Forward FLOPs per input patch (the data's context length does not apply to an image)."""
        head = 2.0 * self.head.in_features * self.head.out_features
        return (self.encoder.flops_per_image() + head) / self.encoder.n_patches
