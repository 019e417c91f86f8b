"""Mixture of Block Attention (Lu et al. 2025, Moonshot, arXiv:2502.13189).

GQA projections and RoPE as `gqa`; the keys are split into blocks of `block_size`, each query head scores
the blocks fully before its own by q . mean(K_block) (a parameter-free router) and attends causally over
its own block plus the `topk - 1` best of them (ops/sparse_attention.py: math and reference form;
block_sparse.py: what it shares with NSA). A query in the first `topk` blocks therefore sees every earlier key:
MoBA is full attention up to `topk * block_size` tokens and sparse beyond.

Decode cache (`BlockMeansCache`; static: `StaticBlockMeansCache`): every key/value plus the mean key of every complete block:
Hkv * D * (2 L + floor(L / BS)) values after L tokens.
"""
from __future__ import annotations

from typing import Optional

import torch

from attnzoo.ops.sparse_attention import moba_attention, moba_attention_static, moba_keys
from attnzoo.config.registry import register_mixer
from attnzoo.mixers.base import dtype_bytes
from attnzoo.mixers.block_sparse import BlockMeansCache, BlockSparseAttention
from attnzoo.mixers.configs import MoBAConfig  # noqa: F401 (torch-free: config checks)


@register_mixer("moba", MoBAConfig)
class MixtureOfBlockAttention(BlockSparseAttention):
    SHAPE_FIELDS = BlockSparseAttention.SHAPE_FIELDS + ("block_size", "topk")
    hf_missing = "mixture-of-block attention has no transformers causal-LM counterpart"

    def __init__(self, cfg: MoBAConfig, model_cfg, layer_idx: int):
        super().__init__(cfg, model_cfg, layer_idx)
        self.topk = cfg.topk

    def forward(self, x: torch.Tensor, *, positions: torch.Tensor, cache: Optional[BlockMeansCache] = None):
        T = x.shape[1]
        x = self.shift(x, cache)
        q, k, v, k_mean, _, qpos = self.blocks(x, positions, cache)
        kw = dict(block_size=self.block_size, topk=self.topk, scale=self.scale, reference=self.impl == "reference")
        if qpos is None:
            y = moba_attention(q, k, v, k_mean, q_start=k.shape[2] - T, **kw)
        else:  # a static cache's decode step
            y = moba_attention_static(q, k, v, k_mean, qpos, **kw)
        return self.output(y, x)

    def cache_bytes(self, context_len: int, batch: int = 1, dtype: torch.dtype = torch.float32) -> int:
        values = self.n_kv_heads * self.head_dim * (2 * context_len + context_len // self.block_size)
        return values * batch * dtype_bytes(dtype) + self.input_conv_bytes(batch, dtype)

    def decode_read_bytes(self, context_len: int, batch: int = 1, dtype: torch.dtype = torch.float32) -> int:
        """A static decode step's reads (ops/sparse_attention._moba_decode): per query head the keys / values of its
        own and its picked blocks (whole blocks), the mean key of every block, the conv tail."""
        blocks = -(-context_len // self.block_size)
        picked = 2 * self.n_heads * self.head_dim * min(self.topk, blocks) * self.block_size
        means = self.n_kv_heads * self.head_dim * blocks
        return (picked + means) * batch * dtype_bytes(dtype) + self.input_conv_bytes(batch, dtype)

    def flops_per_token(self, context_len: int) -> float:
        gate, keys = moba_keys(context_len, self.block_size, self.topk)
        return self.projection_flops() + 2.0 * self.n_heads * self.head_dim * (gate + 2 * keys)
