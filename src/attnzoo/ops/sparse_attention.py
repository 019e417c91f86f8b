"""Block-sparse softmax attention: Native Sparse Attention (NSA) and Mixture of Block Attention (MoBA).

Both split the keys into blocks of `block_size` consecutive positions (block c holds positions
c*BS .. c*BS+BS-1, aligned to absolute positions, so training and decoding see the same blocks) and let
each query read the full keys of a few blocks only, chosen by a cheap score against one summary key per
block (the mean of the block's keys). Queries sit at absolute positions q_start .. q_start+Tq-1 and the
keys k/v hold positions 0 .. Tk-1 (everything up to the last query).

NSA (Yuan et al. 2025), in fla-core's form (`fla/ops/nsa/naive.py`: one block size for compression and
selection, mean-pooled compression), is three gated branches over the same q/k/v:
  - compressed: softmax attention over the mean-pooled keys/values of the blocks fully in the past
    (block c is visible from position t when c*BS + BS - 1 <= t); no visible block -> 0;
  - selected: the query group's `block_counts` best blocks by the compressed attention probabilities
    (averaged over the query heads that share a KV head), the first, previous and current block always
    among them; causal token attention over their full keys;
  - sliding window: the last `window` keys (itself included).
  o = g_cmp * o_cmp + g_slc * o_slc + g_swa * o_swa, the gates sigmoid(x W_g) per head and token.

MoBA (Lu et al. 2025): each query head scores the blocks fully before its own block by q . mean(K_block)
and attends causally over its own block plus the `topk - 1` best of them (topk counts the own block).

The fast forms realise the selection as one boolean (Tq x Tk) mask per head and a masked SDPA call (dense
compute on CPU: the mask is where the sparsity lives; the FLOPs are counted sparse, as block kernels run
them). The reference forms loop over query positions with an explicit softmax over the gathered keys.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from attnzoo.ops.attention import attention_mask
from attnzoo.ops.sliding_window import sliding_window_sdpa

NEG = -1.0  # below every probability: a block that may not be selected ranks after all that may


def block_means(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """(B, H, T, D) -> (B, H, T // BS, D): the mean of every complete block (a trailing partial one is left out)."""
    B, H, T, D = x.shape
    n = T // block_size
    return x[:, :, : n * block_size].reshape(B, H, n, block_size, D).mean(dim=3)


def expand_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, Hkv, ...) -> (B, H, ...): KV head g serves query heads g*G .. g*G+G-1 (G = H / Hkv)."""
    group = n_heads // x.shape[1]
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def _positions(q_start: int, Tq: int, device) -> torch.Tensor:
    return q_start + torch.arange(Tq, device=device)


# ----------------------------------------------------------------------------------------------- NSA
def nsa_selection_scores(p_cmp: torch.Tensor, n_kv_heads: int, qpos: torch.Tensor, n_keys: int,
                         block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of every candidate block for every query, and which blocks may be selected.

    p_cmp (B, H, Tq, NC): the compressed branch's attention probabilities; qpos the queries' positions, (Tq,) or
    per row (B, 1, Tq). Returns scores (B, Hkv, Tq, NB) with NB = ceil(n_keys / BS) (the current partial block is
    a candidate): the group mean of p_cmp, 1.0 for the forced blocks (first, previous, current), NEG where a block
    is neither complete in the past nor forced; and allowed ((Tq, NB) or (B, 1, Tq, NB))."""
    B, H, Tq, NC = p_cmp.shape
    NB = -(-n_keys // block_size)
    score = p_cmp.reshape(B, n_kv_heads, H // n_kv_heads, Tq, NC).mean(dim=2)
    if NB > NC:
        score = torch.cat([score, score.new_zeros(B, n_kv_heads, Tq, NB - NC)], dim=-1)
    score = score[..., :NB]
    c = torch.arange(NB, device=qpos.device)
    blk = (qpos // block_size)[..., None]
    forced = (c == blk) | (c == 0) | (c == blk - 1)
    allowed = forced | ((c + 1) * block_size - 1 <= qpos[..., None])
    score = torch.where(forced, torch.ones_like(score), score).masked_fill(~allowed, NEG)
    return score, allowed


def _nsa_select(q, k_cmp, v_cmp, qpos, n_keys: int, *, block_size: int, block_counts: int, scale: float):
    """The compressed branch's output (B, H, Tq, D) and the selected blocks: idx (B, Hkv, Tq, K) with ok (the same
    shape: False where a pick is not allowed), for queries at qpos ((Tq,), or per row (B, 1, Tq)) over keys at
    positions 0 .. n_keys - 1."""
    B, H, Tq, D = q.shape
    Hkv, NC = k_cmp.shape[1], k_cmp.shape[2]
    # compressed branch: its probabilities also rank the blocks for selection
    s = torch.matmul(q, expand_heads(k_cmp, H).transpose(-1, -2)) * scale  # (B, H, Tq, NC)
    visible = (torch.arange(NC, device=q.device) + 1) * block_size - 1 <= qpos[..., None]
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)  # no visible block: 0
    o_cmp = torch.matmul(p, expand_heads(v_cmp, H))
    # selected branch: top blocks per (query, KV head)
    score, allowed = nsa_selection_scores(p, Hkv, qpos, n_keys, block_size)
    NB = score.shape[-1]
    idx = score.topk(min(block_counts, NB), dim=-1).indices
    return o_cmp, idx, allowed.expand(B, Hkv, Tq, NB).gather(-1, idx)


def _nsa_masks(q, k_cmp, v_cmp, qpos, n_keys: int, *, block_size: int, block_counts: int, scale: float):
    """The compressed branch's output (B, H, Tq, D) and the selected branch's token mask ((B, Hkv, Tq, n_keys))
    for queries at qpos ((Tq,), or per row (B, 1, Tq)) over keys at positions 0 .. n_keys - 1."""
    o_cmp, idx, ok = _nsa_select(q, k_cmp, v_cmp, qpos, n_keys, block_size=block_size, block_counts=block_counts,
                                 scale=scale)
    B, Hkv, Tq, _ = idx.shape
    NB = -(-n_keys // block_size)
    chosen = torch.zeros(B, Hkv, Tq, NB, dtype=torch.bool, device=q.device).scatter(-1, idx, ok)
    causal = torch.arange(n_keys, device=q.device) <= qpos[..., None]
    return o_cmp, chosen.repeat_interleave(block_size, dim=-1)[..., :n_keys] & causal


def gather_slots(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x (B, Hkv, S, D) read at slots (B, Hs, n), Hs = Hkv or a multiple (query head h reads KV head h // (Hs /
    Hkv)) -> (B, Hs, n, D): only the n slots are read and copied (the sparse read of a decode step)."""
    B, Hkv, S, D = x.shape
    Hs = slots.shape[1]
    base = (torch.arange(Hs, device=x.device) // (Hs // Hkv)) * S
    flat = (slots + base[:, None]).reshape(B, -1)
    return x.reshape(B, Hkv * S, D).gather(1, flat[..., None].expand(-1, -1, D)).view(B, Hs, -1, D)


def _block_slots(blocks: torch.Tensor, ok: torch.Tensor, pos: torch.Tensor, block_size: int, n_slots: int):
    """Chosen blocks (B, Hs, K) of rows at positions pos (B,) -> their slots (B, Hs, K * BS) (clamped into the
    cache) and which of them to read: the block allowed (ok) and the slot not past the row's position."""
    slots = blocks[..., None] * block_size + torch.arange(block_size, device=blocks.device)
    valid = ok[..., None] & (slots <= pos[:, None, None, None])
    return slots.flatten(-2).clamp(max=n_slots - 1), valid.flatten(-2)


def nsa_attention(q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, *, q_start: int, block_size: int,
                  block_counts: int, window: int, scale: Optional[float] = None, reference: bool = False):
    """NSA over q (B, H, Tq, D) at positions q_start.., k/v (B, Hkv, Tk, D) at 0..Tk-1, the compressed
    k_cmp/v_cmp (B, Hkv, NC, D) = block means of the complete blocks, gates (B, H, Tq). -> (B, H, Tq, D)."""
    if reference:
        return _nsa_reference(q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, q_start=q_start, block_size=block_size,
                              block_counts=block_counts, window=window, scale=scale)
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    o_cmp, mask = _nsa_masks(q, k_cmp, v_cmp, _positions(q_start, Tq, q.device), Tk, block_size=block_size,
                             block_counts=block_counts, scale=scale)
    ke, ve = expand_heads(k, H), expand_heads(v, H)
    o_slc = F.scaled_dot_product_attention(q, ke, ve, attn_mask=expand_heads(mask, H), scale=scale)
    o = g_slc[..., None] * o_slc + g_cmp[..., None] * o_cmp
    if window > 0:
        if q_start == 0 and Tq == Tk:
            o_swa = sliding_window_sdpa(q, k, v, window=window, scale=scale)
        else:
            band = attention_mask(Tq, Tk, causal=True, window=window, device=q.device, q_offset=q_start)
            o_swa = F.scaled_dot_product_attention(q, ke, ve, attn_mask=band, scale=scale)
        o = o + g_swa[..., None] * o_swa
    return o


def grouped_sdpa(q, k, v, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Masked SDPA of q (B, H, T, D) over k/v (B, Hkv, S, D) with the query heads of a group as query rows of their KV
    head (the keys read once, not copied H / Hkv times); mask (B, M, T, S) with M = 1, Hkv or H."""
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G, M = H // Hkv, mask.shape[1]
    if M == H:
        mask = mask.reshape(B, Hkv, G * T, S)
    else:
        mask = mask[:, :, None].expand(B, M, G, T, S).reshape(B, M, G * T, S)
    out = F.scaled_dot_product_attention(q.reshape(B, Hkv, G * T, D), k, v, attn_mask=mask, scale=scale)
    return out.reshape(B, H, T, v.shape[-1])


def nsa_attention_static(q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, qpos: torch.Tensor, *, block_size: int,
                         block_counts: int, window: int, scale: Optional[float] = None, reference: bool = False):
    """NSA through a static cache: q (B, H, Tq, D) at per-row positions qpos (B, Tq), k/v (B, Hkv, S, D) with slot s
    holding position s (slots past a row's query: masked), k_cmp/v_cmp (B, Hkv, ceil(S / BS), D) the block means
    (a block not complete yet: never read). Every mask a function of tensors, one graph for every position.
    Reference: `_nsa_reference` row by row and query by query over the keys up to the query."""
    B, H, Tq, D = q.shape
    scale = D ** -0.5 if scale is None else scale
    if reference:
        return _static_reference(_nsa_reference, q, k, v, qpos, block_size, (k_cmp, v_cmp), (g_cmp, g_slc, g_swa),
                                 block_counts=block_counts, window=window, scale=scale)
    S = k.shape[2]
    pos = qpos[:, None]  # (B, 1, Tq)
    if Tq == 1:  # a decode step reads the selected blocks and the window only
        return _nsa_decode(q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, qpos[:, 0], block_size=block_size,
                           block_counts=block_counts, window=window, scale=scale)
    o_cmp, mask = _nsa_masks(q, k_cmp, v_cmp, pos, S, block_size=block_size, block_counts=block_counts, scale=scale)
    o = g_slc[..., None] * grouped_sdpa(q, k, v, mask, scale) + g_cmp[..., None] * o_cmp
    if window > 0:
        key = torch.arange(S, device=q.device)
        band = (key <= pos[..., None]) & (key > pos[..., None] - window)  # (B, 1, Tq, S)
        o = o + g_swa[..., None] * grouped_sdpa(q, k, v, band, scale)
    return o


def _nsa_decode(q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, pos: torch.Tensor, *, block_size: int,
                block_counts: int, window: int, scale: float):
    """One query per row at pos (B,): the compressed branch over every block mean, the selected branch over the
    gathered slots of its K blocks, the window over its W gathered slots (B, Hkv, K * BS + W keys read, not S)."""
    S = k.shape[2]
    o_cmp, idx, ok = _nsa_select(q, k_cmp, v_cmp, pos[:, None, None], S, block_size=block_size,
                                 block_counts=block_counts, scale=scale)
    slots, valid = _block_slots(idx[:, :, 0], ok[:, :, 0], pos, block_size, S)  # (B, Hkv, K * BS)
    o = g_slc[..., None] * grouped_sdpa(q, gather_slots(k, slots), gather_slots(v, slots), valid[:, :, None], scale)
    o = o + g_cmp[..., None] * o_cmp
    if window > 0:
        back = pos[:, None] - torch.arange(window, device=q.device)  # (B, W): the window's positions
        w = back.clamp(min=0)[:, None].expand(-1, k.shape[1], -1)
        o = o + g_swa[..., None] * grouped_sdpa(q, gather_slots(k, w), gather_slots(v, w), (back >= 0)[:, None, None],
                                                scale)
    return o


def _static_reference(fn, q, k, v, qpos, block_size: int, means: tuple, per_query: tuple, **kw):
    """A reference form over a static cache: each row's each query alone, at its position p, over the keys 0..p
    and the means of the blocks complete by then (`fn`: _nsa_reference or _moba_reference; `per_query`: tensors
    (B, H, Tq) sliced with the query, as NSA's gates)."""
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        for i in range(q.shape[2]):
            p = int(qpos[b, i])
            n = (p + 1) // block_size
            args = [t[b:b + 1, :, :n] for t in means] + [t[b:b + 1, :, i:i + 1] for t in per_query]
            out[b:b + 1, :, i:i + 1] = fn(q[b:b + 1, :, i:i + 1], k[b:b + 1, :, :p + 1], v[b:b + 1, :, :p + 1], *args,
                                          q_start=p, block_size=block_size, **kw)
    return out


def _softmax_attend(qi: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """One query vector over a list of keys, written out: softmax(q . k * scale) @ v."""
    w = torch.softmax((keys @ qi) * scale, dim=0)
    return w @ values


def _nsa_reference(q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, *, q_start, block_size, block_counts, window, scale):
    """NSA one query, one head at a time: which blocks and keys it reads, spelled out."""
    B, H, Tq, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    scale = D ** -0.5 if scale is None else scale
    out = torch.zeros_like(q)
    for b in range(B):
        for i in range(Tq):
            t = q_start + i
            n_vis = (t + 1) // block_size  # blocks c with c*BS + BS - 1 <= t
            blk = t // block_size
            n_blocks = blk + 1
            probs = torch.zeros(H, n_blocks, dtype=q.dtype, device=q.device)
            for h in range(H):
                g = h // G
                qi = q[b, h, i]
                o_cmp = torch.zeros(D, dtype=q.dtype, device=q.device)
                if n_vis:
                    w = torch.softmax((k_cmp[b, g, :n_vis] @ qi) * scale, dim=0)
                    probs[h, :n_vis] = w
                    o_cmp = w @ v_cmp[b, g, :n_vis]
                out[b, h, i] = out[b, h, i] + g_cmp[b, h, i] * o_cmp
                lo = max(0, t - window + 1)
                if window > 0:
                    out[b, h, i] = out[b, h, i] + g_swa[b, h, i] * _softmax_attend(qi, k[b, g, lo:t + 1], v[b, g, lo:t + 1], scale)
            for g in range(Hkv):
                score = probs[g * G:(g + 1) * G].mean(dim=0)
                for c in {0, blk, blk - 1} - {-1}:
                    score[c] = 1.0
                ranked = score.topk(min(block_counts, n_blocks)).indices.tolist()
                keys = [j for c in sorted(ranked) for j in range(c * block_size, min((c + 1) * block_size, t + 1))]
                for h in range(g * G, (g + 1) * G):
                    o_slc = _softmax_attend(q[b, h, i], k[b, g, keys], v[b, g, keys], scale)
                    out[b, h, i] = out[b, h, i] + g_slc[b, h, i] * o_slc
    return out


def nsa_keys(context_len: int, block_size: int, block_counts: int) -> tuple[float, float]:
    """Average over positions 1..L of (compressed blocks visible, tokens read by the selected branch)."""
    cmp = slc = 0
    for p in range(context_len):
        blk = p // block_size
        cmp += (p + 1) // block_size
        slc += p + 1 if blk + 1 <= block_counts else (block_counts - 1) * block_size + p % block_size + 1
    return cmp / context_len, slc / context_len


# ---------------------------------------------------------------------------------------------- MoBA
def moba_attention(q, k, v, k_mean, *, q_start: int, block_size: int, topk: int, scale: Optional[float] = None,
                   reference: bool = False):
    """MoBA over q (B, H, Tq, D) at positions q_start.., k/v (B, Hkv, Tk, D) at 0..Tk-1, k_mean (B, Hkv, NC, D)
    = the means of the complete key blocks. -> (B, H, Tq, D)."""
    if reference:
        return _moba_reference(q, k, v, k_mean, q_start=q_start, block_size=block_size, topk=topk, scale=scale)
    Tk = k.shape[2]
    mask = _moba_mask(q, k_mean, _positions(q_start, q.shape[2], q.device), Tk, block_size=block_size, topk=topk)
    H = q.shape[1]
    return F.scaled_dot_product_attention(q, expand_heads(k, H), expand_heads(v, H), attn_mask=mask, scale=scale)


def _moba_select(q, k_mean, qpos, *, block_size: int, topk: int):
    """The `topk - 1` best complete past blocks by q . mean(K_block) per query head: idx (B, H, Tq, n) and ok (a
    block not complete at the query is never picked), None when there is nothing to pick (topk 1, no blocks)."""
    B, H, Tq, _ = q.shape
    NC = k_mean.shape[2]
    n_pick = min(topk - 1, NC)
    if n_pick <= 0:
        return None, None
    gate = torch.matmul(q, expand_heads(k_mean, H).transpose(-1, -2))  # (B, H, Tq, NC)
    past = torch.arange(NC, device=q.device) < (qpos // block_size)[..., None]
    idx = gate.masked_fill(~past, float("-inf")).topk(n_pick, dim=-1).indices
    return idx, past.expand(B, H, Tq, NC).gather(-1, idx)


def _moba_mask(q, k_mean, qpos, n_keys: int, *, block_size: int, topk: int) -> torch.Tensor:
    """MoBA's token mask (B, H, Tq, n_keys) for queries at qpos ((Tq,), or per row (B, 1, Tq)) over keys at
    positions 0 .. n_keys - 1: the own block up to the query, and the `topk - 1` best complete past blocks by
    q . mean(K_block) (k_mean (B, Hkv, NC, D); a block not complete at the query is never picked)."""
    B, H, Tq, _ = q.shape
    NC = k_mean.shape[2]
    blk = (qpos // block_size)[..., None]
    key_pos = torch.arange(n_keys, device=q.device)
    mask = ((key_pos // block_size) == blk) & (key_pos <= qpos[..., None])  # own block, causal
    mask = mask.expand(B, H, Tq, n_keys)
    idx, ok = _moba_select(q, k_mean, qpos, block_size=block_size, topk=topk)
    if idx is not None:
        chosen = torch.zeros(B, H, Tq, NC, dtype=torch.bool, device=q.device).scatter(-1, idx, ok)
        picked = chosen.repeat_interleave(block_size, dim=-1)[..., :n_keys]
        mask = mask | F.pad(picked, (0, n_keys - picked.shape[-1]))
    return mask


def _moba_decode(q, k, v, k_mean, pos: torch.Tensor, *, block_size: int, topk: int, scale: float):
    """One query per row at pos (B,): each query head reads the slots of its own block and of its picked blocks
    (B, H, topk * BS keys gathered, not S)."""
    B, H = q.shape[:2]
    own = (pos // block_size)[:, None, None].expand(B, H, 1)
    blocks, ok = own, torch.ones_like(own, dtype=torch.bool)
    idx, picked_ok = _moba_select(q, k_mean, pos[:, None, None], block_size=block_size, topk=topk)
    if idx is not None:
        blocks, ok = torch.cat([own, idx[:, :, 0]], dim=-1), torch.cat([ok, picked_ok[:, :, 0]], dim=-1)
    slots, valid = _block_slots(blocks, ok, pos, block_size, k.shape[2])  # (B, H, topk * BS)
    return F.scaled_dot_product_attention(q, gather_slots(k, slots), gather_slots(v, slots),
                                          attn_mask=valid[:, :, None], scale=scale)


def moba_attention_static(q, k, v, k_mean, qpos: torch.Tensor, *, block_size: int, topk: int,
                          scale: Optional[float] = None, reference: bool = False):
    """MoBA through a static cache: q (B, H, Tq, D) at per-row positions qpos (B, Tq), k/v (B, Hkv, S, D) with slot
    s holding position s, k_mean (B, Hkv, ceil(S / BS), D) (a block not complete yet: never picked). Reference:
    `_moba_reference` row by row and query by query over the keys up to the query."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if reference:
        return _static_reference(_moba_reference, q, k, v, qpos, block_size, (k_mean,), (), topk=topk, scale=scale)
    if q.shape[2] == 1:  # a decode step reads its blocks' slots only
        return _moba_decode(q, k, v, k_mean, qpos[:, 0], block_size=block_size, topk=topk, scale=scale)
    mask = _moba_mask(q, k_mean, qpos[:, None], k.shape[2], block_size=block_size, topk=topk)
    return grouped_sdpa(q, k, v, mask, scale)


def _moba_reference(q, k, v, k_mean, *, q_start, block_size, topk, scale):
    B, H, Tq, D = q.shape
    G = H // k.shape[1]
    scale = D ** -0.5 if scale is None else scale
    out = torch.zeros_like(q)
    for b in range(B):
        for h in range(H):
            g = h // G
            for i in range(Tq):
                t = q_start + i
                blk = t // block_size
                qi = q[b, h, i]
                blocks = [blk]
                if blk > 0 and topk > 1:  # the past blocks, ranked by q . mean(K_block)
                    gate = k_mean[b, g, :blk] @ qi
                    blocks += gate.topk(min(topk - 1, blk)).indices.tolist()
                keys = [j for c in sorted(blocks) for j in range(c * block_size, min((c + 1) * block_size, t + 1))]
                out[b, h, i] = _softmax_attend(qi, k[b, g, keys], v[b, g, keys], scale)
    return out


def moba_keys(context_len: int, block_size: int, topk: int) -> tuple[float, float]:
    """Average over positions 1..L of (past blocks scored by the gate, keys attended). With topk = 1 the own
    block is the only one read and no block is scored."""
    gate = keys = 0
    for p in range(context_len):
        blk = p // block_size
        gate += blk if topk > 1 else 0
        keys += min(topk - 1, blk) * block_size + p % block_size + 1
    return gate / context_len, keys / context_len


def n_blocks(context_len: int, block_size: int) -> int:
    return math.ceil(context_len / block_size)
