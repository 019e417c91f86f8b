"""Multi-head Latent Attention (MLA), DeepSeek-V2 (arXiv:2405.04434) / DeepSeek-V3 (arXiv:2412.19437).

Keys and values come from one low-rank latent per token, and position enters through a separate RoPE key
shared by all heads ("decoupled RoPE"), so the cache holds only kv_lora_rank + qk_rope_head_dim values
per token and layer:

    x ──q_proj (or q_a_proj -> RMSNorm -> q_b_proj)──> per head [q_nope (dn) | q_rope (dr)] -> RoPE on q_rope
    x ──kv_a_proj──> [c_kv (r) | k_rope (dr)];  c_kv -> RMSNorm;  k_rope -> RoPE (one head, shared)
      cache: [c_kv | k_rope]                                          <- all that decoding keeps
    c_kv ──kv_b_proj──> per head [k_nope (dn) | v (dv)]
    score_h(t, s) = (q_nope_h(t) . k_nope_h(s) + q_rope_h(t) . k_rope(s)) * (dn + dr)^-1/2
    out = o_proj(concat_h softmax(score_h) v_h)

Two forms of the same weights (kv_b_proj = [W_UK | W_UV] per head):
- expanded (training, prefill): up-project the latents to per-head k_nope and v, then SDPA.
- absorbed (decode): q_nope_h . (W_UK_h c) = (W_UK_h^T q_nope_h) . c, so each head's query moves into latent
  space, attends over the cached [c_kv | k_rope] directly (one shared "key head", like MQA), and the
  latent output is projected to v_h by W_UV_h afterwards. Cached latents are never re-expanded.
`impl = "reference"` runs the expanded form through the explicit softmax of ops/attention.py.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from attnzoo.layers.kv_cache import LayerCache
from attnzoo.layers.norm import RMSNorm
from attnzoo.distributed import context_parallel as parallel
from attnzoo.ops.attention import attention_mask, attention_reference, attention_sdpa
from attnzoo.layers.position import rotary_from_config
from attnzoo.config.registry import register_mixer
from attnzoo.mixers.base import HF_LATENT_ATTENTION, Mixer, causal_attended, dtype_bytes
from attnzoo.mixers.configs import MLAConfig  # noqa: F401 (torch-free: config checks)


class LatentCache(LayerCache):
    """MLA's cache (DeepSeek-V2): per token only the normed KV latent and the shared RoPE key.

    One tensor `latent` of shape (B, T, kv_lora_rank + qk_rope_head_dim), laid out [c_kv | k_rope], so the
    absorbed decode attends over it without a per-step concatenation. Never the expanded per-head K/V.
    """

    def __init__(self, kv_lora_rank: int) -> None:
        self.kv_lora_rank = kv_lora_rank
        self.latent: Optional[torch.Tensor] = None

    @property
    def seq_len(self) -> int:
        return 0 if self.latent is None else self.latent.shape[1]

    @property
    def c_kv(self) -> torch.Tensor:
        return self.latent[..., : self.kv_lora_rank]

    @property
    def k_rope(self) -> torch.Tensor:
        return self.latent[..., self.kv_lora_rank :]

    def update(self, latent: torch.Tensor) -> torch.Tensor:
        """Append new (B, t, kv_lora_rank + qk_rope_head_dim) entries; return all of them so far."""
        self.latent = latent.contiguous() if self.latent is None else torch.cat([self.latent, latent], dim=1)
        return self.latent


class StaticLatentCache(LayerCache):
    """MLA's static cache (Mixer.new_static_cache): latent (B, max_len, kv_lora_rank + qk_rope_head_dim) allocated
    once, slot s = position s, written in place at each row's positions; read under the mask slot <= position."""

    static = True

    def __init__(self, batch: int, max_len: int, width: int, dtype: torch.dtype, device,
                 conv_tail: Optional[torch.Tensor] = None) -> None:
        self.latent = torch.zeros(batch, max_len, width, dtype=dtype, device=device)
        self.conv_tail = conv_tail

    def write(self, latent: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """New (B, T, width) latents at `positions` (B, T); returns every slot."""
        rows = torch.arange(latent.shape[0], device=latent.device)[:, None]
        self.latent[rows, positions] = latent.to(self.latent.dtype)
        return self.latent

    def filled_bytes(self, lengths: torch.Tensor) -> int:
        per_token = self.latent.shape[2] * self.latent.element_size()
        tail = 0 if self.conv_tail is None else self.conv_tail.numel() * self.conv_tail.element_size()
        return per_token * int(lengths.clamp(max=self.latent.shape[1]).sum()) + tail


@register_mixer("mla", MLAConfig)
class MLA(Mixer):
    kernel_family = "latent"
    hf_layer = HF_LATENT_ATTENTION  # DeepSeek-V3; Kimi Linear's full_attention layers (NoPE: model position none)

    @classmethod
    def mup_qk_grows(cls, cfg) -> bool:  # softmax logits: q.k / d under µP (Mixer.mup_qk_scale)
        return True

    def __init__(self, cfg: MLAConfig, model_cfg, layer_idx: int):
        super().__init__(cfg, model_cfg, layer_idx)
        s = cfg.sizes(model_cfg)
        H, d = model_cfg.n_heads, model_cfg.d_model
        self.n_heads = H
        self.q_lora_rank, self.kv_lora_rank = s["q_lora_rank"], s["kv_lora_rank"]
        self.dn, self.dr, self.dv = s["qk_nope_head_dim"], s["qk_rope_head_dim"], s["v_head_dim"]
        self.scale = self.mup_qk_scale(model_cfg, self.dn + self.dr, cfg.softmax_scale or (self.dn + self.dr) ** -0.5,
                                       cfg.softmax_scale)
        self.dropout = model_cfg.dropout
        qk = self.dn + self.dr
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(d, H * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, self.q_lora_rank, bias=cfg.bias)
            self.q_a_norm = RMSNorm(self.q_lora_rank, cfg.norm_eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, H * qk, bias=False)
        self.kv_a_proj = nn.Linear(d, self.kv_lora_rank + self.dr, bias=cfg.bias)  # [c_kv | k_rope]
        self.kv_a_norm = RMSNorm(self.kv_lora_rank, cfg.norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, H * (self.dn + self.dv), bias=False)  # per head [W_UK | W_UV]
        self.o_proj = nn.Linear(H * self.dv, d, bias=cfg.bias)
        pos = model_cfg.position
        # the decoupled key is the only place position enters, so it rotates fully (rotary_fraction is for
        # ordinary heads); without RoPE in the model it is just a shared, position-free key part
        self.rope = rotary_from_config(pos, self.dr, model_cfg.max_seq_len, rotary_fraction=1.0)
        self.build_input_conv(cfg.conv_size, cfg.conv_bias)

    @classmethod
    def hf_mixer_config(cls, c: dict) -> dict:
        """DeepSeek-V3's attention fields (Kimi Linear's MLA layers have the same, without rope_interleave: they apply
        no RoPE); the q/kv latent RMSNorms use eps 1e-6 in both."""
        return {"name": "mla", "q_lora_rank": c.get("q_lora_rank"), "kv_lora_rank": c["kv_lora_rank"],
                "qk_nope_head_dim": c["qk_nope_head_dim"], "qk_rope_head_dim": c["qk_rope_head_dim"],
                "v_head_dim": c["v_head_dim"], "rope_interleave": bool(c.get("rope_interleave", True)),
                "bias": bool(c.get("attention_bias", False)), "norm_eps": 1e-6}

    # ------------------------------------------------------------------ projections
    def _rotate(self, x: torch.Tensor, cos_sin) -> torch.Tensor:
        if self.rope is None:
            return x
        if self.cfg.rope_interleave:
            # pairs (x0,x1),(x2,x3).. -> [evens | odds]; rotate-half on that equals rotating each pair, and q
            # and k share the permutation, so scores equal DeepSeek's interleaved RoPE exactly
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return self.rope(x, None, cos_sin)

    def query_input(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, d) -> what the per-head query projection reads: the normed query latent c_q (B, T, q_lora_rank),
        or x itself without one (DSA's indexer reads it too: mixers/dsa.py)."""
        return x if self.q_lora_rank is None else self.q_a_norm(self.q_a_proj(x))

    def project(self, x: torch.Tensor, positions: torch.Tensor, q_in: Optional[torch.Tensor] = None):
        """x (B, T, d) -> q_nope (B, H, T, dn), q_rope (B, H, T, dr), latent (B, T, r + dr) = [c_kv | k_rope].
        q_in: `query_input(x)` when the caller has it already."""
        B, T, _ = x.shape
        q_in = self.query_input(x) if q_in is None else q_in
        q = self.q_proj(q_in) if self.q_lora_rank is None else self.q_b_proj(q_in)
        q = q.view(B, T, self.n_heads, self.dn + self.dr).transpose(1, 2)  # (B, H, T, dn + dr)
        q_nope, q_rope = q.split([self.dn, self.dr], dim=-1)
        c_kv, k_rope = self.kv_a_proj(x).split([self.kv_lora_rank, self.dr], dim=-1)  # (B, T, r), (B, T, dr)
        cs = self.rope.cos_sin(positions, x.dtype) if self.rope is not None else None
        # per-row positions (B, T) give (B, 1, T, dr) phases, for the heads of q; the shared key has no head dim
        cs_k = tuple(c[:, 0] for c in cs) if cs is not None and positions.dim() == 2 else cs
        q_rope, k_rope = self._rotate(q_rope, cs), self._rotate(k_rope, cs_k)
        return q_nope, q_rope, torch.cat([self.kv_a_norm(c_kv), k_rope], dim=-1)

    def expand(self, latent: torch.Tensor):
        """latent (B, S, r + dr) -> per-head k (B, H, S, dn + dr) and v (B, H, S, dv)."""
        B, S, _ = latent.shape
        c_kv, k_rope = latent.split([self.kv_lora_rank, self.dr], dim=-1)
        kv = self.kv_b_proj(c_kv).view(B, S, self.n_heads, self.dn + self.dv).transpose(1, 2)
        k_nope, v = kv.split([self.dn, self.dv], dim=-1)
        k = torch.cat([k_nope, k_rope[:, None].expand(B, self.n_heads, S, self.dr)], dim=-1)
        return k, v

    # ------------------------------------------------------------------ the two attention forms
    def attend_expanded(self, q_nope, q_rope, latent, visible=None) -> torch.Tensor:
        """(B, H, T, dn), (B, H, T, dr), (B, S, r + dr) -> (B, H, T, dv); queries are the last T of S, or, with
        `visible` (B, T, S) (a static cache's slots), see the keys it marks."""
        k, v = self.expand(latent)
        q = torch.cat([q_nope, q_rope], dim=-1)
        T, S = q.shape[2], k.shape[2]
        if visible is not None:
            if self.impl == "reference":
                return attention_reference(q, k, v, mask=visible[:, None], scale=self.scale)
            E = q.shape[-1]
            v = F.pad(v, (0, E - self.dv)) if self.dv < E else v
            p = self.dropout if self.training else 0.0  # a training forward with a mask of its own (DSA's top-k)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None], scale=self.scale,
                                                  dropout_p=p)[..., : self.dv]
        if self.impl == "reference":
            mask = attention_mask(T, S, causal=True, device=q.device)
            return attention_reference(q, k, v, mask=mask, scale=self.scale)
        E = q.shape[-1]
        if self.dv < E:
            # SDPA's fused kernels need v's head dim == q's; otherwise CPU falls back to the math kernel
            # (measured 6x slower at T=2048, dims 96/64). Zero-padding v changes nothing but the kernel.
            v = F.pad(v, (0, E - self.dv))
        y = attention_sdpa(q, k, v, causal=True, scale=self.scale, dropout_p=self.dropout if self.training else 0.0)
        return y[..., : self.dv]

    def attend_absorbed(self, q_nope, q_rope, latent, visible=None) -> torch.Tensor:
        """Same result as `attend_expanded`, attending over the latents without expanding them.

        The key is shared by all heads, so heads become extra query rows of one SDPA call:
        q' (B, 1, H*T, r + dr) = [W_UK_h^T q_nope_h | q_rope_h], k' = latent (B, 1, S, r + dr), v' = c_kv
        (the first r dims of the output), then W_UV_h maps each head's latent output to its v space.
        """
        B, H, T, _ = q_nope.shape
        S, r = latent.shape[1], self.kv_lora_rank
        w = self.kv_b_proj.weight.view(H, self.dn + self.dv, r)
        w_uk, w_uv = w[:, : self.dn], w[:, self.dn :]  # (H, dn, r), (H, dv, r)
        q_lat = torch.einsum("bhtd,hdr->bhtr", q_nope, w_uk)  # (B, H, T, r)
        q = torch.cat([q_lat, q_rope], dim=-1).reshape(B, 1, H * T, r + self.dr)  # row h*T + t
        k = latent[:, None]  # (B, 1, S, r + dr)
        # values are c_kv = latent[..., :r]; passing the whole latent keeps v's head dim equal to q's (SDPA's
        # fused kernel) and the extra d_r output dims are dropped below
        v = k
        mask = None
        if visible is not None:  # a static cache's slots (B, T, S): row h*T + t is query t
            mask = visible[:, None].repeat(1, 1, H, 1)
        elif T > 1:  # query t (absolute S - T + t) sees keys <= it; same band for every head
            mask = attention_mask(T, S, causal=True, device=q.device).repeat(H, 1)
        p = self.dropout if self.training else 0.0
        o_lat = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, dropout_p=p)
        o_lat = o_lat[..., :r].reshape(B, H, T, r)
        return torch.einsum("bhtr,hvr->bhtv", o_lat, w_uv)  # (B, H, T, dv)

    # ------------------------------------------------------------------ contract
    def forward(self, x: torch.Tensor, *, positions: torch.Tensor, cache: Optional[LatentCache] = None) -> torch.Tensor:
        B, T, _ = x.shape
        cp = parallel.active()
        if cp is not None and cache is None:  # context parallel (parallel.py): ring attention on the expanded K/V
            x = x if self.input_conv is None else cp.conv(self.input_conv, x)
            q_nope, q_rope, latent = self.project(x, positions)
            k, v = self.expand(latent)
            y = cp.attention(torch.cat([q_nope, q_rope], dim=-1), k, v, causal=True, scale=self.scale)
            return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.dv))
        q_nope, q_rope, latent = self.project(self.shift(x, cache), positions)
        mode = self.cfg.absorb
        absorbed = self.impl == "fast" and (mode == "always" or (mode == "decode" and cache is not None and T == 1))
        attend = self.attend_absorbed if absorbed else self.attend_expanded
        if cache is not None and cache.static:
            pos = positions.expand(B, -1) if positions.dim() == 1 else positions
            if T > 1 and int(pos[:, 0].max()) == 0:  # a prefill from an empty row: over its own latents
                cache.write(latent, pos)
                y = attend(q_nope, q_rope, latent)
            else:  # every slot, under the mask of the positions they hold
                slots = cache.write(latent, pos)
                visible = torch.arange(slots.shape[1], device=x.device)[None, None] <= pos[:, :, None]
                y = attend(q_nope, q_rope, slots.to(latent.dtype), visible)
            return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.dv))
        if cache is not None:
            latent = cache.update(latent)  # (B, S, r + dr): every token so far
        y = attend(q_nope, q_rope, latent)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.dv))

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device) -> LatentCache:
        return LatentCache(self.kv_lora_rank)

    def new_static_cache(self, batch: int, max_len: int, dtype: torch.dtype, device) -> StaticLatentCache:
        tail = None if self.input_conv is None else self.input_conv.empty_tail(batch, dtype, device)
        return StaticLatentCache(batch, max_len, self.kv_lora_rank + self.dr, dtype, device, conv_tail=tail)

    def cache_bytes(self, context_len: int, batch: int = 1, dtype: torch.dtype = torch.float32) -> int:
        latents = (self.kv_lora_rank + self.dr) * context_len * batch * dtype_bytes(dtype)
        return latents + self.input_conv_bytes(batch, dtype)

    def flops_per_token(self, context_len: int) -> float:
        """Expanded form (training / prefill): every projection, then QK^T over dn + dr and PV over dv per head."""
        proj = sum(m.in_features * m.out_features for m in self.modules() if isinstance(m, nn.Linear))
        keys = causal_attended(context_len)
        return 2.0 * proj + self.input_conv_flops() + 2.0 * self.n_heads * (self.dn + self.dr + self.dv) * keys
