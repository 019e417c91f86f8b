"""DeepSeek Sparse Attention (DSA; DeepSeek-AI 2025, DeepSeek-V3.2, arXiv:2512.02556): a lightning indexer scores
every key a query may see, and the query attends its top-k keys only (one selection shared by all heads):

    I[t, s] = sum_j w[t, j] relu(scale_I q_idx[t, j] . k_idx[s])     (j: index heads; one index key per token)
    S_t     = the top_k keys s visible to t by I[t, s]   (ties: the more recent key first)
    o_t     = softmax attention of q_t over the keys of S_t

Layouts (heads first, as ops/attention.py): q (B, H, T, D), k / v (B, Hkv, S, D / Dv) (GQA: H / Hkv query heads a
KV head), q_idx (B, HI, T, DI), k_idx (B, S, DI), w (B, HI, T); `visible` (T, S) or (B, T, S) bool, the keys each
query may see at all: causal by default (the queries are the last T of the S keys), a static cache's filled slots,
a packed row's documents. scale_I defaults to DI^-0.5 and the attention scale to D^-0.5, as fla-core's.

- `index_scores`: dense I (B, T, S), in at least fp32 with autocast off (the selection is a ranking: bf16 scores
  would tie; transformers' indexer computes in fp32 too).
- `topk_slots` / `select_topk`: the selection as (B, T, k) slots (a decode step gathers them) or a (B, T, S) mask.
  The order is made total (score, then position, by a stable sort) so that every form, and a cached decode against
  the full forward, chooses the same keys where scores tie (relu makes exact-zero scores common).
- `dsa_attention`: the fast form, the mask under one SDPA call (dense compute; the sparsity lives in the mask).
- `dsa_attention_reference`: each row and query alone: its visible keys, their index scores, a Python sort, the
  chosen keys gathered, an explicit softmax per head. O(B T) Python steps: for tests.
- `indexer_kl`: the indexer's training loss (the paper's Eq. 3 / 4).
fla-core's `naive_dsa` / `naive_dsa_indexer` are the independent check (tests/test_dsa.py).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from attnzoo.ops.attention import attention_mask
from attnzoo.ops.dispatch import autocast_off
from attnzoo.ops.forgetting_attention import at_least_fp32
from attnzoo.ops.sparse_attention import expand_heads


def causal_visible(q_len: int, k_len: int, device) -> torch.Tensor:
    """(q_len, k_len) bool: the queries are the last q_len of the keys, each sees the keys up to itself."""
    return attention_mask(q_len, k_len, causal=True, device=device)


def index_scores(q_idx: torch.Tensor, k_idx: torch.Tensor, w: torch.Tensor, scale: Optional[float] = None) -> torch.Tensor:
    """q_idx (B, HI, T, DI), k_idx (B, S, DI), w (B, HI, T) -> I (B, T, S) = sum_j w_j relu(scale q_idx_j . k_idx),
    in at least fp32 (autocast off)."""
    scale = q_idx.shape[-1] ** -0.5 if scale is None else scale
    dt = at_least_fp32(q_idx.dtype)
    with autocast_off(q_idx.device.type):
        dots = torch.matmul(q_idx.to(dt), k_idx.to(dt)[:, None].transpose(-1, -2)) * scale  # (B, HI, T, S)
        return torch.einsum("bhts,bht->bts", torch.relu(dots), w.to(dt))


def topk_slots(scores: torch.Tensor, visible: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scores (B, T, S), visible (T, S) or (B, T, S) -> slots (B, T, k), k = min(topk, S): each query's best visible
    keys (best first; of equal scores the later key first), and valid (B, T, k): False where a query sees fewer than
    k keys (those slots are invisible ones). Not differentiable (the scores are detached)."""
    s = scores.detach().masked_fill(~visible, float("-inf"))
    S = s.shape[-1]
    # descending by score; a stable sort over the keys in reverse order puts the later of equal scores first
    order = torch.sort(s.flip(-1), dim=-1, descending=True, stable=True).indices[..., : min(topk, S)]
    slots = S - 1 - order
    return slots, visible.expand_as(s).gather(-1, slots)


def select_topk(scores: torch.Tensor, visible: torch.Tensor, topk: int) -> torch.Tensor:
    """(B, T, S) bool: the keys `topk_slots` chooses (all visible keys when topk >= S: dense attention)."""
    visible = visible.expand_as(scores)
    if topk >= scores.shape[-1]:
        return visible
    slots, valid = topk_slots(scores, visible, topk)
    return torch.zeros_like(visible).scatter(-1, slots, valid)


def dsa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_idx: torch.Tensor, k_idx: torch.Tensor,
                  w: torch.Tensor, *, topk: int, visible: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                  index_scale: Optional[float] = None, dropout_p: float = 0.0) -> torch.Tensor:
    """DSA (layouts above) -> (B, H, T, Dv): the indexer's top-k mask under one SDPA call."""
    T, S = q.shape[2], k.shape[2]
    visible = causal_visible(T, S, q.device) if visible is None else visible
    chosen = select_topk(index_scores(q_idx, k_idx, w, index_scale), visible, topk)  # (B, T, S)
    H = q.shape[1]
    return F.scaled_dot_product_attention(q, expand_heads(k, H), expand_heads(v, H), attn_mask=chosen[:, None],
                                          dropout_p=dropout_p, scale=scale)


def dsa_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_idx: torch.Tensor,
                            k_idx: torch.Tensor, w: torch.Tensor, *, topk: int, visible: Optional[torch.Tensor] = None,
                            scale: Optional[float] = None, index_scale: Optional[float] = None) -> torch.Tensor:
    """The same, one row and one query at a time: the index score of every visible key (each index head's dot
    product, relu, the heads weighted and summed), the keys ranked by (score, position) in Python, the first topk
    gathered, then each head's softmax over them. Matmuls only where the formula counts work (FLOPs tests)."""
    B, H, T, D = q.shape
    S, G = k.shape[2], H // k.shape[1]
    scale = D ** -0.5 if scale is None else scale
    index_scale = q_idx.shape[-1] ** -0.5 if index_scale is None else index_scale
    visible = (causal_visible(T, S, q.device) if visible is None else visible).expand(B, T, S)
    dt = at_least_fp32(q_idx.dtype)
    heads = torch.arange(H, device=q.device) // G  # the KV head of each query head
    out = q.new_zeros(B, H, T, v.shape[-1])
    for b in range(B):
        for t in range(T):
            keys = visible[b, t].nonzero().squeeze(1)  # (n,) the positions this query may see
            dots = torch.matmul(q_idx[b, :, t].to(dt), k_idx[b, keys].to(dt).T) * index_scale  # (HI, n)
            score = torch.matmul(w[b, :, t].to(dt)[None], torch.relu(dots))[0]  # (n,)
            s_list, k_list = score.detach().tolist(), keys.tolist()
            ranked = sorted(range(len(k_list)), key=lambda i: (-s_list[i], -k_list[i]))  # best first, then later
            chosen = keys[ranked[:topk]]  # (m,)
            kk = k[b][heads][:, chosen]  # (H, m, D)
            vv = v[b][heads][:, chosen]
            p = torch.softmax(torch.matmul(q[b, :, t, None], kk.transpose(-1, -2)) * scale, dim=-1)  # (H, 1, m)
            out[b, :, t] = torch.matmul(p, vv)[:, 0]
    return out


def indexer_kl(scores: torch.Tensor, chosen: torch.Tensor, q: torch.Tensor, k: torch.Tensor, *,
               scale: Optional[float] = None) -> torch.Tensor:
    """The lightning indexer's loss (DeepSeek-V3.2, Eq. 3 dense / Eq. 4 sparse): per query t, KL(p_t || softmax(I_t))
    over its chosen keys, p_t the main attention's probabilities summed over heads and L1-normalised (a target:
    no gradient), averaged over the (B, T) queries. scores (B, T, S) the index scores (their gradient trains the
    indexer), chosen (B, T, S) bool, q (B, H, T, D), k (B, Hkv, S, D)."""
    dt = at_least_fp32(q.dtype)
    with torch.no_grad():
        a = torch.matmul(q.to(dt), expand_heads(k, q.shape[1]).to(dt).transpose(-1, -2))
        a = a * (q.shape[-1] ** -0.5 if scale is None else scale)
        p = torch.softmax(a.masked_fill(~chosen[:, None], float("-inf")), dim=-1).mean(1)  # (B, T, S), rows sum to 1
    log_q = torch.log_softmax(scores.to(dt).masked_fill(~chosen, float("-inf")), dim=-1).masked_fill(~chosen, 0.0)
    return (torch.special.xlogy(p, p) - p * log_q).sum(-1).mean()
