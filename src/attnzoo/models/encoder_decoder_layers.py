"""The parts of the encoder-decoder and the encoder-only MLM (encoder_decoder.py): attention over a padded source, cross-attention and its cache, the encoder and
decoder layers, positions, the shared encoder stack and its initialisation.

The encoder self-attention and the cross-attention kinds are the registered mixers whose class is
`bidirectional` (mha / gqa / mqa): their config's `kv_heads` gives the K/V heads.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from attnzoo.config.registry import MIXERS
from attnzoo.config.schema import ModelConfig
from attnzoo.layers.ffn import build_ffn
from attnzoo.layers.kv_cache import LayerCache
from attnzoo.layers.norm import build_norm
from attnzoo.layers.position import AbsolutePosition, sinusoidal_table
from attnzoo.mixers.attention import Attention
from attnzoo.mixers.base import dtype_bytes
from attnzoo.models.decoder import residual
from attnzoo.models.encdec_options import EncDecOptions, attention_kinds, check_decoder_causal, split_config  # noqa: F401
from attnzoo.ops.attention import attention_reference


class CrossAttentionCache(LayerCache):
    """Encoder-decoder cross-attention (attnzoo.models.encoder_decoder): the keys/values of the encoder memory, projected
    once per source and reused by every decoding step. k, v of shape (B, n_kv_heads, S, head_dim).
    Bytes do not grow with the generated length."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v


# ----------------------------------------------------------------------------- attention over a padded source


def padded_attention(q, k, v, key_mask: Optional[torch.Tensor], *, scale=None, dropout_p: float = 0.0,
                     reference: bool = False, return_weights: bool = False):
    """Unmasked-in-time attention over keys some of which are padding.

    q (B, H, Tq, D), k/v (B, Hkv, Tk, D), key_mask (B, Tk) bool True = real key (None: all real) -> (B, H, Tq, D).
    Every row has at least one real key, so no row is fully masked. `reference` (or `return_weights`) runs the
    explicit softmax of ops/attention.py; weights are (B, H, Tq, Tk) with exact zeros on padding keys.
    """
    mask = None if key_mask is None else key_mask[:, None, None, :]  # (B, 1, 1, Tk): broadcast over heads, queries
    if reference or return_weights:
        return attention_reference(q, k, v, mask=mask, scale=scale, return_weights=return_weights)
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, dropout_p=dropout_p)


def _merge_heads(y: torch.Tensor) -> torch.Tensor:
    B, H, T, D = y.shape
    return y.transpose(1, 2).reshape(B, T, H * D)  # (B, T, H*D)


def encoder_self_attention(attn: Attention, x, positions, key_mask) -> torch.Tensor:
    """The zoo's Attention (causal=False) with a key padding mask: its projections (and RoPE if any), then
    `padded_attention`, then its output projection. x (B, S, d) -> (B, S, d)."""
    q, k, v = attn.project(x, positions)
    y = padded_attention(q, k, v, key_mask, scale=attn.scale, reference=attn.impl == "reference",
                         dropout_p=attn.dropout if attn.training else 0.0)
    return attn.output(y, x)


class CrossAttention(nn.Module):
    """Queries from the decoder, keys/values from the encoder memory (no positions, no causality).

    n_heads query heads share n_kv_heads K/V heads (MHA / GQA / MQA). `memory_kv(memory)` projects the memory
    once into a CrossAttentionCache; `forward(x, kv, key_mask)` attends with it.
    """

    impl: str = "fast"

    def __init__(self, cfg: ModelConfig, opts: EncDecOptions):
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, opts.cross_kv(cfg)
        self.head_dim = cfg.head_dim  # resolved by config.resolve_model
        self.dropout = cfg.dropout
        self.q_proj = nn.Linear(cfg.d_model, self.n_heads * self.head_dim, bias=opts.attn_bias)
        self.kv_proj = nn.Linear(cfg.d_model, 2 * self.n_kv_heads * self.head_dim, bias=opts.attn_bias)  # fused [k | v]
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.d_model, bias=opts.attn_bias)

    def memory_kv(self, memory: torch.Tensor) -> CrossAttentionCache:
        B, S, _ = memory.shape
        k, v = self.kv_proj(memory).view(B, S, 2, self.n_kv_heads, self.head_dim).unbind(2)
        return CrossAttentionCache(k.transpose(1, 2), v.transpose(1, 2))  # (B, Hkv, S, D) each

    def forward(self, x: torch.Tensor, kv: CrossAttentionCache, key_mask: Optional[torch.Tensor],
                return_weights: bool = False):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        out = padded_attention(q, kv.k, kv.v, key_mask, reference=self.impl == "reference",
                               return_weights=return_weights, dropout_p=self.dropout if self.training else 0.0)
        if return_weights:
            y, w = out
            return self.o_proj(_merge_heads(y)), w  # w (B, H, T, S): scores [L_q, L_k] per head
        return self.o_proj(_merge_heads(out))

    def cache_bytes(self, source_len: int, batch: int = 1, dtype: torch.dtype = torch.float32) -> int:
        return 2 * self.n_kv_heads * self.head_dim * source_len * batch * dtype_bytes(dtype)

    def flops_per_token(self, source_len: int) -> float:
        """Per target token: q and output projections, QK^T and PV over the source (K/V projection counted
        per source token by `kv_flops_per_source_token`)."""
        d, hd = self.q_proj.in_features, self.n_heads * self.head_dim
        return 2.0 * 2 * d * hd + 2.0 * 2 * hd * source_len

    def kv_flops_per_source_token(self) -> float:
        return 2.0 * self.kv_proj.in_features * self.kv_proj.out_features


# ----------------------------------------------------------------------------- layers


class _Residual(nn.Module):
    """One sublayer with its norm: post-norm norm(h + f(h)) (paper) or pre-norm h + f(norm(h))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.pre = cfg.norm_position == "pre"
        self.norm = build_norm(cfg.norm, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()

    def forward(self, h: torch.Tensor, f) -> torch.Tensor:
        return residual(h, f, self.norm, self.drop, self.pre)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, attn_cfg: Any, layer_idx: int):
        super().__init__()
        self.attn = MIXERS.get(attn_cfg.name).cls(attn_cfg, cfg, layer_idx)
        self.ffn = build_ffn(cfg.ffn, cfg, layer_idx)
        self.sub_attn, self.sub_ffn = _Residual(cfg), _Residual(cfg)

    def forward(self, h, positions, key_mask):
        h = self.sub_attn(h, lambda x: encoder_self_attention(self.attn, x, positions, key_mask))
        return self.sub_ffn(h, self.ffn)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, mixer_cfg: Any, opts: EncDecOptions, layer_idx: int):
        super().__init__()
        check_decoder_causal(mixer_cfg)
        self.self_attn = MIXERS.get(mixer_cfg.name).cls(mixer_cfg, cfg, layer_idx)
        self.cross = CrossAttention(cfg, opts)
        self.ffn = build_ffn(cfg.ffn, cfg, layer_idx)
        self.sub_self, self.sub_cross, self.sub_ffn = _Residual(cfg), _Residual(cfg), _Residual(cfg)

    def forward(self, h, positions, cross_kv: CrossAttentionCache, key_mask, cache=None):
        h = self.sub_self(h, lambda x: self.self_attn(x, positions=positions, cache=cache))
        h = self.sub_cross(h, lambda x: self.cross(x, cross_kv, key_mask))
        return self.sub_ffn(h, self.ffn)


class Positions(nn.Module):
    """Additive absolute positions: sinusoidal in either layout, learned, or none (rope lives in the mixers)."""

    def __init__(self, cfg: ModelConfig, layout: str):
        super().__init__()
        self.kind, self.layout, self.d = cfg.position.name, layout, cfg.d_model
        self.absolute = AbsolutePosition(cfg.position, cfg.d_model, cfg.max_seq_len)

    def forward(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.kind == "sinusoidal" and self.layout == "concat":
            pe = sinusoidal_table(positions, self.d)  # (T, d) interleaved [sin0, cos0, sin1, cos1, ...]
            return h + torch.cat([pe[:, 0::2], pe[:, 1::2]], dim=-1).to(h.dtype)  # -> [sin... | cos...]
        return self.absolute(h, positions)


def _init_weights(module: nn.Module, d_model: int) -> None:
    """Xavier-uniform matrices, zero biases, N(0, d^-1/2) embeddings (fairseq's Transformer; with the
    sqrt(d) embedding scale the embedded tokens start at unit variance)."""
    if isinstance(module, nn.Linear):
        nn.init.xavier_uniform_(module.weight)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=d_model**-0.5)


class _Encoder(nn.Module):
    """Embedding + positions + encoder stack (+ final norm under pre-norm). Shared by both models."""

    def __init__(self, cfg: ModelConfig, opts: EncDecOptions, embed: nn.Embedding):
        super().__init__()
        n = opts.n_encoder_layers or cfg.n_layers
        attn_cfg = opts.encoder_config()
        self.embed, self.scale = embed, math.sqrt(cfg.d_model) if opts.embed_scale else 1.0
        self.position = Positions(cfg, opts.sinusoidal_layout)
        self.drop = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
        self.layers = nn.ModuleList(EncoderLayer(cfg, attn_cfg, i) for i in range(n))
        self.norm = build_norm(cfg.norm, cfg.d_model) if cfg.norm_position == "pre" else nn.Identity()

    def forward(self, src: torch.Tensor, src_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        positions = torch.arange(src.shape[1], device=src.device)
        h = self.drop(self.position(self.embed(src) * self.scale, positions))
        for layer in self.layers:
            h = layer(h, positions, src_mask)
        return self.norm(h)  # (B, S, d)
