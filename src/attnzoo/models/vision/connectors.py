"""The three ways image tokens meet a language model (model/connector), as parts:

- `Projector` (concat, LLaVA: Liu et al. 2023, arXiv:2304.08485): image tokens -> Linear (or Linear-GELU-Linear,
  LLaVA-1.5) -> d_model, then prepended to the text tokens; the decoder's own self-attention reads them.
- `GatedCrossAttention` (cross_attention, Flamingo: Alayrac et al. 2022, arXiv:2204.14198; IDEFICS): a layer
  inserted before decoder blocks, h + tanh(a) * xattn(norm(h), image), then h + tanh(b) * ffn(norm(h)), with
  a = b = 0 at init, so the model starts as the text-only decoder. The image's K/V are projected once per
  image (`image_kv`, a CrossAttentionCache) and reused by every decoding step.
- `PerceiverResampler` (resampler, Flamingo / Idefics2): n learned queries cross-attend to the image tokens
  (keys/values over [image tokens; queries]) in `depth` layers, so the connector sees n tokens per image
  whatever the image size.

Parity with transformers' `IdeficsGatedCrossAttentionLayer` and `Idefics2PerceiverResampler` (weights copied):
tests/test_multimodal.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attnzoo.config.schema import ModelConfig
from attnzoo.models.encoder_decoder import CrossAttentionCache
from attnzoo.layers.ffn import SwiGLU, SwiGLUConfig, build_ffn
from attnzoo.mixers.base import dtype_bytes
from attnzoo.layers.norm import RMSNorm, build_norm


def _no_decay(p: nn.Parameter) -> nn.Parameter:
    p._no_weight_decay = True
    return p


class Projector(nn.Module):
    """(B, M, d_image) -> (B, M, d_model): linear (LLaVA) or Linear-GELU-Linear (mlp, LLaVA-1.5)."""

    def __init__(self, d_image: int, d_model: int, kind: str = "mlp"):
        super().__init__()
        layers = [nn.Linear(d_image, d_model)]
        if kind == "mlp":
            layers += [nn.GELU(), nn.Linear(d_model, d_model)]
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def flops_per_token(self) -> float:
        return sum(2.0 * m.in_features * m.out_features for m in self.net if isinstance(m, nn.Linear))


class GatedCrossAttention(nn.Module):
    """Text queries (n_heads of head_dim, from the decoder's d_model) over image keys/values (from d_image).

    `image_kv(image (B, M, d_image)) -> CrossAttentionCache` (k, v: (B, n_heads, M, head_dim)), once per image;
    `forward(h (B, T, d_model), kv) -> (B, T, d_model)`."""

    def __init__(self, cfg: ModelConfig, d_image: int, gate: str = "float", layer_idx: int = 0):
        super().__init__()
        d, self.n_heads, self.head_dim = cfg.d_model, cfg.n_heads, cfg.head_dim
        inner = self.n_heads * self.head_dim
        self.norm1 = build_norm(cfg.norm, d)
        self.q_proj = nn.Linear(d, inner, bias=False)
        self.k_proj = nn.Linear(d_image, inner, bias=False)
        self.v_proj = nn.Linear(d_image, inner, bias=False)
        self.o_proj = nn.Linear(inner, d, bias=False)
        self.norm2 = build_norm(cfg.norm, d)
        self.ffn = build_ffn(cfg.ffn, cfg, layer_idx)
        shape = (1,) if gate == "float" else (1, 1, d)
        self.alpha_attn = _no_decay(nn.Parameter(torch.zeros(shape)))  # tanh(0) = 0: closed at init
        self.alpha_ffn = _no_decay(nn.Parameter(torch.zeros(shape)))

    def image_kv(self, image: torch.Tensor) -> CrossAttentionCache:
        B, M, _ = image.shape
        k = self.k_proj(image).view(B, M, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, M, D)
        v = self.v_proj(image).view(B, M, self.n_heads, self.head_dim).transpose(1, 2)
        return CrossAttentionCache(k, v)

    def forward(self, h: torch.Tensor, kv: CrossAttentionCache) -> torch.Tensor:
        B, T, _ = h.shape
        q = self.q_proj(self.norm1(h)).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        y = F.scaled_dot_product_attention(q, kv.k, kv.v)  # every text token sees the whole image
        h = h + torch.tanh(self.alpha_attn) * self.o_proj(y.transpose(1, 2).reshape(B, T, -1))
        return h + torch.tanh(self.alpha_ffn) * self.ffn(self.norm2(h))

    def cache_bytes(self, image_tokens: int, batch: int = 1, dtype: torch.dtype = torch.float32) -> int:
        return 2 * self.n_heads * self.head_dim * image_tokens * batch * dtype_bytes(dtype)

    def flops_per_token(self, image_tokens: int) -> float:
        """Per text token: q and output projections, QK^T and PV over the image tokens, the FFN."""
        inner = self.n_heads * self.head_dim
        return 2.0 * 2 * self.q_proj.in_features * inner + 2.0 * 2 * inner * image_tokens + self.ffn.flops_per_token()

    def kv_flops_per_image_token(self) -> float:
        return 2.0 * 2 * self.k_proj.in_features * self.k_proj.out_features


class ResamplerLayer(nn.Module):
    """latents + attn(norm(latents), keys/values over [norm(context); norm(latents)]), then + SwiGLU(norm(.))."""

    def __init__(self, d: int, n_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, head_dim
        self.input_latents_norm = RMSNorm(d, eps)
        self.input_context_norm = RMSNorm(d, eps)
        self.q_proj = nn.Linear(d, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(d, n_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d, n_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * head_dim, d, bias=False)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.mlp = SwiGLU(SwiGLUConfig(d_ff=4 * d), d)

    def forward(self, latents: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        B, n, _ = latents.shape
        lat = self.input_latents_norm(latents)
        both = torch.cat([self.input_context_norm(context), lat], dim=1)  # (B, N + n, d)
        heads = lambda t: t.view(B, t.shape[1], self.n_heads, self.head_dim).transpose(1, 2)  # noqa: E731
        y = F.scaled_dot_product_attention(heads(self.q_proj(lat)), heads(self.k_proj(both)), heads(self.v_proj(both)))
        latents = latents + self.o_proj(y.transpose(1, 2).reshape(B, n, -1))
        return latents + self.mlp(self.post_attention_layernorm(latents))

    def flops(self, n: int, context: int) -> float:
        inner, d = self.n_heads * self.head_dim, self.q_proj.in_features
        keys = context + n
        return (2.0 * d * inner * n * 2  # q and o projections of the latents
                + 2.0 * 2 * d * inner * keys  # k and v over context + latents
                + 2.0 * 2 * inner * n * keys  # QK^T and PV
                + n * self.mlp.flops_per_token())


class PerceiverResampler(nn.Module):
    """`forward(context (B, N, d)) -> (B, n_queries, d)`: learned queries, `depth` ResamplerLayers, RMSNorm."""

    def __init__(self, d: int, n_queries: int, depth: int, n_heads: int, head_dim: int, eps: float = 1e-6):
        super().__init__()
        self.latents = nn.Parameter(torch.randn(n_queries, d) * 0.02)
        self.layers = nn.ModuleList(ResamplerLayer(d, n_heads, head_dim, eps) for _ in range(depth))
        self.norm = RMSNorm(d, eps)

    def forward(self, context: torch.Tensor) -> torch.Tensor:
        latents = self.latents.unsqueeze(0).expand(context.shape[0], -1, -1)
        for layer in self.layers:
            latents = layer(latents, context)
        return self.norm(latents)

    def flops_per_image(self, context: int) -> float:
        return sum(layer.flops(self.latents.shape[0], context) for layer in self.layers)
