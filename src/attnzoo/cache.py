"""Inference caches. Each layer owns one cache of its mixer's kind; `ModelCache` holds them, mixed in hybrids.

Every cache reports `nbytes()` from the tensors it really holds, so the measured bytes can be checked
against each mixer's analytic `cache_bytes(context_len)`.
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch


class LayerCache:
    """Base class: `nbytes()` sums every tensor attribute (and tensors in list/tuple attributes).

    `conv_tail` (B, d_model, K-1): the last inputs of a mixer's short input conv (`Mixer.shift`), set on
    the first call when the mixer has one; None otherwise."""

    conv_tail: Optional[torch.Tensor] = None

    def tensors(self) -> Iterator[torch.Tensor]:
        for value in vars(self).values():
            if isinstance(value, torch.Tensor):
                yield value
            elif isinstance(value, (list, tuple)):
                yield from (v for v in value if isinstance(v, torch.Tensor))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


class KVCache(LayerCache):
    """Keys and values of every past token: k, v of shape (B, n_kv_heads, T, head_dim).

    Grows by concatenation, so it holds exactly the tokens seen (no preallocated slack to hide memory).
    """

    def __init__(self) -> None:
        self.k: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None

    @property
    def seq_len(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new (B, Hkv, t, D) keys/values; return all keys/values so far."""
        if self.k is None:
            # own copies: k/v may be views into the fused qkv activation, which would stay alive
            # (and uncounted) behind them
            self.k, self.v = k.clone(memory_format=torch.contiguous_format), v.clone(memory_format=torch.contiguous_format)
        else:
            self.k = torch.cat([self.k, k], dim=2)
            self.v = torch.cat([self.v, v], dim=2)
        return self.k, self.v


class ModelCache:
    """One cache per layer plus the number of tokens already processed (the next absolute position)."""

    def __init__(self, layers: list) -> None:
        self.layers = layers
        self.seq_len = 0

    def __getitem__(self, i: int):
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)

    def nbytes(self) -> int:
        return sum(c.nbytes() for c in self.layers if c is not None)


class SlidingWindowCache(LayerCache):
    """Keys/values of the last `window` tokens only: k, v of shape (B, n_kv_heads, min(seen, W), head_dim).

    A ring buffer: the token at absolute position p lives in slot p % W. It grows by concatenation until it
    holds W tokens and is then overwritten in place, so decoding far past W keeps memory flat at W tokens.
    Keys are stored after RoPE, so a slot's position never needs to be known again.
    """

    def __init__(self, window: int) -> None:
        self.window = window
        self.k: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None
        self.seen = 0  # tokens processed so far (the next absolute position)

    @property
    def seq_len(self) -> int:
        return self.seen

    @property
    def full(self) -> bool:
        return self.k is not None and self.k.shape[2] == self.window

    def ordered(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Held keys/values oldest first (a copy once the ring has wrapped)."""
        if not self.full or self.seen % self.window == 0:
            return self.k, self.v
        shift = -(self.seen % self.window)  # the oldest held token sits in slot seen % W
        return self.k.roll(shift, dims=2), self.v.roll(shift, dims=2)

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add new (B, Hkv, t, D) keys/values. Returns the keys/values to attend over:

        - one token into a full ring: the ring itself after the write (slot order, not time order: every
          held key is inside the new query's window, and softmax does not care about key order);
        - otherwise: the held tokens oldest first, then the new ones (the caller applies the band mask).
        """
        W, T = self.window, k.shape[2]
        if T == 1 and self.full:
            slot = self.seen % W
            self.k[:, :, slot] = k[:, :, 0]
            self.v[:, :, slot] = v[:, :, 0]
            self.seen += 1
            return self.k, self.v
        old_k, old_v = self.ordered()
        k_all = k if old_k is None else torch.cat([old_k, k], dim=2)
        v_all = v if old_v is None else torch.cat([old_v, v], dim=2)
        self.seen += T
        # keep the last W tokens in slot order; roll/clone copy, so the ring never pins a larger tensor
        # (e.g. the fused qkv projection the new keys are views of)
        shift = self.seen % W if k_all.shape[2] >= W else 0
        self.k = k_all[:, :, -W:].roll(shift, dims=2)
        self.v = v_all[:, :, -W:].roll(shift, dims=2)
        return k_all, v_all


class LatentCache(LayerCache):
    """MLA's cache (DeepSeek-V2): per token only the normed KV latent and the shared RoPE key.

    One tensor `latent` of shape (B, T, kv_lora_rank + qk_rope_head_dim), laid out [c_kv | k_rope], so the
    absorbed decode attends over it without a per-step concatenation. Never the expanded per-head K/V.
    """

    def __init__(self, kv_lora_rank: int) -> None:
        self.kv_lora_rank = kv_lora_rank
        self.latent: Optional[torch.Tensor] = None

    @property
    def seq_len(self) -> int:
        return 0 if self.latent is None else self.latent.shape[1]

    @property
    def c_kv(self) -> torch.Tensor:
        return self.latent[..., : self.kv_lora_rank]

    @property
    def k_rope(self) -> torch.Tensor:
        return self.latent[..., self.kv_lora_rank :]

    def update(self, latent: torch.Tensor) -> torch.Tensor:
        """Append new (B, t, kv_lora_rank + qk_rope_head_dim) entries; return all of them so far."""
        self.latent = latent.contiguous() if self.latent is None else torch.cat([self.latent, latent], dim=1)
        return self.latent


class RecurrentStateCache(LayerCache):
    """Fixed-size state of a recurrent mixer (linear attention, DeltaNet, Gated DeltaNet): constant bytes
    whatever the context, allocated once by the mixer's `new_cache`.

    state (B, H, Dk, Dv): the matrix memory (for normalised linear attention Dv includes the key-sum column),
    kept in at least fp32 because it accumulates over the whole context;
    conv_tail (B, C, K-1) or None: the last K-1 inputs of the short convolution, in the cache dtype.
    """

    def __init__(self, state: torch.Tensor, conv_tail: Optional[torch.Tensor] = None) -> None:
        self.state = state
        self.conv_tail = conv_tail
        self.seen = 0  # tokens processed so far

    @property
    def seq_len(self) -> int:
        return self.seen


class CrossAttentionCache(LayerCache):
    """Encoder-decoder cross-attention (attnzoo.encdec): the keys/values of the encoder memory, projected
    once per source and reused by every decoding step. k, v of shape (B, n_kv_heads, S, head_dim).
    Bytes do not grow with the generated length."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v
