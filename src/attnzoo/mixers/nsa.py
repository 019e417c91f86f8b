"""Native Sparse Attention (Yuan et al. 2025, DeepSeek, arXiv:2502.11089), in fla-core's form.

GQA projections and RoPE as `gqa`, plus a gate projection x -> 3 per query head (sigmoid), and three
branches over the same keys: compressed (mean-pooled blocks), selected (the best `block_counts` blocks by
the compressed attention, shared by the query heads of a KV head) and a sliding window
(ops/sparse_attention.py holds the math and the reference form; block_sparse.py what it shares with MoBA).

Departures from the paper, shared with fla-core's reference (`fla/ops/nsa/naive.py`): one block size for
compression and selection (the paper: compression blocks of 32 at stride 16, selection blocks of 64), and
compression by the mean of a block's keys/values (the paper: a learned MLP with intra-block positions).

Decode cache (`BlockMeansCache` with values; static: `StaticBlockMeansCache`): every key/value (selection may pick
any past block) plus the mean key/value of every complete block: 2 * Hkv * D * (L + floor(L / BS)) values after L
tokens.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from attnzoo.ops.sparse_attention import nsa_attention, nsa_attention_static, nsa_keys
from attnzoo.config.registry import register_mixer
from attnzoo.mixers.base import causal_attended, dtype_bytes
from attnzoo.mixers.block_sparse import BlockMeansCache, BlockSparseAttention
from attnzoo.mixers.configs import NSAConfig  # noqa: F401 (torch-free: config checks)


@register_mixer("nsa", NSAConfig)
class NativeSparseAttention(BlockSparseAttention):
    SHAPE_FIELDS = BlockSparseAttention.SHAPE_FIELDS + ("block_size", "block_counts")
    hf_missing = "native sparse attention has no transformers causal-LM counterpart"
    cache_values = True  # the compressed branch attends over the blocks' mean values too

    def __init__(self, cfg: NSAConfig, model_cfg, layer_idx: int):
        super().__init__(cfg, model_cfg, layer_idx)
        self.block_counts, self.window = cfg.block_counts, cfg.window
        self.g_proj = nn.Linear(self.d_model, 3 * self.n_heads, bias=False)  # [cmp | slc | swa] per head

    def forward(self, x: torch.Tensor, *, positions: torch.Tensor, cache: Optional[BlockMeansCache] = None):
        B, T, _ = x.shape
        x = self.shift(x, cache)
        q, k, v, k_cmp, v_cmp, qpos = self.blocks(x, positions, cache)
        gates = torch.sigmoid(self.g_proj(x)).view(B, T, self.n_heads, 3).permute(3, 0, 2, 1)  # 3 x (B, H, T)
        kw = dict(block_size=self.block_size, block_counts=self.block_counts, window=self.window, scale=self.scale,
                  reference=self.impl == "reference")
        if qpos is None:
            y = nsa_attention(q, k, v, k_cmp, v_cmp, *gates, q_start=k.shape[2] - T, **kw)
        else:  # a static cache's decode step
            y = nsa_attention_static(q, k, v, k_cmp, v_cmp, *gates, qpos, **kw)
        return self.output(y, x)

    def cache_bytes(self, context_len: int, batch: int = 1, dtype: torch.dtype = torch.float32) -> int:
        kv = 2 * self.n_kv_heads * self.head_dim * (context_len + context_len // self.block_size)
        return kv * batch * dtype_bytes(dtype) + self.input_conv_bytes(batch, dtype)

    def decode_read_bytes(self, context_len: int, batch: int = 1, dtype: torch.dtype = torch.float32) -> int:
        """A static decode step's reads (ops/sparse_attention._nsa_decode): the keys / values of its selected
        blocks (whole blocks) and of its window, the mean keys / values of every block, the conv tail."""
        blocks = -(-context_len // self.block_size)
        tokens = min(self.block_counts, blocks) * self.block_size + min(self.window, context_len) + blocks
        kv = 2 * self.n_kv_heads * self.head_dim * tokens  # keys and values; k_cmp and v_cmp
        return kv * batch * dtype_bytes(dtype) + self.input_conv_bytes(batch, dtype)

    def flops_per_token(self, context_len: int) -> float:
        proj = self.projection_flops() + 2.0 * self.g_proj.in_features * self.g_proj.out_features
        cmp, slc = nsa_keys(context_len, self.block_size, self.block_counts)
        swa = causal_attended(context_len, self.window) if self.window else 0.0
        return proj + 2.0 * 2 * self.n_heads * self.head_dim * (cmp + slc + swa)
