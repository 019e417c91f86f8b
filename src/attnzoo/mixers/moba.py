"""Mixture of Block Attention (Lu et al. 2025, Moonshot, arXiv:2502.13189).

GQA projections and RoPE as `gqa`; the keys are split into blocks of `block_size`, each query head scores
the blocks fully before its own by q . mean(K_block) (a parameter-free router) and attends causally over
its own block plus the `topk - 1` best of them (ops/sparse_attention.py: math and reference form). A
query in the first `topk` blocks therefore sees every earlier key: MoBA is full attention up to
`topk * block_size` tokens and sparse beyond.

Decode cache (`MoBACache`): every key/value plus the mean key of every complete block:
Hkv * D * (2 L + floor(L / BS)) values after L tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from attnzoo.config.errors import ConfigError
from attnzoo.ops.sparse_attention import block_means, moba_attention, moba_keys
from attnzoo.config.registry import register_mixer
from attnzoo.mixers.attention import Attention, AttentionConfig, KVCache
from attnzoo.mixers.base import Mixer, dtype_bytes


class MoBACache(KVCache):
    """KVCache (B, Hkv, T, D) plus k_mean (B, Hkv, T // BS, D): the router's key of every complete block."""

    def __init__(self, block_size: int) -> None:
        super().__init__()
        self.block_size = block_size
        self.k_mean: Optional[torch.Tensor] = None

    def update(self, k: torch.Tensor, v: torch.Tensor):
        done = self.seq_len // self.block_size
        k_all, v_all = super().update(k, v)
        complete = k_all.shape[2] // self.block_size
        if complete > done:
            bs = self.block_size
            new = block_means(k_all[:, :, done * bs: complete * bs], bs)
            self.k_mean = new if self.k_mean is None else torch.cat([self.k_mean, new], dim=2)
        return k_all, v_all

    def means(self, like: torch.Tensor) -> torch.Tensor:
        if self.k_mean is None:
            return like.new_zeros(like.shape[0], like.shape[1], 0, like.shape[3])
        return self.k_mean


@dataclass
class MoBAConfig(AttentionConfig):
    name: str = "moba"
    block_size: int = 16  # keys per block (the paper: 512 at 8k context, 4096 at 32k+)
    topk: int = 3         # blocks per query, its own block included (the paper: 3 at 8k, 12 at 32k+)

    def validate(self, model, field: str) -> None:
        super().validate(model, field)
        if model.position.name == "alibi":
            raise ConfigError("ALiBi is implemented for mha / gqa / mqa; allowed positions for moba: rope, none, "
                              "sinusoidal, learned", field="model.position.name")
        if self.block_size < 1:
            raise ConfigError(f"must be >= 1, got {self.block_size}", field=f"{field}.block_size")
        if self.topk < 1:
            raise ConfigError(f"must be >= 1 (the own block counts), got {self.topk}", field=f"{field}.topk")
        blocks = -(-model.max_seq_len // self.block_size)
        if self.topk > blocks:
            raise ConfigError(f"{self.topk} exceeds the {blocks} blocks of model.max_seq_len={model.max_seq_len} "
                              f"(dense everywhere); allowed: 1..{blocks}", field=f"{field}.topk")
        if not self.causal:
            raise ConfigError("moba is causal only; allowed: true", field=f"{field}.causal")


@register_mixer("moba", MoBAConfig)
class MixtureOfBlockAttention(Attention):
    SHAPE_FIELDS = Attention.SHAPE_FIELDS + ("block_size", "topk")
    context_parallel = False  # top-k block selection over the whole past: no ring form here
    full_causal_attention = False
    kernel_family = "block_sparse"
    kv_quantizable = False  # its cache keeps block means beside the keys
    bidirectional = False  # causal only
    linearize_source = False
    hf_layer = None
    hf_missing = "mixture-of-block attention has no transformers causal-LM counterpart"

    @classmethod
    def check_seq_len(cls, cfg, seq_len: int, field: str) -> None:
        """Training sequences are whole blocks."""
        if seq_len % cfg.block_size:
            raise ConfigError(f"{cfg.block_size} does not divide data.seq_len={seq_len}; allowed: a divisor of "
                              f"{seq_len}", field=f"{field}.block_size")

    # block selection follows absolute block boundaries: packed documents run alone (Mixer.forward_packed)
    packing = "gather"
    forward_packed = Mixer.forward_packed

    def __init__(self, cfg: MoBAConfig, model_cfg, layer_idx: int):
        super().__init__(cfg, model_cfg, layer_idx)
        self.block_size, self.topk = cfg.block_size, cfg.topk

    def forward(self, x: torch.Tensor, *, positions: torch.Tensor, cache: Optional[MoBACache] = None) -> torch.Tensor:
        T = x.shape[1]
        x = self.shift(x, cache)
        q, k, v = self.project(x, positions)
        if cache is not None:
            k, v = cache.update(k, v)
            k_mean = cache.means(k)
        else:
            k_mean = block_means(k, self.block_size)
        y = moba_attention(q, k, v, k_mean, q_start=k.shape[2] - T, block_size=self.block_size, topk=self.topk,
                           scale=self.scale, reference=self.impl == "reference")
        return self.output(y, x)

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device) -> MoBACache:
        return MoBACache(self.block_size)

    def cache_bytes(self, context_len: int, batch: int = 1, dtype: torch.dtype = torch.float32) -> int:
        values = self.n_kv_heads * self.head_dim * (2 * context_len + context_len // self.block_size)
        return values * batch * dtype_bytes(dtype) + self.input_conv_bytes(batch, dtype)

    def flops_per_token(self, context_len: int) -> float:
        gate, keys = moba_keys(context_len, self.block_size, self.topk)
        return self.projection_flops() + 2.0 * self.n_heads * self.head_dim * (gate + 2 * keys)
