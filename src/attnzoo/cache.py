"""Inference caches. Each layer owns one cache of its mixer's kind; `ModelCache` holds them, mixed in hybrids.

Every cache reports `nbytes()` from the tensors it really holds, so the measured bytes can be checked
against each mixer's analytic `cache_bytes(context_len)`.
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch


class LayerCache:
    """Base class: `nbytes()` sums every tensor attribute (and tensors in list/tuple attributes)."""

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
            self.k, self.v = k, v
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
