"""Shared plumbing of the recurrent mixers (linear attention, DeltaNet, Gated DeltaNet):

    x -> qkv projection -> [short causal conv + activation] -> split q, k, v -> (subclass) recurrence
      -> [per-head RMSNorm] -> [* SiLU(output gate)] -> output projection

and the fixed-size `RecurrentStateCache` (state + conv tail). Subclasses set the head sizes and implement
`mix()`, which prepares its q / k / v (and gates) and calls `recur()`: the one ladder that picks the form of
the recurrence for the mode (one-token step, the reference recurrence, fla's kernel, the chunkwise form, or a
context-parallel scan), each form a subclass method over the ops in `ops/`. Not a mixer itself (no
registration).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from attnzoo.distributed import context_parallel as parallel
from attnzoo.layers.kv_cache import LayerCache
from attnzoo.ops.dispatch import FLA_MAX_KEY_DIM, compute_dtype, mixer_kernel
from attnzoo.ops.packing import masked_conv
from attnzoo.mixers.base import Mixer, dtype_bytes
from attnzoo.mixers.short_conv import ShortConvolution


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


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (the form fla and transformers' Qwen3-Next use)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The recurrent state accumulates over the whole context: never below fp32 (fp64 stays fp64)."""
    return torch.promote_types(dtype, torch.float32)


def upcast(x: torch.Tensor) -> torch.Tensor:
    return x.to(state_dtype(x.dtype))


class GatedRMSNorm(nn.Module):
    """Per-head output norm: y = x / sqrt(mean(x^2) + eps) * weight, then * act(gate) when a gate is given:
    silu (the gated RMSNorm of Gated DeltaNet / Qwen3-Next's RMSNormGated) or sigmoid (Kimi Linear's). >= fp32."""

    def __init__(self, dim: int, eps: float = 1e-6, activation: str = "silu"):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.act = torch.sigmoid if activation == "sigmoid" else F.silu

    def forward(self, x: torch.Tensor, gate: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = upcast(x)
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.to(x.dtype)
        return y if gate is None else y * self.act(upcast(gate))


class RecurrentMixer(Mixer):
    """Subclasses call `build(...)` from __init__, implement `mix(q, k, v, x, state, mode)` through `recur`, and
    the forms of their recurrence: `step_op`, `recurrent_op`, `chunk_op`, `fla_op`."""

    kernel_family = "linear"
    linearize_target = True  # a fixed-size state that linearize can distil an attention layer into

    def build(
        self,
        *,
        n_qk_heads: int,
        n_v_heads: int,
        qk_dim: int,
        v_dim: int,
        state_shape: tuple[int, int],
        conv_size: int,
        conv_bias: bool,
        activation: str,
        output_norm: bool,
        output_gate: bool,
        norm_eps: float,
    ) -> None:
        self.n_qk_heads, self.n_v_heads, self.qk_dim, self.v_dim = n_qk_heads, n_v_heads, qk_dim, v_dim
        self.state_shape = state_shape  # per value head (Dk_state, Dv_state)
        self.activation = activation
        self.qkv_dims = [n_qk_heads * qk_dim, n_qk_heads * qk_dim, n_v_heads * v_dim]
        self.qkv = nn.Linear(self.d_model, sum(self.qkv_dims), bias=False)  # fused [q | k | v]
        self.conv = ShortConvolution(sum(self.qkv_dims), conv_size, conv_bias, None) if conv_size > 0 else None
        self.norm = GatedRMSNorm(v_dim, norm_eps) if output_norm else None
        self.g_proj = nn.Linear(self.d_model, n_v_heads * v_dim, bias=False) if output_gate else None
        self.o_proj = nn.Linear(n_v_heads * v_dim, self.d_model, bias=False)

    def dispatch_family(self) -> str:
        # fla's chunk kernels take key / feature sizes up to FLA_MAX_KEY_DIM
        return "other" if max(self.state_shape[0], self.qk_dim) > FLA_MAX_KEY_DIM else self.kernel_family

    # ------------------------------------------------------------------ forward
    def mix(self, q, k, v, x, state: Optional[torch.Tensor], mode: str, resets: Optional[torch.Tensor] = None):
        """q, k (B, T, Hqk, Dqk), v (B, T, Hv, Dv) in >= fp32; x the mixer input (B, T, d_model);
        state (B, Hv, *state_shape) or None; mode "reference" | "chunk" | "step" | "cp" (this rank's tokens
        of a context-parallel split: run the op through `parallel.active().scan`, returning state None);
        resets (B, T / chunk_size) bool, chunk mode only: the state is zero entering the marked chunks.
        Returns o (B, T, Hv, Dv) and the final state."""
        raise NotImplementedError

    # the forms of the recurrence (subclass), on q, k (B, H, T, Dk), v (B, H, T, Dv) and the subclass's own per-token
    # inputs (B, H, T, ...) or None, each returning (o (B, H, T, Dv), final state (B, H, Dk, Dv)); `step_op` on one
    # token (the time dim dropped) returns o (B, H, Dv)
    def step_op(self, q, k, v, *inputs, state):
        raise NotImplementedError

    def recurrent_op(self, q, k, v, *inputs, state):
        """The per-token recurrence (the reference)."""
        raise NotImplementedError

    def chunk_op(self, q, k, v, *inputs, state, resets=None):
        """The chunkwise-parallel form; `resets` (B, T / chunk_size): the state is zero entering the marked chunks."""
        raise NotImplementedError

    def fla_op(self, q, k, v, *inputs, state, dtype: torch.dtype):
        """fla's chunk kernel computing in `dtype` (ops/fla_kernels.py; CUDA only)."""
        raise NotImplementedError

    def recur(self, mode: str, x: torch.Tensor, state: Optional[torch.Tensor], resets: Optional[torch.Tensor],
              q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *inputs: Optional[torch.Tensor]):
        """The recurrence over q, k, v and `inputs` (time at dim 2) in the form `mode` asks (see `mix`): the
        one-token step; this rank's tokens of a context-parallel split (the reference or chunkwise form per shard,
        from the states passed in: state None); the reference recurrence; fla's kernel where ops/dispatch.py picks
        it for x (not with `resets`); else the chunkwise form. Returns (o (B, H, T, Dv), final state)."""
        if mode == "step":
            o, state = self.step_op(*(t if t is None else t[:, :, 0] for t in (q, k, v, *inputs)), state=state)
            return o[:, :, None], state
        if mode == "cp":
            op = self.recurrent_op if self.impl == "reference" else self.chunk_op
            run = lambda v_, s0, q_, k_, *rest: op(q_, k_, v_, *rest, state=s0)  # noqa: E731
            return parallel.active().scan(run, v, q, k, *inputs), None
        if mode == "reference":
            return self.recurrent_op(q, k, v, *inputs, state=state)
        if resets is None and mixer_kernel(self, x) == "fla":  # CUDA + fla-core + triton, fp16/bf16 (ops/dispatch.py)
            return self.fla_op(q, k, v, *inputs, state=state, dtype=compute_dtype(x))
        return self.chunk_op(q, k, v, *inputs, state=state, resets=resets)

    def _heads(self, qkv: torch.Tensor):
        """The (conv-ed) fused projection -> q, k (B, T, Hqk, Dqk), v (B, T, Hv, Dv) in >= fp32."""
        B, T, _ = qkv.shape
        if self.activation == "silu":
            qkv = F.silu(qkv)
        q, k, v = upcast(qkv).split(self.qkv_dims, dim=-1)
        return (q.reshape(B, T, self.n_qk_heads, self.qk_dim), k.reshape(B, T, self.n_qk_heads, self.qk_dim),
                v.reshape(B, T, self.n_v_heads, self.v_dim))

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        """Position information on q, k (B, T, H, D) at `positions` ((T,) or (B, T) absolute positions) before the
        recurrence: none by default (the decay orders the tokens); RetNet rotates them (RoPE)."""
        return q, k

    def _output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o (B, T, Hv, Dv) -> [norm, gate] -> o_proj -> (B, T, d_model) in x's dtype."""
        B, T, _ = x.shape
        gate = None if self.g_proj is None else self.g_proj(x).reshape(B, T, self.n_v_heads, self.v_dim)
        if self.norm is not None:
            o = self.norm(o, gate)
        elif gate is not None:
            o = o * F.silu(upcast(gate))
        return self.o_proj(o.reshape(B, T, -1).to(x.dtype))

    def form(self, cp, cache, T: int) -> str:
        """Which form a call runs: "cp" (context-parallel state passing), "reference" (impl=reference: the per-token
        recurrence), "step" (a one-token decode with a cache) or "chunk" (the chunkwise-parallel form)."""
        if cp is not None:
            return "cp"
        if self.impl == "reference":
            return "reference"
        return "step" if (cache is not None and T == 1) else "chunk"

    def forward(self, x: torch.Tensor, *, positions: torch.Tensor, cache: Optional[RecurrentStateCache] = None):
        T = x.shape[1]
        qkv = self.qkv(x)
        cp = parallel.active() if cache is None else None  # context parallel (parallel.py): state passing
        if cp is not None:
            qkv = qkv if self.conv is None else cp.conv(self.conv, qkv)
        elif self.conv is not None:
            qkv, tail = self.conv(qkv, None if cache is None else cache.conv_tail)
            if cache is not None:
                cache.store("conv_tail", tail)
        q, k, v = self._heads(qkv)
        q, k = self.rotate(q, k, positions)
        mode = self.form(cp, cache, T)
        o, state = self.mix(q, k, v, x, None if cache is None else cache.state, mode)
        if cache is not None:
            cache.store("state", state)
            cache.tick(T)
        return self._output(o, x)

    packing = "native"  # the conv masked at document starts, the recurrence from a zero state per document

    def forward_packed(self, x: torch.Tensor, *, positions: torch.Tensor, documents) -> torch.Tensor:
        """Packed documents (packing.py): projections, gates and output over the packed tokens; the short conv
        never reads the previous document; the recurrence starts every document from a zero state: the chunked form
        runs once over the documents laid out chunk-aligned (packing.Documents.chunk_layout: < one chunk of zeros
        per document) with the state reset entering each document's first chunk; the reference form runs each
        document by its own call. Outputs are put back in the packed layout."""
        qkv = self.qkv(x)
        if self.conv is not None:
            qkv = masked_conv(self.conv, qkv, documents.positions())
        q, k, v = self._heads(qkv)
        q, k = self.rotate(q, k, positions)
        if self.impl == "reference":  # the per-token recurrence, each document by its own call
            o = documents.per_document(lambda *a: self.mix(*a, None, "reference")[0], q, k, v, x)
        else:  # one call: documents chunk-aligned in their rows, the state zeroed entering each one's first chunk
            C = self.chunk_size
            _, resets, _ = documents.chunk_layout(C)
            o = self.mix(*(documents.to_chunks(t, C) for t in (q, k, v, x)), None, "chunk", resets=resets)[0]
            o = documents.from_chunks(o, C)
        return self._output(o, x)

    # ------------------------------------------------------------------ cache and accounting
    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device) -> RecurrentStateCache:
        state = torch.zeros(batch, self.n_v_heads, *self.state_shape, dtype=state_dtype(dtype), device=device)
        tail = None if self.conv is None else self.conv.empty_tail(batch, dtype, device)
        return RecurrentStateCache(state, tail)

    def new_static_cache(self, batch: int, max_len: int, dtype: torch.dtype, device) -> RecurrentStateCache:
        """The same fixed-size cache, written in place (`LayerCache.store`)."""
        cache = self.new_cache(batch, max_len, dtype, device)
        cache.static = True
        return cache

    def cache_bytes(self, context_len: int, batch: int = 1, dtype: torch.dtype = torch.float32) -> int:
        """n_v_heads * Dk * Dv state values (>= fp32) + channels * (K-1) conv-tail values: constant in context."""
        dk, dv = self.state_shape
        state = self.n_v_heads * dk * dv * dtype_bytes(state_dtype(dtype))
        tail = 0 if self.conv is None else self.conv.channels * (self.conv.kernel_size - 1) * dtype_bytes(dtype)
        return batch * (state + tail)

    def op_flops_per_token(self, context_len: int) -> float:
        """FLOPs per token of the recurrence itself (subclass: from its chunk algorithm)."""
        raise NotImplementedError

    def flops_per_token(self, context_len: int) -> float:
        linears = [m for m in self.modules() if isinstance(m, nn.Linear)]
        total = sum(2.0 * m.in_features * m.out_features for m in linears)
        if self.conv is not None:
            total += self.conv.flops_per_token()
        return total + self.op_flops_per_token(context_len)
