"""The original Transformer (Vaswani et al. 2017, arXiv:1706.03762) on the zoo's parts, and its encoder half
as a BERT-style masked LM (Devlin et al. 2018, arXiv:1810.04805).

    source ──embed*sqrt(d)+PE──> [ bidirectional self-attn (key padding mask) -> FFN ] x N_enc ──> memory
                                                                                                     │ K/V once
    target ──embed*sqrt(d)+PE──> [ causal self-attn (any zoo mixer, its cache) -> cross-attn -> FFN ] x N_dec -> head

- Encoder self-attention is the zoo's `Attention` (mha/gqa/mqa) with `causal=False`; its projections are used
  with an explicit key padding mask (`padded_attention`), so padding never reaches a real position.
- Decoder self-attention is any causal mixer of the registry (`model.mixer` / `model.pattern`), with its own cache.
- Cross-attention (`CrossAttention`): n_heads query heads over n_kv_heads K/V heads of the memory (MHA/GQA/MQA);
  the memory's K/V are projected once per source into a `CrossAttentionCache` and reused at every step.
- post-norm (the paper) or pre-norm (`model.norm_position`), sinusoidal positions (interleaved as the paper's
  formula, or concatenated [sin | cos] as tensor2tensor/fairseq/Marian), shared or separate embeddings.

Encoder-decoder-only options live in `model.encdec` (`EncDecOptions`); everything else is the usual ModelConfig.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from attnzoo.config.schema import layer_mixer_configs
from attnzoo.layers.kv_cache import LayerCache, ModelCache
from attnzoo.layers.norm import build_norm
from attnzoo.models.encoder_decoder_layers import (CrossAttention, CrossAttentionCache, DecoderLayer, EncDecOptions,
                                                   Positions, _Encoder, _init_weights, split_config)

# the parts live in encoder_decoder_layers.py; those the package, tests and docs import from here stay importable
__all__ = ["CrossAttention", "CrossAttentionCache", "EncDecCache", "EncDecOptions", "EncoderDecoder", "EncoderMLM",
           "mask_tokens", "split_config"]


# ----------------------------------------------------------------------------- encoder-decoder


class EncDecCache:
    """Decoding state for one batch of sources: the decoder self-attention caches (a ModelCache of the zoo's
    kinds), the cross-attention K/V of every decoder layer (computed once), and the source padding mask."""

    def __init__(self, self_attn: ModelCache, cross: list, src_mask: Optional[torch.Tensor]):
        self.self_attn, self.cross, self.src_mask = self_attn, cross, src_mask

    @property
    def seq_len(self) -> int:
        return self.self_attn.seq_len

    def nbytes(self) -> int:
        return self.self_attn.nbytes() + sum(c.nbytes() for c in self.cross)

    def reorder(self, index: torch.Tensor) -> None:
        """Beam search: row i of the batch becomes old row index[i]. Every tensor a zoo cache holds is
        batch-first (KV, sliding-window ring, MLA latent, recurrent state, conv tail), so one index_select
        per tensor reorders any mixer's cache. Cross K/V are identical within a source's beams: untouched."""
        for layer in self.self_attn.layers:
            if isinstance(layer, LayerCache):
                for name, value in vars(layer).items():
                    if isinstance(value, torch.Tensor):
                        setattr(layer, name, value.index_select(0, index))
                    elif isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
                        setattr(layer, name, type(value)(t.index_select(0, index) for t in value))


class EncoderDecoder(nn.Module):
    """`forward(src (B, S), tgt_in (B, T), src_mask (B, S) bool | None) -> logits (B, T, V)` (teacher forcing).

    `encode`, `prepare_cache` + `decode_step` (incremental), `generate` (greedy) and `beam_search`.
    """

    def __init__(self, cfg: Any, vocab_size: Optional[int] = None):
        super().__init__()
        cfg, opts = split_config(cfg, vocab_size)
        self.cfg, self.opts = cfg, opts
        V, d = cfg.vocab_size, cfg.d_model
        src_embed = nn.Embedding(V, d)
        self.tgt_embed = src_embed if opts.share_embeddings else nn.Embedding(V, d)
        self.encoder = _Encoder(cfg, opts, src_embed)
        self.scale = math.sqrt(d) if opts.embed_scale else 1.0
        self.dec_position = Positions(cfg, opts.sinusoidal_layout)
        self.drop = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
        dec_cfg = dataclasses.replace(cfg, n_layers=opts.n_decoder_layers or cfg.n_layers)
        self.layer_mixers = layer_mixer_configs(dec_cfg)  # the decoder self-attention of each layer
        self.decoder = nn.ModuleList(DecoderLayer(cfg, mc, opts, i) for i, mc in enumerate(self.layer_mixers))
        self.dec_norm = build_norm(cfg.norm, d) if cfg.norm_position == "pre" else nn.Identity()
        self.lm_head = nn.Linear(d, V, bias=opts.final_logits_bias)
        self.apply(lambda m: _init_weights(m, d))
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tgt_embed.weight

    # ------------------------------------------------------------------ forward
    def encode(self, src: torch.Tensor, src_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.encoder(src, src_mask)

    def _decode(self, tgt, cross: list, src_mask, self_cache: Optional[ModelCache]) -> torch.Tensor:
        start = self_cache.seq_len if self_cache is not None else 0
        positions = torch.arange(start, start + tgt.shape[1], device=tgt.device)
        h = self.drop(self.dec_position(self.tgt_embed(tgt) * self.scale, positions))
        for i, layer in enumerate(self.decoder):
            h = layer(h, positions, cross[i], src_mask, None if self_cache is None else self_cache[i])
        if self_cache is not None:
            self_cache.seq_len += tgt.shape[1]
        return self.lm_head(self.dec_norm(h))

    def decode(self, tgt_in, memory, src_mask=None) -> torch.Tensor:
        """Full (teacher-forced) decoder pass over a given memory: (B, T) -> (B, T, V)."""
        return self._decode(tgt_in, [layer.cross.memory_kv(memory) for layer in self.decoder], src_mask, None)

    def forward(self, src, tgt_in, src_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.decode(tgt_in, self.encode(src, src_mask), src_mask)

    # ------------------------------------------------------------------ incremental decoding
    def prepare_cache(self, src, src_mask=None, *, repeat: int = 1) -> EncDecCache:
        """Encode once, project every layer's cross K/V once, empty self-attention caches. `repeat` copies
        each source that many times (consecutive rows: beams)."""
        memory = self.encode(src, src_mask)
        if repeat > 1:
            memory = memory.repeat_interleave(repeat, dim=0)
            src_mask = None if src_mask is None else src_mask.repeat_interleave(repeat, dim=0)
        B = memory.shape[0]
        caches = ModelCache([layer.self_attn.new_cache(B, self.cfg.max_seq_len, memory.dtype, memory.device) for layer in self.decoder])
        return EncDecCache(caches, [layer.cross.memory_kv(memory) for layer in self.decoder], src_mask)

    def decode_step(self, tokens: torch.Tensor, cache: EncDecCache) -> torch.Tensor:
        """Continue from cache.seq_len with tokens (B, t) -> logits (B, t, V); updates the cache in place."""
        return self._decode(tokens, cache.cross, cache.src_mask, cache.self_attn)

    @torch.no_grad()
    def generate(self, src, src_mask=None, *, max_new_tokens: int, bos_id: int, eos_id: Optional[int] = None,
                 pad_id: int = 0, use_cache: bool = True) -> torch.Tensor:
        """Greedy decoding -> (B, <= max_new_tokens) tokens after BOS; a row that emitted EOS continues with pad.
        use_cache=False recomputes the whole decoder prefix at each step (the reference)."""
        was_training = self.training
        self.eval()
        B = src.shape[0]
        cache = self.prepare_cache(src, src_mask)
        memory = None if use_cache else self.encode(src, src_mask)
        seq = torch.full((B, 1), bos_id, dtype=torch.long, device=src.device)
        done = torch.zeros(B, dtype=torch.bool, device=src.device)
        for _ in range(max_new_tokens):
            logits = self.decode_step(seq[:, -1:], cache) if use_cache else self.decode(seq, memory, src_mask)
            nxt = logits[:, -1].argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
            seq = torch.cat([seq, nxt[:, None]], dim=1)
            if eos_id is not None:
                done |= nxt == eos_id
                if bool(done.all()):
                    break
        self.train(was_training)
        return seq[:, 1:]

    @torch.no_grad()
    def beam_search(self, src, src_mask=None, *, max_new_tokens: int, bos_id: int, eos_id: Optional[int] = None,
                    pad_id: int = 0, beam_size: int = 4, length_penalty: Optional[float] = None):
        """Beam search -> (tokens (B, <= max_new_tokens), scores (B,)): the best finished or surviving beam by
        sum log-prob / length^alpha (alpha = length_penalty, default model.encdec.length_penalty).

        A finished beam (it emitted EOS) stays in the beam with its score frozen: its only continuation is
        pad at log-prob 0. Beams of one source are consecutive rows; caches are reordered after each step."""
        was_training = self.training
        self.eval()
        alpha = self.opts.length_penalty if length_penalty is None else length_penalty
        B, K, V = src.shape[0], beam_size, self.cfg.vocab_size
        dev = src.device
        cache = self.prepare_cache(src, src_mask, repeat=K)
        scores = torch.full((B, K), float("-inf"), device=dev)
        scores[:, 0] = 0.0  # all beams start identical: expand only the first
        finished = torch.zeros(B * K, dtype=torch.bool, device=dev)
        lengths = torch.zeros(B * K, device=dev)
        out = torch.empty(B * K, 0, dtype=torch.long, device=dev)
        last = torch.full((B * K, 1), bos_id, dtype=torch.long, device=dev)
        for _ in range(max_new_tokens):
            logp = F.log_softmax(self.decode_step(last, cache)[:, -1].float(), dim=-1)  # (B*K, V)
            if eos_id is not None and bool(finished.any()):
                logp[finished] = float("-inf")
                logp[finished, pad_id] = 0.0
            top, idx = (scores.view(B * K, 1) + logp).view(B, K * V).topk(K, dim=-1)  # (B, K)
            rows = (torch.arange(B, device=dev)[:, None] * K + idx // V).view(-1)  # parent row of each new beam
            tok = (idx % V).view(-1)
            cache.reorder(rows)
            lengths = lengths[rows] + (~finished[rows]).float()
            finished = finished[rows] | (tok == eos_id if eos_id is not None else torch.zeros_like(finished))
            out = torch.cat([out[rows], tok[:, None]], dim=1)
            scores, last = top, tok[:, None]
            if bool(finished.all()):
                break
        norm = scores / lengths.view(B, K).clamp_min(1) ** alpha
        best = norm.argmax(-1)
        pick = torch.arange(B, device=dev) * K + best
        self.train(was_training)
        return out[pick], norm.gather(1, best[:, None])[:, 0]

    # ------------------------------------------------------------------ accounting (train()'s summary)
    def num_params(self, trainable_only: bool = False) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    def active_params(self) -> int:
        return self.num_params()

    @property
    def mixers(self) -> list:
        return [layer.self_attn for layer in self.decoder]

    def cache_bytes(self, context_len: int, batch: int = 1, dtype: torch.dtype = torch.float32) -> int:
        """Decoder self-attention caches after `context_len` target tokens + cross K/V of a `context_len`
        source (equal lengths assumed)."""
        return sum(layer.self_attn.cache_bytes(context_len, batch, dtype) + layer.cross.cache_bytes(context_len, batch, dtype)
                   for layer in self.decoder)

    def flops_per_token(self, context_len: int) -> float:
        """Forward FLOPs per source token, for equal source and target lengths L: one source token through the
        encoder (bidirectional attention over L keys) plus one target token through the decoder (its mixer
        at context L, cross-attention over L source tokens, the memory's K/V projection, FFN) and the head."""
        total = 2.0 * self.cfg.d_model * self.cfg.vocab_size
        for layer in self.encoder.layers:
            total += layer.attn.flops_per_token(context_len) + _ffn_flops(layer.ffn)
        for layer in self.decoder:
            total += layer.self_attn.flops_per_token(context_len) + layer.cross.flops_per_token(context_len)
            total += layer.cross.kv_flops_per_source_token() + _ffn_flops(layer.ffn)
        return total


def _ffn_flops(ffn: nn.Module) -> float:
    return 0.0 if getattr(ffn, "is_identity", False) else ffn.flops_per_token()


# ----------------------------------------------------------------------------- encoder-only masked LM


class EncoderMLM(nn.Module):
    """BERT-style encoder-only masked LM on the zoo's encoder stack: `forward(idx (B, T), key_mask=None) ->
    logits (B, T, V)`. The `[MASK]` token is id `vocab_size - 1` when built by LitMLM (one id past the text
    tokenizer's vocabulary)."""

    def __init__(self, cfg: Any, vocab_size: Optional[int] = None):
        super().__init__()
        cfg, opts = split_config(cfg, vocab_size)
        self.cfg, self.opts = cfg, opts
        V, d = cfg.vocab_size, cfg.d_model
        self.encoder = _Encoder(cfg, opts, nn.Embedding(V, d))
        self.lm_head = nn.Linear(d, V, bias=opts.final_logits_bias)
        self.layer_mixers = [layer.attn.cfg for layer in self.encoder.layers]
        self.apply(lambda m: _init_weights(m, d))
        if cfg.tie_embeddings:
            self.lm_head.weight = self.encoder.embed.weight

    def forward(self, idx: torch.Tensor, key_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.lm_head(self.encoder(idx, key_mask))

    def num_params(self, trainable_only: bool = False) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    def active_params(self) -> int:
        return self.num_params()

    def cache_bytes(self, context_len: int, batch: int = 1, dtype: torch.dtype = torch.float32) -> int:
        return 0  # no incremental decoding: an encoder re-reads its whole input

    def flops_per_token(self, context_len: int) -> float:
        total = 2.0 * self.cfg.d_model * self.cfg.vocab_size
        for layer in self.encoder.layers:
            total += layer.attn.flops_per_token(context_len) + _ffn_flops(layer.ffn)
        return total


def mask_tokens(x: torch.Tensor, mask_id: int, vocab_size: int, prob: float = 0.15,
                generator: Optional[torch.Generator] = None, special_mask: Optional[torch.Tensor] = None):
    """BERT's masking: choose each token with probability `prob`; of the chosen, 80% become `[MASK]`, 10% a
    uniformly random token from [0, vocab_size), 10% stay. Returns (inputs, chosen (B, T) bool); the loss
    counts the chosen positions only, with the original tokens as targets.
    `special_mask` (B, T) bool: positions never chosen (padding)."""
    u = torch.rand(x.shape, generator=generator, device=x.device)
    chosen = u < prob
    if special_mask is not None:
        chosen &= ~special_mask
    # one more uniform per token splits the chosen ones 80 / 10 / 10
    r = torch.rand(x.shape, generator=generator, device=x.device)
    rand_tok = torch.randint(0, vocab_size, x.shape, generator=generator, device=x.device)
    inp = torch.where(chosen & (r < 0.8), torch.full_like(x, mask_id), x)
    inp = torch.where(chosen & (r >= 0.8) & (r < 0.9), rand_tok, inp)
    return inp, chosen
