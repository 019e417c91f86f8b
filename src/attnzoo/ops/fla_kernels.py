"""fla's Triton chunk kernels (fla-core; `pip install -e '.[gpu]'` adds triton) behind this package's op
signatures, so a mixer swaps `chunk_delta_rule` / `chunk_linear_attention` for these with nothing else changed.

Same inputs and results as the torch ops (ops/delta_rule.py, ops/linear_attention.py): heads-first
q, k (B, H, T, Dk), v (B, H, T, Dv), beta / g (B, H, T), state (B, H, Dk, Dv); returns (o (B, H, T, Dv) in q's
dtype, final state in fp32). What is converted, and what already matches:
- layout: fla takes sequence-first [B, T, H, D]; the mixers' tensors were (B, T, H, D) before their
  transpose, so the transpose back is a contiguous view and the dtype cast is the one copy;
- dtype: q / k / v / beta are cast to `dtype` (the call's compute dtype: fp16 / bf16; fla refuses fp32 in
  its chunk delta rule), the log-decay g, the initial state and the returned state stay fp32 (as fla's
  own tests pass them); o returns in q's dtype so the mixer's fp32 output norm reads what it always did;
- semantics: the mixers L2-normalise q/k (eps inside the sqrt, as fla's l2norm) and apply sigmoid to beta
  (times 2 with allow_neg_eigval) before the op, so fla's in-kernel options stay off; scale d_k^-1/2;
  Gated DeltaNet's g is the log-decay itself (fla's `use_gate_in_kernel=False`), decay before the delta read
  and the output reads the updated state in both; value heads are already expanded to one q/k head each;
- linear attention: phi and the normaliser's ones column are applied by the mixer, so plain linear attention
  (fla's `chunk_simple_gla` with no gate: S_t = S_{t-1} + k_t v_t^T, o_t = scale S_t^T q_t) is exactly the op;
  the denominator is the last output column, as in the torch form;
- gated linear attention (gla, retnet, hgrn2, mamba2: ops/gated_linear_attention.py): a log-decay per key channel
  (B, H, T, Dk) goes to fla's `chunk_gla`, one per head (B, H, T, 1) to `chunk_simple_gla` (its `g`, per head and
  token); both S_t = diag(e^g_t) S_{t-1} + k_t v_t^T, o_t = scale S_t^T q_t, as the torch forms;
- the generalized delta rule (rwkv7: ops/generalized_delta_rule.py): fla's `chunk_dplr_delta_rule` (what its
  `chunk_rwkv7` calls) with alpha = a, beta = b, gk = g: S_t = diag(e^g_t) S_{t-1} + b_t a_t^T S_{t-1} + k_t v_t^T;
- chunk size: fla takes 16 / 32 / 64 (64 otherwise); the result does not depend on it beyond rounding.
fla is imported inside the functions: importing this module imports neither fla nor triton.
"""
from __future__ import annotations

from typing import Optional

import torch

FLA_CHUNK_SIZES = (16, 32, 64)


def _seq_first(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, H, T, ...) -> fla's (B, T, H, ...) in `dtype` (contiguous: a view when x was (B, T, H, ...) transposed)."""
    return x.transpose(1, 2).to(dtype).contiguous()


def _heads_first(o: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return o.transpose(1, 2).to(like.dtype)


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"fla's chunk kernels run in fp16 / bf16, got {dtype} (ops/dispatch.py sends fp32 to torch)")


def _prepare(k: torch.Tensor, scale: Optional[float], initial_state: Optional[torch.Tensor], dtype: torch.dtype):
    """The checks and conversions every wrapper makes: the compute dtype (fp16 / bf16), the scale (None: d_k^-1/2)
    and the initial state in fp32 -> (scale, h0)."""
    _check_dtype(dtype)
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    return scale, None if initial_state is None else initial_state.float()


def fla_chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: Optional[torch.Tensor] = None,
    initial_state: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    chunk_size: int = 64,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.delta_rule.chunk_delta_rule` through fla: `chunk_delta_rule` (g None, DeltaNet) or
    `chunk_gated_delta_rule` (Gated DeltaNet), computing in `dtype`."""
    scale, h0 = _prepare(k, scale, initial_state, dtype)
    cs = chunk_size if chunk_size in FLA_CHUNK_SIZES else 64
    qs, ks, vs, bs = (_seq_first(t, dtype) for t in (q, k, v, beta))
    if g is None:
        from fla.ops.delta_rule import chunk_delta_rule

        o, state = chunk_delta_rule(qs, ks, vs, bs, scale=scale, initial_state=h0, output_final_state=True,
                                    chunk_size=cs)
    else:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        o, state = chunk_gated_delta_rule(qs, ks, vs, g.transpose(1, 2).float(), bs, scale=scale, initial_state=h0,
                                          output_final_state=True, chunk_size=cs)
    return _heads_first(o, q), state.float()


def fla_chunk_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    chunk_size: int = 64,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.linear_attention.chunk_linear_attention` through fla's `chunk_simple_gla` with no gate (plain causal
    linear attention, q/k already feature-mapped, v already carrying the normaliser's ones column)."""
    from fla.ops.simple_gla import chunk_simple_gla

    scale, h0 = _prepare(k, scale, initial_state, dtype)
    qs, ks, vs = (_seq_first(t, dtype) for t in (q, k, v))
    o, state = chunk_simple_gla(qs, ks, vs, scale=scale, initial_state=h0, output_final_state=True)
    return _heads_first(o, q), state.float()


def fla_chunk_gated_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.gated_linear_attention.chunk_gated_linear_attention` through fla: g (B, H, T, Dk) log-decays per key
    channel -> `chunk_gla`; g (B, H, T, 1) one per head -> `chunk_simple_gla`. g and the states stay fp32."""
    scale, h0 = _prepare(k, scale, initial_state, dtype)
    qs, ks, vs = (_seq_first(t, dtype) for t in (q, k, v))
    if g.shape[-1] == 1:
        from fla.ops.simple_gla import chunk_simple_gla

        gs = _seq_first(g[..., 0], torch.float32)  # (B, T, H)
        o, state = chunk_simple_gla(qs, ks, vs, g=gs, scale=scale, initial_state=h0, output_final_state=True)
    else:
        from fla.ops.gla import chunk_gla

        o, state = chunk_gla(qs, ks, vs, _seq_first(g, torch.float32), scale=scale, initial_state=h0,
                             output_final_state=True)
    return _heads_first(o, q), state.float()


def fla_chunk_generalized_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    g: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.generalized_delta_rule.chunk_generalized_delta_rule` through fla's `chunk_dplr_delta_rule` (RWKV-7's
    kernel): a, b, g (B, H, T, Dk); g (the log-decay) and the states stay fp32."""
    from fla.ops.generalized_delta_rule import chunk_dplr_delta_rule

    scale, h0 = _prepare(k, scale, initial_state, dtype)
    qs, ks, vs, as_, bs = (_seq_first(t, dtype) for t in (q, k, v, a, b))
    o, state = chunk_dplr_delta_rule(qs, ks, vs, as_, bs, _seq_first(g, torch.float32), scale=scale,
                                     initial_state=h0, output_final_state=True)
    return _heads_first(o, q), state.float()
