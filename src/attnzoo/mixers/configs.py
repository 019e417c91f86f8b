"""The mixers' config dataclasses, torch-free: what `config.resolve_model` and `training/config_checks.validate`
read (issue 45: a refused value is reported before torch is imported). Each dataclass is the schema of its mixer's
section (`model.mixer`, `model.mixers.<key>`), with its own `validate(model, field)`, and declares what the config
checks ask of its mixer (`MixerSpec`; `register_mixer` copies those facts onto the class, so they are stated here
once). The classes (`nn.Module`s) live in this package's other modules, declared at the end of this file: the
registry imports a class's module when it is first built.

A plugin mixer (a file of its own in this package, with its config beside its class) needs no declaration here:
the registry imports it before listing the names, and asks its class for the facts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional

from attnzoo.config.errors import ConfigError, check_choice
from attnzoo.config.registry import MIXERS
from attnzoo.mixers.recurrent_configs import (FEATURE_MAPS, LOG_DECAY_SCALE, MIN_DECAY,  # noqa: F401 (re-exported)
                                              DeltaNetConfig, GatedDeltaNetConfig, GatedDeltaProductConfig, GLAConfig,
                                              GDN2Config, HGRN2Config, KDAConfig,
                                              LinearAttentionConfig, Mamba2Config, Mamba3Config, RetNetConfig,
                                              RWKV7Config)
from attnzoo.mixers.spec import MixerSpec, validate_conv  # noqa: F401 (re-exported)


# ----------------------------------------------------------------------------- attention

@dataclass
class AttentionConfig(MixerSpec):
    context_parallel = True  # ring attention (Attention.forward_context_parallel)
    full_causal_attention = True  # every past key: the zigzag layout balances the ring
    kv_quantizable = True  # a plain KVCache (new_cache / cache_bytes take kv_format)
    bidirectional = True  # causal=false through project() / output() (the encoder, cross-attention kinds)
    name: str = "gqa"
    n_kv_heads: Optional[int] = None  # overrides model.n_kv_heads for this mixer (mha/mqa force theirs)
    qkv_bias: bool = False
    out_bias: bool = False
    softmax_scale: Optional[float] = None  # default head_dim ** -0.5; µP: softmax_scale / head_dim (null: 1)
    causal: bool = True
    conv_size: int = 0  # short causal conv on the mixer input (Based / Canon-A, Mixer.shift); 0 = off
    conv_bias: bool = False
    # per-head RMSNorm of q and k over head_dim, after the projection and before RoPE (Qwen3; Dehghani et al.
    # 2023 ViT-22B, Wortsman et al. 2023 for the stability motive); weights of size head_dim, eps model.norm.eps
    qk_norm: bool = False
    # y * sigmoid(x W_g) per head and channel before o_proj (Qwen3-Next's gated attention; Qiu et al. 2025,
    # arXiv:2505.06708); W_g is `gate_proj` (d_model -> n_heads * head_dim, biased with qkv_bias)
    output_gate: bool = False

    def kv_heads(self, model) -> int:
        if self.name == "mha":
            return model.n_heads
        if self.name == "mqa":
            return 1
        return self.n_kv_heads or model.n_kv_heads

    def validate(self, model, field: str) -> None:
        kv = self.kv_heads(model)
        if kv <= 0 or model.n_heads % kv != 0:
            allowed = [d for d in range(1, model.n_heads + 1) if model.n_heads % d == 0]
            raise ConfigError(
                f"n_heads={model.n_heads} is not divisible by n_kv_heads={kv}; allowed: {', '.join(map(str, allowed))}",
                # name the field the value came from: the mixer's own, or the model-wide default
                field=f"{field}.n_kv_heads" if self.n_kv_heads else "model.n_kv_heads",
            )
        validate_conv(self, field)
        if model.position.name == "alibi" and (getattr(self, "window", None) is not None):
            raise ConfigError("alibi is implemented for mha / gqa / mqa (the sliding-window ring keeps keys in slot "
                              "order); allowed positions here: rope, none, sinusoidal, learned", field="model.position.name")


@dataclass
class SlidingWindowConfig(AttentionConfig):
    full_causal_attention = False  # W keys per query: equal work per contiguous shard, one ring hop
    kv_quantizable = False  # its own ring cache
    bidirectional = False  # causal only (validate)
    name: str = "sliding_window"
    window: int = 128  # W: query t sees keys t-W+1 .. t (W keys including itself); Mistral 7B uses 4096
    sink_tokens: int = 0  # StreamingLLM attention sinks: the first k tokens stay visible to every query

    def validate(self, model, field: str) -> None:
        super().validate(model, field)
        if self.window < 1:
            raise ConfigError(f"must be >= 1, got {self.window}", field=f"{field}.window")
        if self.sink_tokens < 0:
            raise ConfigError(f"must be >= 0 (0 = none), got {self.sink_tokens}", field=f"{field}.sink_tokens")
        if self.sink_tokens > self.window:  # sinks are the tokens that stay visible after leaving the window
            raise ConfigError(f"{self.sink_tokens} sink tokens exceed the window {self.window}; allowed: 0 .. "
                              f"{self.window} (0 = none)", field=f"{field}.sink_tokens")
        if not self.causal:
            raise ConfigError("sliding_window is causal only; allowed: true", field=f"{field}.causal")

    def check_seq_len(self, seq_len: int, field: str) -> None:
        """Fewer sinks than the sequence, or every token would be a sink (full attention, each token cached twice:
        in the window's ring and beside it)."""
        sinks = self.sink_tokens
        if sinks >= seq_len and sinks != 0:
            raise ConfigError(f"{sinks} sink tokens cover the whole data.seq_len={seq_len}; allowed: 0 .. {seq_len - 1}",
                              field=f"{field}.sink_tokens")


# ----------------------------------------------------------------------------- fox

@dataclass
class ForgettingAttentionConfig(AttentionConfig):
    """FoX (Lin et al. 2025, arXiv:2503.02130): softmax attention whose scores carry a data-dependent forget
    bias (mixers/forgetting.py). The paper's defaults: a forget gate per head (a biased d_model -> n_heads
    projection), no RoPE, no output gate, no q/k norm (its "Pro" block adds both, plus a key/value shift: here
    `output_gate`, `qk_norm` and the input conv `conv_size`)."""
    context_parallel = False  # the forget bias spans the ring's blocks: no ring form here
    full_causal_attention = False
    kv_quantizable = False  # its cache keeps each key's log forget gate beside the keys
    bidirectional = False  # causal only (validate)
    fla_kernel = "parallel_forgetting_attn"  # where dispatch picks fla (a call without cache or mask)
    name: str = "fox"
    # apply the model's RoPE to q / k as well (the paper's "FoX with RoPE" ablation); false: the forget gate is
    # the only position signal, as the paper's FoX (model.position=rope then leaves this layer unrotated)
    use_rope: bool = False
    # null: the gate's bias starts at 0 (f = 1/2 for a zero input: the paper's data-dependent gate); [t_min, t_max]:
    # head h's bias starts at logit(exp(-1 / t_h)), t_h log-spaced from t_min to t_max tokens (the paper's init of
    # its data-independent gates; a memory of t_h tokens at init, which retrieval over long gaps needs to start)
    decay_time_range: Optional[List[float]] = None

    def validate(self, model, field: str) -> None:
        super().validate(model, field)
        span = self.decay_time_range
        if span is not None and not (len(span) == 2 and all(math.isfinite(v) for v in span) and 0 < span[0] <= span[1]):
            raise ConfigError(f"must be null or [t_min, t_max] with 0 < t_min <= t_max (tokens), got {list(span)}",
                              field=f"{field}.decay_time_range")
        if model.position.name == "alibi":
            raise ConfigError("fox's forget gate is its own (data-dependent) distance bias; allowed positions for "
                              "fox: rope, none, sinusoidal, learned", field="model.position.name")
        if not self.causal:
            raise ConfigError("fox is causal only (the forget gate decays the past); allowed: true",
                              field=f"{field}.causal")


# ----------------------------------------------------------------------------- block_sparse

@dataclass
class BlockSparseConfig(AttentionConfig):
    context_parallel = False  # top-k block selection over the whole past: no ring form here
    full_causal_attention = False
    kv_quantizable = False  # its cache keeps block means beside the keys
    bidirectional = False  # causal only
    block_size: int = 16  # keys per block

    # the subclass's field counting the blocks a query sees, its least value and why (not dataclass fields)
    COUNT_FIELD = ""
    COUNT_MIN = 1
    COUNT_WHY = ""

    def validate(self, model, field: str) -> None:
        super().validate(model, field)
        if model.position.name == "alibi":
            raise ConfigError(f"ALiBi is implemented for mha / gqa / mqa; allowed positions for {self.name}: rope, "
                              f"none, sinusoidal, learned", field="model.position.name")
        if self.block_size < 1:
            raise ConfigError(f"must be >= 1, got {self.block_size}", field=f"{field}.block_size")
        count, key = getattr(self, self.COUNT_FIELD), f"{field}.{self.COUNT_FIELD}"
        if count < self.COUNT_MIN:
            raise ConfigError(f"must be >= {self.COUNT_MIN} ({self.COUNT_WHY}), got {count}", field=key)
        blocks = -(-model.max_seq_len // self.block_size)
        if count > blocks:
            raise ConfigError(f"{count} exceeds the {blocks} blocks of model.max_seq_len={model.max_seq_len} (dense "
                              f"everywhere); allowed: {self.COUNT_MIN}..{blocks}", field=key)
        self.validate_own(model, field)
        if not self.causal:
            raise ConfigError(f"{self.name} is causal only; allowed: true", field=f"{field}.causal")

    def validate_own(self, model, field: str) -> None:
        """The subclass's other fields (called before the causal check)."""

    def check_seq_len(self, seq_len: int, field: str) -> None:
        """Training sequences are whole blocks."""
        if seq_len % self.block_size:
            raise ConfigError(f"{self.block_size} does not divide data.seq_len={seq_len}; allowed: a divisor of "
                              f"{seq_len}", field=f"{field}.block_size")


# ----------------------------------------------------------------------------- moba

@dataclass
class MoBAConfig(BlockSparseConfig):
    name: str = "moba"
    block_size: int = 16  # keys per block (the paper: 512 at 8k context, 4096 at 32k+)
    topk: int = 3         # blocks per query, its own block included (the paper: 3 at 8k, 12 at 32k+)

    COUNT_FIELD, COUNT_MIN, COUNT_WHY = "topk", 1, "the own block counts"



# ----------------------------------------------------------------------------- nsa

@dataclass
class NSAConfig(BlockSparseConfig):
    name: str = "nsa"
    block_size: int = 16   # BS: compression and selection block (fla: one size for both; the paper 32 / 64)
    block_counts: int = 4  # selected blocks per query, the first, previous and current included (>= 3)
    window: int = 32       # the sliding branch's keys per query (itself included); 0 = no sliding branch

    COUNT_FIELD, COUNT_MIN, COUNT_WHY = "block_counts", 3, "the first, previous and current blocks are always selected"

    def validate_own(self, model, field: str) -> None:
        if self.window < 0:
            raise ConfigError(f"must be >= 0 (0 = no sliding branch), got {self.window}", field=f"{field}.window")



# ----------------------------------------------------------------------------- mla

@dataclass
class MLAConfig(MixerSpec):
    context_parallel = True  # ring attention over the expanded K/V (MLA.forward)
    full_causal_attention = True  # every past key: the zigzag layout balances the ring
    name: str = "mla"
    # null sizes derive from head_dim = d_model / n_heads, in DeepSeek-V2's proportions (head_dim 128:
    # kv_lora_rank 512, qk_nope 128, qk_rope 64, v 128); d_model 32 / 4 heads gives r=32, dn=8, dr=4, dv=8.
    q_lora_rank: Optional[int] = None  # null: full-rank q projection (as DeepSeek-V2-Lite); V2/V3 use 1536
    kv_lora_rank: Optional[int] = None  # d_c, the cached latent; null: 4 * head_dim
    qk_nope_head_dim: Optional[int] = None  # per-head key/query dims without position; null: head_dim
    qk_rope_head_dim: Optional[int] = None  # d_r, the decoupled RoPE dims (key shared by heads); null: head_dim / 2
    v_head_dim: Optional[int] = None  # null: head_dim
    softmax_scale: Optional[float] = None  # null: (qk_nope_head_dim + qk_rope_head_dim) ** -0.5; µP: it / that sum
    rope_interleave: bool = False  # rotate (x0,x1),(x2,x3).. pairs as DeepSeek checkpoints (HF rope_interleave)
    absorb: str = "decode"  # decode: absorbed form for one-token cached steps | always | never
    bias: bool = False  # biases on q_a_proj, kv_a_proj, o_proj (HF attention_bias)
    norm_eps: float = 1e-6  # the q and kv latent RMSNorms
    conv_size: int = 0  # short causal conv on the mixer input (Based / Canon-A, Mixer.shift); 0 = off
    conv_bias: bool = False

    def sizes(self, model) -> dict:
        hd = model.head_dim  # resolved by config.resolve_model

        def pick(value, default):  # null -> default; 0 stays 0 so validate() rejects it
            return default if value is None else value

        return {
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": pick(self.kv_lora_rank, 4 * hd),
            "qk_nope_head_dim": pick(self.qk_nope_head_dim, hd),
            "qk_rope_head_dim": pick(self.qk_rope_head_dim, max(2, hd // 2 - (hd // 2) % 2)),
            "v_head_dim": pick(self.v_head_dim, hd),
        }

    def validate(self, model, field: str) -> None:
        check_choice(self.absorb, f"{field}.absorb", ("decode", "always", "never"))
        if model.position.name == "alibi":
            raise ConfigError("MLA's position is its decoupled RoPE key; allowed positions: rope, none",
                              field="model.position.name")
        for key, value in self.sizes(model).items():
            if value is not None and value <= 0:
                raise ConfigError(f"must be positive or null, got {value}", field=f"{field}.{key}")
        dr = self.sizes(model)["qk_rope_head_dim"]
        if dr % 2:
            raise ConfigError(f"must be even (RoPE rotates pairs), got {dr}", field=f"{field}.qk_rope_head_dim")
        if model.position.name == "rope" and getattr(model.position, "scaling", "none") == "dynamic" and dr <= 2:
            raise ConfigError(f"{dr} rotates 2 channels; dynamic NTK scales theta by a power dim/(dim-2); allowed "
                              f"with model.position.scaling=dynamic: >= 4", field=f"{field}.qk_rope_head_dim")
        validate_conv(self, field)


# ----------------------------------------------------------------------------- dsa

@dataclass
class DSAConfig(MLAConfig):
    """DeepSeek Sparse Attention (DeepSeek-V3.2, arXiv:2512.02556; mixers/dsa.py): MLA whose queries each attend
    their top-k keys by a lightning indexer. The paper's indexer: 64 heads of 128 (64 of them rotary), top-k 2048;
    the defaults here are sized for the zoo's small models (docs/attention.md, "DeepSeek Sparse Attention")."""
    context_parallel = False  # the top-k over the whole past: no ring form here
    full_causal_attention = False
    name: str = "dsa"
    index_n_heads: int = 4  # HI, the indexer's query heads (the paper: 64)
    # DI, the index query / key size; its first qk_rope_head_dim dims rotate. null: 2 * qk_rope_head_dim (the paper's
    # proportion: 128 = 2 x 64)
    index_head_dim: Optional[int] = None
    index_topk: int = 32  # keys each query attends (the paper: 2048 of 128K); >= the sequence: dense attention
    # weight of the indexer's KL loss to the main attention (the paper's L^I; mean over queries): the only gradient
    # the indexer gets (its inputs are detached); 0 freezes it at its init
    index_loss_coef: float = 1.0
    # optimizer steps at the start of training with dense attention and the indexer's KL over every key (the paper's
    # dense warm-up, Eq. 3), then the top-k; validation and decoding always use the top-k. 0: sparse from the first step
    index_warmup_steps: int = 0
    # during those steps only the indexers train, the rest of the model frozen (the paper's stage 1, for a trained
    # dense model); false: everything trains from the first step (a model trained from scratch learns the task then)
    index_warmup_freeze: bool = False

    def sizes(self, model) -> dict:
        s = super().sizes(model)
        s["index_head_dim"] = 2 * s["qk_rope_head_dim"] if self.index_head_dim is None else self.index_head_dim
        return s

    def validate(self, model, field: str) -> None:
        super().validate(model, field)  # every size positive (index_head_dim included), RoPE dims even
        if self.index_n_heads < 1:
            raise ConfigError(f"must be >= 1 (index heads), got {self.index_n_heads}", field=f"{field}.index_n_heads")
        if self.index_topk < 1:
            raise ConfigError(f"must be >= 1 (keys each query attends), got {self.index_topk}",
                              field=f"{field}.index_topk")
        s = self.sizes(model)
        if s["index_head_dim"] < s["qk_rope_head_dim"]:
            raise ConfigError(f"{s['index_head_dim']} is less than qk_rope_head_dim={s['qk_rope_head_dim']} (the index "
                              f"keys' rotary part); allowed: >= {s['qk_rope_head_dim']}", field=f"{field}.index_head_dim")
        if self.index_warmup_steps < 0:
            raise ConfigError(f"must be >= 0 (0 = sparse from the first step), got {self.index_warmup_steps}",
                              field=f"{field}.index_warmup_steps")
        if not (math.isfinite(self.index_loss_coef) and self.index_loss_coef >= 0):
            raise ConfigError(f"must be >= 0 (0 = the indexer stays at its init), got {self.index_loss_coef}",
                              field=f"{field}.index_loss_coef")
        if self.index_warmup_freeze and self.index_warmup_steps == 0:
            raise ConfigError("true freezes the model during the dense warm-up, which index_warmup_steps=0 leaves out; "
                              "allowed: false, or index_warmup_steps >= 1", field=f"{field}.index_warmup_freeze")
        if self.index_warmup_freeze and self.index_loss_coef == 0:
            raise ConfigError("true with index_loss_coef=0 trains nothing during the warm-up (the indexer learns only "
                              "from its KL); allowed: false, or index_loss_coef > 0", field=f"{field}.index_warmup_freeze")



# ----------------------------------------------------------------------------- where each class lives
for _name, _config, _module in (
        ("mha", AttentionConfig, "attention"), ("gqa", AttentionConfig, "attention"), ("mqa", AttentionConfig, "attention"),
        ("sliding_window", SlidingWindowConfig, "attention"), ("moba", MoBAConfig, "moba"), ("nsa", NSAConfig, "nsa"),
        ("mla", MLAConfig, "mla"), ("dsa", DSAConfig, "dsa"), ("fox", ForgettingAttentionConfig, "forgetting"), ("deltanet", DeltaNetConfig, "deltanet"),
        ("gated_deltanet", GatedDeltaNetConfig, "deltanet"), ("kda", KDAConfig, "kda"), ("gdn2", GDN2Config, "kda"),
        ("gated_deltaproduct", GatedDeltaProductConfig, "deltaproduct"), ("gla", GLAConfig, "gla"), ("hgrn2", HGRN2Config, "hgrn2"),
        ("linear_attention", LinearAttentionConfig, "linear_attention"), ("mamba2", Mamba2Config, "mamba2"),
        ("mamba3", Mamba3Config, "mamba3"),
        ("retnet", RetNetConfig, "retnet"), ("rwkv7", RWKV7Config, "rwkv7")):
    MIXERS.declare(_name, _config, f"attnzoo.mixers.{_module}")
# modules of the package that register no mixer
MIXERS.helpers(*(f"attnzoo.mixers.{m}" for m in ("base", "attention_cache", "block_sparse", "kv_quant",
                                                  "recurrent_base", "short_conv", "kv_format", "spec",
                                                  "recurrent_configs")))
