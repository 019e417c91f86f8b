"""The caches of softmax attention: `KVCache` (every past key/value, mha / gqa / mqa and the block-sparse
mixers) and `SlidingWindowCache` (a ring of the last W tokens, plus the attention sinks). Both are batch-first and
count the tensors they hold in `nbytes()` (layers/kv_cache.LayerCache)."""
from __future__ import annotations

from typing import Optional

import torch

from attnzoo.layers.kv_cache import LayerCache


class _Capacity:
    """The buffers behind a KVCache's k / v views (not a tensor attribute: `nbytes()` counts the filled views,
    beam search's reorder leaves it alone, and `KVCache.update` rebuilds it when k is no longer its view)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


class KVCache(LayerCache):
    """Keys and values of every past token: k, v of shape (B, n_kv_heads, T, head_dim).

    The first call (the prefill) stores exactly its tokens. Later calls write into buffers whose capacity
    doubles when full, so decoding copies each token once (amortised) instead of copying the whole cache per
    token; k and v are views of the filled part. `nbytes()` counts the filled part (the context's cache,
    equal to `cache_bytes`); `allocated_bytes()` also the spare capacity (at most the filled part again).
    With autograd recording (a cache in a graph) it concatenates instead, so no in-place write can touch a
    tensor the graph saved.
    """

    def __init__(self) -> None:
        self.k: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None
        self._capacity: Optional[_Capacity] = None

    @property
    def seq_len(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def allocated_bytes(self) -> int:
        """Bytes really allocated: the buffers (capacity) when k / v are their views, else nbytes()."""
        cap = self._capacity
        if cap is not None and self.k is not None and cap.k.data_ptr() == self.k.data_ptr():
            return self.nbytes() - self.k.numel() * self.k.element_size() - self.v.numel() * self.v.element_size() \
                + cap.nbytes()
        return self.nbytes()

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new (B, Hkv, t, D) keys/values; return all keys/values so far."""
        if self.k is None:
            # own copies: k/v may be views into the fused qkv activation, which would stay alive
            # (and uncounted) behind them
            self.k, self.v = k.clone(memory_format=torch.contiguous_format), v.clone(memory_format=torch.contiguous_format)
            return self.k, self.v
        if torch.is_grad_enabled() and (k.requires_grad or self.k.requires_grad):
            self.k, self.v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
            return self.k, self.v
        n, t = self.k.shape[2], k.shape[2]
        cap = self._capacity
        if (cap is None or cap.k.data_ptr() != self.k.data_ptr() or cap.k.shape[2] < n + t
                or cap.k.dtype != k.dtype or cap.k.shape[:2] != self.k.shape[:2]):
            size = max(2 * n, n + t)  # doubling: each token is copied O(1) times over a whole decode
            kb = self.k.new_empty(*self.k.shape[:2], size, self.k.shape[3])
            vb = self.v.new_empty(*self.v.shape[:2], size, self.v.shape[3])
            kb[:, :, :n], vb[:, :, :n] = self.k, self.v
            cap = self._capacity = _Capacity(kb, vb)
        cap.k[:, :, n:n + t], cap.v[:, :, n:n + t] = k, v
        self.k, self.v = cap.k[:, :, :n + t], cap.v[:, :, :n + t]
        return self.k, self.v


class SlidingWindowCache(LayerCache):
    """Keys/values of the last `window` tokens only: k, v of shape (B, n_kv_heads, min(seen, W), head_dim).

    A ring buffer: the token at absolute position p lives in slot p % W. It grows by concatenation until it
    holds W tokens and is then overwritten in place, so decoding far past W keeps memory flat at W tokens.
    Keys are stored after RoPE, so a slot's position never needs to be known again.
    """

    def __init__(self, window: int, sinks: int = 0) -> None:
        self.window = window
        self.sinks = sinks  # attention sinks (StreamingLLM): the first `sinks` tokens, kept beside the ring
        self.k: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None
        self.sink_k: Optional[torch.Tensor] = None  # (B, Hkv, min(seen, sinks), D), after RoPE
        self.sink_v: Optional[torch.Tensor] = None
        self.seen = 0  # tokens processed so far (the next absolute position)

    def update_with_sinks(self, k: torch.Tensor, v: torch.Tensor):
        """`update`, plus the sinks: returns (keys, values, absolute position of keys[0] or None when the keys
        are in ring slot order, prefix keys, prefix values). The prefix holds the sink tokens that are not
        among the returned keys (they left the window), so every query sees them."""
        S, T, seen = self.sinks, k.shape[2], self.seen
        if seen < S:  # the first S tokens are recorded once, as they arrive
            take = min(S - seen, T)
            new_k, new_v = k[:, :, :take].clone(), v[:, :, :take].clone()
            self.sink_k = new_k if self.sink_k is None else torch.cat([self.sink_k, new_k], dim=2)
            self.sink_v = new_v if self.sink_v is None else torch.cat([self.sink_v, new_v], dim=2)
        if T == 1 and self.full:
            key_start, first = None, seen + 1 - self.window  # the ring after the write: positions seen+1-W .. seen
        else:
            held = 0 if self.k is None else self.k.shape[2]
            key_start = first = seen - held
        n = max(0, min(first, S))
        keys, values = self.update(k, v)
        if n == 0:
            return keys, values, key_start, None, None
        return keys, values, key_start, self.sink_k[:, :, :n], self.sink_v[:, :, :n]

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


class StaticKVCache(LayerCache):
    """The static cache of softmax attention (`Attention.new_static_cache`; layers/kv_cache.StaticModelCache):
    k, v (B, Hkv, S, D) allocated once and written in place at each row's positions.

    Full attention: S = the longest context, slot s holds position s. Sliding window (`window` W): a ring, S = W,
    slot s holds the latest position p = s (mod W); the first `sinks` tokens (StreamingLLM) also sit in
    sink_k / sink_v (B, Hkv, sinks, D), read once they have left the window. Keys are stored after RoPE.
    `key_positions` says which position each key holds (-1: none yet), so the attention mask is a function of
    tensors and one compiled step serves every position."""

    static = True
    # keys/values stored in less precision than computed (a KV format, mixers/kv_quant.py): a chunk's own keys are
    # attended as computed, the past as stored (`with_chunk`), as the dynamic format caches do
    lossy = False

    def __init__(self, batch: int, n_kv_heads: int, slots: int, head_dim: int, dtype: torch.dtype, device,
                 window: Optional[int] = None, sinks: int = 0, conv_tail: Optional[torch.Tensor] = None,
                 lossy: bool = False) -> None:
        self.lossy = lossy
        shape = (batch, n_kv_heads, slots, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.window, self.sinks = window, sinks
        sink_shape = (batch, n_kv_heads, sinks, head_dim)
        self.sink_k = torch.zeros(sink_shape, dtype=dtype, device=device) if sinks else None
        self.sink_v = torch.zeros(sink_shape, dtype=dtype, device=device) if sinks else None
        self.conv_tail = conv_tail

    @property
    def ring(self) -> bool:
        return self.window is not None

    @property
    def chunks(self) -> bool:
        """Whether a chunk of several tokens may follow the prefill (a ring: one token at a time)."""
        return not self.ring

    def write(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """New keys/values (B, Hkv, T, D) at `positions` (B, T), each into its slot (a ring takes the last W of
        them, so no two share a slot); the first `sinks` positions also into their sink slots."""
        rows = torch.arange(k.shape[0], device=k.device)[:, None]
        if self.sinks:
            n = min(k.shape[2], self.sinks)
            p = positions[:, :n]
            s, keep = p.clamp(max=self.sinks - 1), (p < self.sinks)[..., None, None]  # past the sinks: left as is
            self.sink_k[rows, :, s] = torch.where(keep, k[:, :, :n].transpose(1, 2).to(self.k.dtype), self.sink_k[rows, :, s])
            self.sink_v[rows, :, s] = torch.where(keep, v[:, :, :n].transpose(1, 2).to(self.v.dtype), self.sink_v[rows, :, s])
        S = self.k.shape[2]
        if self.ring and k.shape[2] > S:
            k, v, positions = k[:, :, -S:], v[:, :, -S:], positions[:, -S:]
        slot = positions % S if self.ring else positions
        self.k[rows, :, slot] = k.transpose(1, 2).to(self.k.dtype)
        self.v[rows, :, slot] = v.transpose(1, 2).to(self.v.dtype)

    def keys(self, last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(keys, values, key_positions (B, S')) once the row's latest token is at `last` (B,): the position each
        key holds, -1 for a slot not written yet (or, for a sink, one still inside the window: the ring has it)."""
        S = self.k.shape[2]
        slot = torch.arange(S, device=last.device)
        if not self.ring:
            return self.k, self.v, slot.expand(last.shape[0], S)
        held = last[:, None] - (last[:, None] - slot) % S  # the latest position = s (mod W), <= last
        held = held.masked_fill(held < 0, -1)
        if not self.sinks:
            return self.k, self.v, held
        j = torch.arange(self.sinks, device=last.device)
        sink_pos = torch.where(j[None, :] <= last[:, None] - S, j[None, :], -1)
        return (torch.cat([self.sink_k, self.k], dim=2), torch.cat([self.sink_v, self.v], dim=2),
                torch.cat([sink_pos, held], dim=1))

    def filled_bytes(self, lengths: torch.Tensor) -> int:
        """Per row: min(length, S) slots of k and v (+ min(length, sinks) sink slots) and the conv tail."""
        per_slot = 2 * self.k.shape[1] * self.k.shape[3] * self.k.element_size()
        held = int(lengths.clamp(max=self.k.shape[2]).sum()) + int(lengths.clamp(max=self.sinks).sum())
        tail = 0 if self.conv_tail is None else self.conv_tail.numel() * self.conv_tail.element_size()
        return per_slot * held + tail


def with_chunk(keys: torch.Tensor, values: torch.Tensor, held: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               first: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """keys/values (B, Hkv, S, D) read from a lossy static cache, holding positions `held` (B, S), with the slots of
    the chunk just written (positions first .. first + T - 1, first (B,)) replaced by its keys/values as computed,
    k/v (B, Hkv, T, D): the past as stored, the chunk's own tokens in full precision."""
    B, Hkv, S, D = keys.shape
    rel = held - first[:, None]
    inside = ((rel >= 0) & (rel < k.shape[2]))[:, None, :, None]
    idx = rel.clamp(0, k.shape[2] - 1)[:, None, :, None].expand(B, Hkv, S, D)
    return (torch.where(inside, k.gather(2, idx).to(keys.dtype), keys),
            torch.where(inside, v.gather(2, idx).to(values.dtype), values))
