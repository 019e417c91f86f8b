"""Inference caches: the `LayerCache` base every mixer's cache derives from, and `ModelCache`, one cache
per layer (mixed kinds in hybrids). Each mixer's own cache class lives beside it (KVCache and
SlidingWindowCache in mixers/attention_cache.py, LatentCache in mixers/mla.py, RecurrentStateCache in
mixers/recurrent_base.py, CrossAttentionCache in encdec.py). Caches are batch-first: beam search
reorders every tensor attribute along dim 0.

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
