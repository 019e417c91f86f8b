"""Ring attention for context parallelism (context_parallel.py): causal (or bidirectional) softmax attention of
this rank's queries over every rank's K/V blocks (Liu et al. 2023). The K/V blocks travel round the ring, each
block's partial result merges by its log-sum-exp (the online softmax); backward sends the blocks round again with
their gradient accumulators and returns the accumulators home. `MaskSpec` says which keys of a block a query
sees (causal, window, sinks), so blocks no local query can see are skipped. Each block runs through ATen's fused
CPU flash-attention kernel ("fast") or the same math written out in einsums ("reference", other devices).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:  # the ring's process group and layout; that module builds the ring from this one
    from attnzoo.distributed.context_parallel import ContextParallel


@dataclass(frozen=True)
class MaskSpec:
    causal: bool
    window: Optional[int]
    sinks: int
    scale: float

    def visibility(self, q: tuple[int, int], k: tuple[int, int]) -> str:
        """Which keys of positions [k0, k1) the queries [q0, q1) see: "none", "all" or "partial"."""
        (a, b), (c, d) = q, k
        if not self.causal:
            return "all"
        causal_any = c <= b - 1
        if self.window is None:
            if not causal_any:
                return "none"
            return "all" if d - 1 <= a else "partial"
        in_window = causal_any and d - 1 > a - self.window
        sink = self.sinks > 0 and c < self.sinks and causal_any
        if not (in_window or sink):
            return "none"
        return "all" if d - 1 <= a and c > b - 1 - self.window else "partial"

    def mask(self, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
        qi, kj = qpos[:, None], kpos[None, :]
        m = kj <= qi if self.causal else torch.ones(len(qpos), len(kpos), dtype=torch.bool, device=qpos.device)
        if self.window is not None:
            m = m & ((kj > qi - self.window) | (kj < self.sinks))
        return m


_Q_CHUNK = 1024  # query rows per masked block: bounds the (rows x keys) scores / mask held at once


def _bias(spec: MaskSpec, qpos, kpos, vis: str, slopes, H: int, dtype):
    """Additive scores for one block: ALiBi's -slope_h |i - j| (H, Tq, Tk) and -inf where a "partial" block's
    mask hides a key; None when neither applies."""
    bias = None
    if slopes is not None:
        bias = -slopes.to(dtype)[:, None, None] * (qpos[:, None] - kpos[None, :]).abs().to(dtype)
    if vis == "partial":
        hide = torch.zeros(len(qpos), len(kpos), dtype=dtype, device=qpos.device).masked_fill(
            ~spec.mask(qpos, kpos), float("-inf"))
        bias = hide if bias is None else bias + hide
    return bias


def _block_forward_reference(spec, q, k, v, qpos, kpos, vis, slopes):
    """softmax over one block, written out: q (B, H, Tq, D), k/v (B, Hkv, Tk, .) -> (o, lse (B, H, Tq))."""
    B, H, Tq, _ = q.shape
    Hkv = k.shape[1]
    qg = q.reshape(B, Hkv, H // Hkv, Tq, -1)
    s = torch.einsum("bhgqd,bhkd->bhgqk", qg, k) * spec.scale
    bias = _bias(spec, qpos, kpos, vis, slopes, H, s.dtype)
    if bias is not None:
        s = s + (bias.reshape(Hkv, H // Hkv, Tq, -1) if bias.dim() == 3 else bias)
    lse = torch.logsumexp(s, dim=-1)  # -inf for a row with no visible key
    p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0)[..., None])
    o = torch.einsum("bhgqk,bhkd->bhgqd", p, v)
    return o.reshape(B, H, Tq, -1), lse.reshape(B, H, Tq)


def _block_backward_reference(spec, do, q, k, v, out, lse, qpos, kpos, vis, slopes):
    """Gradients of one block given the merged output and log-sum-exp of its query rows (flash-attention's
    backward: P = exp(S - lse), dS = P (dP - rowsum(dO O)))."""
    B, H, Tq, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    qg, dog = q.reshape(B, Hkv, G, Tq, D), do.reshape(B, Hkv, G, Tq, -1)
    s = torch.einsum("bhgqd,bhkd->bhgqk", qg, k) * spec.scale
    bias = _bias(spec, qpos, kpos, vis, slopes, H, s.dtype)
    if bias is not None:
        s = s + (bias.reshape(Hkv, G, Tq, -1) if bias.dim() == 3 else bias)
    p = torch.exp(s - lse.reshape(B, Hkv, G, Tq)[..., None])
    delta = (dog * out.reshape(B, Hkv, G, Tq, -1)).sum(-1, keepdim=True)
    dv = torch.einsum("bhgqk,bhgqd->bhkd", p, dog)
    ds = p * (torch.einsum("bhgqd,bhkd->bhgqk", dog, v) - delta) * spec.scale
    dq = torch.einsum("bhgqk,bhkd->bhgqd", ds, k).reshape(B, H, Tq, D)
    dk = torch.einsum("bhgqk,bhgqd->bhkd", ds, qg)
    return dq, dk, dv


def _flash_inputs(q, k, v):
    """K/V heads expanded to the query heads, v zero-padded to q's head size (the fused kernel's shapes)."""
    G = q.shape[1] // k.shape[1]
    if G > 1:
        k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    pad = q.shape[-1] - v.shape[-1]
    return k, (torch.nn.functional.pad(v, (0, pad)) if pad > 0 else v), pad


def _rows(spec, vis, qpos, kpos, slopes) -> tuple[bool, bool, list[slice]]:
    """(is_causal, needs a mask, row slices): a fully visible block and the causal diagonal block need no mask
    (one kernel call); masked blocks go in chunks of _Q_CHUNK rows."""
    Tq = len(qpos)
    plain_diagonal = vis == "partial" and spec.window is None and torch.equal(qpos, kpos)
    if slopes is None and (vis == "all" or plain_diagonal):
        return plain_diagonal, False, [slice(0, Tq)]
    return False, True, [slice(c, min(Tq, c + _Q_CHUNK)) for c in range(0, Tq, _Q_CHUNK)]


def _block_forward_flash(spec, q, k, v, qpos, kpos, vis, slopes):
    """The same block through ATen's fused CPU flash-attention kernel, which also returns the log-sum-exp."""
    ke, ve, pad = _flash_inputs(q, k, v)
    causal, masked, rows = _rows(spec, vis, qpos, kpos, slopes)
    os_, ls = [], []
    for sl in rows:
        bias = _bias(spec, qpos[sl], kpos, vis, slopes, q.shape[1], q.dtype) if masked else None
        bias = bias[None] if bias is not None and bias.dim() == 3 else bias  # the kernel takes 2 or 4 dims
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[:, :, sl], ke, ve, 0.0, causal, attn_mask=bias, scale=spec.scale)
        if bias is not None:  # a row with no visible key: the kernel reports lse 0, the merge needs -inf
            lse = lse.masked_fill(~torch.isfinite(bias).any(-1), float("-inf"))
        os_.append(o[..., : v.shape[-1]] if pad else o)
        ls.append(lse)
    return torch.cat(os_, dim=2), torch.cat(ls, dim=2)


def _block_backward_flash(spec, do, q, k, v, out, lse, qpos, kpos, vis, slopes):
    ke, ve, pad = _flash_inputs(q, k, v)
    if pad:
        do, out = torch.nn.functional.pad(do, (0, pad)), torch.nn.functional.pad(out, (0, pad))
    causal, masked, rows = _rows(spec, vis, qpos, kpos, slopes)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(ke), torch.zeros_like(ve)
    for sl in rows:
        bias = _bias(spec, qpos[sl], kpos, vis, slopes, q.shape[1], q.dtype) if masked else None
        bias = bias[None] if bias is not None and bias.dim() == 3 else bias
        a, b, c = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do[:, :, sl].contiguous(), q[:, :, sl], ke, ve, out[:, :, sl].contiguous(), lse[:, :, sl].contiguous(),
            0.0, causal, attn_mask=bias, scale=spec.scale)
        dq[:, :, sl], dk, dv = a, dk + b, dv + c
    if pad:
        dv = dv[..., : v.shape[-1]]
    G = q.shape[1] // k.shape[1]
    if G > 1:  # the expanded heads' gradients back onto their shared K/V head
        dk = dk.unflatten(1, (k.shape[1], G)).sum(2)
        dv = dv.unflatten(1, (k.shape[1], G)).sum(2)
    return dq, dk, dv


def _merge(o_acc, lse_acc, o, lse):
    """Two partial softmax results over disjoint keys -> the result over both (rows with no key yet: -inf)."""
    if o_acc is None:
        return o, lse
    new = torch.logaddexp(lse_acc, lse)
    finite = torch.isfinite(new)
    wa = torch.where(finite, torch.exp(lse_acc - new), torch.zeros_like(new))
    wb = torch.where(finite, torch.exp(lse - new), torch.zeros_like(new))
    return o_acc * wa[..., None] + o * wb[..., None], new


class _RingAttention(torch.autograd.Function):
    """Causal (or bidirectional) softmax attention of this rank's queries over every rank's K/V."""

    @staticmethod
    def forward(ctx, q, k, v, slopes, cp: ContextParallel, spec: MaskSpec):
        flash = cp.impl == "fast" and q.device.type == "cpu"
        acc = torch.promote_types(q.dtype, torch.float32)  # the merge's accumulators
        ct = q.dtype if flash else acc
        fwd = _block_forward_flash if flash else _block_forward_reference
        lay, S = cp.layout, cp.layout.seg_len
        qc, k_cur, v_cur = q.to(ct).contiguous(), k.to(ct).contiguous(), v.to(ct).contiguous()
        qranges = lay.ranges(cp.rank)
        n_steps = cp.n_hops(spec)
        o, lse = [None] * len(qranges), [None] * len(qranges)
        for step in range(n_steps):
            pending = cp.exchange([k_cur, v_cur], 1) if step < n_steps - 1 else None
            src = (cp.rank - step) % cp.size
            for ia, qr in enumerate(qranges):
                qpos = torch.arange(*qr, device=q.device)
                for ib, kr in enumerate(lay.ranges(src)):
                    vis = spec.visibility(qr, kr)
                    if vis == "none":
                        continue
                    ob, lb = fwd(spec, qc[:, :, ia * S:(ia + 1) * S], k_cur[:, :, ib * S:(ib + 1) * S],
                                 v_cur[:, :, ib * S:(ib + 1) * S], qpos, torch.arange(*kr, device=q.device), vis, slopes)
                    o[ia], lse[ia] = _merge(o[ia], lse[ia], ob.to(acc), lb.to(acc))
            if pending is not None:
                k_cur, v_cur = pending.wait()
        out = torch.cat(o, dim=2).to(ct)  # (B, H, T, Dv)
        lse_all = torch.cat(lse, dim=2)
        ctx.save_for_backward(q, k, v, out, lse_all, slopes)
        ctx.cp, ctx.spec, ctx.n_steps, ctx.flash = cp, spec, n_steps, flash
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, slopes = ctx.saved_tensors
        cp, spec, n_steps, flash = ctx.cp, ctx.spec, ctx.n_steps, ctx.flash
        bwd = _block_backward_flash if flash else _block_backward_reference
        ct = out.dtype
        lay, S = cp.layout, cp.layout.seg_len
        qc, do = q.to(ct).contiguous(), dout.to(ct).contiguous()
        dq = torch.zeros_like(qc)
        k_cur, v_cur = k.to(ct).contiguous(), v.to(ct).contiguous()
        dk_cur, dv_cur = torch.zeros_like(k_cur), torch.zeros_like(v_cur)
        qranges = lay.ranges(cp.rank)
        for step in range(n_steps):
            pending = cp.exchange([k_cur, v_cur], 1) if step < n_steps - 1 else None
            src = (cp.rank - step) % cp.size
            for ia, qr in enumerate(qranges):
                qs = slice(ia * S, (ia + 1) * S)
                qpos = torch.arange(*qr, device=q.device)
                for ib, kr in enumerate(lay.ranges(src)):
                    vis = spec.visibility(qr, kr)
                    if vis == "none":
                        continue
                    ks = slice(ib * S, (ib + 1) * S)
                    a, b, c = bwd(spec, do[:, :, qs], qc[:, :, qs], k_cur[:, :, ks], v_cur[:, :, ks], out[:, :, qs],
                                  lse[:, :, qs], qpos, torch.arange(*kr, device=q.device), vis, slopes)
                    dq[:, :, qs] += a
                    dk_cur[:, :, ks] += b
                    dv_cur[:, :, ks] += c
            if pending is not None:  # the accumulators travel with their blocks
                dk_cur, dv_cur = cp.exchange([dk_cur, dv_cur], 1).wait()
                k_cur, v_cur = pending.wait()
        if n_steps > 1:  # the accumulators here belong to rank - (n_steps - 1): send them home
            dk_cur, dv_cur = cp.exchange([dk_cur, dv_cur], -(n_steps - 1)).wait()
        return dq.to(q.dtype), dk_cur.to(k.dtype), dv_cur.to(v.dtype), None, None, None
