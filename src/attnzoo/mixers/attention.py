"""Softmax attention with grouped KV heads: MHA (n_kv_heads = n_heads), GQA, MQA (n_kv_heads = 1),
and the sliding-window variant of the same class.

One implementation for the whole family (Shazeer 2019 MQA; Ainslie et al. 2023 GQA):

    MHA  q: h h h h   GQA  q: h h h h   MQA  q: h h h h
         kv:h h h h        kv: g   g         kv:   g

Fused QKV projection, optionally a per-head RMSNorm of q and k (`qk_norm`, as Qwen3), RoPE on q/k when the
model's position is `rope`, SDPA for training/prefill, a KV cache for decoding, optionally a sigmoid gate on
the attention output (`output_gate`, as Qwen3-Next's full-attention layers). `impl = "reference"` runs the
explicit softmax of ops/attention.py instead.

`sliding_window` (Beltagy et al. 2020 Longformer; Jiang et al. 2023 Mistral) is a thin subclass: the same
projections and RoPE, a band mask (query t sees keys t-W+1..t) and a ring-buffer cache of W tokens.
The caches (`KVCache`, `SlidingWindowCache`) are in attention_cache.py, importable from here too.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from attnzoo.ops.attention import alibi_bias, alibi_slopes, attention_mask, attention_reference, attention_sdpa
from attnzoo.layers.norm import RMSNorm
from attnzoo.distributed import context_parallel as parallel
from attnzoo.ops.sliding_window import sliding_window_sdpa
from attnzoo.ops.dispatch import FLEX_MIN_HEAD_DIM, mixer_kernel
from attnzoo.layers.position import rotary_from_config
from attnzoo.config.registry import register_mixer
from attnzoo.mixers.attention_cache import KVCache, SlidingWindowCache, StaticKVCache, with_chunk
from attnzoo.mixers.base import (HF_FULL_ATTENTION, HF_SLIDING_ATTENTION, Mixer, causal_attended, dtype_bytes,
                                 validate_conv)
from attnzoo.mixers.configs import AttentionConfig, SlidingWindowConfig  # noqa: F401 (torch-free: config checks)


class Attention(Mixer):
    window: Optional[int] = None  # sliding-window subclasses set this
    sinks: int = 0  # and this (attention sinks)
    kernel_family = "softmax"
    linearize_source = True  # q/k/v/o seed a linear mixer (training/linearize.py)
    hf_layer = HF_FULL_ATTENTION  # Llama / Qwen2 / Qwen3 / Mixtral, Qwen3-Next's attention layers

    @classmethod
    def mup_qk_grows(cls, cfg) -> bool:  # softmax logits: q.k / d under µP (Mixer.mup_qk_scale)
        return True

    def __init__(self, cfg: AttentionConfig, model_cfg, layer_idx: int):
        super().__init__(cfg, model_cfg, layer_idx)
        self.n_heads = model_cfg.n_heads
        self.n_kv_heads = cfg.kv_heads(model_cfg)
        self.head_dim = model_cfg.head_dim  # resolved by config.resolve_model
        # None: head_dim^-1/2; µP: softmax_scale / head_dim (1 / head_dim by default)
        self.scale = self.mup_qk_scale(model_cfg, self.head_dim, cfg.softmax_scale, cfg.softmax_scale)
        self.causal = cfg.causal
        self.dropout = model_cfg.dropout
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.qkv = nn.Linear(self.d_model, q_dim + 2 * kv_dim, bias=cfg.qkv_bias)  # fused [q | k | v]
        self.o_proj = nn.Linear(q_dim, self.d_model, bias=cfg.out_bias)
        # one weight vector per projection, shared by its heads (Qwen3's q_norm / k_norm)
        self.q_norm = RMSNorm(self.head_dim, model_cfg.norm.eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, model_cfg.norm.eps) if cfg.qk_norm else None
        self.gate_proj = nn.Linear(self.d_model, q_dim, bias=cfg.qkv_bias) if cfg.output_gate else None
        pos = model_cfg.position
        self.rope = rotary_from_config(pos, self.head_dim, model_cfg.max_seq_len)
        # ALiBi (Press et al. 2022): a per-head linear distance penalty on the scores instead of any embedding
        self.register_buffer("alibi", alibi_slopes(self.n_heads) if pos.name == "alibi" else None, persistent=False)
        self.build_input_conv(cfg.conv_size, cfg.conv_bias)

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split(
            [self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, self.n_kv_heads * self.head_dim], dim=-1
        )
        # split d_model into (heads, head_dim) first, then move heads forward: each head keeps its own slice
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        if self.q_norm is not None:  # over head_dim, before RoPE: the cache holds normed, rotated keys
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            cs = self.rope.cos_sin(positions, q.dtype)
            q, k = self.rope(q, positions, cs), self.rope(k, positions, cs)
        return q, k, v

    def output(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Heads (B, H, T, D) merged, gated by sigmoid(gate_proj(x)) with `output_gate` (x: the mixer input the
        queries came from), then o_proj -> (B, T, d_model)."""
        B, H, T, D = y.shape
        y = y.transpose(1, 2).reshape(B, T, H * D)
        if self.gate_proj is not None:
            y = y * torch.sigmoid(self.gate_proj(x))
        return self.o_proj(y)

    def projection_flops(self) -> float:
        """The dense projections (qkv, o_proj, gate_proj) and the input conv, per token."""
        layers = [m for m in (self.qkv, self.o_proj, self.gate_proj) if m is not None]
        return 2.0 * sum(m.in_features * m.out_features for m in layers) + self.input_conv_flops()

    def attend(self, q, k, v, q_offset: int) -> torch.Tensor:
        """q (B,H,Tq,D) at absolute offset `q_offset` relative to the first key in k/v."""
        bias = None
        if self.alibi is not None:
            bias = alibi_bias(self.alibi, q.shape[2], k.shape[2], causal=self.causal, q_offset=q_offset, dtype=q.dtype)
        if self.impl == "reference":
            mask = attention_mask(
                q.shape[2], k.shape[2], causal=self.causal, window=self.window, device=q.device, q_offset=q_offset
            )
            return attention_reference(q, k, v, mask=mask, scale=self.scale, bias=bias)
        if bias is not None:  # the full (H, Tq, Tk) score bias: SDPA with a float mask, decode included
            return attention_sdpa(q, k, v, causal=self.causal, scale=self.scale, bias=bias,
                                  dropout_p=self.dropout if self.training else 0.0)
        if q.shape[2] == 1 and (self.window is None or k.shape[2] <= self.window):
            # one new token: every held key is visible
            return decode_sdpa(q, k, v, scale=self.scale, dropout_p=self.dropout if self.training else 0.0)
        return attention_sdpa(
            q, k, v, causal=self.causal, window=self.window, scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0,
        )

    def forward_context_parallel(self, x: torch.Tensor, positions: torch.Tensor, cp) -> torch.Tensor:
        """This rank's tokens of a sequence split over a context-parallel group (parallel.py): ring attention
        over the K/V blocks of every rank, the input conv continuing across the shard boundary."""
        if self.input_conv is not None:
            x = cp.conv(self.input_conv, x)
        q, k, v = self.project(x, positions)
        y = cp.attention(q, k, v, causal=self.causal, scale=self.scale, window=self.window,
                         sinks=self.sinks, alibi=self.alibi)
        return self.output(y, x)

    packing = "native"  # a block-diagonal document mask

    def forward_packed(self, x: torch.Tensor, *, positions: torch.Tensor, documents) -> torch.Tensor:
        """Packed documents (packing.py): the same projections with per-document positions; attention for each
        document by its own call when they are few (the causal / band kernels), else one call under the
        block-diagonal mask (causal, window and sinks counted inside each document; ALiBi distances are only read
        inside a document). The mask is O(T^2) per row: flex_attention's block mask on GPU."""
        x = self.shift_packed(x, documents)
        q, k, v = self.project(x, positions)
        if documents.split():  # few documents: each by its own causal / band call, no mask
            def one(q, k, v):  # (1, L, H, D) -> (1, L, H, D)
                return self.attend_alone(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

            y = documents.per_document(one, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            return self.output(y.transpose(1, 2), x)
        mask = documents.mask(causal=self.causal, window=self.window, sinks=self.sinks)
        bias = None
        if self.alibi is not None:
            T = x.shape[1]
            bias = alibi_bias(self.alibi, T, T, causal=False, dtype=q.dtype)[None]  # (1, H, T, T)
        if self.impl == "reference":
            y = attention_reference(q, k, v, mask=mask, scale=self.scale, bias=bias)
        else:
            if bias is not None:  # one float mask: the distance penalty where visible, -inf elsewhere
                mask = bias.masked_fill(~mask, float("-inf"))
            y = attention_sdpa(q, k, v, causal=False, scale=self.scale, mask=mask,
                               dropout_p=self.dropout if self.training else 0.0)
        return self.output(y, x)

    def attend_alone(self, q, k, v) -> torch.Tensor:
        """Attention over one whole sequence starting at position 0 (a packed document by its own call)."""
        return self.attend(q, k, v, q_offset=0)

    def forward(self, x: torch.Tensor, *, positions: torch.Tensor, cache: Optional[KVCache] = None) -> torch.Tensor:
        cp = parallel.active()
        if cp is not None and cache is None:
            return self.forward_context_parallel(x, positions, cp)
        T = x.shape[1]
        x = self.shift(x, cache)
        q, k, v = self.project(x, positions)
        if cache is not None and cache.static:
            return self.output(self.attend_static(q, k, v, positions, cache), x)
        if cache is not None:
            k, v = cache.update(k, v)
        y = self.attend(q, k, v, q_offset=k.shape[2] - T)  # (B, H, T, D)
        return self.output(y, x)

    def attend_static(self, q, k, v, positions: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        """Attention through a `StaticKVCache` (positions (B, T) or (T,)). A chunk that starts every row (a prompt's
        prefill, eager): the mixer's own attention over its keys, then written. Otherwise (a decode step, the
        compiled path; or a chunk continuing a full-attention cache): written first, then every slot read under
        the mask of the position it holds (and ALiBi's distances from those positions)."""
        positions = positions.expand(q.shape[0], -1) if positions.dim() == 1 else positions
        T = q.shape[2]
        if T > 1 and int(positions[:, 0].max()) == 0:
            y = self.attend_alone(q, k, v)
            cache.write(k, v, positions)
            return y
        if T > 1 and not cache.chunks:
            raise ValueError(f"a {type(cache).__name__} continues one token at a time after its prefill")
        cache.write(k, v, positions)
        keys, values, held = cache.keys(positions[:, -1])
        keys, values = keys.to(q.dtype), values.to(q.dtype)
        if cache.lossy:  # a KV format: the chunk's own keys/values as computed, the past as stored
            keys, values = with_chunk(keys, values, held, k, v, positions[:, 0])
        visible = (held[:, None, :] >= 0) & (held[:, None, :] <= positions[:, :, None])  # (B, T, S)
        bias = None
        if self.alibi is not None:
            dist = (positions[:, :, None] - held[:, None, :]).abs().to(q.dtype)
            bias = -self.alibi.to(q.dtype)[None, :, None, None] * dist[:, None]  # (B, H, T, S)
        return static_attention(q, keys, values, visible, bias=bias, scale=self.scale,
                                reference=self.impl == "reference")

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device, kv_format=None) -> KVCache:
        # kv_format (attnzoo.mixers.kv_quant.KVFormat): keys/values stored in bf16 or quantized (KIVI); None: as computed
        return KVCache() if kv_format is None else kv_format.new_cache()

    def new_static_cache(self, batch: int, max_len: int, dtype: torch.dtype, device, kv_format=None) -> StaticKVCache:
        """Keys/values for positions 0 .. max_len - 1 (a sliding window: a ring of W slots, + the sinks); kv_format
        (full attention): stored in bf16 or KIVI's codes (mixers/kv_quant.py), None: as computed."""
        tail = None if self.input_conv is None else self.input_conv.empty_tail(batch, dtype, device)
        if kv_format is not None:
            return kv_format.new_static_cache(batch, self.n_kv_heads, max_len, self.head_dim, dtype, device, tail)
        slots = max_len if self.window is None else self.window
        return StaticKVCache(batch, self.n_kv_heads, slots, self.head_dim, dtype, device, window=self.window,
                             sinks=self.sinks, conv_tail=tail)

    def cache_bytes(self, context_len: int, batch: int = 1, dtype: torch.dtype = torch.float32, kv_format=None) -> int:
        if kv_format is None:
            kv = 2 * self.n_kv_heads * self.head_dim * context_len * batch * dtype_bytes(dtype)
        else:
            kv = kv_format.kv_bytes(context_len, batch, self.n_kv_heads, self.head_dim, dtype)
        return kv + self.input_conv_bytes(batch, dtype)

    @classmethod
    def hf_mixer_config(cls, c: dict, *, qkv_bias: bool, out_bias: bool) -> dict:
        """mha, mqa or gqa by config.json's K/V heads (num_key_value_heads, all / one / some)."""
        kv, h = c.get("num_key_value_heads") or c["num_attention_heads"], c["num_attention_heads"]
        name = "mha" if kv == h else "mqa" if kv == 1 else "gqa"
        return {"name": name, "qkv_bias": qkv_bias, "out_bias": out_bias}

    def layer_shape(self) -> dict:
        out = super().layer_shape()
        if self.q_norm is not None:
            out["qk_norm"] = True
        if self.gate_proj is not None:
            out["output_gate"] = True
        return out

    def flops_per_token(self, context_len: int) -> float:
        # q/k norms and the output gate's sigmoid (like softmax and the other norms) are elementwise: not counted
        proj = self.projection_flops()
        keys = causal_attended(context_len, self.window) if self.causal else float(context_len)
        return proj + 2.0 * 2 * self.n_heads * self.head_dim * keys  # QK^T and PV


def sink_window_attention(q, k, v, *, q_start: int, key_start: Optional[int], window: int, sinks: int,
                          prefix_k=None, prefix_v=None, scale=None, reference: bool = False, dropout_p: float = 0.0):
    """Sliding window with attention sinks. q (B, H, Tq, D) at absolute positions q_start.., k/v (B, Hkv,
    Tk, D) at key_start.. (None: a ring in slot order, every key inside the window: one-token decode);
    prefix keys (sinks that left the window) are visible to every query. One masked SDPA call (O(Tq x Tk)
    scores: the blocked band of sliding_window_sdpa is not used with sinks)."""
    Tq, Tk = q.shape[2], k.shape[2]
    if key_start is None:
        mask = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device)
    else:
        qi = q_start + torch.arange(Tq, device=q.device)[:, None]
        kj = key_start + torch.arange(Tk, device=q.device)[None, :]
        mask = (kj <= qi) & ((kj > qi - window) | (kj < sinks))
    if prefix_k is not None:
        mask = torch.cat([torch.ones(Tq, prefix_k.shape[2], dtype=torch.bool, device=q.device), mask], dim=1)
        k, v = torch.cat([prefix_k.to(k.dtype), k], dim=2), torch.cat([prefix_v.to(v.dtype), v], dim=2)
    if reference:
        return attention_reference(q, k, v, mask=mask, scale=scale)
    return attention_sdpa(q, k, v, causal=False, scale=scale, dropout_p=dropout_p, mask=mask)


def static_attention(q, k, v, visible: torch.Tensor, *, bias=None, scale=None, reference: bool = False) -> torch.Tensor:
    """q (B, H, T, D) over every slot of a static cache k/v (B, Hkv, S, D) where `visible` (B, T, S); bias (B, H,
    T, S) or None. The query heads of a group become query rows of their KV head ((B, Hkv, G*T, D), as in
    decode_sdpa), so the cache is read once, not copied H/Hkv times. Reference: `attention_reference`."""
    if reference:
        return attention_reference(q, k, v, mask=visible[:, None], scale=scale, bias=bias)
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = H // Hkv
    if bias is None:
        mask = visible[:, None, None].expand(B, 1, G, T, S).reshape(B, 1, G * T, S)
    else:
        mask = bias.view(B, Hkv, G, T, S).masked_fill(~visible[:, None, None], float("-inf")).reshape(B, Hkv, G * T, S)
    out = F.scaled_dot_product_attention(q.reshape(B, Hkv, G * T, D), k, v, attn_mask=mask, scale=scale)
    return out.reshape(B, H, T, v.shape[-1])


def decode_sdpa(q, k, v, *, scale: Optional[float] = None, dropout_p: float = 0.0) -> torch.Tensor:
    """One query per head over every held key, no mask: q (B, H, 1, D), k/v (B, Hkv, Tk, D) -> (B, H, 1, D).

    The query heads of a group become query rows of their shared KV head, (B, H, 1, D) -> (B, Hkv, H/Hkv, D),
    so GQA/MQA decoding reads the cache once instead of copying it H/Hkv times (attention_sdpa's expand).
    Reference: `attention_reference` (heads h share KV head h // (H/Hkv), the same grouping).
    """
    B, H, _, D = q.shape
    Hkv = k.shape[1]
    out = F.scaled_dot_product_attention(q.reshape(B, Hkv, H // Hkv, D), k, v, scale=scale, dropout_p=dropout_p)
    return out.reshape(B, H, 1, v.shape[-1])


for _name in ("mha", "gqa", "mqa"):
    register_mixer(_name, AttentionConfig)(Attention)


@register_mixer("sliding_window", SlidingWindowConfig)
class SlidingWindowAttention(Attention):
    """GQA restricted to the last W keys. Prefill: band-masked SDPA in query blocks (O(T * W));
    decode: a `SlidingWindowCache` ring buffer that never holds more than W tokens."""

    kernel_family = "window"
    hf_layer = HF_SLIDING_ATTENTION  # Mistral, Mixtral with a window

    def __init__(self, cfg: SlidingWindowConfig, model_cfg, layer_idx: int):
        super().__init__(cfg, model_cfg, layer_idx)
        self.window = cfg.window
        self.sinks = cfg.sink_tokens

    def forward(self, x: torch.Tensor, *, positions: torch.Tensor, cache: Optional[SlidingWindowCache] = None):
        static = cache is not None and cache.static  # Attention.attend_static: the ring and sinks by their mask
        if not self.sinks or static or (cache is None and parallel.active() is not None):
            return super().forward(x, positions=positions, cache=cache)
        # with attention sinks (Xiao et al. 2023, StreamingLLM): key j is visible to query i when
        # i - W < j <= i (the window) or j < sinks (a sink); the cache keeps the sinks beside the ring
        x = self.shift(x, cache)
        q, k, v = self.project(x, positions)
        q_start = int(positions.reshape(-1)[0]) if positions.numel() else 0
        pk = pv = None
        key_start = q_start
        if cache is not None:
            k, v, key_start, pk, pv = cache.update_with_sinks(k, v)
        return self.output(self.sink_attention(q, k, v, q_start, key_start, pk, pv), x)

    def sink_attention(self, q, k, v, q_start: int, key_start: Optional[int], prefix_k=None, prefix_v=None):
        return sink_window_attention(q, k, v, q_start=q_start, key_start=key_start, window=self.window, sinks=self.sinks,
                                     prefix_k=prefix_k, prefix_v=prefix_v, scale=self.scale,
                                     reference=self.impl == "reference", dropout_p=self.dropout if self.training else 0.0)

    def attend_alone(self, q, k, v) -> torch.Tensor:
        return self.sink_attention(q, k, v, 0, 0) if self.sinks else super().attend_alone(q, k, v)

    def dispatch_family(self) -> str:
        # sinks run their own masked forward; flex has no dropout, and Inductor compiles it for head sizes >= 16 only
        return "other" if self.sinks or self.dropout or self.head_dim < FLEX_MIN_HEAD_DIM else self.kernel_family

    @classmethod
    def hf_mixer_config(cls, c: dict, *, window: int, qkv_bias: bool, out_bias: bool) -> dict:
        return {"name": "sliding_window", "window": int(window), "qkv_bias": qkv_bias, "out_bias": out_bias}

    def attend(self, q, k, v, q_offset: int) -> torch.Tensor:
        if self.impl == "reference" or (q.shape[2] == 1 and k.shape[2] <= self.window):
            # decode over the ring (slot order, at most W keys, all inside the window): no band needed
            return super().attend(q, k, v, q_offset)
        dropout_p = self.dropout if self.training else 0.0
        if q.shape[2] == k.shape[2] and mixer_kernel(self, q) == "flex":
            # CUDA with flex_attention (ops/dispatch.py): the band as a block mask, only its tiles computed
            from attnzoo.ops.flex import flex_sliding_window

            return flex_sliding_window(q, k, v, window=self.window, scale=self.scale)
        return sliding_window_sdpa(q, k, v, window=self.window, scale=self.scale, dropout_p=dropout_p)

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device) -> SlidingWindowCache:
        return SlidingWindowCache(self.window, self.sinks)

    def cache_bytes(self, context_len: int, batch: int = 1, dtype: torch.dtype = torch.float32) -> int:
        # ring (at most W tokens) + the sink copies (at most `sinks` tokens) + conv tail: flat in the context
        return super().cache_bytes(min(context_len, self.window) + min(context_len, self.sinks), batch, dtype)

    def flops_per_token(self, context_len: int) -> float:
        flops = super().flops_per_token(context_len)
        if self.sinks:  # sink keys outside the window: min(sinks, t - W) at position t, averaged over 1..L
            L, W, S = context_len, self.window, self.sinks
            extra = sum(min(S, max(0, t - W)) for t in range(1, L + 1)) / L
            flops += 2.0 * 2 * self.n_heads * self.head_dim * extra
        return flops
