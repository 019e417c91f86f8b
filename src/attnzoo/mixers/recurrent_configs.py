"""The recurrent mixers' config dataclasses (linear attention, DeltaNet, Gated DeltaNet, GLA, HGRN2, Mamba-2, Mamba-3,
RetNet, RWKV-7), torch-free: declared with the others in mixers/configs.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional

from attnzoo.config.errors import ConfigError, check_choice
from attnzoo.mixers.spec import MixerSpec, validate_conv


def check_init_ranges(cfg, field: str) -> None:
    """Mamba-2's decay init (Mamba2Config, GatedDeltaNetConfig): A_init_range and dt_init_range two finite numbers
    0 < low <= high (A ~ U(range), A_log = log A; dt ~ logU(range)); a list of another length was an unpacking
    traceback, [0, 16] an A_log of -inf."""
    for key in ("A_init_range", "dt_init_range"):
        span = list(getattr(cfg, key))
        if not (len(span) == 2 and all(math.isfinite(v) for v in span) and 0 < span[0] <= span[1]):
            raise ConfigError(f"must be [low, high] with 0 < low <= high, got {span}; allowed: two finite numbers, "
                              f"e.g. {cfg.__dataclass_fields__[key].default_factory()}", field=f"{field}.{key}")


# ----------------------------------------------------------------------------- deltanet

@dataclass
class DeltaNetConfig(MixerSpec):
    context_parallel = True  # state passing (RecurrentMixer, mode "cp")
    fla_kernel = "chunk_delta_rule"
    name: str = "deltanet"
    n_heads: Optional[int] = None  # q/k heads (null: model.n_heads)
    n_v_heads: Optional[int] = None  # value heads = states, a multiple of n_heads (null: n_heads)
    head_dim: Optional[int] = None  # d_k (null: model head_dim)
    v_head_dim: Optional[int] = None  # d_v (null: head_dim)
    chunk_size: int = 64  # chunkwise form's chunk length (any T works)
    conv_size: int = 4  # short causal depthwise conv on q/k/v; 0 = off
    conv_bias: bool = False
    qkv_activation: str = "silu"  # after the conv: silu | none
    allow_neg_eigval: bool = False  # beta in (0, 2) (Grazzi et al. 2024, negative eigenvalues)
    use_output_norm: bool = True  # per-head RMSNorm on the output
    use_gate: bool = False  # output gate: norm(o) * silu(W_g x)
    norm_eps: float = 1e-6

    def sizes(self, model) -> tuple[int, int, int, int]:
        h = self.n_heads or model.n_heads
        hv = self.n_v_heads or h
        dk = self.head_dim or model.head_dim
        return h, hv, dk, self.v_head_dim or dk

    def validate(self, model, field: str) -> None:
        h, hv, dk, dv = self.sizes(model)
        if hv % h != 0:
            raise ConfigError(f"n_v_heads={hv} is not a multiple of n_heads={h}", field=f"{field}.n_v_heads")
        if self.chunk_size < 1:
            raise ConfigError(f"must be >= 1, got {self.chunk_size}", field=f"{field}.chunk_size")
        validate_conv(self, field)
        check_choice(self.qkv_activation, f"{field}.qkv_activation", ("silu", "none"))


@dataclass
class GatedDeltaNetConfig(DeltaNetConfig):
    fla_kernel = "chunk_gated_delta_rule"
    name: str = "gated_deltanet"
    use_gate: bool = True  # Gated DeltaNet: gated RMSNorm on the output (as Qwen3-Next)
    A_init_range: List[float] = field(default_factory=lambda: [1.0, 16.0])  # A = exp(A_log) ~ U(range) (Mamba-2)
    dt_init_range: List[float] = field(default_factory=lambda: [0.001, 0.1])  # softplus(dt_bias) ~ logU(range)

    def validate(self, model, field: str) -> None:
        super().validate(model, field)
        check_init_ranges(self, field)  # were not checked: [0, 16] gave A_log = -inf, a reversed range no error



# ----------------------------------------------------------------------------- gated_deltaproduct

@dataclass
class GatedDeltaProductConfig(GatedDeltaNetConfig):
    """Gated DeltaProduct (Siems et al. 2025; mixers/deltaproduct.py): n_h delta-rule steps per token."""
    context_parallel = False  # the sub-steps per token: no state-passing form here
    fla_kernel = "chunk_gated_delta_product"  # fla's own (ops/fla_kernels.fla_chunk_gated_delta_product), 16-bit only
    name: str = "gated_deltaproduct"
    num_householder: int = 2  # n_h: delta-rule (Householder) steps per token (the paper's n_h = 2; 1 = Gated DeltaNet)
    chunk_size: int = 16  # tokens per chunk (chunk_size x n_h sub-steps)

    def validate(self, model, field: str) -> None:
        super().validate(model, field)
        if self.num_householder < 1:
            raise ConfigError(f"must be >= 1 (1: Gated DeltaNet), got {self.num_householder}",
                              field=f"{field}.num_householder")


# ----------------------------------------------------------------------------- kda

@dataclass
class KDAConfig(DeltaNetConfig):
    """Kimi Delta Attention (Kimi Linear, 2025; mixers/kda.py): the gated delta rule with a decay per key channel."""
    fla_kernel = "chunk_kda"  # fla's own KDA kernel (ops/fla_kernels.fla_chunk_kda) where dispatch picks fla
    name: str = "kda"
    chunk_size: int = 16  # the chunkwise form holds a (C, C, d_k) decay per chunk (a decay per key channel)
    use_gate: bool = True  # output gate: norm(o) * sigmoid(W_g x) through a low-rank projection (Kimi Linear)
    A_init_range: List[float] = field(default_factory=lambda: [1.0, 16.0])  # A = exp(A_log) ~ U(range), per head
    dt_init_range: List[float] = field(default_factory=lambda: [0.001, 0.1])  # softplus(dt_bias) ~ logU, per channel
    gate_low_rank_dim: Optional[int] = None  # the forget gate's and output gate's rank r (d -> r -> H d); null: d_k

    def validate(self, model, field: str) -> None:
        super().validate(model, field)
        check_init_ranges(self, field)
        if self.gate_low_rank_dim is not None and self.gate_low_rank_dim < 1:
            raise ConfigError(f"must be >= 1 or null (null: head_dim), got {self.gate_low_rank_dim}",
                              field=f"{field}.gate_low_rank_dim")


@dataclass
class GDN2Config(KDAConfig):
    """Gated DeltaNet-2 (mixers/kda.py): KDA with a channel-wise erase gate (key axis) and write gate (value axis)."""
    fla_kernel = "chunk_gdn2"  # fla's own GDN-2 kernel (ops/fla_kernels.fla_chunk_gdn2) where dispatch picks fla
    name: str = "gdn2"


# ----------------------------------------------------------------------------- gla

@dataclass
class GLAConfig(MixerSpec):
    context_parallel = True  # state passing (RecurrentMixer, mode "cp")
    fla_kernel = "chunk_gla"  # a log-decay per key channel; RetNet / Mamba2 (one per head) take chunk_simple_gla
    name: str = "gla"
    n_heads: Optional[int] = None  # null: model.n_heads
    head_dim: Optional[int] = None  # d_k (null: model head_dim; fla's layer: expand_k 0.5, i.e. half of it)
    v_head_dim: Optional[int] = None  # d_v (null: head_dim)
    gate_low_rank_dim: int = 16  # the forget gate's low-rank projection d_model -> r -> H d_k
    gate_logit_normalizer: float = 16.0  # log alpha = logsigmoid(.) / this: alpha = sigmoid(.)^(1/16)
    # the chunkwise form holds a (C, C, d_k) decay per chunk (one decay per key channel): short chunks
    chunk_size: int = 16
    conv_size: int = 0  # short causal depthwise conv on q/k/v (fla's use_short_conv, off by default); 0 = off
    conv_bias: bool = False
    qkv_activation: str = "none"  # after the conv: silu (fla's, with its conv) | none
    use_output_norm: bool = True  # per-head RMSNorm on the output
    use_gate: bool = True  # output gate: norm(o) * silu(W_g x)
    norm_eps: float = 1e-5  # fla's

    def validate(self, model, field: str) -> None:
        check_choice(self.qkv_activation, f"{field}.qkv_activation", ("silu", "none"))
        for key in ("chunk_size", "gate_low_rank_dim"):
            if getattr(self, key) < 1:
                raise ConfigError(f"must be >= 1, got {getattr(self, key)}", field=f"{field}.{key}")
        if not (self.gate_logit_normalizer > 0 and math.isfinite(self.gate_logit_normalizer)):  # NaN, inf too
            raise ConfigError(f"must be > 0, got {self.gate_logit_normalizer}; allowed: a finite positive number "
                              f"(16: fla's)", field=f"{field}.gate_logit_normalizer")
        validate_conv(self, field)



# ----------------------------------------------------------------------------- hgrn2

@dataclass
class HGRN2Config(MixerSpec):
    context_parallel = True  # state passing (RecurrentMixer, mode "cp")
    fla_kernel = "chunk_gla"  # GLA's kernel: the forget gate is a log-decay per key channel
    name: str = "hgrn2"
    n_heads: Optional[int] = None  # null: model.n_heads
    head_dim: Optional[int] = None  # d_k: forget-gate channels per head (fla's expand_ratio; null: model head_dim)
    v_head_dim: Optional[int] = None  # d_v (null: head_dim; fla's layer: d_model / n_heads)
    lower_bound: float = 0.0  # f = lb + (1 - lb) sigmoid(.), in [0, 1); 0 = off (fla's first layer)
    # the chunkwise form holds a (C, C, d_k) decay per chunk (one decay per key channel): short chunks
    chunk_size: int = 16
    conv_size: int = 0  # short causal depthwise conv on q/f/i (fla's use_short_conv, off by default); 0 = off
    conv_bias: bool = False
    use_output_norm: bool = True  # one RMSNorm over all heads' outputs (fla's g_norm)
    norm_eps: float = 1e-5  # fla's

    def validate(self, model, field: str) -> None:
        if self.chunk_size < 1:
            raise ConfigError(f"must be >= 1, got {self.chunk_size}", field=f"{field}.chunk_size")
        if not 0.0 <= self.lower_bound < 1.0:
            raise ConfigError(f"must be in [0, 1), got {self.lower_bound}", field=f"{field}.lower_bound")
        validate_conv(self, field)



# ----------------------------------------------------------------------------- linear_attention

FEATURE_MAPS = ("identity", "elu", "relu", "taylor2")


@dataclass
class LinearAttentionConfig(MixerSpec):
    context_parallel = True  # state passing (RecurrentMixer, mode "cp")
    fla_kernel = "chunk_simple_gla"  # with no gate
    name: str = "linear_attention"
    n_heads: Optional[int] = None  # null: model.n_heads
    feature_dim: Optional[int] = None  # q/k projection size per head before phi (null: model head_dim)
    head_dim: Optional[int] = None  # value size per head (null: model head_dim)
    feature_map: str = "elu"  # identity | elu | relu | taylor2
    normalize: bool = True  # divide by phi(q) . sum phi(k) (Katharopoulos); needs a positive map
    norm_eps: float = 1e-6  # for the normaliser and the output RMSNorm
    scale: Optional[float] = None  # on q; null: feature_dim^-1/2 (1 for taylor2, whose map is scaled)
    chunk_size: int = 64
    conv_size: int = 0  # short causal depthwise conv on q/k/v (Based uses one); 0 = off
    conv_bias: bool = False
    qkv_activation: str = "none"  # after the conv: silu | none
    use_output_norm: bool = False
    use_gate: bool = False

    def validate(self, model, field: str) -> None:
        check_choice(self.feature_map, f"{field}.feature_map", FEATURE_MAPS)
        check_choice(self.qkv_activation, f"{field}.qkv_activation", ("silu", "none"))
        if self.chunk_size < 1:
            raise ConfigError(f"must be >= 1, got {self.chunk_size}", field=f"{field}.chunk_size")
        validate_conv(self, field)



def validate_ssd_shape(cfg, model, field: str, positive: tuple) -> None:
    """Mamba-2 / Mamba-3's sizes: the `positive` fields >= 1, head_dim (null: the model's) dividing expand * d_model,
    n_groups dividing the heads."""
    for key in positive:
        if getattr(cfg, key) < 1:
            raise ConfigError(f"must be >= 1, got {getattr(cfg, key)}", field=f"{field}.{key}")
    p = cfg.head_dim or model.head_dim
    inner = cfg.expand * model.d_model
    if p < 1 or inner % p:
        raise ConfigError(f"head_dim={p} does not divide expand * d_model = {inner}", field=f"{field}.head_dim")
    if (inner // p) % cfg.n_groups:
        raise ConfigError(f"does not divide n_heads = {inner // p}", field=f"{field}.n_groups")


# ----------------------------------------------------------------------------- mamba2

@dataclass
class Mamba2Config(MixerSpec):
    context_parallel = True  # state passing (RecurrentMixer, mode "cp")
    fla_kernel = "chunk_simple_gla(g)"  # one log-decay per head (dt A)
    name: str = "mamba2"
    expand: int = 2  # inner width d_inner = expand * d_model (x and the gate z)
    head_dim: Optional[int] = None  # P, channels per head (null: model head_dim); n_heads = d_inner / P
    d_state: int = 64  # N: each head's state is N x P; B and C are N wide per group
    n_groups: int = 1  # B and C groups, each shared by n_heads / n_groups heads
    chunk_size: int = 64  # chunkwise form's chunk length (one decay per head: a (C, C) decay matrix per chunk)
    conv_size: int = 4  # causal depthwise conv on [C | B | x] before the SiLU; 0 = off
    conv_bias: bool = True
    A_init_range: List[float] = field(default_factory=lambda: [1.0, 16.0])  # A = exp(A_log) ~ U(range)
    dt_init_range: List[float] = field(default_factory=lambda: [0.001, 0.1])  # softplus(dt_bias) ~ logU(range)
    dt_init_floor: float = 1e-4  # the sampled dt floored here before the inverse softplus
    norm_eps: float = 1e-5  # the gated RMSNorm's (mamba_ssm's)

    def sizes(self, model) -> tuple[int, int, int]:
        """(n_heads, head_dim P, d_state N)."""
        p = self.head_dim or model.head_dim
        return self.expand * model.d_model // p, p, self.d_state

    def validate(self, model, field: str) -> None:
        validate_ssd_shape(self, model, field, ("expand", "d_state", "n_groups", "chunk_size"))
        check_init_ranges(self, field)
        if not (self.dt_init_floor >= 0 and math.isfinite(self.dt_init_floor)):  # NaN too
            raise ConfigError(f"must be >= 0, got {self.dt_init_floor}; allowed: a finite number >= 0 (1e-4: "
                              f"mamba_ssm's)", field=f"{field}.dt_init_floor")
        validate_conv(self, field)



# ----------------------------------------------------------------------------- mamba3

@dataclass
class Mamba3Config(MixerSpec):
    """Mamba-3 (Lahoti et al. 2026, arXiv:2603.15569; mixers/mamba3.py). The paper's code defaults are in
    conf/model/mixer/mamba3.yaml beside the zoo's."""
    # the trapezoid's previous-token term and the state's rotation cross a shard boundary: no sharded form here
    context_parallel = False
    fla_kernel = None  # fla-core 0.6.0 ships no Mamba-3 op: the torch chunkwise form everywhere
    name: str = "mamba3"
    expand: int = 2  # d_inner = expand * d_model (x and the gate z)
    head_dim: Optional[int] = None  # P, channels per head (null: model head_dim); n_heads = d_inner / P
    d_state: int = 64  # N: each head's state is N x P; B and C are N wide per group and rank
    n_groups: int = 1  # B and C groups, each shared by n_heads / n_groups heads
    mimo_rank: int = 1  # R: inputs / outputs per head (1: SISO; the paper's MIMO: 4)
    rope_fraction: float = 0.5  # share of the d_state channels rotated (in pairs); 0: a real state (no rotation)
    trapezoid: bool = True  # exponential-trapezoidal rule (lambda = sigmoid(W x)); false: exponential-Euler (lambda 1)
    chunk_size: int = 64  # chunkwise form's chunk length (in tokens; the scores are (C R) x (C R))
    conv_size: int = 0  # causal depthwise conv on [C | B | x] (Mamba-3 drops Mamba-2's); 0 = off
    conv_bias: bool = False
    A_floor: float = 1e-4  # A_t = -softplus(W_A x) <= -A_floor
    dt_init_range: List[float] = field(default_factory=lambda: [0.001, 0.1])  # softplus(dt_bias) ~ logU(range)
    dt_init_floor: float = 1e-4  # the sampled dt floored here before the inverse softplus
    use_output_norm: bool = False  # RMSNorm per head before the gate (mamba_ssm's is_outproj_norm)
    norm_eps: float = 1e-5  # the B / C RMSNorms' (and the output norm's)

    def sizes(self, model) -> tuple[int, int, int]:
        """(n_heads, head_dim P, d_state N)."""
        p = self.head_dim or model.head_dim
        return self.expand * model.d_model // p, p, self.d_state

    def n_angles(self) -> int:
        """Rotation angles A per token (pairs of state channels rotated): mamba_ssm's int(N * rope_fraction) rounded
        down to even, halved."""
        rotated = int(self.d_state * self.rope_fraction)
        return (rotated - rotated % 2) // 2

    def validate(self, model, field: str) -> None:
        validate_ssd_shape(self, model, field, ("expand", "d_state", "n_groups", "mimo_rank", "chunk_size"))
        if not 0.0 <= self.rope_fraction <= 1.0:  # NaN too
            raise ConfigError(f"must be in [0, 1], got {self.rope_fraction}; allowed: 0 (no rotation), 0.5 (the "
                              f"paper's), 1.0", field=f"{field}.rope_fraction")
        if not (self.A_floor >= 0 and math.isfinite(self.A_floor)):
            raise ConfigError(f"must be >= 0, got {self.A_floor}; allowed: a finite number >= 0 (1e-4: mamba_ssm's)",
                              field=f"{field}.A_floor")
        span = list(self.dt_init_range)
        if not (len(span) == 2 and all(math.isfinite(v) for v in span) and 0 < span[0] <= span[1]):
            raise ConfigError(f"must be [low, high] with 0 < low <= high, got {span}; allowed: two finite numbers, "
                              f"e.g. [0.001, 0.1]", field=f"{field}.dt_init_range")
        if not (self.dt_init_floor >= 0 and math.isfinite(self.dt_init_floor)):
            raise ConfigError(f"must be >= 0, got {self.dt_init_floor}; allowed: a finite number >= 0 (1e-4: "
                              f"mamba_ssm's)", field=f"{field}.dt_init_floor")
        validate_conv(self, field)



# ----------------------------------------------------------------------------- retnet

@dataclass
class RetNetConfig(MixerSpec):
    context_parallel = True  # state passing (RecurrentMixer, mode "cp")
    fla_kernel = "chunk_simple_gla(g)"  # one log-decay per head
    name: str = "retnet"
    n_heads: Optional[int] = None  # null: model.n_heads (head h decays by 1 - 2^(-5-h))
    head_dim: Optional[int] = None  # d_k (null: model head_dim)
    v_head_dim: Optional[int] = None  # d_v (null: head_dim; the paper and fla's layer: 2 x head_dim)
    chunk_size: int = 64
    conv_size: int = 0  # short causal depthwise conv on q/k/v (fla's use_short_conv, off by default); 0 = off
    conv_bias: bool = False
    qkv_activation: str = "none"  # after the conv: silu (fla's, with its conv) | none
    use_output_norm: bool = True  # per-head RMSNorm on the output (the paper's GroupNorm)
    use_gate: bool = True  # swish output gate: norm(o) * silu(W_g x)
    norm_eps: float = 1e-5  # fla's

    def validate(self, model, field: str) -> None:
        check_choice(self.qkv_activation, f"{field}.qkv_activation", ("silu", "none"))
        if self.chunk_size < 1:
            raise ConfigError(f"must be >= 1, got {self.chunk_size}", field=f"{field}.chunk_size")
        validate_conv(self, field)



# ----------------------------------------------------------------------------- rwkv7

LOG_DECAY_SCALE = math.exp(-0.5)  # log w = -e^{-1/2} sigmoid(.): w in (e^{-0.6065}, 1)


MIN_DECAY = math.exp(-LOG_DECAY_SCALE)  # 0.54524: the fastest per-token decay the parameterisation reaches


@dataclass
class RWKV7Config(MixerSpec):
    context_parallel = True  # state passing (RecurrentMixer, mode "cp")
    fla_kernel = "chunk_dplr_delta_rule"
    name: str = "rwkv7"
    n_heads: Optional[int] = None  # null: model.n_heads
    head_dim: Optional[int] = None  # d_k of r, k (null: model head_dim; fla's layer: 64)
    v_head_dim: Optional[int] = None  # d_v (null: head_dim)
    # the LoRAs' ranks; null: fla's max(32, round(2.5 sqrt(d_model) d_k / 64 / 32) * 32) for w and a,
    # max(32, round(5 sqrt(d_model) / 32) * 32) for the gate; with model.mup_base_width set, that width's d_model
    # and d_k at every width (µP: a fixed rank, so a LoRA's role does not depend on the widths compared)
    decay_low_rank_dim: Optional[int] = None
    a_low_rank_dim: Optional[int] = None
    gate_low_rank_dim: Optional[int] = None
    # the chunkwise form holds (C, C, d_k) decays per chunk (one decay per key channel): short chunks
    chunk_size: int = 16
    # a short causal depthwise conv on the mixer input before the token shift (the Based recipe; experiment=mqar sets
    # 4); 0 = off: RWKV-7's own token shift is its short conv
    conv_size: int = 0
    conv_bias: bool = False
    norm_eps: float = 1e-5  # the per-head GroupNorm's eps is head_dim * norm_eps (fla's)
    # null: the paper's decay init by layer (w_0 above); [low, high]: each head's d_k channels start at per-token
    # decays from high (channel 0) down to low, forgetting rates -log w spaced geometrically (experiment=mqar sets
    # [0.99, 0.9999]: the paper's spread forgets most pairs of a recall example within a few tokens at small widths)
    decay_init_range: Optional[List[float]] = None
    # the paper's value residual: every RWKV-7 layer after the first mixes the first one's values into its own,
    # v + (v_first - v) sigmoid(v_0 + x^v W_v1 W_v2) (a LoRA of rank v_low_rank_dim; null: RWKV's
    # max(32, round(1.7 sqrt(d_model) / 32) * 32)); false: each layer its own values (the zoo's RWKV-7 before)
    value_residual: bool = True
    v_low_rank_dim: Optional[int] = None

    def ranks(self, model) -> tuple[int, int, int]:
        """(decay, learning-rate, gate) LoRA ranks, fla's defaults where null."""
        d, dk = model.d_model, self.head_dim or model.head_dim
        base = getattr(model, "mup_base_width", None)
        if base:  # the base width's defaults (its d_k: model.head_dim scales with d_model where it tiles it)
            if self.head_dim is None and model.head_dim * model.n_heads == d:
                dk = dk * base // d
            d = base
        fla = lambda c, f: max(32, int(round(c * d**0.5 * f / 32) * 32))  # noqa: E731
        return (self.decay_low_rank_dim or fla(2.5, dk / 64), self.a_low_rank_dim or fla(2.5, dk / 64),
                self.gate_low_rank_dim or fla(5.0, 1.0))

    def value_rank(self, model) -> int:
        """The value-residual LoRA's rank: v_low_rank_dim, or RWKV's max(32, round(1.7 sqrt(d_model) / 32) * 32)."""
        d = getattr(model, "mup_base_width", None) or model.d_model
        return self.v_low_rank_dim or max(32, int(round(1.7 * d**0.5 / 32) * 32))

    def validate(self, model, field: str) -> None:
        for key in ("chunk_size", "decay_low_rank_dim", "a_low_rank_dim", "gate_low_rank_dim", "v_low_rank_dim"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ConfigError(f"must be >= 1{'' if key == 'chunk_size' else ' or null'}, got {value}",
                                  field=f"{field}.{key}")
        span = self.decay_init_range
        if span is not None and not (len(span) == 2 and MIN_DECAY < span[0] <= span[1] < 1):
            raise ConfigError(f"must be null or [low, high] per-token decays with {MIN_DECAY:.5f} < low <= high < 1, "
                              f"got {list(span)}", field=f"{field}.decay_init_range")
        validate_conv(self, field)
