"""Forgetting Attention (`fox`; Lin et al. 2025, "Forgetting Transformer: Softmax Attention with a Forget Gate",
ICLR 2025, arXiv:2503.02130): the softmax attention of attention.py with a forget gate per head and token,

    f_t = sigmoid(x_t W_f + b_f)  (W_f: d_model -> n_heads, `f_proj`),   s_ij = scale q_i . k_j + sum_{j<l<=i} log f_l

(ops/forgetting_attention.py). A key fades by the product of the gates written after it, so the layer can forget
the way a gated recurrence does while keeping softmax attention's exact retrieval. The paper's FoX has no RoPE
(`use_rope=false`: the forget gate is the position signal); its "Pro" block adds an output gate, q/k norms and a
key/value shift, offered here as `output_gate`, `qk_norm` and the input conv `conv_size` (which shifts the whole
input, not k and v only). The gate bias starts at zero (the paper's default, `fgate_bias_init=False`: f = 1/2 at
init for a zero input); `decay_time_range` starts each head's gate at a chosen memory instead (below).

The cache keeps every key's log forget gate beside its key and value (a KV cache plus n_heads numbers per token),
and each call sums them from the first key, as the full forward does. Packing is native (a document mask: the sum
between two tokens of one document never crosses its start). No ring form (context parallelism is refused), no KV
formats, no transformers counterpart. Where ops/dispatch.py picks fla (family "forgetting": CUDA, or a CPU under
Triton's interpreter) a call without a cache or mask (training, a prefill into an empty cache) runs fla's
`parallel_forgetting_attn` (tested equal under the interpreter); elsewhere SDPA under the (B, H, T, T) float bias.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from attnzoo.config.registry import register_mixer
from attnzoo.mixers.attention import Attention, static_attention
from attnzoo.mixers.attention_cache import KVCache, StaticKVCache
from attnzoo.mixers.base import dtype_bytes
from attnzoo.mixers.configs import ForgettingAttentionConfig
from attnzoo.ops import dispatch
from attnzoo.ops.forgetting_attention import (at_least_fp32, forgetting_attention, forgetting_attention_reference,
                                              static_forget_bias)


class ForgettingCache(KVCache):
    """A `KVCache` plus the log forget gate of every cached token: log_f (B, n_heads, T), fp32 (fp64 for fp64)."""

    def __init__(self) -> None:
        super().__init__()
        self.log_f: Optional[torch.Tensor] = None

    def update_gates(self, log_f: torch.Tensor) -> torch.Tensor:
        """Append the new tokens' (B, H, t) log gates; return every token's so far."""
        self.log_f = log_f if self.log_f is None else torch.cat([self.log_f, log_f.to(self.log_f.dtype)], dim=-1)
        return self.log_f


class StaticForgettingCache(StaticKVCache):
    """The static form (layers/kv_cache.StaticModelCache): a full-attention `StaticKVCache` (slot s holds position s)
    plus log_f (B, n_heads, S), each position's log forget gate, written in place."""

    def __init__(self, batch: int, n_kv_heads: int, n_heads: int, slots: int, head_dim: int, dtype: torch.dtype,
                 device, conv_tail: Optional[torch.Tensor] = None) -> None:
        super().__init__(batch, n_kv_heads, slots, head_dim, dtype, device, conv_tail=conv_tail)
        self.log_f = torch.zeros(batch, n_heads, slots, dtype=at_least_fp32(dtype), device=device)

    def write_gates(self, log_f: torch.Tensor, positions: torch.Tensor) -> None:
        """(B, H, T) log gates at `positions` (B, T), each into its slot."""
        rows = torch.arange(log_f.shape[0], device=log_f.device)[:, None]
        self.log_f[rows, :, positions] = log_f.transpose(1, 2).to(self.log_f.dtype)

    def filled_bytes(self, lengths: torch.Tensor) -> int:
        per_slot = self.log_f.shape[1] * self.log_f.element_size()
        return super().filled_bytes(lengths) + per_slot * int(lengths.clamp(max=self.log_f.shape[2]).sum())


@register_mixer("fox", ForgettingAttentionConfig)
class ForgettingAttention(Attention):
    kernel_family = "forgetting"  # fla's parallel_forgetting_attn where dispatch picks fla, else SDPA under the bias
    linearize_source = False
    hf_layer = None
    hf_missing = "transformers has no Forgetting Transformer counterpart (no FoX layer)"
    packing = "native"  # a document mask over the same bias

    def __init__(self, cfg: ForgettingAttentionConfig, model_cfg, layer_idx: int):
        super().__init__(cfg, model_cfg, layer_idx)
        if not cfg.use_rope:
            self.rope = None
        self.f_proj = nn.Linear(self.d_model, self.n_heads, bias=False)
        # the gate's bias, a parameter of its own (the model's init zeroes every nn.Linear bias): zero, as the paper's
        # data-dependent gate; with `decay_time_range` [t_min, t_max] head h starts at f = exp(-1 / t_h), t_h
        # log-spaced over the heads (the paper's init of its data-independent gates, `fgate_bias_init`)
        self.f_bias = nn.Parameter(torch.zeros(self.n_heads))
        if cfg.decay_time_range is not None:
            lo, hi = cfg.decay_time_range
            with torch.no_grad():
                t = torch.exp(torch.linspace(math.log(lo), math.log(hi), self.n_heads))
                self.f_bias.copy_(-torch.log(torch.expm1(1.0 / t)))  # sigmoid(b) = exp(-1 / t)
        self.f_bias._no_weight_decay = True

    def log_forget(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, d_model) -> (B, H, T) log f = logsigmoid(x W_f + b_f), in at least fp32."""
        g = self.f_proj(x) + self.f_bias.to(x.dtype)
        return F.logsigmoid(g.to(at_least_fp32(g.dtype))).transpose(1, 2)

    def forget_attend(self, q, k, v, log_f, mask=None) -> torch.Tensor:
        if self.impl == "reference":
            return forgetting_attention_reference(q, k, v, log_f, scale=self.scale, mask=mask)
        if mask is None and q.shape[2] == k.shape[2] and not (self.training and self.dropout) \
                and dispatch.mixer_kernel(self, q) == "fla":  # fla's kernel: no cache, no mask, no dropout
            from attnzoo.ops.fla_kernels import fla_forgetting_attention  # fla / triton: where fla runs only

            return fla_forgetting_attention(q, k, v, log_f, scale=self.scale, dtype=dispatch.compute_dtype(q))
        return forgetting_attention(q, k, v, log_f, scale=self.scale, mask=mask,
                                    dropout_p=self.dropout if self.training else 0.0)

    def forward(self, x: torch.Tensor, *, positions: torch.Tensor, cache: Optional[ForgettingCache] = None):
        x = self.shift(x, cache)
        q, k, v = self.project(x, positions)
        log_f = self.log_forget(x)
        if cache is not None and cache.static:
            return self.output(self.forget_attend_static(q, k, v, log_f, positions, cache), x)
        if cache is not None:
            k, v = cache.update(k, v)
            log_f = cache.update_gates(log_f)
        return self.output(self.forget_attend(q, k, v, log_f), x)

    def forget_attend_static(self, q, k, v, log_f, positions: torch.Tensor, cache: StaticForgettingCache):
        """Through the static cache: the chunk's keys, values and gates written at their positions, then every slot
        read under the bias of its position (the compiled decode step: no Python number changes per token)."""
        positions = positions.expand(q.shape[0], -1) if positions.dim() == 1 else positions
        cache.write(k, v, positions)
        cache.write_gates(log_f, positions)
        reference = self.impl == "reference"
        bias = static_forget_bias(cache.log_f, positions, reference=reference)
        visible = bias[:, 0] > float("-inf")  # (B, T, S): slot s <= the query's position
        return static_attention(q, cache.k.to(q.dtype), cache.v.to(q.dtype), visible, bias=bias.to(q.dtype),
                                scale=self.scale, reference=reference)

    def forward_packed(self, x: torch.Tensor, *, positions: torch.Tensor, documents) -> torch.Tensor:
        """Every document of a packed row under its document mask: the sum of log gates between two tokens of one
        document reads that document's gates only, so one cumulative sum over the row serves all of them."""
        x = self.shift_packed(x, documents)
        q, k, v = self.project(x, positions)
        return self.output(self.forget_attend(q, k, v, self.log_forget(x), mask=documents.mask(causal=True)), x)

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device) -> ForgettingCache:
        return ForgettingCache()

    def new_static_cache(self, batch: int, max_len: int, dtype: torch.dtype, device) -> StaticForgettingCache:
        tail = None if self.input_conv is None else self.input_conv.empty_tail(batch, dtype, device)
        return StaticForgettingCache(batch, self.n_kv_heads, self.n_heads, max_len, self.head_dim, dtype, device, tail)

    def cache_bytes(self, context_len: int, batch: int = 1, dtype: torch.dtype = torch.float32) -> int:
        gates = batch * self.n_heads * context_len * dtype_bytes(at_least_fp32(dtype))
        return super().cache_bytes(context_len, batch, dtype) + gates

    def projection_flops(self) -> float:
        return super().projection_flops() + 2.0 * self.f_proj.in_features * self.f_proj.out_features

    def layer_shape(self) -> dict:
        out = super().layer_shape()
        out["forget_gate"] = "per head"
        out["rope"] = self.rope is not None
        return out
