"""Forgetting Attention (Lin et al. 2025, FoX, arXiv:2503.02130): softmax attention with a forget gate.

Per query head h and token l a forget gate f_l in (0, 1) (given as log f_l <= 0); query i scores key j <= i as

    s_ij = scale * q_i . k_j + sum_{l = j+1 .. i} log f_l  =  scale * q_i . k_j + c_i - c_j,   c_t = sum_{l <= t} log f_l

so a key fades by the product of the gates written after it: a data-dependent ALiBi (a slope per token, not per
head). `forgetting_attention` adds c_i - c_j to SDPA's scores as a float mask (fp32 cumsum, the difference cast
to the compute dtype: the keys that matter are the recent ones, whose bias is small); the reference writes the sum
over l out for every (i, j). fla-core's `naive_forgetting_attn` is the independent check (tests/test_fox.py).
"""
from __future__ import annotations

from typing import Optional

import torch

from attnzoo.ops.attention import attention_reference, attention_sdpa


def at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16-bit gates (their cumulative sum), the dtype itself for fp32 / fp64."""
    return torch.promote_types(dtype, torch.float32)


def forget_bias(log_f: torch.Tensor, q_len: int, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """log_f (B, H, Tk) the log forget gates of the keys; the queries are the last `q_len` keys (a cache's chunk)
    -> (B, H, q_len, Tk) scores (fp32, or fp64 for fp64 gates) c_i - c_j where key j is visible to query i (causal, and `mask` (B, 1, Tq, Tk)
    when given: a packed row's document mask), -inf elsewhere. c is a cumulative sum in fp32 over every key."""
    c = log_f.to(at_least_fp32(log_f.dtype)).cumsum(-1)  # (B, H, Tk)
    Tk = c.shape[-1]
    bias = c[..., Tk - q_len:, None] - c[..., None, :]  # (B, H, Tq, Tk)
    i = torch.arange(Tk - q_len, Tk, device=c.device)[:, None]
    visible = torch.arange(Tk, device=c.device)[None, :] <= i
    if mask is not None:
        visible = visible & mask
    return bias.masked_fill(~visible, float("-inf"))


def forgetting_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_f: torch.Tensor, *,
                         scale: Optional[float] = None, mask: Optional[torch.Tensor] = None,
                         dropout_p: float = 0.0) -> torch.Tensor:
    """q (B, H, Tq, D), the last Tq of the keys k / v (B, Hkv, Tk, D) (GQA: H / Hkv query heads per KV head), log_f
    (B, H, Tk) the log forget gates of every key -> (B, H, Tq, D). One SDPA call under the (B, H, Tq, Tk) bias."""
    bias = forget_bias(log_f, q.shape[2], mask)
    return attention_sdpa(q, k, v, causal=False, scale=scale, bias=bias, dropout_p=dropout_p)


def forgetting_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_f: torch.Tensor, *,
                                   scale: Optional[float] = None, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The same, written out: the decay of key j for query i is the sum of log f_l over j < l <= i, summed for
    every (i, j) from the gates themselves (no cumulative sums to difference), then the explicit softmax of
    ops/attention.attention_reference. O(Tq * Tk^2) memory: for tests."""
    Tq, Tk = q.shape[2], k.shape[2]
    i = torch.arange(Tk - Tq, Tk, device=q.device)[:, None, None]  # query positions among the keys
    j = torch.arange(Tk, device=q.device)[None, :, None]
    l = torch.arange(Tk, device=q.device)[None, None, :]
    between = ((l > j) & (l <= i)).to(log_f.dtype)  # (Tq, Tk, Tk): gate l lies between key j and query i
    decay = (log_f[:, :, None, None, :] * between).sum(-1)  # (B, H, Tq, Tk), elementwise: no matmul
    visible = (j[..., 0] <= i[..., 0])[None, None]  # (1, 1, Tq, Tk)
    if mask is not None:
        visible = visible & mask
    return attention_reference(q, k, v, mask=visible, scale=scale, bias=decay)


def static_forget_bias(log_f: torch.Tensor, positions: torch.Tensor, *, reference: bool = False) -> torch.Tensor:
    """The bias of queries at `positions` (B, T) over every slot s of a static cache, slot s holding position s:
    log_f (B, H, S) the gates written so far -> (B, H, T, S), c_p - c_s for s <= p and -inf beyond (slots past a
    row's position hold nothing of it yet, or a stale prompt's gates: never read). Reference: the gates between s
    and p summed for every pair."""
    S = log_f.shape[-1]
    slot = torch.arange(S, device=log_f.device)
    p = positions[:, None, :, None]  # (B, 1, T, 1)
    if reference:
        l = slot[None, None, None, None, :]
        between = ((l > slot[:, None]) & (l <= p[..., None])).to(log_f.dtype)  # (B, 1, T, S, S)
        bias = (log_f[:, :, None, None, :] * between).sum(-1)
    else:
        c = log_f.to(at_least_fp32(log_f.dtype)).cumsum(-1)  # (B, H, S)
        cq = c.gather(-1, positions[:, None, :].expand(-1, c.shape[1], -1))  # (B, H, T)
        bias = cq[..., None] - c[:, :, None, :]
    return bias.masked_fill(slot > p, float("-inf"))
