"""Native Sparse Attention (Yuan et al. 2025, DeepSeek, arXiv:2502.11089), in fla-core's form.

GQA projections and RoPE as `gqa`, plus a gate projection x -> 3 per query head (sigmoid), and three
branches over the same keys: compressed (mean-pooled blocks), selected (the best `block_counts` blocks by
the compressed attention, shared by the query heads of a KV head) and a sliding window
(ops/sparse_attention.py holds the math and the reference form).

Departures from the paper, shared with fla-core's reference (`fla/ops/nsa/naive.py`): one block size for
compression and selection (the paper: compression blocks of 32 at stride 16, selection blocks of 64), and
compression by the mean of a block's keys/values (the paper: a learned MLP with intra-block positions).

Decode cache (`NSACache`): every key/value (selection may pick any past block) plus the mean key/value of
every complete block: 2 * Hkv * D * (L + floor(L / BS)) values after L tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from attnzoo.config.errors import ConfigError
from attnzoo.ops.sparse_attention import block_means, nsa_attention, nsa_keys
from attnzoo.config.registry import register_mixer
from attnzoo.mixers.attention import Attention, AttentionConfig, KVCache
from attnzoo.mixers.base import Mixer, causal_attended, dtype_bytes


class NSACache(KVCache):
    """KVCache (B, Hkv, T, D) plus the compressed keys/values k_cmp, v_cmp (B, Hkv, T // BS, D): the mean of
    each block, appended when its last token arrives."""

    def __init__(self, block_size: int) -> None:
        super().__init__()
        self.block_size = block_size
        self.k_cmp: Optional[torch.Tensor] = None
        self.v_cmp: Optional[torch.Tensor] = None

    def update(self, k: torch.Tensor, v: torch.Tensor):
        done = self.seq_len // self.block_size
        k_all, v_all = super().update(k, v)
        complete = k_all.shape[2] // self.block_size
        if complete > done:
            bs = self.block_size
            new_k = block_means(k_all[:, :, done * bs: complete * bs], bs)
            new_v = block_means(v_all[:, :, done * bs: complete * bs], bs)
            self.k_cmp = new_k if self.k_cmp is None else torch.cat([self.k_cmp, new_k], dim=2)
            self.v_cmp = new_v if self.v_cmp is None else torch.cat([self.v_cmp, new_v], dim=2)
        return k_all, v_all

    def compressed(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k_cmp is None:
            empty = like.new_zeros(like.shape[0], like.shape[1], 0, like.shape[3])
            return empty, empty
        return self.k_cmp, self.v_cmp


@dataclass
class NSAConfig(AttentionConfig):
    name: str = "nsa"
    block_size: int = 16   # BS: compression and selection block (fla: one size for both; the paper 32 / 64)
    block_counts: int = 4  # selected blocks per query, the first, previous and current included (>= 3)
    window: int = 32       # the sliding branch's keys per query (itself included); 0 = no sliding branch

    def validate(self, model, field: str) -> None:
        super().validate(model, field)
        if model.position.name == "alibi":
            raise ConfigError("ALiBi is implemented for mha / gqa / mqa; allowed positions for nsa: rope, none, "
                              "sinusoidal, learned", field="model.position.name")
        if self.block_size < 1:
            raise ConfigError(f"must be >= 1, got {self.block_size}", field=f"{field}.block_size")
        if self.block_counts < 3:
            raise ConfigError(f"must be >= 3 (the first, previous and current blocks are always selected), "
                              f"got {self.block_counts}", field=f"{field}.block_counts")
        blocks = -(-model.max_seq_len // self.block_size)
        if self.block_counts > blocks:
            raise ConfigError(f"{self.block_counts} exceeds the {blocks} blocks of model.max_seq_len="
                              f"{model.max_seq_len} (dense everywhere); allowed: 3..{blocks}", field=f"{field}.block_counts")
        if self.window < 0:
            raise ConfigError(f"must be >= 0 (0 = no sliding branch), got {self.window}", field=f"{field}.window")
        if not self.causal:
            raise ConfigError("nsa is causal only; allowed: true", field=f"{field}.causal")


@register_mixer("nsa", NSAConfig)
class NativeSparseAttention(Attention):
    SHAPE_FIELDS = Attention.SHAPE_FIELDS + ("block_size", "block_counts")
    context_parallel = False  # top-k block selection over the whole past: no ring form here
    full_causal_attention = False
    kernel_family = "block_sparse"
    kv_quantizable = False  # its cache keeps block means beside the keys
    bidirectional = False  # causal only
    linearize_source = False
    hf_layer = None
    hf_missing = "native sparse attention has no transformers causal-LM counterpart"

    @classmethod
    def check_seq_len(cls, cfg, seq_len: int, field: str) -> None:
        """Training sequences are whole blocks."""
        if seq_len % cfg.block_size:
            raise ConfigError(f"{cfg.block_size} does not divide data.seq_len={seq_len}; allowed: a divisor of "
                              f"{seq_len}", field=f"{field}.block_size")

    # block selection follows absolute block boundaries: packed documents run alone (Mixer.forward_packed)
    packing = "gather"
    forward_packed = Mixer.forward_packed

    def __init__(self, cfg: NSAConfig, model_cfg, layer_idx: int):
        super().__init__(cfg, model_cfg, layer_idx)
        self.block_size, self.block_counts, self.window = cfg.block_size, cfg.block_counts, cfg.window
        self.g_proj = nn.Linear(self.d_model, 3 * self.n_heads, bias=False)  # [cmp | slc | swa] per head

    def forward(self, x: torch.Tensor, *, positions: torch.Tensor, cache: Optional[NSACache] = None) -> torch.Tensor:
        B, T, _ = x.shape
        x = self.shift(x, cache)
        q, k, v = self.project(x, positions)
        gates = torch.sigmoid(self.g_proj(x)).view(B, T, self.n_heads, 3).permute(3, 0, 2, 1)  # 3 x (B, H, T)
        if cache is not None:
            k, v = cache.update(k, v)
            k_cmp, v_cmp = cache.compressed(k)
        else:
            k_cmp, v_cmp = block_means(k, self.block_size), block_means(v, self.block_size)
        y = nsa_attention(q, k, v, k_cmp, v_cmp, gates[0], gates[1], gates[2], q_start=k.shape[2] - T,
                          block_size=self.block_size, block_counts=self.block_counts, window=self.window,
                          scale=self.scale, reference=self.impl == "reference")
        return self.output(y, x)

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device) -> NSACache:
        return NSACache(self.block_size)

    def cache_bytes(self, context_len: int, batch: int = 1, dtype: torch.dtype = torch.float32) -> int:
        kv = 2 * self.n_kv_heads * self.head_dim * (context_len + context_len // self.block_size)
        return kv * batch * dtype_bytes(dtype) + self.input_conv_bytes(batch, dtype)

    def flops_per_token(self, context_len: int) -> float:
        proj = self.projection_flops() + 2.0 * self.g_proj.in_features * self.g_proj.out_features
        cmp, slc = nsa_keys(context_len, self.block_size, self.block_counts)
        swa = causal_attended(context_len, self.window) if self.window else 0.0
        return proj + 2.0 * 2 * self.n_heads * self.head_dim * (cmp + slc + swa)
