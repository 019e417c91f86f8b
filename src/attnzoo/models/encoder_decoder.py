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
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import nn

from attnzoo.layers.kv_cache import LayerCache, ModelCache
from attnzoo.config.schema import ConfigError, ModelConfig, check, check_choice, layer_mixer_configs, resolve_model
from attnzoo.layers.ffn import build_ffn
from attnzoo.mixers.attention import Attention
from attnzoo.mixers.base import dtype_bytes
from attnzoo.models.decoder import residual
from attnzoo.layers.norm import build_norm
from attnzoo.ops.attention import attention_reference
from attnzoo.layers.position import AbsolutePosition, sinusoidal_table
from attnzoo.config.registry import MIXERS


class CrossAttentionCache(LayerCache):
    """Encoder-decoder cross-attention (attnzoo.models.encoder_decoder): the keys/values of the encoder memory, projected
    once per source and reused by every decoding step. k, v of shape (B, n_kv_heads, S, head_dim).
    Bytes do not grow with the generated length."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v


@dataclass
class EncDecOptions:
    """`model.encdec`: what an encoder(-decoder) needs beyond ModelConfig."""

    n_encoder_layers: Optional[int] = None  # null: model.n_layers
    n_decoder_layers: Optional[int] = None  # null: model.n_layers
    # encoder self-attention kind: a registered mixer whose class is `bidirectional` (mha | gqa | mqa; gqa:
    # model.n_kv_heads K/V heads)
    encoder_attention: str = "mha"
    cross_attention: str = "mha"  # the same kinds: K/V heads of the cross-attention over the memory
    cross_kv_heads: Optional[int] = None  # gqa only; null: model.n_kv_heads
    attn_bias: bool = False  # biases on encoder self-attn and cross-attn projections (Marian/BART: true)
    share_embeddings: bool = True  # one token table for source and target (model.tie_embeddings ties the head)
    embed_scale: bool = True  # token embeddings * sqrt(d_model) (paper section 3.4)
    sinusoidal_layout: str = "interleaved"  # interleaved (paper: sin even, cos odd dims) | concat ([sin | cos], Marian)
    final_logits_bias: bool = False  # a bias on the output projection (Marian/BART's final_logits_bias)
    label_smoothing: float = 0.1  # epsilon_ls (paper: 0.1), used by LitSeq2Seq
    length_penalty: float = 1.0  # beam search: score / length^alpha
    mlm_prob: float = 0.15  # encoder-only MLM: fraction of tokens chosen (BERT 80/10/10 rule on them)

    def validate(self, cfg: ModelConfig, field: str = "model.encdec") -> None:
        for name in ("n_encoder_layers", "n_decoder_layers"):
            v = getattr(self, name)
            check(v is None or v > 0, f"{field}.{name}", f"must be positive, got {v}")
        kinds = attention_kinds()
        check_choice(self.encoder_attention, f"{field}.encoder_attention", kinds)
        check_choice(self.cross_attention, f"{field}.cross_attention", kinds)
        kv = self.cross_kv(cfg)
        divisors = [d for d in range(1, cfg.n_heads + 1) if cfg.n_heads % d == 0]
        enc_kv = self.encoder_config().kv_heads(cfg)  # its config's K/V heads (model.n_kv_heads where it reads it)
        check(enc_kv > 0 and cfg.n_heads % enc_kv == 0, "model.n_kv_heads",
              f"n_heads={cfg.n_heads} is not divisible by n_kv_heads={enc_kv}; allowed: {', '.join(map(str, divisors))}")
        check(kv > 0 and cfg.n_heads % kv == 0, f"{field}.cross_kv_heads",
              f"n_heads={cfg.n_heads} is not divisible by {kv}; allowed: {', '.join(map(str, divisors))}")
        check_choice(self.sinusoidal_layout, f"{field}.sinusoidal_layout", ("interleaved", "concat"))
        check(0.0 <= self.label_smoothing < 1.0, f"{field}.label_smoothing", "must be in [0, 1)")
        check(0.0 < self.mlm_prob < 1.0, f"{field}.mlm_prob", "must be in (0, 1)")

    def encoder_config(self) -> Any:
        """The encoder self-attention's mixer config: the kind's own, bidirectional, with attn_bias."""
        return MIXERS.get(self.encoder_attention).config_cls(name=self.encoder_attention, causal=False,
                                                             qkv_bias=self.attn_bias, out_bias=self.attn_bias)

    def cross_kv(self, cfg: ModelConfig) -> int:
        """K/V heads of the cross-attention: what its kind's config gives (cross_kv_heads where it reads them)."""
        kind = MIXERS.get(self.cross_attention).config_cls(name=self.cross_attention, n_kv_heads=self.cross_kv_heads)
        return kind.kv_heads(cfg)


def attention_kinds() -> list[str]:
    """The kinds of encoder self-attention and cross-attention: registered mixers whose class is `bidirectional`."""
    return [n for n in MIXERS.names() if MIXERS.get(n).cls.bidirectional]


def split_config(node: Any, vocab_size: Optional[int] = None) -> tuple[ModelConfig, EncDecOptions]:
    """(typed ModelConfig, EncDecOptions) from a model section; `encdec` is taken out before resolve_model
    so this works whether or not ModelConfig itself declares the field."""
    if isinstance(node, ModelConfig):
        raw, cfg = getattr(node, "encdec", None), node
        if vocab_size is not None:
            cfg.vocab_size = vocab_size
    else:
        if isinstance(node, DictConfig):
            node = OmegaConf.to_container(node, resolve=True)
        node = dict(node or {})
        raw = node.pop("encdec", None)
        cfg = resolve_model(node, vocab_size=vocab_size)
    if raw is not None and not isinstance(raw, (dict, EncDecOptions)):
        raise ConfigError("expected a mapping of encoder-decoder options", field="model.encdec")
    if isinstance(raw, EncDecOptions):
        opts = raw
    else:
        allowed = {f.name for f in dataclasses.fields(EncDecOptions)}
        for k in raw or {}:
            check(k in allowed, f"model.encdec.{k}", f"unknown key; allowed keys: {', '.join(sorted(allowed))}")
        opts = EncDecOptions(**(raw or {}))
    opts.validate(cfg)
    if cfg.vocab_size is None:
        raise ValueError("model.vocab_size: not set; pass vocab_size= or set model.vocab_size")
    return cfg, opts


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
        if not getattr(mixer_cfg, "causal", True):
            raise ConfigError("the decoder's self-attention must be causal; allowed: true", field="model.mixer.causal")
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
