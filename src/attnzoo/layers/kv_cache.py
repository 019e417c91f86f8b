"""Inference caches: the `LayerCache` base every mixer's cache derives from, and `ModelCache`, one cache
per layer (mixed kinds in hybrids). Each mixer's own cache class lives beside it (KVCache and
SlidingWindowCache in mixers/attention_cache.py, LatentCache in mixers/mla.py, RecurrentStateCache in
mixers/recurrent_base.py, CrossAttentionCache in encdec.py). Caches are batch-first: beam search
reorders every tensor attribute along dim 0.

Every cache reports `nbytes()` from the tensors it really holds, so the measured bytes can be checked
against each mixer's analytic `cache_bytes(context_len)`.

Static caches (`LayerCache.static`, `StaticModelCache`; the compiled decode of attnzoo.models.decoding): every
tensor allocated once by the mixer's `new_static_cache` (to the longest context, or fixed by construction) and
written in place, the positions a (B,) tensor: the addresses never change, so one compiled decode step (and one
CUDA graph) serves every position and every prompt. `nbytes()` of a static model cache is what its rows have
filled (the analytic `cache_bytes`), `allocated_bytes()` what its buffers hold.
"""
from __future__ import annotations

from typing import Iterator, Optional

import copy

import torch


class LayerCache:
    """Base class: `nbytes()` sums every tensor attribute (and tensors in list/tuple attributes).

    `conv_tail` (B, d_model, K-1): the last inputs of a mixer's short input conv (`Mixer.shift`), set on
    the first call when the mixer has one; None otherwise."""

    conv_tail: Optional[torch.Tensor] = None
    static = False  # preallocated, written in place (new_static_cache): no Python number changes while decoding

    def store(self, name: str, value: torch.Tensor) -> None:
        """`cache.<name> = value`: into the preallocated tensor, in place, when static (its address stays), else
        rebound (value in the stored tensor's dtype when there is one)."""
        old = getattr(self, name)
        if self.static:
            old.copy_(value)
        else:
            setattr(self, name, value if old is None else value.to(old.dtype))

    def tick(self, n: int) -> None:
        """`n` more tokens seen (`seen`, where the cache counts them; a static cache's positions are the model's)."""
        if not self.static and hasattr(self, "seen"):
            self.seen += n

    def row(self, b: int) -> "LayerCache":
        """Row b as a cache of batch 1 whose tensors are views of this one's (a static cache's per-row prefill)."""
        view = copy.copy(self)
        for key, value in vars(self).items():
            if isinstance(value, torch.Tensor):
                setattr(view, key, value[b:b + 1])
        return view

    def reset(self) -> None:
        """A static cache emptied in place: every tensor zero (states, tails; stale keys are masked anyway)."""
        for t in self.tensors():
            t.zero_()

    def filled_bytes(self, lengths: torch.Tensor) -> int:
        """Bytes a static cache's rows have filled after `lengths` (B,) tokens each (fixed-size caches: all)."""
        return self.nbytes()

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

    def positions(self, T: int, device) -> torch.Tensor:
        """The absolute positions (T,) of the next T tokens."""
        return torch.arange(self.seq_len, self.seq_len + T, device=device)

    def advance(self, T: int) -> None:
        self.seq_len += T


class StaticModelCache(ModelCache):
    """Static layer caches (every layer's `static`) and `pos` (B,) int64: each row's next position, a tensor
    advanced in place, so a compiled step never sees a changing Python number. Rows may differ (prompts of other
    lengths: `row(b)` prefills one). `max_len`: the positions the buffers hold (0 .. max_len - 1)."""

    def __init__(self, layers: list, batch: int, max_len: int, device) -> None:
        super().__init__(layers)
        self.max_len = max_len
        self.pos = torch.zeros(batch, dtype=torch.long, device=device)
        for t in self.tensors():
            torch._dynamo.mark_static_address(t)  # CUDA graphs (mode="reduce-overhead") keep reading these

    def tensors(self) -> Iterator[torch.Tensor]:
        yield self.pos
        for c in self.layers:
            yield from c.tensors()

    def positions(self, T: int, device) -> torch.Tensor:
        return self.pos[:, None] + torch.arange(T, device=device)  # (B, T)

    def advance(self, T: int) -> None:
        self.pos.add_(T)

    @property
    def seq_len(self) -> int:  # the longest row (eager callers only: a compiled step reads `pos`)
        return int(self.pos.max())

    @seq_len.setter
    def seq_len(self, value: int) -> None:  # ModelCache.__init__
        pass

    def row(self, b: int) -> "StaticModelCache":
        """Row b as a batch-1 static cache over views of this one's buffers (prefill prompts one by one)."""
        view = copy.copy(self)
        view.layers = [c.row(b) for c in self.layers]
        view.pos = self.pos[b:b + 1]
        return view

    def reset(self) -> None:
        """Empty again (positions 0; recurrent states and conv tails zero), the buffers kept: a new batch of
        prompts reuses the compiled step."""
        self.pos.zero_()
        for c in self.layers:
            c.reset()

    def nbytes(self) -> int:
        """What the rows hold at their positions: the analytic `cache_bytes` (summed over rows)."""
        return sum(c.filled_bytes(self.pos) for c in self.layers)

    def allocated_bytes(self) -> int:
        return sum(c.nbytes() for c in self.layers)
