"""Cross-entropy from the final hidden states and the LM head, a chunk of tokens at a time (trainer.ce_chunk_tokens).

The full logits of N tokens over a vocabulary V are N x V floats (4 GiB in fp32 for 32k tokens x 32k vocabulary),
and F.cross_entropy's backward makes a second tensor of that size for their gradient. `chunked_cross_entropy`
never holds either: for each chunk of C tokens it computes the chunk's logits (C, V) in fp32, the loss, and at
once the chunk's share of the gradients of the hidden states and of the head weight (softmax - one-hot, times the
token's weight), then drops the chunk. Backward only scales those gradients by the incoming scalar. This is
Liger-Kernel's fused linear cross-entropy (Hsu et al. 2024, arXiv:2410.10989); Cut Cross-Entropy (Wijmans et al.
2024, arXiv:2411.09009) recomputes each chunk in backward instead (one more matmul per chunk, nothing stored).

Extra memory: one chunk's (C, V) fp32 logits/probabilities, plus the gradients (N, d) and (V, d) that backward
would make anyway. FLOPs: the three matmuls of logits forward + backward, the same as the full form.

`reference_cross_entropy` is the plain form over full logits (the oracle the tests compare with).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from attnzoo.ops.dispatch import autocast_off


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: autocast's when it is on (as nn.Linear would), else the input's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _chunk(h: torch.Tensor, t: torch.Tensor, m: torch.Tensor, w: torch.Tensor, acc: torch.dtype,
           grad_h: Optional[torch.Tensor], grad_w: Optional[torch.Tensor]) -> torch.Tensor:
    """One chunk: h (C, d) and w (V, d) in the compute dtype, t (C,) targets, m (C,) token weights. Returns the sum
    of m * ce; writes d/dh into grad_h (C, d) and adds d/dw into grad_w (V, d) (None: not wanted). Its (C, V)
    tensor dies on return, before the next chunk's is made."""
    logits = (h @ w.t()).to(acc)  # (C, V); the only chunk-sized tensor, reused in place below
    target_logit = logits.gather(1, t[:, None]).squeeze(1)
    mx = logits.amax(dim=1, keepdim=True)
    p = logits.sub_(mx).exp_()
    sum_exp = p.sum(dim=1, keepdim=True)
    loss = ((mx.squeeze(1) + sum_exp.log().squeeze(1) - target_logit) * m).sum()
    if grad_h is None and grad_w is None:
        return loss
    # d(sum_i m_i ce_i) / d logits = m_i (softmax_i - onehot(t_i))
    g = p.div_(sum_exp)
    g[torch.arange(g.shape[0], device=g.device), t] -= 1.0
    g = g.mul_(m[:, None]).to(h.dtype)
    if grad_h is not None:
        grad_h.copy_(g @ w)
    if grad_w is not None:
        if g.dtype == grad_w.dtype:
            grad_w.addmm_(g.t(), h)
        else:  # bf16: the chunk's product as nn.Linear's backward makes it, summed in fp32
            grad_w += (g.t() @ h).to(grad_w.dtype)
    return loss


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, mask, chunk: int, dtype: torch.dtype, ignore_index: int, want_grad: bool):
        N = hidden.shape[0]
        acc = torch.promote_types(dtype, torch.float32)  # the softmax and the sums: fp32 (fp64 for fp64 inputs)
        w = weight.to(dtype)  # (V, d)
        grad_h = torch.empty_like(hidden) if want_grad and ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_grad and ctx.needs_input_grad[1] \
            else None
        total = torch.zeros((), dtype=acc, device=hidden.device)
        for s in range(0, N, chunk):
            t = targets[s:s + chunk]
            keep = t != ignore_index
            m = keep.to(acc) if mask is None else mask[s:s + chunk].to(acc) * keep
            total += _chunk(hidden[s:s + chunk].to(dtype), torch.where(keep, t, 0), m, w, acc,
                            None if grad_h is None else grad_h[s:s + chunk], grad_w)
        ctx.weight_dtype = weight.dtype
        ctx.save_for_backward(grad_h, grad_w)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        dh = None if grad_h is None else grad_h * grad_out.to(grad_h.dtype)
        dw = None if grad_w is None else (grad_w * grad_out.to(grad_w.dtype)).to(ctx.weight_dtype)
        return dh, dw, None, None, None, None, None, None


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          mask: Optional[torch.Tensor] = None, *, chunk_tokens: int,
                          ignore_index: int = -100) -> torch.Tensor:
    """Sum over tokens of mask * cross_entropy(hidden @ weight.T, targets), never holding the (N, V) logits.

    hidden (..., d): final hidden states; weight (V, d): the LM head (tied embeddings: the embedding table);
    targets (...) int64; mask (...) bool or float token weights (None: 1); a target equal to `ignore_index`
    counts 0 (as F.cross_entropy). chunk_tokens: tokens per chunk (the last chunk may be shorter).
    Returns a scalar in fp32 (fp64 for fp64 inputs); the matmuls run in autocast's dtype when it is on.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens: must be >= 1, got {chunk_tokens}")
    d = hidden.shape[-1]
    want_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    h = hidden.reshape(-1, d)
    m = None if mask is None else mask.reshape(-1)
    dtype = compute_dtype(hidden)
    with autocast_off(hidden.device.type):  # the op casts explicitly
        return _ChunkedCrossEntropy.apply(h, weight, targets.reshape(-1), m, int(chunk_tokens), dtype, ignore_index,
                                          want_grad)


def reference_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                            mask: Optional[torch.Tensor] = None, ignore_index: int = -100) -> torch.Tensor:
    """The same sum over full logits (F.linear + F.cross_entropy in fp32): the oracle of chunked_cross_entropy."""
    logits = F.linear(hidden, weight)
    acc = torch.promote_types(logits.dtype, torch.float32)
    ce = F.cross_entropy(logits.to(acc).reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none",
                         ignore_index=ignore_index)
    return ce.sum() if mask is None else (ce * mask.reshape(-1).to(acc)).sum()
