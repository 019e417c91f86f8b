"""The transformers architectures attnzoo maps to, and `arch_for(model)`: which one is exactly equivalent to an
attnzoo DecoderLM (one-line ConfigError naming the field that has none). Import and export both go through it.

Which transformers layer a mixer is equivalent to is the mixer class's own knowledge (`Mixer.hf_layer`, or
`hf_missing` saying why there is none; `hf_mixer_config` for import): `mixer_class` finds the class."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from attnzoo.config.errors import ConfigError
from attnzoo.config.registry import MIXERS
from attnzoo.mixers.base import (HF_FULL_ATTENTION, HF_KIMI_DELTA_ATTENTION, HF_LATENT_ATTENTION, HF_LINEAR_ATTENTION,
                                 HF_SLIDING_ATTENTION, HF_SPARSE_LATENT_ATTENTION, Mixer)
from attnzoo.models.decoder import DecoderLM

FIELD = "model.init_from"


# ----------------------------------------------------------------------------- architectures


@dataclass(frozen=True)
class Arch:
    """One transformers causal-LM class: how its checkpoint names the parts attnzoo maps."""

    model_type: str
    cls: str  # config.json `architectures`
    moe_prefix: str = "mlp."  # the routed FFN's module name in a layer
    expert_names: tuple = ("gate_proj", "up_proj", "down_proj")  # per-expert [gate, up, down] in the checkpoint
    shared_prefix: Optional[str] = None  # the shared expert(s)
    norm_offset: float = 0.0  # RMSNorm computes x * (offset + w): Qwen3-Next stores w - 1 (zero-centred)
    # (regex, replacement) on checkpoint tensor names before import: other names a checkpoint may hold for a tensor
    aliases: tuple = ()


LLAMA = Arch("llama", "LlamaForCausalLM")
QWEN2 = Arch("qwen2", "Qwen2ForCausalLM")
MISTRAL = Arch("mistral", "MistralForCausalLM")
MIXTRAL = Arch("mixtral", "MixtralForCausalLM", moe_prefix="block_sparse_moe.", expert_names=("w1", "w3", "w2"))
DEEPSEEK_V3 = Arch("deepseek_v3", "DeepseekV3ForCausalLM", shared_prefix="shared_experts.")
DEEPSEEK_V32 = Arch("deepseek_v32", "DeepseekV32ForCausalLM", shared_prefix="shared_experts.")  # V3 + DSA indexer
DEEPSEEK = (DEEPSEEK_V3, DEEPSEEK_V32)  # one MoE (sigmoid, groups, selection bias, ungated shared experts)
QWEN3_NEXT = Arch("qwen3_next", "Qwen3NextForCausalLM", shared_prefix="shared_expert.", norm_offset=1.0)
QWEN3 = Arch("qwen3", "Qwen3ForCausalLM")
QWEN3_MOE = Arch("qwen3_moe", "Qwen3MoeForCausalLM")
# Kimi Linear: KDA + NoPE MLA layers, DeepSeek-V3's MoE; checkpoints in Moonshot's names (what transformers' own
# save_pretrained writes back): routed FFNs under block_sparse_moe., experts w1 / w3 / w2, dense MLPs under mlp.
# (save_pretrained writes those under block_sparse_moe. too: read as mlp.)
KIMI_LINEAR = Arch("kimi_linear", "KimiLinearForCausalLM", moe_prefix="block_sparse_moe.",
                   expert_names=("w1", "w3", "w2"), shared_prefix="shared_experts.",
                   aliases=((r"\.block_sparse_moe\.(gate_proj|up_proj|down_proj)\.", r".mlp.\1."),))
SIGMOID_ROUTED = (*DEEPSEEK, KIMI_LINEAR)  # DeepSeek-V3's MoE: sigmoid, groups, selection bias, ungated shared experts
@dataclass(frozen=True)
class _Mamba2Arch(Arch):
    """transformers' Mamba2ForCausalLM: blocks of RMSNorm + Mamba2Mixer, no FFN, no positions. Its model_type is
    what the mixer class that exports as a whole model says (`Mixer.hf_model_type`; arch_for asks the class)."""

    model_type: str = "mamba2"
    cls: str = "Mamba2ForCausalLM"


MAMBA2 = _Mamba2Arch()
ARCHS = {a.model_type: a for a in (LLAMA, QWEN2, MISTRAL, MIXTRAL, DEEPSEEK_V3, DEEPSEEK_V32, QWEN3_NEXT, QWEN3,
                                   QWEN3_MOE, KIMI_LINEAR, MAMBA2)}

# model types people will try that attnzoo cannot represent exactly, and the missing feature
MISSING = {
    "gemma": "embeddings scaled by sqrt(hidden_size), GELU MLP and (1 + w) RMSNorm, which attnzoo has no options for",
    "gemma2": "logit soft-capping, sandwich norms and alternating local/global layers, which attnzoo has no "
              "options for",
    "gemma3": "q/k RMSNorm, sandwich norms and alternating local/global RoPE, which attnzoo has no options for",
    "phi3": "a fused qkv with partial rotary and LongRoPE scaling, which attnzoo has no options for",
    "gpt2": "Conv1D weights, a GELU MLP with biases and learned positions, a layout attnzoo does not map",
}



def mixer_class(hf_layer: str) -> type[Mixer]:
    """The registered mixer class equivalent to a transformers layer kind (`Mixer.hf_layer`)."""
    return next(MIXERS.get(n).cls for n in MIXERS.names() if MIXERS.get(n).cls.hf_layer == hf_layer)


def _hf_layer(mc) -> str | None:
    """The transformers layer kind of a layer's mixer config (None: no equivalent)."""
    return MIXERS.get(mc.name).cls.hf_layer


# ----------------------------------------------------------------------------- the architecture of an attnzoo model


def _no(field: str, why: str) -> ConfigError:
    return ConfigError(f"{why}; no transformers architecture is exactly equivalent (export and import need one)",
                       field=field)


def _moe_of(model):
    from attnzoo.layers.moe import MoE

    return next((b.ffn for b in model.blocks if isinstance(b.ffn, MoE)), None)


def _dense_of(model):
    from attnzoo.layers.ffn import SwiGLU

    return next((b.ffn for b in model.blocks if isinstance(b.ffn, SwiGLU)), None)


def _check_moe(model, arch: Arch) -> None:
    """The routed FFN matches `arch`'s router and experts exactly (else one-line refusal)."""
    moe = _moe_of(model)
    f = model.cfg.ffn
    field = "model.ffn"
    if f.expert_type != "swiglu":
        raise _no(f"{field}.expert_type", f"{f.expert_type} experts (transformers' are SiLU-gated)")
    if f.capacity_factor is not None:
        raise _no(f"{field}.capacity_factor", f"{f.capacity_factor} drops tokens (transformers' MoE are dropless)")
    want = "sigmoid" if arch in SIGMOID_ROUTED else "softmax"
    if f.scoring != want:
        raise _no(f"{field}.scoring", f"{f.scoring} routing ({arch.cls} routes by {want})")
    if arch not in SIGMOID_ROUTED:
        if f.routed_scaling_factor != 1.0:
            raise _no(f"{field}.routed_scaling_factor", f"{f.routed_scaling_factor} ({arch.cls} has none)")
        if (f.n_group or 1) != 1 or (f.topk_group or 1) != 1:
            raise _no(f"{field}.n_group", f"group-limited routing ({arch.cls} has none)")
        if any(bool((b.ffn.expert_bias != 0).any()) for b in model.blocks if hasattr(b.ffn, "expert_bias")):
            raise _no(f"{field}.bias_update_speed", f"a non-zero expert selection bias ({arch.cls} has none)")
    if arch is MIXTRAL:
        if moe.shared is not None:
            raise _no(f"{field}.n_shared_experts", "shared experts (Mixtral has none)")
        if not f.norm_topk_prob:
            raise _no(f"{field}.norm_topk_prob", "false (Mixtral renormalises the top-k weights)")
        if f.first_k_dense:
            raise _no(f"{field}.first_k_dense", f"{f.first_k_dense} dense layers (Mixtral has none)")
    if arch in SIGMOID_ROUTED:
        if moe.shared_gate is not None:
            raise _no(f"{field}.shared_expert_gate", f"true ({arch.cls}'s shared experts are ungated)")
        if moe.shared is not None and moe.shared.hidden != f.n_shared_experts * moe.hidden:
            raise _no(f"{field}.shared_d_ff", f"{moe.shared.hidden} ({arch.cls}'s is n_shared_experts * "
                      f"d_ff = {f.n_shared_experts * moe.hidden})")
    if arch is KIMI_LINEAR and moe.shared is None:
        raise _no(f"{field}.n_shared_experts", "0 (KimiLinearMoE always adds its shared experts; allowed: >= 1)")
    if arch is QWEN3_MOE and moe.shared is not None:
        raise _no(f"{field}.n_shared_experts", "shared experts (Qwen3-MoE has none)")
    if arch is QWEN3_NEXT and (moe.shared is None or moe.shared_gate is None):
        raise _no(f"{field}.shared_expert_gate", "Qwen3-Next's MoE has a sigmoid-gated shared expert; allowed: "
                  "shared_d_ff (or n_shared_experts) with shared_expert_gate=true")


def _check_rope(cfg, scalings: tuple) -> None:
    pos = cfg.position
    if pos.name != "rope":
        raise _no("model.position.name", f"{pos.name} (the transformers attention layers use RoPE)")
    if pos.scaling not in scalings:
        raise _no("model.position.scaling", f"{pos.scaling} (exported: {', '.join(scalings)})")


def _mixer_field(cfg, mc) -> str:
    """The config path of a layer's mixer config: model.mixers.<key> for a named one, else model.mixer."""
    named = next((k for k, v in cfg.mixers.items() if v is mc), None)
    if named is None and cfg.pattern:  # a registered name in the pattern: configured as model.mixers.<name>
        named = mc.name
    return "model.mixer" if named is None else f"model.mixers.{named}"


def _check_qwen3_next_attention(cfg, mc) -> None:
    """The attention layers of a GDN hybrid match Qwen3-Next's gated attention exactly."""
    field = _mixer_field(cfg, mc)
    for key, want in (("qk_norm", True), ("output_gate", True), ("causal", True), ("conv_size", 0),
                      ("softmax_scale", None), ("out_bias", mc.qkv_bias)):
        if getattr(mc, key) != want:
            raise _no(f"{field}.{key}", f"{getattr(mc, key)} (Qwen3-Next's attention layers: {key}={want}; they "
                      f"have q/k RMSNorm, a sigmoid output gate and biases on all four projections or none)")
    if cfg.position.name != "rope":
        raise _no("model.position.name", f"{cfg.position.name} (Qwen3-Next's attention layers use RoPE)")
    rot = cfg.head_dim * cfg.position.rotary_fraction
    if int(rot) % 2:
        raise _no("model.position.rotary_fraction", f"{cfg.position.rotary_fraction} rotates an odd {int(rot)} of "
                  f"{cfg.head_dim} channels (transformers' partial_rotary_factor needs an even count)")


def _check_mamba2(model) -> Arch:
    """Mamba2ForCausalLM (transformers' Mamba2Model: embeddings, blocks of x + Mamba2Mixer(RMSNorm(x)), norm_f, lm_head):
    every layer mamba2 with one config, no FFN, no positions, one RMSNorm eps for the blocks and the gated norm
    (transformers' layer_norm_epsilon is both), a conv (conv_kernel >= 1)."""
    cfg, mc = model.cfg, model.layer_mixers[0]
    if len({repr(m) for m in model.layer_mixers}) > 1:
        raise _no("model.pattern", "mamba2 layers configured differently (Mamba2ForCausalLM: one config)")
    if cfg.ffn.name != "none":
        raise _no("model.ffn.name", f"{cfg.ffn.name} (Mamba2ForCausalLM's blocks have no FFN; allowed: none)")
    if cfg.position.name != "none":
        raise _no("model.position.name", f"{cfg.position.name} (Mamba2ForCausalLM has no positions; allowed: none)")
    field = _mixer_field(cfg, mc)
    if mc.conv_size < 1:
        raise _no(f"{field}.conv_size", "0 (transformers' Mamba2Mixer always has its causal conv)")
    if mc.norm_eps != cfg.norm.eps:
        raise _no(f"{field}.norm_eps", f"{mc.norm_eps} with model.norm.eps={cfg.norm.eps} (transformers' "
                  f"layer_norm_epsilon is both; allowed: the same value)")
    if any(getattr(model.mixers[0], p).bias is not None for p in ("qkv", "g_proj", "dt_proj", "o_proj")):
        raise _no(field, "projection biases (exported with use_bias=false)")
    return MAMBA2


def _check_kimi_linear(model) -> Arch:
    """KimiLinearForCausalLM (KimiLinearModel: embeddings, pre-norm blocks, norm, lm_head): KDA layers (kda, as
    KimiLinearDeltaAttention builds them) and MLA layers (KimiLinearAttention: DeepSeek-V3's MLA without RoPE, so the
    decoupled key part is a position-free key shared by the heads) in any order, one config per kind; no positions;
    a SwiGLU MLP or DeepSeek-V3's MoE with shared experts after the first k dense layers."""
    cfg = model.cfg
    if cfg.position.name != "none":
        raise _no("model.position.name", f"{cfg.position.name} (KimiLinearForCausalLM applies no positions: its MLA "
                  f"layers are NoPE; allowed: none)")
    if cfg.tie_embeddings:
        raise _no("model.tie_embeddings", "true (KimiLinearForCausalLM never ties lm_head to the embedding, whatever "
                  "tie_word_embeddings says: its _tied_weights_keys is empty; allowed: false)")
    by_layer = {_hf_layer(m): m for m in model.layer_mixers}
    kda, mla = by_layer.get(HF_KIMI_DELTA_ATTENTION), by_layer.get(HF_LATENT_ATTENTION)
    if kda is not None:
        field, (h, hv, dk, dv) = _mixer_field(cfg, kda), kda.sizes(cfg)
        for key, value, want, has in (
                ("n_v_heads", hv, h, "linear_num_heads heads for q, k and v alike"),
                ("v_head_dim", dv, dk, "one linear_head_dim for keys and values"),
                ("gate_low_rank_dim", kda.gate_low_rank_dim or dk, dk, "forget and output gates of rank head_dim"),
                ("conv_bias", kda.conv_bias, False, "a short conv without bias"),
                ("qkv_activation", kda.qkv_activation, "silu", "the short conv activated by hidden_act silu"),
                ("allow_neg_eigval", kda.allow_neg_eigval, False, "beta = sigmoid(W_b x)"),
                ("use_output_norm", kda.use_output_norm, True, "a gated RMSNorm on the output"),
                ("use_gate", kda.use_gate, True, "a sigmoid output gate"),
                ("norm_eps", kda.norm_eps, cfg.norm.eps, "rms_norm_eps for the output norm too (model.norm.eps)")):
            if value != want:
                raise _no(f"{field}.{key}", f"{value} (KimiLinearForCausalLM's KDA layers have {has}; allowed: {want})")
        if kda.conv_size < 1:
            raise _no(f"{field}.conv_size", "0 (KimiLinearForCausalLM's KDA layers have a short conv; allowed: >= 1)")
    if mla is not None:
        field = _mixer_field(cfg, mla)
        if mla.norm_eps != 1e-6:
            raise _no(f"{field}.norm_eps", f"{mla.norm_eps} (Kimi Linear's latent RMSNorms use 1e-6; allowed: 1e-6)")
        if mla.conv_size:
            raise _no(f"{field}.conv_size", f"{mla.conv_size}: a short conv in front of attention has no transformers "
                      f"counterpart")
        if mla.softmax_scale is not None:
            raise _no(f"{field}.softmax_scale", f"{mla.softmax_scale} (KimiLinearAttention scales by "
                      f"(qk_nope_head_dim + qk_rope_head_dim)^-1/2; allowed: null)")
    if cfg.ffn.name not in ("swiglu", "moe"):
        raise _no("model.ffn.name", f"{cfg.ffn.name} (KimiLinearForCausalLM's FFNs are SwiGLU MLPs and DeepSeek-V3's "
                  f"MoE; allowed: swiglu, moe)")
    if cfg.ffn.name == "swiglu" and cfg.ffn.bias:
        raise _no("model.ffn.bias", "true (Kimi Linear's MLPs have no bias)")
    if cfg.ffn.name == "moe":
        _check_moe(model, KIMI_LINEAR)
    return KIMI_LINEAR


def arch_for(model) -> Arch:
    """The transformers architecture exactly equivalent to `model` (a DecoderLM); one-line ConfigError
    naming the field that has no equivalent otherwise. Import uses the same rules, so both directions agree."""
    cfg = model.cfg
    if not isinstance(model, DecoderLM):
        raise _no("model.name", f"{cfg.name} (exported: decoder-only LMs)")
    if cfg.norm_position != "pre":
        raise _no("model.norm_position", f"{cfg.norm_position}-norm blocks (transformers' decoders are pre-norm)")
    if cfg.norm.name != "rmsnorm":
        raise _no("model.norm.name", f"{cfg.norm.name} (the exported architectures use RMSNorm)")
    if cfg.parametrization != "standard":  # models/mup.py: a logit multiplier, q.k / d
        raise _no("model.parametrization", f"{cfg.parametrization} (µP's readout multiplier and attention scale)")
    kinds = [m.name for m in model.layer_mixers]
    if len(set(kinds)) == 1 and getattr(MIXERS.get(kinds[0]).cls, "hf_model_type", None) == MAMBA2.model_type:
        return _check_mamba2(model)
    layers = {_hf_layer(m) for m in model.layer_mixers}
    # Qwen3-Next: Gated DeltaNet layers and full-attention layers (one attention kind) in any order
    hybrid = len(set(kinds)) == 2 and layers == {HF_LINEAR_ATTENTION, HF_FULL_ATTENTION}
    # Kimi Linear: KDA layers with or without MLA layers in any order; all-MLA too where it has no positions (NoPE)
    kimi = layers <= {HF_KIMI_DELTA_ATTENTION, HF_LATENT_ATTENTION} and (
        HF_KIMI_DELTA_ATTENTION in layers or cfg.position.name == "none")
    if len(set(kinds)) > 1 and not (hybrid or kimi):
        raise _no("model.pattern", f"{sorted(set(kinds))} (exported: one mixer for every layer - mamba2 as "
                  f"Mamba2ForCausalLM - gated_deltanet with mha / gqa / mqa layers as Qwen3-Next, or kda with mla "
                  f"layers as Kimi Linear)")
    for k in set(kinds):
        if len({repr(m) for m in model.layer_mixers if m.name == k}) > 1:
            raise _no("model.pattern", f"{k} layers configured differently (exported: one config per mixer kind)")
    if kimi:
        return _check_kimi_linear(model)
    if hybrid:
        _check_qwen3_next_attention(cfg, next(m for m in model.layer_mixers if _hf_layer(m) == HF_FULL_ATTENTION))
    mc = next(m for m in model.layer_mixers if _hf_layer(m) == HF_LINEAR_ATTENTION) if hybrid else model.layer_mixers[0]
    kind, ffn, field = mc.name, cfg.ffn.name, _mixer_field(cfg, mc)
    cls = MIXERS.get(kind).cls
    layer = cls.hf_layer
    if layer is None:
        raise _no(f"{field}.name", f"{kind}: {cls.hf_missing}")
    if ffn not in ("swiglu", "moe"):
        raise _no("model.ffn.name", f"{ffn} (the exported architectures have a SwiGLU or MoE FFN)")
    if getattr(mc, "conv_size", 0) and layer != HF_LINEAR_ATTENTION:
        raise _no(f"{field}.conv_size", f"{mc.conv_size}: a short conv in front of attention has no transformers "
                  f"counterpart")
    if getattr(mc, "softmax_scale", None) is not None:
        raise _no(f"{field}.softmax_scale", f"{mc.softmax_scale} (transformers scales by head_dim^-1/2)")
    mlp_bias = ffn == "swiglu" and cfg.ffn.bias
    if layer in (HF_FULL_ATTENTION, HF_SLIDING_ATTENTION):
        _check_rope(cfg, ("none", "linear", "llama3"))
        if cfg.position.rotary_fraction != 1.0:
            raise _no("model.position.rotary_fraction", f"{cfg.position.rotary_fraction} (Llama/Mistral rotate whole "
                      f"heads)")
        if not mc.causal:
            raise _no(f"{field}.causal", "false (a causal LM)")
        if getattr(mc, "sink_tokens", 0):
            raise _no(f"{field}.sink_tokens", f"{mc.sink_tokens} attention sinks (Mistral's window has none)")
        if mc.output_gate:
            raise _no(f"{field}.output_gate", "true without gated_deltanet layers (Qwen3-Next's gated attention is "
                      "exported in a hybrid pattern with gated_deltanet)")
        if mc.qk_norm:  # Qwen3 / Qwen3-MoE: q/k RMSNorm on every head
            if layer == HF_SLIDING_ATTENTION:
                raise _no(f"{field}.qk_norm", "true with a sliding window (Qwen3's window applies above "
                          "max_window_layers only; exported with qk_norm: mha, gqa, mqa)")
            if mc.qkv_bias != mc.out_bias:
                raise _no(f"{field}.out_bias", f"{mc.out_bias} with qkv_bias={mc.qkv_bias} (Qwen3 biases all four "
                          f"projections or none)")
            if mlp_bias:
                raise _no("model.ffn.bias", "true (Qwen3's MLP has no bias)")
            if ffn == "moe":
                _check_moe(model, QWEN3_MOE)
                return QWEN3_MOE
            return QWEN3
        if ffn == "moe":
            if mc.qkv_bias or mc.out_bias:
                raise _no(f"{field}.qkv_bias", "attention biases (Mixtral has none)")
            _check_moe(model, MIXTRAL)
            return MIXTRAL
        if layer == HF_SLIDING_ATTENTION:
            if mc.qkv_bias or mc.out_bias or mlp_bias:
                raise _no(f"{field}.qkv_bias", "biases (Mistral has none)")
            return MISTRAL
        if mc.qkv_bias and not mc.out_bias:
            if mlp_bias:
                raise _no("model.ffn.bias", "true with qkv-only biases (Qwen2's MLP has no bias)")
            return QWEN2
        if mc.out_bias and not mc.qkv_bias:
            raise _no(f"{field}.out_bias", "true without qkv_bias (Llama biases all four projections, Qwen2 q/k/v "
                      "only)")
        return LLAMA
    if layer in (HF_LATENT_ATTENTION, HF_SPARSE_LATENT_ATTENTION):  # DeepSeek-V3 (mla), V3.2 (dsa)
        arch = DEEPSEEK_V3 if layer == HF_LATENT_ATTENTION else DEEPSEEK_V32
        _check_rope(cfg, ("none",))
        if mc.norm_eps != 1e-6:
            raise _no(f"{field}.norm_eps", f"{mc.norm_eps} (DeepSeek-V3's and V3.2's latent RMSNorms use 1e-6)")
        if arch is DEEPSEEK_V32 and mc.q_lora_rank is None:
            raise _no(f"{field}.q_lora_rank", "null (DeepSeek-V3.2's attention and indexer read a query latent: "
                      "q_a_proj is always there; allowed: a rank)")
        if arch is DEEPSEEK_V32 and not mc.rope_interleave:
            raise _no(f"{field}.rope_interleave", "false (DeepSeek-V3.2's main RoPE is interleaved; allowed: true)")
        if mlp_bias:
            raise _no("model.ffn.bias", "true (DeepSeek-V3's and V3.2's MLPs have no bias)")
        if ffn == "moe":
            _check_moe(model, arch)
        return arch
    if layer == HF_LINEAR_ATTENTION:
        if cfg.position.name not in ("none", "rope"):
            raise _no("model.position.name", f"{cfg.position.name} embeddings (Qwen3-Next adds none)")
        if hybrid:
            _check_rope(cfg, ("none",))
        for key, want in (("conv_bias", False), ("qkv_activation", "silu"), ("allow_neg_eigval", False),
                          ("use_output_norm", True), ("use_gate", True)):
            if getattr(mc, key) != want:
                raise _no(f"{field}.{key}", f"{getattr(mc, key)} (Qwen3-Next's linear layers: {want})")
        if mc.conv_size < 1:
            raise _no(f"{field}.conv_size", "0 (Qwen3-Next's linear layers have a short conv)")
        if mc.norm_eps != cfg.norm.eps:
            raise _no(f"{field}.norm_eps", f"{mc.norm_eps} differs from model.norm.eps={cfg.norm.eps} (Qwen3-Next "
                      f"uses rms_norm_eps for both)")
        if mlp_bias:
            raise _no("model.ffn.bias", "true (Qwen3-Next's MLP has no bias)")
        if ffn == "moe":
            _check_moe(model, QWEN3_NEXT)
        return QWEN3_NEXT
    exported = [n for n in MIXERS.names() if MIXERS.get(n).cls.hf_layer is not None]
    raise _no(f"{field}.name", f"{kind} (exported: {', '.join(exported)})")
