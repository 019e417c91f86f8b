"""fla's Triton chunk kernels (fla-core; `pip install -e '.[gpu]'` adds triton) behind this package's op
signatures, so a mixer swaps `chunk_delta_rule` / `chunk_linear_attention` for these with nothing else changed.

Same inputs and results as the torch ops (ops/delta_rule.py, ops/linear_attention.py): heads-first
q, k (B, H, T, Dk), v (B, H, T, Dv), beta / g (B, H, T), state (B, H, Dk, Dv); returns (o (B, H, T, Dv) in q's
dtype, final state in fp32). What is converted, and what already matches:
- layout: fla takes sequence-first [B, T, H, D]; the mixers' tensors were (B, T, H, D) before their
  transpose, so the transpose back is a contiguous view and the dtype cast is the one copy;
- dtype: q / k / v / beta are cast to `dtype` (the call's compute dtype: fp16 / bf16, or fp32 where the
  kernel takes it: all but `chunk_delta_rule`, which asserts against fp32; ops/dispatch.py FLA_KERNELS), the
  log-decay g, the initial state and the returned state stay fp32 (as fla's own tests pass them); o returns
  in q's dtype so the mixer's fp32 output norm reads what it always did;
- what fla asserts before a launch, checked here in one place (`_prepare`): an odd key or value width in
  fp16 / bf16 (fla's `chunk_bwd_dv`: "requires even K and V"; linear attention's normaliser makes V = Dv + 1)
  is padded with a zero column (zero keys and values add nothing to the state or the output; the padding is
  cut off the output and the final state, and gradients flow through the pad), and a key width above
  FLA_MAX_KEY_DIM, which padding cannot fix, is refused naming the mixer setting (ops/dispatch.py keeps such
  layers on torch, so only a direct call reaches it);
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
import torch.nn.functional as F

from attnzoo.ops.dispatch import FLA_KERNELS, FLA_MAX_KEY_DIM

FLA_CHUNK_SIZES = (16, 32, 64)
_16BIT = (torch.float16, torch.bfloat16)


def _seq_first(x: torch.Tensor, dtype: torch.dtype, pad: int = 0) -> torch.Tensor:
    """(B, H, T, ...) -> fla's (B, T, H, ...) in `dtype` (contiguous: a view when x was (B, T, H, ...) transposed),
    the last dim padded with `pad` zero columns."""
    x = x.transpose(1, 2).to(dtype)
    return (F.pad(x, (0, pad)) if pad else x).contiguous()


def _heads_first(o: torch.Tensor, like: torch.Tensor, width: int) -> torch.Tensor:
    return o[..., :width].transpose(1, 2).to(like.dtype)


def _check_dtype(kernel: str, dtype: torch.dtype) -> None:
    allowed = FLA_KERNELS[kernel][0]
    if dtype not in allowed:
        names = " / ".join({torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[d] for d in allowed)
        raise ValueError(f"fla's {kernel} runs in {names}, got {dtype} (ops/dispatch.py sends such calls to torch)")


class FlaCall:
    """One call's checks and conversions (what every wrapper makes): the compute dtype the kernel takes, the
    scale (None: d_k^-1/2), the zero padding of an odd key / value width in 16-bit, the initial state in fp32
    (padded alike). `seq_first(x, 'k' | 'v' | None)` converts an input; `result(o, state, like)` cuts the padding
    off and returns (o heads-first in like's dtype, final state fp32)."""

    def __init__(self, kernel: str, k: torch.Tensor, v: torch.Tensor, scale: Optional[float],
                 initial_state: Optional[torch.Tensor], dtype: torch.dtype) -> None:
        _check_dtype(kernel, dtype)
        self.K, self.V, self.dtype = k.shape[-1], v.shape[-1], dtype
        if self.K > FLA_MAX_KEY_DIM:
            raise ValueError(f"fla's {kernel} takes key widths up to {FLA_MAX_KEY_DIM}, got {self.K}: lower the "
                             f"mixer's head_dim / feature_dim / d_state, or model.impl=torch")
        self.pad = {"k": self.K % 2, "v": self.V % 2} if dtype in _16BIT else {"k": 0, "v": 0}
        self.scale = self.K ** -0.5 if scale is None else scale
        self.h0 = None if initial_state is None else \
            F.pad(initial_state.float(), (0, self.pad["v"], 0, self.pad["k"]))

    def seq_first(self, x: torch.Tensor, width: Optional[str] = None, dtype: Optional[torch.dtype] = None):
        return _seq_first(x, dtype or self.dtype, self.pad[width] if width else 0)

    def result(self, o: torch.Tensor, state: torch.Tensor, like: torch.Tensor):
        return _heads_first(o, like, self.V), state[..., :self.K, :self.V].float()


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
    c = FlaCall("chunk_delta_rule" if g is None else "chunk_gated_delta_rule", k, v, scale, initial_state, dtype)
    cs = chunk_size if chunk_size in FLA_CHUNK_SIZES else 64
    qs, ks, vs, bs = c.seq_first(q, "k"), c.seq_first(k, "k"), c.seq_first(v, "v"), c.seq_first(beta)
    if g is None:
        from fla.ops.delta_rule import chunk_delta_rule

        o, state = chunk_delta_rule(qs, ks, vs, bs, scale=c.scale, initial_state=c.h0, output_final_state=True,
                                    chunk_size=cs)
    else:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        o, state = chunk_gated_delta_rule(qs, ks, vs, c.seq_first(g, dtype=torch.float32), bs, scale=c.scale,
                                          initial_state=c.h0, output_final_state=True, chunk_size=cs)
    return c.result(o, state, q)


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

    c = FlaCall("chunk_simple_gla", k, v, scale, initial_state, dtype)
    o, state = chunk_simple_gla(c.seq_first(q, "k"), c.seq_first(k, "k"), c.seq_first(v, "v"), scale=c.scale,
                                initial_state=c.h0, output_final_state=True)
    return c.result(o, state, q)


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
    per_head = g.shape[-1] == 1
    c = FlaCall("chunk_simple_gla(g)" if per_head else "chunk_gla", k, v, scale, initial_state, dtype)
    qs, ks, vs = c.seq_first(q, "k"), c.seq_first(k, "k"), c.seq_first(v, "v")
    if per_head:
        from fla.ops.simple_gla import chunk_simple_gla

        gs = _seq_first(g[..., 0], torch.float32)  # (B, T, H)
        o, state = chunk_simple_gla(qs, ks, vs, g=gs, scale=c.scale, initial_state=c.h0, output_final_state=True)
    else:
        from fla.ops.gla import chunk_gla

        o, state = chunk_gla(qs, ks, vs, c.seq_first(g, "k", torch.float32), scale=c.scale, initial_state=c.h0,
                             output_final_state=True)
    return c.result(o, state, q)


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

    c = FlaCall("chunk_dplr_delta_rule", k, v, scale, initial_state, dtype)
    qs, ks, as_, bs = (c.seq_first(t, "k") for t in (q, k, a, b))
    o, state = chunk_dplr_delta_rule(qs, ks, c.seq_first(v, "v"), as_, bs, c.seq_first(g, "k", torch.float32),
                                     scale=c.scale, initial_state=c.h0, output_final_state=True)
    return c.result(o, state, q)


def fla_chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kimi Delta Attention through fla's own `chunk_kda`: S_t = (I - beta_t k_t k_t^T) Diag(e^g_t) S_{t-1} +
    beta_t k_t v_t^T, o_t = scale S_t^T q_t, on q, k (L2-normalised by the mixer), v (B, H, T, D), the log-decay
    per key channel g (B, H, T, Dk, fp32, the gate computed by the mixer: fla's use_gate_in_kernel off) and beta
    (B, H, T, sigmoid applied by the mixer); the same rule as `chunk_generalized_delta_rule` on
    mixers/kda.kda_as_generalized's inputs. g and the states stay fp32."""
    from fla.ops.kda import chunk_kda

    c = FlaCall("chunk_kda", k, v, scale, initial_state, dtype)
    o, state = chunk_kda(c.seq_first(q, "k"), c.seq_first(k, "k"), c.seq_first(v, "v"),
                         c.seq_first(g, "k", torch.float32), c.seq_first(beta), scale=c.scale, initial_state=c.h0,
                         output_final_state=True)
    return c.result(o, state, q)


def fla_chunk_gdn2(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    erase: torch.Tensor,
    write: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet-2 through fla's own `chunk_gdn2`: S_t = (I - k_t (erase_t * k_t)^T) Diag(e^g_t) S_{t-1} +
    k_t (write_t * v_t)^T, o_t = scale S_t^T q_t, on q, k (L2-normalised by the mixer), v, g (B, H, T, Dk, fp32),
    the erase gate per key channel (B, H, T, Dk) and the write gate per value channel (B, H, T, Dv), gates applied
    by the mixer (fla's in-kernel gate off); the rule of mixers/kda.gdn2_as_generalized. g and the states fp32."""
    from fla.ops.gdn2 import chunk_gdn2

    c = FlaCall("chunk_gdn2", k, v, scale, initial_state, dtype)
    o, state = chunk_gdn2(c.seq_first(q, "k"), c.seq_first(k, "k"), c.seq_first(v, "v"),
                          c.seq_first(g, "k", torch.float32), c.seq_first(erase, "k"), c.seq_first(write, "v"),
                          scale=c.scale, initial_state=c.h0, output_final_state=True)
    return c.result(o, state, q)


def fla_chunk_gated_delta_product(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: Optional[torch.Tensor] = None,
    initial_state: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.delta_product.chunk_delta_product` through fla's `chunk_gated_delta_product` (16-bit only: it asserts
    against fp32): q (B, H, T, Dk), each token's n_h keys / values / betas k (B, H, T, n, Dk), v (B, H, T, n, Dv),
    beta (B, H, T, n) laid out as fla's T n sub-steps in token order ([B, T n, H, D], a token's steps together),
    the log-decay g (B, H, T) fp32, applied once per token before its first step (fla's interleaved gate)."""
    from fla.ops.gated_delta_product import chunk_gated_delta_product

    c = FlaCall("chunk_gated_delta_product", k, v, scale, initial_state, dtype)
    B, H, T, n = beta.shape

    def steps(x: torch.Tensor, width: Optional[str]) -> torch.Tensor:  # (B, H, T, n, ...) -> (B, T n, H, ...)
        x = x.movedim(1, 3).reshape(B, T * n, H, *x.shape[4:]).to(dtype)
        return (F.pad(x, (0, c.pad[width])) if width and c.pad[width] else x).contiguous()

    gs = None if g is None else _seq_first(g, torch.float32)
    o, state = chunk_gated_delta_product(c.seq_first(q, "k"), steps(k, "k"), steps(v, "v"), gs, steps(beta, None),
                                         num_householder=n, scale=c.scale, initial_state=c.h0,
                                         output_final_state=True)
    return c.result(o, state, q)


def fla_forgetting_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_f: torch.Tensor,
    scale: Optional[float] = None,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """`ops.forgetting_attention.forgetting_attention` without a cache or a mask (queries = keys) through fla's
    `parallel_forgetting_attn`: q (B, H, T, D), k / v (B, Hkv, T, D) (GQA: fla pairs H / Hkv query heads per KV head,
    as the torch form), the log forget gates log_f (B, H, T) fp32: the score of key j for query i gets
    sum_{j<l<=i} log f_l (fla's cumulative g), causal. -> o (B, H, T, D) in q's dtype."""
    from fla.ops.forgetting_attn import parallel_forgetting_attn

    _check_dtype("parallel_forgetting_attn", dtype)
    o = parallel_forgetting_attn(_seq_first(q, dtype), _seq_first(k, dtype), _seq_first(v, dtype),
                                 _seq_first(log_f, torch.float32), scale=scale)  # None: fla's d^-1/2
    return o.transpose(1, 2).to(q.dtype)
