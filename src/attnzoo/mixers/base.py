"""The mixer contract (DESIGN.md section 2) every token mixer implements."""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn


class Mixer(nn.Module):
    """Maps (B, T, d_model) -> (B, T, d_model).

    Subclasses are constructed as `cls(cfg, model_cfg, layer_idx)` and implement:
      forward(x, *, positions, cache=None): positions are absolute token positions (T,); `cache` is this
          layer's cache (from `new_cache`), read and updated in place; None for a plain training forward.
      new_cache(batch, max_len, dtype, device): an empty cache of this mixer's kind.
      cache_bytes(context_len, batch=1, dtype=torch.float32): analytic bytes held after context_len tokens.
      flops_per_token(context_len): forward FLOPs per token, averaged over positions 1..context_len.
    `impl` selects the fast form ("fast") or the slow reference form ("reference") of the same weights.
    """

    impl: str = "fast"

    def __init__(self, cfg: Any, model_cfg: Any, layer_idx: int):
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.d_model = model_cfg.d_model

    def forward(self, x: torch.Tensor, *, positions: torch.Tensor, cache: Optional[Any] = None) -> torch.Tensor:
        raise NotImplementedError

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device | str) -> Any:
        raise NotImplementedError

    def cache_bytes(self, context_len: int, batch: int = 1, dtype: torch.dtype = torch.float32) -> int:
        raise NotImplementedError

    def flops_per_token(self, context_len: int) -> float:
        raise NotImplementedError


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def causal_attended(context_len: int, window: Optional[int] = None) -> float:
    """Average number of keys a query attends over positions 1..L (causal; min(W, t) with a window)."""
    L = context_len
    if window is None or window >= L:
        return (L + 1) / 2.0
    W = window
    # sum_{t=1}^{L} min(W, t) = W(W+1)/2 + (L - W) W
    return (W * (W + 1) / 2.0 + (L - W) * W) / L
