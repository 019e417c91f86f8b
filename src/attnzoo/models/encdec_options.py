"""`model.encdec`: the options of the encoder-decoder and the encoder-only MLM (models/encoder_decoder.py), settled
once by `split_config` into a typed ModelConfig and `EncDecOptions`. Torch-free, so that `validate()` refuses a
bad option before torch is imported (issue 45); the layers that read them are in encoder_decoder_layers.py.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from attnzoo.config.registry import MIXERS
from attnzoo.config.schema import ConfigError, ModelConfig, check, check_choice, resolve_model


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
    return [n for n in MIXERS.names() if MIXERS.get(n).fact("bidirectional")]


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


def check_decoder_causal(mixer_cfg: Any, field: str = "model.mixer.causal") -> None:
    """The encoder-decoder's decoder self-attention is causal (model.mixer.causal=true)."""
    causal = mixer_cfg.get("causal", True) if isinstance(mixer_cfg, dict) else getattr(mixer_cfg, "causal", True)
    if not causal:
        raise ConfigError("the decoder's self-attention must be causal; allowed: true", field=field)
