"""RWKV-7 "Goose" (Peng, Zhang, Goldstein et al. 2025, "RWKV-7 "Goose" with Expressive Dynamic State Evolution",
arXiv:2503.14456): the time-mix layer as fla's `RWKV7Attention` builds it (fla/layers/rwkv7.py, non-fused path):

    x^*_t = x_t + (x_{t-1} - x_t) * mu_*        for * in r, w, k, v, a, g   (token shift: six learned mixes)
    r = W_r x^r,   k~ = W_k x^k,   v = W_v x^v                              (H heads: d_k for r, k; d_v for v)
    log w_t = -e^{-1/2} sigmoid(w_0 + tanh(x^w W_w1) W_w2)    a decay per key channel, w_t in (0.545, 1)
    lr_t = sigmoid(a_0 + x^a W_a1 W_a2)                         the in-context learning rate, per key channel
    gate = sigmoid(x^g W_g1) W_g2                               the output gate (no bias)
    kk = normalize(k~ * k_k) per head,     k = k~ + k~ (lr - 1) k_a
    S_t = (diag(w_t) - (lr_t kk_t) kk_t^T) S_{t-1} + k_t v_t^T,     o_t = S_t^T r_t          (scale 1)
    out = o_proj(gate * (GroupNorm_per_head(o) + (sum_d r k r_k) v))       (the "bonus": the current token's value)

The recurrence is the generalized delta rule with a = -kk, b = kk * lr (ops/generalized_delta_rule.py), in its three
forms (`impl="reference"` runs the per-token recurrence). The token shift is a one-tap causal conv on the mixer
input: its tail (the previous token's x) is kept in the cache beside the state, masked at document starts when
packing, and passed between ranks under context parallelism like a short conv's (ContextParallel.conv).

Initialisation as the paper's code and fla's `_initialize_weights` (it depends on layer_idx / model.n_layers): the mixes
mu_* = 1 - (n / d_model)^(p * (1 - l / L)) with p = 0.2, 0.9, 0.7, 0.7, 0.9, 0.2 for r, w, k, v, a, g; the decay bias
w_0 = -6 + 6 (n / (n_k - 1))^(1 + (l / (L - 1))^0.3) + 0.5 + 2.5 zigzag (a per-channel spread of forgetting rates,
slower in deeper layers; `decay_init_range: [low, high]` replaces it by each head's channels starting at per-token
decays from high down to low, as experiment=mqar does); a_0 = -0.19 + 0.3 zigzag + 0.4 linear; k_k = 0.71 - 0.1
linear; k_a = 1.02; r_k = -0.04; LoRAs down 0, up orthogonal x 0.1; GroupNorm weight ((l + 1) / L)^0.7; r, v
orthogonal, k orthogonal x 0.1, o_proj 0.
Those are raw parameters (not nn.Linear), so the model's `model.init=gpt2` (which re-draws every nn.Linear) keeps them;
only the four projections r, k, v, o follow `model.init` like every mixer's (their paper init with `model.init=pytorch`).

The value residual (the paper's v_first; `value_residual`, on by default): the first RWKV-7 layer of the stack
leaves its values in the model's per-forward carry (Mixer.carries), and every later one mixes them into its own,
v <- v + (v_first - v) sigmoid(v_0 + x^v W_v1 W_v2) (v_0 = 1, W_v1 = 0, W_v2 orthogonal x 0.1 at init, as the
paper's code). fla's fused GroupNorm (fuse_norm) is the same norm; its bf16 fast paths are not wired here
(torch forms on every device).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from attnzoo.config.registry import register_mixer
from attnzoo.distributed import context_parallel as parallel
from attnzoo.mixers.base import dtype_bytes
from attnzoo.mixers.recurrent_base import RecurrentMixer, RecurrentStateCache, state_dtype, upcast
from attnzoo.ops.generalized_delta_rule import (chunk_generalized_delta_rule, generalized_delta_rule_recurrent,
                                                generalized_delta_rule_step)
from attnzoo.mixers.configs import LOG_DECAY_SCALE, MIN_DECAY, RWKV7Config  # noqa: F401 (torch-free: config checks)

def decay_bias(decay_range, n_heads: int, dk: int) -> torch.Tensor:
    """w_0 (n_heads * dk,) such that each head's channels start (the decay LoRA is 0 at init) at per-token decays
    w = exp(-e^{-1/2} sigmoid(w_0)) from `high` (channel 0) down to `low`, the forgetting rates -log w spaced
    geometrically: `decay_init_range` (RWKV7Config)."""
    low, high = decay_range
    rate = torch.logspace(math.log10(-math.log(high)), math.log10(-math.log(low)), dk, dtype=torch.float64)
    return torch.logit(rate / LOG_DECAY_SCALE).repeat(n_heads)


class TokenShift(nn.Module):
    """x_{t-1} at every t (zeros before the first token, or the previous call's last input `tail`): RWKV's token
    shift, a causal depthwise conv whose one tap is fixed to the previous token. The interface of ShortConvolution
    (`kernel_size` 2, forward(x (B, T, C), tail (B, C, 1) or None) -> (shifted, new tail)), so a context-parallel
    split passes its tail between ranks the same way."""

    kernel_size = 2

    def forward(self, x: torch.Tensor, tail: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        first = x.new_zeros(x.shape[0], 1, x.shape[2]) if tail is None else tail.transpose(1, 2).to(x.dtype)
        return torch.cat([first, x[:, :-1]], dim=1), x[:, -1:].transpose(1, 2)


class LoRA(nn.Module):
    """act(x W_down) W_up (+ bias), fla's LoRA of RWKV-6/7: W_down 0, W_up orthogonal x 0.1 (x sqrt(rank / d_out)
    when rank > d_out), bias 0 until the layer sets it. Raw parameters, not nn.Linear: the model's GPT-2 init re-draws
    every nn.Linear, and the biases carry the paper's decay and learning-rate inits."""

    def __init__(self, d_in: int, d_out: int, rank: int, activation: Optional[str], bias: bool):
        super().__init__()
        self.d_in, self.d_out, self.rank, self.activation = d_in, d_out, rank, activation
        self.down = nn.Parameter(torch.zeros(d_in, rank))
        up = torch.empty(d_out, rank)  # fla's lora[2].weight
        nn.init.orthogonal_(up, gain=0.1 * (math.sqrt(rank / d_out) if rank > d_out else 1.0))
        self.up = nn.Parameter(up.T.contiguous())
        self.down._fan_in_dim = self.up._fan_in_dim = 0  # input-major (x @ W): µP's fan-in (models/mup.py)
        self.bias = nn.Parameter(torch.zeros(d_out)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.down
        h = torch.tanh(h) if self.activation == "tanh" else torch.sigmoid(h) if self.activation == "sigmoid" else h
        y = h @ self.up
        return y if self.bias is None else y + self.bias

    def flops_per_token(self) -> float:
        return 2.0 * self.rank * (self.d_in + self.d_out)


class TokenShiftStateCache(RecurrentStateCache):
    """RWKV-7's cache, constant in the context: the state (B, H, Dk, Dv) in >= fp32, the token shift's last input
    `shift_tail` (B, d_model, 1) and the input conv's tail (B, d_model, K-1) (None without one), in the cache dtype."""

    def __init__(self, state: torch.Tensor, shift_tail: torch.Tensor, conv_tail: Optional[torch.Tensor] = None):
        super().__init__(state, conv_tail)
        self.shift_tail = shift_tail


V_FIRST = "rwkv7.v_first"  # the carry key (Mixer.carries): the first RWKV-7 layer's values (B, T, H, Dv)


@register_mixer("rwkv7", RWKV7Config)
class RWKV7(RecurrentMixer):
    hf_missing = ("RWKV-7 has no transformers causal-LM counterpart (transformers' Rwkv is RWKV-4; fla's "
                  "RWKV7Attention is its reference)")
    # fla's chunk_dplr_delta_rule (chunk_rwkv7's op) on CUDA in fp16 / bf16 where model.impl allows
    # (RecurrentMixer.recur, ops/dispatch.py); the torch forms everywhere else. The token shift, LoRAs and readout
    # stay torch (fla's fused addcmul / output-correction kernels are not wired)
    kernel_family = "linear"
    # r, k, v come from six differently token-shifted inputs, with decay and learning-rate LoRAs: no attention layer's
    # q/k/v/o to seed them
    linearize_target = False
    carries = True  # the value residual: the first RWKV-7 layer's values, read by the later ones
    MIXES = ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g")
    MIX_POWERS = (0.2, 0.9, 0.7, 0.7, 0.9, 0.2)  # mu_* = 1 - (n / d_model)^(power * (1 - l / L))

    def __init__(self, cfg: RWKV7Config, model_cfg, layer_idx: int):
        super().__init__(cfg, model_cfg, layer_idx)
        d, H = self.d_model, cfg.n_heads or model_cfg.n_heads
        dk = cfg.head_dim or model_cfg.head_dim  # resolved by config.resolve_model
        dv = cfg.v_head_dim or dk
        self.n_qk_heads = self.n_v_heads = H
        self.qk_dim, self.v_dim, self.state_shape = dk, dv, (dk, dv)
        self.chunk_size = cfg.chunk_size
        self.conv = None  # no q/k/v conv (RecurrentMixer's); the optional conv is on the input (`input_conv`)
        self.build_input_conv(cfg.conv_size, cfg.conv_bias)
        self.token_shift = TokenShift()
        for name in self.MIXES:
            setattr(self, name, nn.Parameter(torch.zeros(d)))
        self.r_proj = nn.Linear(d, H * dk, bias=False)
        self.k_proj = nn.Linear(d, H * dk, bias=False)
        self.v_proj = nn.Linear(d, H * dv, bias=False)
        self.o_proj = nn.Linear(H * dv, d, bias=False)
        rank_w, rank_a, rank_g = cfg.ranks(model_cfg)
        self.w_lora = LoRA(d, H * dk, rank_w, "tanh", bias=True)
        self.a_lora = LoRA(d, H * dk, rank_a, None, bias=True)
        self.g_lora = LoRA(d, H * dv, rank_g, "sigmoid", bias=False)
        self.k_k = nn.Parameter(torch.zeros(H * dk))
        self.k_a = nn.Parameter(torch.zeros(H * dk))
        self.r_k = nn.Parameter(torch.zeros(H, dk))
        self.r_k._no_weight_decay = True  # a per-channel coefficient (2-D only by its head layout)
        self.g_norm = nn.GroupNorm(H, H * dv, eps=dk * cfg.norm_eps)  # per head: one group of d_v channels each
        self.decay_init_range = cfg.decay_init_range
        # the value residual: the stack's first RWKV-7 layer is its source, every later one mixes it in (v_lora)
        from attnzoo.config.schema import layer_mixer_configs

        first = min((i for i, mc in enumerate(layer_mixer_configs(model_cfg)) if mc.name == cfg.name), default=0)
        self.v_lora = (LoRA(d, H * dv, cfg.value_rank(model_cfg), None, bias=True)
                       if cfg.value_residual and layer_idx > first else None)
        self.init_rwkv7(model_cfg.n_layers)

    @torch.no_grad()
    def init_rwkv7(self, n_layers: int) -> None:
        """The paper's code / fla's `_initialize_weights` for layer `layer_idx` of `n_layers` (the formulas in the
        module docstring; l / (L - 1) is 0 for a one-layer model, where fla divides by zero)."""
        layer, H, dk = self.layer_idx, self.n_qk_heads, self.qk_dim
        deep = layer / (n_layers - 1) if n_layers > 1 else 0.0  # 0 -> 1 over the layers
        shallow = 1.0 - layer / n_layers  # 1 -> ~0
        ddd = torch.arange(self.d_model, dtype=torch.float64) / self.d_model
        for name, power in zip(self.MIXES, self.MIX_POWERS):
            getattr(self, name).copy_(1.0 - ddd.pow(power * shallow))
        n = torch.arange(H * dk, dtype=torch.float64)
        linear = n / max(H * dk - 1, 1) - 0.5
        half = (dk - 1) / 2 or 1.0
        zigzag = ((n % dk) - half) / half
        zigzag = zigzag * zigzag.abs()
        www = -6 + 6 * (n / max(H * dk - 1, 1)).pow(1 + deep**0.3)
        self.k_k.copy_(0.71 - linear * 0.1)
        self.k_a.fill_(1.02)
        self.r_k.fill_(-0.04)
        self.w_lora.bias.copy_(www + 0.5 + zigzag * 2.5)  # 0.5: fla's offset (from the official code's softplus)
        if self.decay_init_range is not None:  # the recipe's slower start (RWKV7Config.decay_init_range)
            self.w_lora.bias.copy_(decay_bias(self.decay_init_range, H, dk))
        self.a_lora.bias.copy_(-0.19 + zigzag * 0.3 + linear * 0.4)
        if self.v_lora is not None:
            self.v_lora.bias.fill_(1.0)  # v_0 = 1: sigmoid(1) = 0.73 of v_first at init (the paper's code)
        self.g_norm.weight.fill_(((layer + 1) / n_layers) ** 0.7)
        self.g_norm.bias.zero_()
        nn.init.orthogonal_(self.r_proj.weight)
        nn.init.orthogonal_(self.k_proj.weight, gain=0.1)
        nn.init.orthogonal_(self.v_proj.weight)
        self.o_proj.weight.zero_()

    # ------------------------------------------------------------------ the layer
    def features(self, h: torch.Tensor, prev: torch.Tensor, carry: Optional[dict] = None):
        """h (B, T, d_model) the (conv-ed) mixer input, prev its token shift -> r, log-decay w, k, v, kk, lr
        (B, T, H, D) and the output gate (B, T, H Dv), in >= fp32. `carry`: the model's (value residual)."""
        B, T, _ = h.shape
        H, dk, dv = self.n_qk_heads, self.qk_dim, self.v_dim
        delta = prev - h
        xr, xw, xk, xv, xa, xg = (h + delta * getattr(self, name) for name in self.MIXES)  # lerp(h, prev, mu)
        heads = lambda t, d: upcast(t).reshape(B, T, H, d)  # noqa: E731
        r, k, v = heads(self.r_proj(xr), dk), heads(self.k_proj(xk), dk), heads(self.v_proj(xv), dv)
        v = self.value_residual(v, xv, carry, heads)
        w = -LOG_DECAY_SCALE * torch.sigmoid(heads(self.w_lora(xw), dk))
        lr = torch.sigmoid(heads(self.a_lora(xa), dk))
        kk = F.normalize(k * self.k_k.view(H, dk).to(k.dtype), dim=-1)
        k = k + k * (lr - 1) * self.k_a.view(H, dk).to(k.dtype)  # fla's addcmul form of k (1 + (lr - 1) k_a)
        return r, w, k, v, kk, lr, upcast(self.g_lora(xg))

    def value_residual(self, v: torch.Tensor, xv: torch.Tensor, carry: Optional[dict], heads) -> torch.Tensor:
        """The first RWKV-7 layer leaves its values in `carry`; a later one returns v + (v_first - v) sigmoid(v_lora(xv))."""
        if not self.cfg.value_residual:
            return v
        if self.v_lora is None:
            if carry is not None:
                carry[V_FIRST] = v
            return v
        if carry is None or V_FIRST not in carry:
            raise ValueError(f"rwkv7 layer {self.layer_idx}: the value residual reads the first RWKV-7 layer's values "
                             f"from the model's carry; run it inside its model (or set value_residual=false)")
        return v + (carry[V_FIRST].to(v.dtype) - v) * torch.sigmoid(heads(self.v_lora(xv), self.v_dim))

    def run(self, mode: str, x: torch.Tensor, state: Optional[torch.Tensor], resets: Optional[torch.Tensor],
            r, w, k, v, kk, lr):
        """The recurrence (a = -kk, b = kk lr) on (B, T, H, D) inputs in the form `mode` asks (`recur`) ->
        (o (B, T, H, Dv), final state)."""
        t = lambda u: u.transpose(1, 2)  # noqa: E731  heads-first for the op
        state = None if state is None else state.to(r.dtype)
        o, state = self.recur(mode, x, state, resets, t(r), t(k), t(v), t(-kk), t(kk * lr), t(w))
        return o.transpose(1, 2), state

    def readout(self, o: torch.Tensor, r, k, v, gate, x: torch.Tensor) -> torch.Tensor:
        """o (B, T, H, Dv) -> GroupNorm per head + the bonus (sum_d r k r_k) v -> * gate -> o_proj, in x's dtype."""
        B, T, H, dv = o.shape
        gn = self.g_norm
        o = F.group_norm(o.reshape(B * T, H * dv), H, gn.weight.to(o.dtype), gn.bias.to(o.dtype), gn.eps)
        o = o.reshape(B, T, H, dv) + (r * k * self.r_k.to(r.dtype)).sum(-1, keepdim=True) * v
        return self.o_proj((o.reshape(B, T, H * dv) * gate).to(x.dtype))

    def forward(self, x: torch.Tensor, *, positions: torch.Tensor, cache: Optional[TokenShiftStateCache] = None,
                carry: Optional[dict] = None):
        T = x.shape[1]
        cp = parallel.active() if cache is None else None  # context parallel (parallel.py): tails and states passed
        if cp is not None:
            h = x if self.input_conv is None else cp.conv(self.input_conv, x)
            prev = cp.conv(self.token_shift, h)
        else:
            h = x
            if self.input_conv is not None:
                h, tail = self.input_conv(x, None if cache is None else cache.conv_tail)
                if cache is not None:
                    cache.store("conv_tail", tail)
            prev, tail = self.token_shift(h, None if cache is None else cache.shift_tail)
            if cache is not None:
                cache.store("shift_tail", tail)
        r, w, k, v, kk, lr, gate = self.features(h, prev, carry)
        mode = self.form(cp, cache, T)
        o, state = self.run(mode, x, None if cache is None else cache.state, None, r, w, k, v, kk, lr)
        if cache is not None:
            cache.store("state", state)
            cache.tick(T)
        return self.readout(o, r, k, v, gate, x)

    def forward_packed(self, x: torch.Tensor, *, positions: torch.Tensor, documents,
                       carry: Optional[dict] = None) -> torch.Tensor:
        """Packed documents (packing.py): the input conv and the token shift never read the previous document (the
        shift reads zeros at a document start, as at a sequence start); the recurrence starts each document from a
        zero state: chunk-aligned with resets (chunked form) or each document by its own call (reference form)."""
        h = self.shift_packed(x, documents)
        starts = (documents.positions() >= 1)[..., None].to(h.dtype)
        prev = F.pad(h, (0, 0, 1, 0))[:, :-1] * starts
        r, w, k, v, kk, lr, gate = self.features(h, prev, carry)
        seq = (r, w, k, v, kk, lr)
        if self.impl == "reference":  # the per-token recurrence, each document by its own call
            o = documents.per_document(lambda *t: self.run("reference", x, None, None, *t)[0], *seq)
        else:  # one call: documents chunk-aligned in their rows, the state zeroed entering each one's first chunk
            C = self.chunk_size
            _, resets, _ = documents.chunk_layout(C)
            o = self.run("chunk", x, None, resets, *(documents.to_chunks(t, C) for t in seq))[0]
            o = documents.from_chunks(o, C)
        return self.readout(o, r, k, v, gate, x)

    # the generalized delta rule's forms (ops/generalized_delta_rule.py), read at scale 1 (RWKV-7's)
    def step_op(self, q, k, v, a, b, g, *, state):
        return generalized_delta_rule_step(q, k, v, a, b, g, state, 1.0)

    def recurrent_op(self, q, k, v, a, b, g, *, state):
        return generalized_delta_rule_recurrent(q, k, v, a, b, g, state, 1.0)

    def chunk_op(self, q, k, v, a, b, g, *, state, resets=None):
        return chunk_generalized_delta_rule(q, k, v, a, b, g, state, 1.0, self.chunk_size, resets)

    def fla_op(self, q, k, v, a, b, g, *, state, dtype):
        from attnzoo.ops.fla_kernels import fla_chunk_generalized_delta_rule  # fla / triton: imported on CUDA only

        return fla_chunk_generalized_delta_rule(q, k, v, a, b, g, state, 1.0, dtype)

    # ------------------------------------------------------------------ cache and accounting
    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device) -> TokenShiftStateCache:
        state = torch.zeros(batch, self.n_v_heads, *self.state_shape, dtype=state_dtype(dtype), device=device)
        shift = torch.zeros(batch, self.d_model, 1, dtype=dtype, device=device)
        conv = None if self.input_conv is None else self.input_conv.empty_tail(batch, dtype, device)
        return TokenShiftStateCache(state, shift, conv)

    def cache_bytes(self, context_len: int, batch: int = 1, dtype: torch.dtype = torch.float32) -> int:
        """n_heads * Dk * Dv state values (>= fp32) + d_model token-shift values + d_model * (K-1) input-conv values:
        constant in context."""
        dk, dv = self.state_shape
        state = self.n_v_heads * dk * dv * dtype_bytes(state_dtype(dtype))
        return batch * (state + self.d_model * dtype_bytes(dtype)) + self.input_conv_bytes(batch, dtype)

    def op_flops_per_token(self, context_len: int) -> float:
        """Chunkwise WY/UT form per head, chunk C = min(chunk_size, L), per token:
        10 C Dk + 8 C Dv + 8 Dk Dv + 2 Dk^2 + 2 Dk^2 Dv / C + C^2/3
        (the four decayed score matrices 8 C Dk; A_ak V 2 C Dv; T [A_ak V | a e^G] 2 C (Dv + Dk) and the inverse C^2/3;
        Bd^T [U | W] 2 Dk (Dv + Dk) and Kd^T V 2 Dk Dv; W S_0 and Q S_0 4 Dk Dv; A_qk V and A_qb u 4 C Dv; the
        hand-over M S 2 Dk^2 Dv / C)."""
        C = max(1, min(self.chunk_size, context_len))
        dk, dv = self.state_shape
        per_head = (10 * C * dk + 8 * C * dv + 8 * dk * dv + 2 * dk * dk + 2 * dk * dk * dv / C + C * C / 3)
        return self.n_v_heads * per_head

    def flops_per_token(self, context_len: int) -> float:
        linears = sum(2.0 * m.in_features * m.out_features for m in self.modules() if isinstance(m, nn.Linear))
        loras = sum(m.flops_per_token() for m in (self.w_lora, self.a_lora, self.g_lora, self.v_lora) if m is not None)
        return linears + loras + self.input_conv_flops() + self.op_flops_per_token(context_len)
