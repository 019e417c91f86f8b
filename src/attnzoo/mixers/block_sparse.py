"""What the block-sparse attention mixers share (nsa.py, moba.py): GQA's projections and RoPE, the keys split
into blocks of `block_size`, each query attending to a data-dependent choice of blocks scored against the blocks'
mean keys (ops/sparse_attention.py holds the math and the reference forms).

- `BlockSparseConfig`: GQA's options, `block_size`, and the count of blocks a query sees (NSA's block_counts,
  MoBA's topk: COUNT_FIELD), checked alike (at least COUNT_MIN, at most the blocks of model.max_seq_len); causal
  only.
- `BlockMeansCache`: the `KVCache` plus the mean key (and, for NSA, the mean value) of every complete block,
  appended when the block's last token arrives.
- `StaticBlockMeansCache`: the static form (a `StaticKVCache` of every position, plus the means of every block,
  preallocated; a decode step recomputes its row's current block's mean, read only once the block is complete).
- `BlockSparseAttention`: the settings they share: no ring form, packed documents run alone, training sequences
  of whole blocks, no transformers counterpart; `blocks()` projects and returns the keys and block means.
Not a mixer itself (no registration).
"""
from __future__ import annotations

from typing import Optional

import torch

from attnzoo.mixers.attention import Attention
from attnzoo.mixers.attention_cache import KVCache, StaticKVCache
from attnzoo.mixers.base import Mixer
from attnzoo.ops.sparse_attention import block_means
from attnzoo.mixers.configs import BlockSparseConfig  # noqa: F401 (torch-free: config checks)


class BlockMeansCache(KVCache):
    """KVCache (B, Hkv, T, D) plus k_mean, and with `values` v_mean, (B, Hkv, T // BS, D): the mean key / value of
    every complete block, appended when its last token arrives."""

    def __init__(self, block_size: int, values: bool) -> None:
        super().__init__()
        self.block_size, self.values = block_size, values
        self.k_mean: Optional[torch.Tensor] = None
        self.v_mean: Optional[torch.Tensor] = None

    def update(self, k: torch.Tensor, v: torch.Tensor):
        done = self.seq_len // self.block_size
        k_all, v_all = super().update(k, v)
        complete = k_all.shape[2] // self.block_size
        if complete > done:
            bs = self.block_size
            new_k = block_means(k_all[:, :, done * bs: complete * bs], bs)
            self.k_mean = new_k if self.k_mean is None else torch.cat([self.k_mean, new_k], dim=2)
            if self.values:
                new_v = block_means(v_all[:, :, done * bs: complete * bs], bs)
                self.v_mean = new_v if self.v_mean is None else torch.cat([self.v_mean, new_v], dim=2)
        return k_all, v_all

    def means(self, like: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(k_mean, v_mean) of the complete blocks so far ((B, Hkv, 0, D), shaped as `like`, before the first);
        v_mean None without `values`."""
        if self.k_mean is None:
            empty = like.new_zeros(like.shape[0], like.shape[1], 0, like.shape[3])
            return empty, empty if self.values else None
        return self.k_mean, self.v_mean


class StaticBlockMeansCache(StaticKVCache):
    """`StaticKVCache` (B, Hkv, S, D) of positions 0 .. S - 1 plus k_mean, and with `values` v_mean, (B, Hkv,
    ceil(S / BS), D): block c's mean key / value once its last token is written. A one-token step writes the mean of
    its row's current block from the slots (complete or not: a block's mean is read only once the block is
    complete, under the position mask); a longer chunk (a prefill, eager) recomputes every block's."""

    def __init__(self, batch: int, n_kv_heads: int, slots: int, head_dim: int, dtype: torch.dtype, device, *,
                 block_size: int, values: bool, conv_tail: Optional[torch.Tensor] = None) -> None:
        super().__init__(batch, n_kv_heads, slots, head_dim, dtype, device, conv_tail=conv_tail)
        shape = (batch, n_kv_heads, -(-slots // block_size), head_dim)
        self.block_size = block_size
        self.k_mean = torch.zeros(shape, dtype=dtype, device=device)
        self.v_mean = torch.zeros(shape, dtype=dtype, device=device) if values else None

    def write(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        super().write(k, v, positions)
        BS, S = self.block_size, self.k.shape[2]
        pairs = [(self.k, self.k_mean)] + ([(self.v, self.v_mean)] if self.v_mean is not None else [])
        if positions.shape[1] > 1:
            n = S // BS
            for full, mean in pairs:
                mean[:, :, :n] = block_means(full, BS)
            return
        rows = torch.arange(k.shape[0], device=k.device)
        block = positions[:, 0] // BS  # (B,)
        slots = (block[:, None] * BS + torch.arange(BS, device=k.device)).clamp(max=S - 1)  # (B, BS)
        for full, mean in pairs:
            mean[rows, :, block] = full[rows[:, None], :, slots].mean(dim=1)  # (B, BS, Hkv, D) -> (B, Hkv, D)

    def filled_bytes(self, lengths: torch.Tensor) -> int:
        """Every position's key and value (and conv tail), plus the means of the rows' complete blocks."""
        n_means = 1 + (self.v_mean is not None)
        per_block = n_means * self.k_mean.shape[1] * self.k_mean.shape[3] * self.k_mean.element_size()
        return super().filled_bytes(lengths) + per_block * int((lengths // self.block_size).sum())


class BlockSparseAttention(Attention):
    """An `Attention` whose queries see a data-dependent choice of key blocks; subclasses set `cache_values`
    (their cache keeps the blocks' mean values too) and implement forward with `blocks()`."""

    kernel_family = "block_sparse"
    linearize_source = False
    hf_layer = None
    cache_values = False

    # block selection follows absolute block boundaries: packed documents run alone (Mixer.forward_packed)
    packing = "gather"
    forward_packed = Mixer.forward_packed

    def __init__(self, cfg: BlockSparseConfig, model_cfg, layer_idx: int):
        super().__init__(cfg, model_cfg, layer_idx)
        self.block_size = cfg.block_size

    def blocks(self, x: torch.Tensor, positions: torch.Tensor, cache):
        """x (the shifted input) -> q (B, H, T, D), every key / value so far (B, Hkv, S, D) (the cache updated), the
        mean key / value (None without `cache_values`) of their blocks, and qpos: None when the queries are the
        last T of the keys' positions 0 .. S - 1; with a static cache's decode step, its rows' positions (B, T) over
        the cache's slots (the means of the blocks not complete yet are there too: masked by the attention)."""
        q, k, v = self.project(x, positions)
        if cache is not None and cache.static:
            pos = positions.expand(q.shape[0], -1) if positions.dim() == 1 else positions
            prefill = q.shape[2] > 1 and int(pos[:, 0].max()) == 0  # every row starts: its own keys, then written
            cache.write(k, v, pos)
            if prefill:
                return (q, k, v, *self.means(k, v), None)
            v_mean = None if cache.v_mean is None else cache.v_mean.to(q.dtype)
            return q, cache.k.to(q.dtype), cache.v.to(q.dtype), cache.k_mean.to(q.dtype), v_mean, pos
        if cache is not None:
            k, v = cache.update(k, v)
            return (q, k, v, *cache.means(k), None)
        return (q, k, v, *self.means(k, v), None)

    def means(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The mean key (and with `cache_values` value) of every complete block of k / v."""
        return block_means(k, self.block_size), block_means(v, self.block_size) if self.cache_values else None

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device) -> BlockMeansCache:
        return BlockMeansCache(self.block_size, values=self.cache_values)

    def new_static_cache(self, batch: int, max_len: int, dtype: torch.dtype, device) -> StaticBlockMeansCache:
        """Keys/values for positions 0 .. max_len - 1 and the means of their blocks."""
        tail = None if self.input_conv is None else self.input_conv.empty_tail(batch, dtype, device)
        return StaticBlockMeansCache(batch, self.n_kv_heads, max_len, self.head_dim, dtype, device,
                                     block_size=self.block_size, values=self.cache_values, conv_tail=tail)
