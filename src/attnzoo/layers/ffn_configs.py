"""The FFNs' config dataclasses, torch-free: what `config.resolve_model` and the config checks read (issue 45: a
refused value is reported before torch is imported). The classes live in `layers/ffn.py` (mlp, swiglu, none) and
`layers/moe.py` (moe), declared at the end of this file: the registry imports a class's module when it is first built.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from attnzoo.config.errors import ConfigError, check, check_choice
from attnzoo.config.registry import FFNS


@dataclass
class MLPConfig:
    name: str = "mlp"
    d_ff: Optional[int] = None  # default: hidden_mult * d_model
    hidden_mult: float = 4.0
    multiple_of: int = 1
    activation: str = "gelu"  # gelu | relu
    bias: bool = True

    def validate(self, model, field: str) -> None:
        check_choice(self.activation, f"{field}.activation", ("gelu", "relu"))
        if self.d_ff is not None and self.d_ff <= 0:
            raise ConfigError("must be positive", field=f"{field}.d_ff")


@dataclass
class SwiGLUConfig:
    name: str = "swiglu"
    d_ff: Optional[int] = None  # default: hidden_mult * d_model rounded up to multiple_of
    hidden_mult: float = 8.0 / 3.0  # keeps parameters equal to a 4x MLP (Shazeer 2020)
    multiple_of: int = 32
    bias: bool = False

    def validate(self, model, field: str) -> None:
        if self.d_ff is not None and self.d_ff <= 0:
            raise ConfigError("must be positive", field=f"{field}.d_ff")


@dataclass
class NoFFNConfig:
    name: str = "none"


@dataclass
class MoEConfig:
    name: str = "moe"
    n_experts: int = 8  # routed experts E
    top_k: int = 2  # experts per token K
    # expert hidden size; fine-grained experts (DeepSeekMoE) use a small d_ff and many experts
    d_ff: Optional[int] = None  # default: hidden_mult * d_model rounded up to multiple_of
    hidden_mult: float = 8.0 / 3.0
    multiple_of: int = 32
    expert_type: str = "swiglu"  # swiglu | mlp (GELU)
    # router
    scoring: str = "softmax"  # softmax (Mixtral/Switch) | sigmoid (DeepSeek-V3)
    norm_topk_prob: bool = True  # renormalise the K selected weights to sum to 1
    routed_scaling_factor: float = 1.0  # multiplies the routed weights (DeepSeek-V3: 2.5)
    n_group: Optional[int] = None  # group-limited routing (DeepSeek-V3): E experts in n_group groups ...
    topk_group: Optional[int] = None  # ... and a token picks its experts from its topk_group best groups
    # shared experts (DeepSeekMoE), always on
    n_shared_experts: int = 0
    shared_d_ff: Optional[int] = None  # default: n_shared_experts * expert d_ff
    shared_expert_gate: bool = False  # sigmoid gate on the shared output (Qwen3-Next)
    first_k_dense: int = 0  # the first k layers use a dense FFN instead (DeepSeek-V3: 3)
    dense_d_ff: Optional[int] = None  # their hidden size; default: the dense FFN's default
    # balancing, each off at 0
    aux_loss_coef: float = 0.01  # Switch/GShard load-balancing loss
    z_loss_coef: float = 1e-3  # ST-MoE router z-loss
    bias_update_speed: float = 0.0  # gamma of DeepSeek-V3's auxiliary-loss-free balancing (paper: 0.001)
    capacity_factor: Optional[float] = None  # null: dropless; else C = ceil(cf * tokens * K / E) per expert
    dispatch: str = "auto"  # auto | grouped_mm | loop (how the fast form runs the experts)

    def validate(self, model, field: str) -> None:
        check(self.n_experts >= 1, f"{field}.n_experts", f"must be >= 1, got {self.n_experts}")
        check(1 <= self.top_k <= self.n_experts, f"{field}.top_k",
              f"got {self.top_k}; allowed: 1..n_experts={self.n_experts}")
        check_choice(self.expert_type, f"{field}.expert_type", ("swiglu", "mlp"))
        check_choice(self.scoring, f"{field}.scoring", ("softmax", "sigmoid"))
        check_choice(self.dispatch, f"{field}.dispatch", ("auto", "grouped_mm", "loop"))
        for name in ("d_ff", "shared_d_ff", "dense_d_ff"):
            v = getattr(self, name)
            check(v is None or v > 0, f"{field}.{name}", f"must be positive or null, got {v}")
        check(self.n_shared_experts >= 0, f"{field}.n_shared_experts", "must be >= 0")
        check(not self.shared_expert_gate or self.n_shared_experts > 0 or bool(self.shared_d_ff),
              f"{field}.shared_expert_gate", "needs a shared expert (n_shared_experts > 0 or shared_d_ff)")
        for name in ("aux_loss_coef", "z_loss_coef", "bias_update_speed"):
            check(getattr(self, name) >= 0, f"{field}.{name}", f"must be >= 0, got {getattr(self, name)}")
        check(self.capacity_factor is None or self.capacity_factor > 0, f"{field}.capacity_factor",
              f"must be positive or null (dropless), got {self.capacity_factor}")
        n_layers = getattr(model, "n_layers", None)
        check(self.first_k_dense >= 0 and (n_layers is None or self.first_k_dense <= n_layers),
              f"{field}.first_k_dense", f"got {self.first_k_dense}; allowed: 0..n_layers")
        if self.n_group is not None or self.topk_group is not None:
            G, tg = self.n_group or 1, self.topk_group or 1
            divisors = [g for g in range(1, self.n_experts + 1) if self.n_experts % g == 0]
            check(G in divisors, f"{field}.n_group", f"got {G}; allowed: a divisor of n_experts: {divisors}")
            check(1 <= tg <= G, f"{field}.topk_group", f"got {tg}; allowed: 1..n_group={G}")
            check(self.top_k <= tg * (self.n_experts // G), f"{field}.top_k",
                  f"{self.top_k} exceeds the experts in topk_group groups ({tg * (self.n_experts // G)})")


FFNS.declare("mlp", MLPConfig, "attnzoo.layers.ffn")
FFNS.declare("swiglu", SwiGLUConfig, "attnzoo.layers.ffn")
FFNS.declare("none", NoFFNConfig, "attnzoo.layers.ffn")
FFNS.declare("moe", MoEConfig, "attnzoo.layers.moe")
