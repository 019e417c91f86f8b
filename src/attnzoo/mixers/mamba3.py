"""Mamba-3 (Lahoti, Li, Chen, Wang, Bick, Kolter, Dao & Gu 2026, "Mamba-3: Improved Sequence Modeling using State
Space Principles", arXiv:2603.15569), the layer as mamba_ssm's `Mamba3` (mamba_ssm/modules/mamba3.py) builds it:

    [z | x | B | C | dt_raw | A_raw | lambda_raw | theta] = in_proj(u)          (no conv, no activation on x, B, C)
    dt = softplus(dt_raw + dt_bias),  A = -max(softplus(A_raw), A_floor),  lambda = sigmoid(lambda_raw)   (per head)
    B~ = RMSNorm(B) + B_bias,  C~ = RMSNorm(C) + C_bias                       (norm per group, bias per head, init 1)
    psi = dt * pi tanh(theta)                                                  (angles per head, theta shared by heads)
    h_t = e^{dt_t A_t - i psi_t} (h_{t-1} + (1 - lambda_t) dt_t B~_{t-1} x_{t-1}^T) + lambda_t dt_t B~_t x_t^T
    y_t = Re(conj(C~_t)^T h_t) + D x_t,   out = out_proj(y * silu(z))          ([RMSNorm(y)] * silu(z) with use_output_norm)

- (a) exponential-trapezoidal discretisation: the state's input integral is the trapezoid between the previous and
  the current token (weights (1 - lambda) dt, decayed with the state, and lambda dt), lambda data-dependent; it
  replaces Mamba-2's short conv (lambda = 1, `trapezoid: false`, is Mamba-2's exponential-Euler rule);
- (b) complex state: the first `rope_fraction` of the state's channels, in pairs, are complex numbers turned by psi_t
  per token (a data-dependent rotation; `rope_fraction: 0` a real state). The reference runs it in complex numbers,
  the chunkwise form as the paper's "RoPE trick" (C and B rotated by the cumulative angle) and decode in real pairs;
- (c) MIMO (`mimo_rank` R > 1): B and C carry R vectors per group, x and z are scaled per rank (x_r = x * mimo_x_r,
  z_r = z * mimo_z_r), the state sums the R outer products, each rank is read and gated, and the ranks are summed with
  weights mimo_o (init 1/R, 1, 1/R); R = 1 (SISO) has none of these;
- plus B / C RMSNorm and their per-head biases (init 1), the data-dependent A (no A_log), D = 1.

The op (all three forms) is ops/trapezoidal_ssd.py. The cache holds the state, the last token's B~ and x (what the
next token's trapezoid term reads) and the conv tail when a conv is configured: constant in the context. Packing:
every document starts from a zero state, and the trapezoid term of a document's first token is zero (it never reads
the previous document's last token). No context-parallel form (refused in one line by the config checks).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from attnzoo.config.registry import register_mixer
from attnzoo.mixers.base import dtype_bytes
from attnzoo.mixers.configs import Mamba3Config
from attnzoo.mixers.mamba2 import dt_bias_init
from attnzoo.mixers.recurrent_base import (GatedRMSNorm, RecurrentMixer, RecurrentStateCache, state_dtype,
                                           upcast)
from attnzoo.ops.packing import masked_conv
from attnzoo.ops.trapezoidal_ssd import chunk_trapezoidal_ssd, trapezoidal_ssd_recurrent, trapezoidal_ssd_step


class Mamba3StateCache(RecurrentStateCache):
    """Mamba-3's cache, constant in the context, all but the conv tail in >= fp32: the state (B, H, N, P), the last
    token's normalised, biased B (`k_prev`, (B, H, R, N), unrotated) and its x (`x_prev`, (B, H, P)), and the conv
    tail (B, C, K-1) in the cache dtype (None without a conv)."""

    def __init__(self, state: torch.Tensor, k_prev: torch.Tensor, x_prev: torch.Tensor,
                 conv_tail: Optional[torch.Tensor] = None) -> None:
        super().__init__(state, conv_tail)
        self.k_prev, self.x_prev = k_prev, x_prev


@register_mixer("mamba3", Mamba3Config)
class Mamba3(RecurrentMixer):
    kernel_family = "other"  # fla-core has no Mamba-3 op: the torch chunkwise form on every device
    hf_missing = "transformers has no Mamba-3 counterpart (mamba_ssm's and fla's layers run CUDA kernels only)"
    # B / C shared over groups of heads, a trapezoid over two tokens, a rotating state: no attention's q/k/v to seed
    linearize_target = False

    def __init__(self, cfg: Mamba3Config, model_cfg, layer_idx: int):
        super().__init__(cfg, model_cfg, layer_idx)
        H, P, N = cfg.sizes(model_cfg)
        G, R = cfg.n_groups, cfg.mimo_rank
        self.n_groups, self.mimo_rank, self.n_angles = G, R, cfg.n_angles()
        self.chunk_size = cfg.chunk_size
        # qkv = [C | B | x] (each of C, B laid out (rank, group, N) as mamba_ssm's), no activation; z is g_proj
        self.build(n_qk_heads=R * G, n_v_heads=H, qk_dim=N, v_dim=P, state_shape=(N, P), conv_size=cfg.conv_size,
                   conv_bias=cfg.conv_bias, activation="none", output_norm=cfg.use_output_norm, output_gate=True,
                   norm_eps=cfg.norm_eps)
        d = self.d_model
        self.dt_proj = nn.Linear(d, H, bias=False)  # in_proj's dd_dt slice
        self.a_proj = nn.Linear(d, H, bias=False)  # dd_A: the data-dependent A
        self.trap_proj = nn.Linear(d, H, bias=False) if cfg.trapezoid else None  # lambda's logit
        self.angle_proj = nn.Linear(d, self.n_angles, bias=False) if self.n_angles else None  # theta, all heads
        self.dt_bias = nn.Parameter(dt_bias_init(H, cfg.dt_init_range, cfg.dt_init_floor))
        self.B_norm, self.C_norm = GatedRMSNorm(N, cfg.norm_eps), GatedRMSNorm(N, cfg.norm_eps)
        self.B_bias, self.C_bias = nn.Parameter(torch.ones(H, R, N)), nn.Parameter(torch.ones(H, R, N))
        self.D = nn.Parameter(torch.ones(H))  # the skip y += D x
        self.mimo_x = self.mimo_z = self.mimo_o = None
        if R > 1:  # mamba_ssm's MIMO init: x and the output averaged over the ranks, z as is
            self.mimo_x = nn.Parameter(torch.full((H, R, P), 1.0 / R))
            self.mimo_z = nn.Parameter(torch.ones(H, R, P))
            self.mimo_o = nn.Parameter(torch.full((H, R, P), 1.0 / R))
        # mamba_ssm exempts dt_bias and D; B / C biases and the MIMO scales are biases / per-channel scales here too
        for p in (self.dt_bias, self.D, self.B_bias, self.C_bias, self.mimo_x, self.mimo_z, self.mimo_o):
            if p is not None:
                p._no_weight_decay = True

    # ------------------------------------------------------------------ the op's inputs, time second
    def features(self, qkv: torch.Tensor, x: torch.Tensor):
        """The (conv-ed) projection and the mixer input (B, T, d_model) -> C~, B~ (B, T, H, R, N), x (B, T, H, P),
        log-decay dt A, the trapezoid's weights lambda dt and (1 - lambda) dt (B, T, H), angles psi (B, T, H, A),
        all in >= fp32."""
        B, T, _ = qkv.shape
        H, P, (N, R, G) = self.n_v_heads, self.v_dim, (self.qk_dim, self.mimo_rank, self.n_groups)
        c, b, xs = upcast(qkv).split(self.qkv_dims, dim=-1)

        def per_head(t, norm, bias):  # (B, T, R G N) -> normalised per group, to heads, + the head's bias
            t = norm(t.reshape(B, T, R, G, N)).repeat_interleave(H // G, dim=3)  # head h reads group h // (H / G)
            return t.transpose(2, 3) + bias.to(t.dtype)

        q, k = per_head(c, self.C_norm, self.C_bias), per_head(b, self.B_norm, self.B_bias)
        # softplus as logaddexp(., 0), the same function: F.softplus's backward here made torch.compile's backward
        # view a non-contiguous gradient (the failure tests/test_bench.py COMPILE_XFAIL lists for gated_deltanet)
        dt = torch.logaddexp(upcast(self.dt_proj(x)) + self.dt_bias.to(q.dtype), q.new_zeros(()))  # (B, T, H)
        A = -F.softplus(upcast(self.a_proj(x))).clamp(min=self.cfg.A_floor)
        lam = torch.ones_like(dt) if self.trap_proj is None else torch.sigmoid(upcast(self.trap_proj(x)))
        if self.angle_proj is None:
            psi = dt.new_zeros(B, T, H, 0)
        else:
            psi = dt[..., None] * (math.pi * torch.tanh(upcast(self.angle_proj(x))))[:, :, None, :]
        return q, k, xs.reshape(B, T, H, P), dt * A, lam * dt, (1 - lam) * dt, psi

    def values(self, xs: torch.Tensor) -> torch.Tensor:
        """x (..., H, P) -> the R values per head (..., H, R, P): x itself (SISO), x * mimo_x_r (MIMO)."""
        v = xs.unsqueeze(-2)
        return v if self.mimo_x is None else v * self.mimo_x.to(v.dtype)

    def run(self, mode: str, q, k, v, g, gamma, w, psi, state, resets=None):
        """The op (ops/trapezoidal_ssd.py) on time-second inputs in the form `mode` asks: "step" (one token, from the
        cache), "reference" (the complex recurrence) or "chunk" -> (y (B, T, H, R, P), final state, heads-first)."""
        seq = [t.transpose(1, 2) for t in (q, k, v, g, gamma, w, psi)]  # heads-first
        if mode == "step":
            y, state = trapezoidal_ssd_step(*(t[:, :, 0] for t in seq), state)
            return y[:, None], state
        if mode == "reference":
            y, state = trapezoidal_ssd_recurrent(*seq, state)
        else:
            y, state = chunk_trapezoidal_ssd(*seq, state, self.chunk_size, resets)
        return y.transpose(1, 2), state

    def _output(self, y: torch.Tensor, v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y, v (B, T, H, R, P) -> + D v -> [RMSNorm per head] * silu(z_r) -> sum of the ranks (weights mimo_o)
        -> o_proj -> (B, T, d_model) in x's dtype."""
        B, T, _ = x.shape
        y = y + self.D.to(y.dtype)[:, None, None] * v
        z = upcast(self.g_proj(x)).reshape(B, T, self.n_v_heads, 1, self.v_dim)
        if self.mimo_z is not None:
            z = z * self.mimo_z.to(z.dtype)
        y = self.norm(y, z) if self.norm is not None else y * F.silu(z)
        y = y[..., 0, :] if self.mimo_o is None else (y * self.mimo_o.to(y.dtype)).sum(-2)
        return self.o_proj(y.reshape(B, T, -1).to(x.dtype))

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, *, positions: torch.Tensor, cache: Optional[Mamba3StateCache] = None):
        T = x.shape[1]
        qkv = self.qkv(x)
        if self.conv is not None:
            qkv, tail = self.conv(qkv, None if cache is None else cache.conv_tail)
            if cache is not None:
                cache.store("conv_tail", tail)
        q, k, xs, g, gamma, w, psi = self.features(qkv, x)
        v = self.values(xs)
        state = None if cache is None else (cache.state, cache.k_prev, self.values(cache.x_prev))
        mode = "reference" if self.impl == "reference" else ("step" if cache is not None and T == 1 else "chunk")
        y, (S, k_last, _) = self.run(mode, q, k, v, g, gamma, w, psi, state)
        if cache is not None:
            cache.store("state", S)
            cache.store("k_prev", k_last)
            cache.store("x_prev", xs[:, -1])
            cache.tick(T)
        return self._output(y, v, x)

    def forward_packed(self, x: torch.Tensor, *, positions: torch.Tensor, documents) -> torch.Tensor:
        """Packed documents (packing.py): the conv (if any) never reads the previous document; a document's first
        token has no trapezoid term (w = 0 there, as at a sequence start); the state starts from zero in every
        document: chunk-aligned with resets (chunked form) or each document by its own call (reference form)."""
        qkv = self.qkv(x)
        if self.conv is not None:
            qkv = masked_conv(self.conv, qkv, documents.positions())
        q, k, xs, g, gamma, w, psi = self.features(qkv, x)
        w = w * (~documents.starts)[..., None].to(w.dtype)
        v = self.values(xs)
        seq = (q, k, v, g, gamma, w, psi)
        if self.impl == "reference":  # the complex recurrence, each document by its own call
            y = documents.per_document(lambda *t: self.run("reference", *t, None)[0], *seq)
        else:  # one call: documents chunk-aligned in their rows, the state zeroed entering each one's first chunk
            C = self.chunk_size
            _, resets, _ = documents.chunk_layout(C)
            y = self.run("chunk", *(documents.to_chunks(t, C) for t in seq), None, resets)[0]
            y = documents.from_chunks(y, C)
        return self._output(y, v, x)

    # ------------------------------------------------------------------ cache and accounting
    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device) -> Mamba3StateCache:
        H, (N, P), R, sd = self.n_v_heads, self.state_shape, self.mimo_rank, state_dtype(dtype)
        tail = None if self.conv is None else self.conv.empty_tail(batch, dtype, device)
        return Mamba3StateCache(torch.zeros(batch, H, N, P, dtype=sd, device=device),
                                torch.zeros(batch, H, R, N, dtype=sd, device=device),
                                torch.zeros(batch, H, P, dtype=sd, device=device), tail)

    def cache_bytes(self, context_len: int, batch: int = 1, dtype: torch.dtype = torch.float32) -> int:
        """n_heads (N P state + R N of the last B~ + P of the last x) values in >= fp32 + the conv tail's
        channels * (K-1) in dtype: constant in context."""
        H, (N, P), R = self.n_v_heads, self.state_shape, self.mimo_rank
        tail = 0 if self.conv is None else self.conv.channels * (self.conv.kernel_size - 1) * dtype_bytes(dtype)
        return batch * (H * (N * P + R * N + P) * dtype_bytes(state_dtype(dtype)) + tail)

    def op_flops_per_token(self, context_len: int) -> float:
        """Chunkwise form per head, chunk C = min(chunk_size, L), per token: 2 C R^2 (N + P) + 4 R N P (the (C R)^2
        scores over N and their product with V, the chunk's write K^T V and the read Q S_0, R rows per token; the
        rotations, decays and trapezoid weights elementwise, not counted). R = 1: gated linear attention's count."""
        C = max(1, min(self.chunk_size, context_len))
        (N, P), R = self.state_shape, self.mimo_rank
        return self.n_v_heads * (2 * C * R * R * (N + P) + 4 * R * N * P)

    def layer_shape(self) -> dict:
        out = super().layer_shape()
        out.update(mimo_rank=self.mimo_rank, rotary_angles=self.n_angles, trapezoid=self.trap_proj is not None)
        return out
