"""Softmax attention: the fast SDPA path and the explicit reference it is tested against."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F


def attention_mask(
    q_len: int, k_len: int, *, causal: bool, window: Optional[int] = None, device=None, q_offset: Optional[int] = None
) -> Optional[torch.Tensor]:
    """Boolean mask (q_len, k_len), True = may attend. Queries sit at the last `q_len` key positions
    (`q_offset` = k_len - q_len unless given). Causal: key j <= query i. Window W: key j > query i - W."""
    if not causal and window is None:
        return None
    off = (k_len - q_len) if q_offset is None else q_offset
    qi = torch.arange(q_len, device=device)[:, None] + off
    kj = torch.arange(k_len, device=device)[None, :]
    mask = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    if causal:
        mask &= kj <= qi
    if window is not None:
        mask &= kj > qi - window
    return mask


def alibi_slopes(n_heads: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """ALiBi's per-head slopes (Press et al. 2022; BLOOM's tensor): for the largest power of two p <= H,
    2^(-8/p), 2^(-16/p), ...; the remaining H - p heads take every other slope of 2p heads."""
    p = 2 ** math.floor(math.log2(n_heads))
    slopes = [2.0 ** (-8.0 * (i + 1) / p) for i in range(p)]
    slopes += [2.0 ** (-4.0 * (2 * i + 1) / p) for i in range(n_heads - p)]  # base 2^(-8 / 2p), odd powers
    return torch.tensor(slopes, dtype=dtype)


def alibi_bias(slopes: torch.Tensor, q_len: int, k_len: int, *, causal: bool, q_offset: Optional[int] = None,
               dtype=torch.float32) -> torch.Tensor:
    """(H, q_len, k_len) additive scores: -slope_h * distance(query, key), -inf where a causal query may not
    look. Queries sit at the last q_len key positions unless `q_offset` says otherwise (decode with a cache)."""
    off = (k_len - q_len) if q_offset is None else q_offset
    qi = torch.arange(q_len, device=slopes.device)[:, None] + off
    kj = torch.arange(k_len, device=slopes.device)[None, :]
    dist = (qi - kj).abs().to(dtype)
    bias = -slopes.to(dtype)[:, None, None] * dist
    if causal:
        bias = bias.masked_fill(kj > qi, float("-inf"))
    return bias


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    return_weights: bool = False,
    bias: Optional[torch.Tensor] = None,
):
    """softmax(q k^T * scale + mask) v, written out. q (B, H, Tq, D), k/v (B, Hkv, Tk, D[v]).

    Key/value heads are shared by groups of H/Hkv consecutive query heads (GQA). Masked scores get a
    large finite negative (not -inf) so a fully masked row cannot produce NaN; softmax subtracts the row max.
    """
    B, H, Tq, D = q.shape
    group = H // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    # matmul, not einsum: einsum turns a 1-query x 1-key product into an elementwise one that FLOP counters miss
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if bias is not None:  # ALiBi (H, Tq, Tk); -inf entries are the positions the mask removes too
        scores = scores + bias.to(scores.dtype).clamp_min(torch.finfo(scores.dtype).min)
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    scores = scores - scores.amax(dim=-1, keepdim=True)
    weights = scores.exp()
    weights = weights / weights.sum(dim=-1, keepdim=True)
    out = torch.matmul(weights, v)
    return (out, weights) if return_weights else out


def attention_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    window: Optional[int] = None,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    bias: Optional[torch.Tensor] = None,
    mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Fast path through `F.scaled_dot_product_attention`. Queries are the last Tq of the Tk keys.
    `bias` (H, Tq, Tk): additive scores (ALiBi, with -inf for masked keys) used as SDPA's float mask."""
    Tq, Tk = q.shape[2], k.shape[2]
    group = q.shape[1] // k.shape[1]
    if group > 1:
        # expand (a view + one copy) instead of SDPA's enable_gqa, which drops CPU to the math kernel
        k = k[:, :, None].expand(-1, -1, group, -1, -1).reshape(k.shape[0], -1, Tk, k.shape[-1])
        v = v[:, :, None].expand(-1, -1, group, -1, -1).reshape(v.shape[0], -1, Tk, v.shape[-1])
    if bias is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), scale=scale, dropout_p=dropout_p)
    if mask is not None:  # an explicit boolean (Tq, Tk) visibility mask (sliding window with sinks)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, dropout_p=dropout_p)
    if window is None and causal and Tq == Tk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, dropout_p=dropout_p)
    if window is None and (not causal or Tq == 1):
        return F.scaled_dot_product_attention(q, k, v, scale=scale, dropout_p=dropout_p)
    mask = attention_mask(Tq, Tk, causal=causal, window=window, device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, dropout_p=dropout_p)
