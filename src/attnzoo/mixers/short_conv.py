"""Short causal depthwise convolution over time, the token-shift in front of recurrent mixers
(H3 / Based "short conv"; used on q/k/v by DeltaNet, Gated DeltaNet and Qwen3-Next's linear layers).

A conv over the concatenation [q | k | v] is the same as separate convs on each (depthwise = one filter
per channel), so one module serves any split. For decoding it keeps the last K-1 inputs (the "conv tail").
Not a mixer: it has no registration; mixers own one.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class ShortConvolution(nn.Module):
    """y_t = act(b + sum_{j=0}^{K-1} w_j * x_{t-K+1+j}) per channel, with x before position 0 taken from
    `tail` (the previous K-1 inputs) or zeros. activation: "silu" or None."""

    def __init__(self, channels: int, kernel_size: int = 4, bias: bool = False, activation: Optional[str] = "silu"):
        super().__init__()
        self.channels, self.kernel_size, self.activation = channels, kernel_size, activation
        # same init as nn.Conv1d(groups=channels): fan_in = kernel_size
        bound = 1.0 / math.sqrt(kernel_size)
        self.weight = nn.Parameter(torch.empty(channels, kernel_size).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(channels).uniform_(-bound, bound)) if bias else None

    def _act(self, y: torch.Tensor) -> torch.Tensor:
        return F.silu(y) if self.activation == "silu" else y

    def empty_tail(self, batch: int, dtype: torch.dtype, device) -> torch.Tensor:
        return torch.zeros(batch, self.channels, self.kernel_size - 1, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, tail: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, C), tail (B, C, K-1) or None -> (y (B, T, C), new tail (B, C, K-1))."""
        B, T, C = x.shape
        if tail is None:
            tail = self.empty_tail(B, x.dtype, x.device)
        if T == 1:
            return self.step(x[:, 0], tail)
        xp = torch.cat([tail.to(x.dtype), x.transpose(1, 2)], dim=-1)  # (B, C, K-1+T)
        y = F.conv1d(xp, self.weight[:, None, :].to(x.dtype), None if self.bias is None else self.bias.to(x.dtype), groups=C)
        return self._act(y).transpose(1, 2), xp[..., xp.shape[-1] - (self.kernel_size - 1) :]

    def step(self, x: torch.Tensor, tail: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token: x (B, C), tail (B, C, K-1) -> (y (B, 1, C), new tail)."""
        window = torch.cat([tail.to(x.dtype), x[..., None]], dim=-1)  # (B, C, K)
        y = (window * self.weight.to(x.dtype)).sum(-1)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return self._act(y)[:, None], window[..., 1:]

    def flops_per_token(self) -> float:
        return 2.0 * self.channels * self.kernel_size
