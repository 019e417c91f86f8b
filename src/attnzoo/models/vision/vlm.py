"""A vision-language model (model=vlm): an image encoder (ViT or Swin, model.vision), an optional Perceiver
resampler, and the zoo's decoder LM (`model.DecoderLM`: any mixer, hybrids included) as the language side.

    image ──encoder──> (B, N, d_img) ──[resampler: n_queries]──> image tokens (B, M, d_img)
      concat:           Projector -> (B, M, d) prepended:  [img_1 .. img_M, text_1 .. text_T] through the decoder
      cross_attention:  before decoder block i (i = 0, k, 2k, ..): h + tanh(a_i) xattn(h, image) + tanh(b_i) ffn(.)

The decoder's blocks, embedding, final norm and head are the DecoderLM's own; only the order of calls is new
(image prefix positions 0..M-1 for concat; gated layers between blocks for cross-attention), so any mixer the
decoder supports is a language side here, with its own cache kind.

Decoding (`prepare_cache` + `decode_step`, `generate`): the image is encoded once; concat prefills its M tokens
into the self-attention caches, cross-attention projects each gated layer's K/V once (`VLMCache.cross`); every
text step then reuses them. Cached decode == the full forward (tests/test_multimodal.py).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from attnzoo.layers.kv_cache import ModelCache
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.vision.classifier import build_encoder, init_vision_weights
from attnzoo.models.vision.connectors import GatedCrossAttention, PerceiverResampler, Projector
from attnzoo.models.vision.options import split_config


class VLMCache:
    """Decoding state for one batch of images: the decoder's ModelCache (concat: the image prefix already in
    it) and the gated layers' image K/V (cross_attention), computed once."""

    def __init__(self, self_attn: ModelCache, cross: dict):
        self.self_attn, self.cross = self_attn, cross

    @property
    def seq_len(self) -> int:
        return self.self_attn.seq_len

    def nbytes(self) -> int:
        return self.self_attn.nbytes() + sum(c.nbytes() for c in self.cross.values())


class VisionLanguageModel(nn.Module):
    """`forward(idx (B, T), images (B, C, S, S)) -> logits (B, T, V)` over the text positions."""

    def __init__(self, cfg: Any, vocab_size: Optional[int] = None, image_size: Optional[int] = None,
                 channels: Optional[int] = None):
        super().__init__()
        setup = split_config(cfg, vocab_size, image_size, channels)
        if setup.vision.image_size is None or setup.vision.channels is None:
            raise ValueError("model.vision.image_size / channels: not set; build the model for a data module")
        self.cfg, self.vision, self.connector = setup.model, setup.vision, setup.connector
        self.lm = DecoderLM(self.cfg)
        self.encoder = build_encoder(setup.encoder, self.vision, cls_token=False)
        self.encoder.apply(init_vision_weights)
        for p in self.encoder.parameters():  # its own AdamW groups at optim.lr * lr_scale (lit.param_groups)
            p._lr_scale = self.vision.lr_scale
            p.requires_grad_(self.vision.lr_scale > 0)
        d_img, conn = self.encoder.d_out, self.connector
        self.resampler = None
        if conn.n_queries:
            heads = conn.resampler_heads
            self.resampler = PerceiverResampler(d_img, conn.n_queries, conn.resampler_depth, heads,
                                                conn.resampler_head_dim or d_img // heads)
        self.concat = conn.meet == "concat"
        self.projector = Projector(d_img, self.cfg.d_model, conn.projector) if self.concat else None
        self.xattn = None if self.concat else nn.ModuleDict(
            {str(i): GatedCrossAttention(self.cfg, d_img, conn.gate, i) for i in range(0, self.cfg.n_layers, conn.every)})
        if self.projector is not None:
            self.projector.apply(init_vision_weights)
        self.layer_mixers = self.lm.layer_mixers

    # ------------------------------------------------------------------ parts
    @property
    def image_tokens_per_image(self) -> int:
        """M: the tokens of one image the text sees (resampler queries, or the encoder's output tokens)."""
        return self.connector.n_queries or self.encoder.n_tokens

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        """(B, C, S, S) -> (B, M, d_model) for concat, (B, M, d_img) for cross-attention."""
        tokens = self.encoder(images)
        if self.resampler is not None:
            tokens = self.resampler(tokens)
        return self.projector(tokens) if self.concat else tokens

    def _embed(self, idx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.lm.drop(self.lm.position(self.lm.embed(idx), positions))

    def _blocks(self, h: torch.Tensor, positions: torch.Tensor, cache: Optional[ModelCache], cross: dict) -> torch.Tensor:
        carry = {}  # the forward's cross-layer carry (Mixer.carries), as DecoderLM's
        for i, block in enumerate(self.lm.blocks):
            if cross and str(i) in self.xattn:
                h = self.xattn[str(i)](h, cross[str(i)])
            h = block(h, positions, None if cache is None else cache[i], carry=carry)
        if cache is not None:
            cache.seq_len += h.shape[1]
        return h

    def _cross(self, image: torch.Tensor) -> dict:
        return {k: layer.image_kv(image) for k, layer in self.xattn.items()} if self.xattn is not None else {}

    # ------------------------------------------------------------------ forward
    def forward(self, idx: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
        image = self.encode_image(images)
        T = idx.shape[1]
        if self.concat:
            M = image.shape[1]
            positions = torch.arange(M + T, device=idx.device)
            h = torch.cat([self.lm.drop(self.lm.position(image, positions[:M])), self._embed(idx, positions[M:])], dim=1)
            h = self._blocks(h, positions, None, {})[:, M:]
        else:
            positions = torch.arange(T, device=idx.device)
            h = self._blocks(self._embed(idx, positions), positions, None, self._cross(image))
        return self.lm.lm_head(self.lm.norm(h))

    # ------------------------------------------------------------------ incremental decoding
    def prepare_cache(self, images: torch.Tensor, max_len: int) -> VLMCache:
        """Encode the images once: concat prefills the image tokens into the decoder caches, cross-attention
        projects every gated layer's K/V. `max_len`: the longest text to follow."""
        image = self.encode_image(images)
        B, M = image.shape[:2]
        dtype = self.lm.embed.weight.dtype
        cache = self.lm.new_cache(B, max_len + (M if self.concat else 0), dtype)
        if self.concat:
            positions = torch.arange(M, device=images.device)
            self._blocks(self.lm.drop(self.lm.position(image, positions)), positions, cache, {})
            return VLMCache(cache, {})
        return VLMCache(cache, self._cross(image))

    def decode_step(self, idx: torch.Tensor, cache: VLMCache) -> torch.Tensor:
        """Continue from cache.seq_len with text tokens (B, t) -> logits (B, t, V); updates the cache in place."""
        start = cache.seq_len
        positions = torch.arange(start, start + idx.shape[1], device=idx.device)
        h = self._blocks(self._embed(idx, positions), positions, cache.self_attn, cache.cross)
        return self.lm.lm_head(self.lm.norm(h))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, images: torch.Tensor, max_new_tokens: int, eos_id: Optional[int] = None,
                 use_cache: bool = True) -> torch.Tensor:
        """Greedy continuation of the prompts idx (B, T) about `images` -> (B, T + new). use_cache=False
        recomputes the whole forward at every step (the reference)."""
        was_training = self.training
        self.eval()
        out = idx
        if use_cache:
            cache = self.prepare_cache(images, idx.shape[1] + max_new_tokens)
            logits = self.decode_step(idx, cache)[:, -1]
        else:
            logits = self(idx, images)[:, -1]
        for _ in range(max_new_tokens):
            nxt = logits.argmax(-1, keepdim=True)
            out = torch.cat([out, nxt], dim=1)
            if eos_id is not None and bool((nxt == eos_id).all()):
                break
            logits = self.decode_step(nxt, cache)[:, -1] if use_cache else self(out, images)[:, -1]
        self.train(was_training)
        return out

    # ------------------------------------------------------------------ accounting
    @property
    def mixers(self) -> list:
        return self.lm.mixers

    def num_params(self, trainable_only: bool = False) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    def active_params(self) -> int:
        return self.num_params() - self.lm.num_params() + self.lm.active_params()

    def cross_cache_bytes(self, batch: int = 1, dtype: torch.dtype = torch.float32) -> int:
        """The gated layers' image K/V (cross_attention); 0 for concat."""
        if self.xattn is None:
            return 0
        return sum(layer.cache_bytes(self.image_tokens_per_image, batch, dtype) for layer in self.xattn.values())

    def cache_bytes(self, context_len: int, batch: int = 1, dtype: torch.dtype = torch.float32, **kw) -> int:
        """After `context_len` text tokens about one image: the decoder caches (over M + context_len tokens
        for concat) plus the cross-attention K/V."""
        prefix = self.image_tokens_per_image if self.concat else 0
        return self.lm.cache_bytes(context_len + prefix, batch, dtype) + self.cross_cache_bytes(batch, dtype)

    def image_flops(self) -> float:
        """Forward FLOPs of one image up to the text: encoder, resampler, projector or the gated layers' K/V."""
        total = self.encoder.flops_per_image()
        if self.resampler is not None:
            total += self.resampler.flops_per_image(self.encoder.n_tokens)
        M = self.image_tokens_per_image
        if self.concat:
            return total + M * self.projector.flops_per_token()
        return total + M * sum(layer.kv_flops_per_image_token() for layer in self.xattn.values())

    def flops_per_token(self, context_len: int) -> float:
        """Forward FLOPs per text token for texts of `context_len` tokens, one image each: the image's FLOPs
        spread over its text, the decoder over the text (concat: over image + text tokens, at that context),
        the gated cross-attention layers, and the LM head on the text."""
        L, M = context_len, self.image_tokens_per_image
        C = L + M if self.concat else L
        decoder = C * sum(b.mixer.flops_per_token(C) + (b.ffn.flops_per_token() if b.has_ffn else 0.0)
                          for b in self.lm.blocks)
        if self.xattn is not None:
            decoder += L * sum(layer.flops_per_token(M) for layer in self.xattn.values())
        head = L * 2.0 * self.cfg.d_model * self.cfg.vocab_size
        return (self.image_flops() + decoder + head) / L
