"""Checkpoint tensors both ways: reading a local safetensors checkpoint (single file or sharded), the
tensor-name rules of each architecture (`_rules`), `load_hf_weights` and `hf_state_dict`."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from attnzoo.config.errors import ConfigError
from attnzoo.interop.hf.archs import (DEEPSEEK_V3, DEEPSEEK_V32, FIELD, KIMI_LINEAR, LLAMA, MAMBA2, MISTRAL, MIXTRAL,
                                      QWEN2, QWEN3, QWEN3_MOE, QWEN3_NEXT, SIGMOID_ROUTED, Arch, arch_for)
from attnzoo.mixers.base import HF_KIMI_DELTA_ATTENTION, HF_LINEAR_ATTENTION


# ----------------------------------------------------------------------------- reading a local directory


def read_hf_config(path: str | Path, field: str = FIELD) -> dict:
    """config.json of a local transformers model directory, as a dict (one-line error if it is not one)."""
    d = Path(path).expanduser()
    if not d.is_dir():
        raise ConfigError(f"{d} is not a directory; allowed: a local transformers model directory (config.json + "
                          f"*.safetensors; the hub is never contacted)", field=field)
    f = d / "config.json"
    if not f.is_file():
        raise ConfigError(f"{d} has no config.json; allowed: a directory written by save_pretrained", field=field)
    try:
        return json.loads(f.read_text())
    except ValueError as e:
        raise ConfigError(f"{f} is not valid JSON ({e})", field=field) from None


def safetensors_files(path: str | Path, field: str = FIELD) -> list[Path]:
    """The checkpoint's safetensors files: model.safetensors, or the shards its index names."""
    d = Path(path).expanduser()
    index = d / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (d / s).is_file()]
        if missing:
            raise ConfigError(f"{d}: shard {missing[0]} named by model.safetensors.index.json is missing", field=field)
        return [d / s for s in shards]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in d.glob("*.bin"))
        why = f" (found {pickles[0]}: pickled weights are not read; re-save with safe_serialization)" if pickles else ""
        raise ConfigError(f"{d} has no *.safetensors{why}", field=field)
    return files


def read_hf_state_dict(path: str | Path, field: str = FIELD) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    sd: dict[str, torch.Tensor] = {}
    for f in safetensors_files(path, field):
        sd.update(load_file(str(f)))
    return sd


# ----------------------------------------------------------------------------- tensor-name rules, both ways


@dataclass(frozen=True)
class Rule:
    """attnzoo tensors `ours` <-> checkpoint tensors `hf`: to_ours(hf tensors) -> ours tensors, to_hf back."""

    ours: tuple
    hf: tuple
    to_ours: Callable[[list], list]
    to_hf: Callable[[list], list]


def _same(ours: str, hf: str, offset: float = 0.0) -> Rule:
    if offset:  # zero-centred RMSNorm weights (Qwen3-Next): x * (1 + w_hf) = x * w_ours
        return Rule((ours,), (hf,), lambda t: [t[0].float() + offset], lambda t: [t[0] - offset])
    return Rule((ours,), (hf,), lambda t: t, lambda t: t)


def _cat(ours: str, hf: tuple, sizes: list) -> Rule:
    """A fused attnzoo tensor = the checkpoint's parts stacked on dim 0 ([q | k | v], [gate | up])."""
    return Rule((ours,), hf, lambda t: [torch.cat(t, 0)], lambda t: list(t[0].split(sizes, 0)))


def _attention_rules(m, o: str, h: str) -> list:
    h += "self_attn."
    q, kv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    rules = [_cat(o + "qkv.weight", (h + "q_proj.weight", h + "k_proj.weight", h + "v_proj.weight"), [q, kv, kv]),
             _same(o + "o_proj.weight", h + "o_proj.weight")]
    if m.qkv.bias is not None:
        rules.append(_cat(o + "qkv.bias", (h + "q_proj.bias", h + "k_proj.bias", h + "v_proj.bias"), [q, kv, kv]))
    if m.o_proj.bias is not None:
        rules.append(_same(o + "o_proj.bias", h + "o_proj.bias"))
    if m.q_norm is not None:  # Qwen3: per-head q/k RMSNorm, one (head_dim,) weight each
        rules += [_same(o + "q_norm.weight", h + "q_norm.weight"), _same(o + "k_norm.weight", h + "k_norm.weight")]
    return rules


def _gated_attention_rules(m, o: str, h: str, offset: float) -> list:
    """Qwen3-Next's full-attention layers: q_proj holds, per head, [q_h (D) ; gate_h (D)] rows; attnzoo keeps q in
    the fused qkv and the gate in gate_proj. Its q/k RMSNorms are zero-centred like its other norms."""
    h += "self_attn."
    H, D, kv = m.n_heads, m.head_dim, m.n_kv_heads * m.head_dim

    def to_ours(t):
        q, g = t[0].view(H, 2 * D, *t[0].shape[1:]).split([D, D], dim=1)
        return [torch.cat([q.reshape(H * D, *q.shape[2:]), t[1], t[2]]), g.reshape(H * D, *g.shape[2:])]

    def to_hf(t):
        q, k, v = t[0].split([H * D, kv, kv], 0)
        rest = q.shape[1:]
        return [torch.cat([q.view(H, D, *rest), t[1].view(H, D, *rest)], dim=1).reshape(2 * H * D, *rest), k, v]

    rules = []
    for leaf in ("weight", "bias") if m.qkv.bias is not None else ("weight",):
        rules.append(Rule((f"{o}qkv.{leaf}", f"{o}gate_proj.{leaf}"),
                          tuple(f"{h}{p}_proj.{leaf}" for p in "qkv"), to_ours, to_hf))
        rules.append(_same(f"{o}o_proj.{leaf}", f"{h}o_proj.{leaf}"))
    return rules + [_same(o + "q_norm.weight", h + "q_norm.weight", offset),
                    _same(o + "k_norm.weight", h + "k_norm.weight", offset)]


MLA_NAMES = {"kv_a_proj": "kv_a_proj_with_mqa", "q_a_norm": "q_a_layernorm", "kv_a_norm": "kv_a_layernorm"}


def _mla_rules(m, o: str, h: str) -> list:
    """MLA (DeepSeek-V3) and DSA (V3.2): self_attn.<name> per tensor, three renamed; DSA's indexer.{wq_b, wk,
    k_norm, weights_proj} are named as transformers' DeepseekV32Indexer."""
    rules = []
    for name in m.state_dict():
        mod, _, leaf = name.rpartition(".")
        rules.append(_same(o + name, f"{h}self_attn.{MLA_NAMES.get(mod, mod)}.{leaf}"))
    return rules


def _gdn_rules(m, o: str, h: str) -> list:
    """Qwen3-Next interleaves its fused projections per key head: in_proj_qkvz is, for each of the Hk key
    heads, [q (Dk) | k (Dk) | v (r Dv) | z (r Dv)] rows; in_proj_ba is [b (r) | a (r)] per key head
    (r = value heads per key head). attnzoo keeps [all q | all k | all v] in qkv, z in g_proj, b and a apart."""
    h += "linear_attn."
    Hk, Dk, Dv, r = m.n_qk_heads, m.qk_dim, m.v_dim, m.n_v_heads // m.n_qk_heads
    D = m.d_model

    def qkvz_to_ours(t):
        q, k, v, z = t[0].view(Hk, 2 * Dk + 2 * r * Dv, D).split([Dk, Dk, r * Dv, r * Dv], dim=1)
        return [torch.cat([q.reshape(-1, D), k.reshape(-1, D), v.reshape(-1, D)]), z.reshape(-1, D)]

    def qkvz_to_hf(t):
        q, k, v = t[0].split(m.qkv_dims, 0)
        parts = [q.view(Hk, Dk, D), k.view(Hk, Dk, D), v.view(Hk, r * Dv, D), t[1].view(Hk, r * Dv, D)]
        return [torch.cat(parts, dim=1).reshape(-1, D)]

    def ba_to_ours(t):
        b, a = t[0].view(Hk, 2 * r, D).split([r, r], dim=1)
        return [b.reshape(-1, D), a.reshape(-1, D)]

    def ba_to_hf(t):
        return [torch.cat([t[0].view(Hk, r, D), t[1].view(Hk, r, D)], dim=1).reshape(-1, D)]

    return [
        Rule((o + "qkv.weight", o + "g_proj.weight"), (h + "in_proj_qkvz.weight",), qkvz_to_ours, qkvz_to_hf),
        Rule((o + "b_proj.weight", o + "a_proj.weight"), (h + "in_proj_ba.weight",), ba_to_ours, ba_to_hf),
        Rule((o + "conv.weight",), (h + "conv1d.weight",), lambda t: [t[0][:, 0]], lambda t: [t[0][:, None]]),
        _same(o + "A_log", h + "A_log"), _same(o + "dt_bias", h + "dt_bias"),
        _same(o + "norm.weight", h + "norm.weight"),  # the gated output norm is not zero-centred
        _same(o + "o_proj.weight", h + "out_proj.weight"),
    ]


def _kda_rules(m, o: str, h: str) -> list:
    """Kimi Linear's KDA layers under the names its checkpoints hold (Moonshot's, which transformers' save_pretrained
    writes back; tests/test_kda.py matches the layer itself against KimiLinearDeltaAttention): q/k/v_proj -> the fused
    qkv, q/k/v_conv1d (C, 1, K) each -> the one conv over [q | k | v] (3C, K), f_a/f_b_proj -> f_proj.0/1 (the forget
    gate), g_a/g_b_proj -> g_proj.0/1 (the output gate), A_log (1, 1, H, 1) -> (H,), o_norm -> norm."""
    h += "self_attn."
    parts = list(m.qkv_dims)
    return [
        _cat(o + "qkv.weight", tuple(f"{h}{p}_proj.weight" for p in "qkv"), parts),
        Rule((o + "conv.weight",), tuple(f"{h}{p}_conv1d.weight" for p in "qkv"), lambda t: [torch.cat(t)[:, 0]],
             lambda t: [c[:, None] for c in t[0].split(parts, 0)]),
        _same(o + "f_proj.0.weight", h + "f_a_proj.weight"), _same(o + "f_proj.1.weight", h + "f_b_proj.weight"),
        _same(o + "dt_bias", h + "dt_bias"),
        Rule((o + "A_log",), (h + "A_log",), lambda t: [t[0].reshape(-1)], lambda t: [t[0].view(1, 1, -1, 1)]),
        _same(o + "b_proj.weight", h + "b_proj.weight"),
        _same(o + "g_proj.0.weight", h + "g_a_proj.weight"), _same(o + "g_proj.1.weight", h + "g_b_proj.weight"),
        _same(o + "norm.weight", h + "o_norm.weight"), _same(o + "o_proj.weight", h + "o_proj.weight"),
    ]


def _swiglu_rules(f, o: str, h: str, names=("gate_proj", "up_proj", "down_proj")) -> list:
    g, u, d = names
    rules = [_cat(o + "gate_up.weight", (f"{h}{g}.weight", f"{h}{u}.weight"), [f.hidden, f.hidden]),
             _same(o + "down.weight", f"{h}{d}.weight")]
    if f.gate_up.bias is not None:
        rules += [_cat(o + "gate_up.bias", (f"{h}{g}.bias", f"{h}{u}.bias"), [f.hidden, f.hidden]),
                  _same(o + "down.bias", f"{h}{d}.bias")]
    return rules


def _moe_rules(f, o: str, h: str, arch: Arch) -> list:
    """attnzoo's experts are input-major stacks: w_up (E, d, 2h) with columns [gate | up], w_down (E, h, d);
    checkpoints hold one (out, in) Linear per expert and part."""
    E, hid = f.n_experts, f.hidden
    g, u, d = arch.expert_names
    ex = h + "experts."
    up_keys = tuple(f"{ex}{e}.{g}.weight" for e in range(E)) + tuple(f"{ex}{e}.{u}.weight" for e in range(E))
    down_keys = tuple(f"{ex}{e}.{d}.weight" for e in range(E))

    def up_to_ours(t):
        return [torch.cat([torch.stack(t[:E]), torch.stack(t[E:])], dim=1).transpose(1, 2)]  # (E, d, 2h)

    def up_to_hf(t):
        gate, up = t[0].transpose(1, 2).split([hid, hid], dim=1)  # (E, h, d) each
        return list(gate.unbind(0)) + list(up.unbind(0))

    rules = [
        _same(o + "router.weight", h + "gate.weight"),
        Rule((o + "w_up",), up_keys, up_to_ours, up_to_hf),
        Rule((o + "w_down",), down_keys, lambda t: [torch.stack(t).transpose(1, 2)],
             lambda t: list(t[0].transpose(1, 2).unbind(0))),
    ]
    if arch in SIGMOID_ROUTED:
        rules.append(_same(o + "expert_bias", h + "gate.e_score_correction_bias"))
    else:  # no selection bias in the checkpoint: zeros (export refuses a non-zero one)
        rules.append(Rule((o + "expert_bias",), (), lambda t: [torch.zeros(E)], lambda t: []))
    if f.shared is not None:
        rules += _swiglu_rules(f.shared, o + "shared.", h + arch.shared_prefix)
    if f.shared_gate is not None:
        rules.append(_same(o + "shared_gate.weight", h + "shared_expert_gate.weight"))
    return rules


def _mamba2_rules(m, o: str, h: str) -> list:
    """transformers' Mamba2Mixer: in_proj = [z | x | B | C | dt] rows, the conv over [x | B | C] channels (its weight
    (channels, 1, K)); attnzoo keeps z in g_proj, [C | B | x] in qkv (and its conv), dt in dt_proj."""
    h += "mixer."
    nc, nb, nx = m.qkv_dims  # C, B, x
    inner, H = m.n_v_heads * m.v_dim, m.n_v_heads

    def proj_to_ours(t):
        z, x, b, c, dt = t[0].split([inner, nx, nb, nc, H], 0)
        return [z, torch.cat([c, b, x]), dt]

    def proj_to_hf(t):
        c, b, x = t[1].split(m.qkv_dims, 0)
        return [torch.cat([t[0], x, b, c, t[2]])]

    def conv_to_ours(t):
        x, b, c = t[0].split([nx, nb, nc], 0)
        return [torch.cat([c, b, x])[:, 0] if t[0].dim() == 3 else torch.cat([c, b, x])]

    def conv_to_hf(t):
        c, b, x = t[0].split(m.qkv_dims, 0)
        return [torch.cat([x, b, c])[:, None] if t[0].dim() == 2 else torch.cat([x, b, c])]

    rules = [Rule((o + "g_proj.weight", o + "qkv.weight", o + "dt_proj.weight"), (h + "in_proj.weight",),
                  proj_to_ours, proj_to_hf),
             Rule((o + "conv.weight",), (h + "conv1d.weight",), conv_to_ours, conv_to_hf)]
    if m.conv.bias is not None:
        rules.append(Rule((o + "conv.bias",), (h + "conv1d.bias",), conv_to_ours, conv_to_hf))
    return rules + [_same(o + "A_log", h + "A_log"), _same(o + "dt_bias", h + "dt_bias"), _same(o + "D", h + "D"),
                    _same(o + "norm.weight", h + "norm.weight"), _same(o + "o_proj.weight", h + "out_proj.weight")]


def _mamba2_model_rules(model) -> list:
    """Mamba2ForCausalLM: backbone.embeddings, backbone.layers.i.{norm, mixer}, backbone.norm_f, lm_head."""
    rules = [_same("embed.weight", "backbone.embeddings.weight"), _same("norm.weight", "backbone.norm_f.weight")]
    if not model.cfg.tie_embeddings:
        rules.append(_same("lm_head.weight", "lm_head.weight"))
    for i, block in enumerate(model.blocks):
        o, h = f"blocks.{i}.", f"backbone.layers.{i}."
        rules += [_same(o + "norm1.weight", h + "norm.weight"), *_mamba2_rules(block.mixer, o + "mixer.", h)]
    return rules


def _rules(model, arch: Arch) -> list:
    from attnzoo.layers.moe import MoE

    if arch is MAMBA2:
        return _mamba2_model_rules(model)
    off = arch.norm_offset
    rules = [_same("embed.weight", "model.embed_tokens.weight"), _same("norm.weight", "model.norm.weight", off)]
    if not model.cfg.tie_embeddings:
        rules.append(_same("lm_head.weight", "lm_head.weight"))
    mixer_rules = {LLAMA: _attention_rules, QWEN2: _attention_rules, MISTRAL: _attention_rules,
                   MIXTRAL: _attention_rules, DEEPSEEK_V3: _mla_rules, DEEPSEEK_V32: _mla_rules, QWEN3_NEXT: _gdn_rules,
                   QWEN3: _attention_rules, QWEN3_MOE: _attention_rules, KIMI_LINEAR: _mla_rules}[arch]
    for i, block in enumerate(model.blocks):
        o, h = f"blocks.{i}.", f"model.layers.{i}."
        rules += [_same(o + "norm1.weight", h + "input_layernorm.weight", off),
                  _same(o + "norm2.weight", h + "post_attention_layernorm.weight", off)]
        if arch is QWEN3_NEXT and block.mixer.hf_layer != HF_LINEAR_ATTENTION:
            rules += _gated_attention_rules(block.mixer, o + "mixer.", h, off)
        elif block.mixer.hf_layer == HF_KIMI_DELTA_ATTENTION:  # Kimi Linear's KDA layers (its MLA layers: _mla_rules)
            rules += _kda_rules(block.mixer, o + "mixer.", h)
        else:
            rules += mixer_rules(block.mixer, o + "mixer.", h)
        if isinstance(block.ffn, MoE):
            rules += _moe_rules(block.ffn, o + "ffn.", h + arch.moe_prefix, arch)
        else:
            rules += _swiglu_rules(block.ffn, o + "ffn.", h + "mlp.")
    return rules


# ----------------------------------------------------------------------------- weights, both ways


IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some checkpoints carry; recomputed from the config


@torch.no_grad()
def load_hf_weights(model, state_dict: dict, field: str = FIELD) -> None:
    """Copy a transformers checkpoint's tensors into an attnzoo DecoderLM built from `config_from_hf`
    (cast to the model's dtype). Every model tensor must be filled and every checkpoint tensor used:
    otherwise one-line ConfigError naming the first tensor that does not fit."""
    arch = arch_for(model)
    sd = {k: v for k, v in state_dict.items() if not k.endswith(IGNORED_SUFFIXES)}
    for pattern, name in arch.aliases:  # another name a checkpoint may hold a tensor under
        sd = {re.sub(pattern, name, k): v for k, v in sd.items()}
    ours: dict[str, torch.Tensor] = {}
    for rule in _rules(model, arch):
        missing = [k for k in rule.hf if k not in sd]
        if missing:
            raise ConfigError(f"the checkpoint has no tensor {missing[0]!r}, which a {arch.cls} of this config needs",
                              field=field)
        ours.update(zip(rule.ours, rule.to_ours([sd.pop(k) for k in rule.hf])))
    if model.cfg.tie_embeddings:
        head = sd.pop("lm_head.weight", None)
        if head is not None and not torch.equal(head.to(ours["embed.weight"].dtype), ours["embed.weight"]):
            raise ConfigError("tie_word_embeddings is true but lm_head.weight differs from the embedding", field=field)
        ours["lm_head.weight"] = ours["embed.weight"]
    if sd:
        first = sorted(sd)[0]
        raise ConfigError(f"{len(sd)} checkpoint tensor(s) have no attnzoo counterpart, e.g. {first!r} (a feature "
                          f"attnzoo lacks); not imported", field=field)
    params = model.state_dict()
    for k, v in ours.items():
        if k not in params or params[k].shape != v.shape:
            got = tuple(params[k].shape) if k in params else "nothing"
            raise ConfigError(f"{k}: the checkpoint gives shape {tuple(v.shape)}, the model from its config.json has "
                              f"{got}", field=field)
    missing = sorted(set(params) - set(ours))
    if missing:
        raise ConfigError(f"no checkpoint tensor fills {missing[0]}", field=field)
    for k, v in ours.items():
        params[k].copy_(v)


def hf_state_dict(model) -> dict[str, torch.Tensor]:
    """The model's weights under `arch_for(model)`'s checkpoint names (each tensor its own contiguous copy)."""
    arch = arch_for(model)
    sd = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    for rule in _rules(model, arch):
        out.update(zip(rule.hf, rule.to_hf([sd[k].detach() for k in rule.ours])))
    return {k: v.detach().to("cpu").clone().contiguous() for k, v in out.items()}
