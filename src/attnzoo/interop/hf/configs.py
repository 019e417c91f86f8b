"""config.json both ways: `config_from_hf` (a transformers config -> the attnzoo `model` section) and `hf_config`
(an attnzoo DecoderLM -> the config.json of its `arch_for` architecture, every field that matters written out;
export_configs.py, re-exported here)."""
from __future__ import annotations

from typing import Any, Callable, Optional

from attnzoo.config.errors import ConfigError
from attnzoo.interop.hf.archs import KIMI_LINEAR, MAMBA2, MISSING, mixer_class
from attnzoo.interop.hf.export_configs import hf_config  # noqa: F401 (re-exported)
from attnzoo.mixers.base import (HF_FULL_ATTENTION, HF_KIMI_DELTA_ATTENTION, HF_LATENT_ATTENTION, HF_LINEAR_ATTENTION,
                                 HF_SLIDING_ATTENTION, HF_SPARSE_LATENT_ATTENTION, HF_WINDOW_FIELD)


# ----------------------------------------------------------------------------- import: config.json -> model section


def _as_dict(hf_config: Any) -> dict:
    return hf_config if isinstance(hf_config, dict) else hf_config.to_dict()


def _refuse(field: str, why: str) -> ConfigError:
    return ConfigError(f"{why}; not imported (attnzoo has no exact equivalent)", field=f"config.json:{field}")


def _position_from_hf(c: dict, rotary: bool = True) -> dict:
    rp = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    theta = float(rp.get("rope_theta", c.get("rope_theta", 10000.0)))
    kind = rp.get("rope_type", rp.get("type", "default"))
    partial = rp.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    if rotary and partial not in (None, 1.0, 1):
        raise _refuse("partial_rotary_factor", f"{partial} (this architecture rotates whole heads)")
    pos = {"name": "rope", "theta": theta}
    if kind == "linear":
        pos.update(scaling="linear", factor=float(rp["factor"]))
    elif kind == "llama3":
        pos.update(scaling="llama3", factor=float(rp["factor"]), low_freq_factor=float(rp["low_freq_factor"]),
                   high_freq_factor=float(rp["high_freq_factor"]),
                   original_max_len=int(rp["original_max_position_embeddings"]))
    elif kind != "default":
        raise _refuse("rope_parameters.rope_type", f"{kind!r} (imported: default, linear, llama3)")
    return pos


def _check_act(c: dict) -> None:
    act = c.get("hidden_act", "silu")
    if act != "silu":
        raise _refuse("hidden_act", f"{act!r} (attnzoo's SwiGLU and experts are SiLU-gated)")


def _base(c: dict, position: dict) -> dict:
    return {
        "name": "decoder", "d_model": c["hidden_size"], "n_layers": c["num_hidden_layers"],
        "n_heads": c["num_attention_heads"], "n_kv_heads": c.get("num_key_value_heads") or c["num_attention_heads"],
        "head_dim": c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"], "vocab_size": c["vocab_size"],
        "max_seq_len": c.get("max_position_embeddings", 2048), "norm_position": "pre",
        "tie_embeddings": bool(c.get("tie_word_embeddings", False)),
        "norm": {"name": "rmsnorm", "eps": c["rms_norm_eps"]},
        "position": position, "pattern": None, "mixers": {},
    }


def _attention_mixer(c: dict, window: Optional[int], qkv_bias: bool, out_bias: bool) -> dict:
    """The attention layer's mixer section: its mixer class's (`Mixer.hf_mixer_config`), windowed or full."""
    if window is not None:
        return mixer_class(HF_SLIDING_ATTENTION).hf_mixer_config(c, window=window, qkv_bias=qkv_bias, out_bias=out_bias)
    return mixer_class(HF_FULL_ATTENTION).hf_mixer_config(c, qkv_bias=qkv_bias, out_bias=out_bias)


def _check_full_attention(c: dict) -> None:
    types = c.get("layer_types")
    if types and set(types) != {"full_attention"}:
        raise _refuse("layer_types", f"{sorted(set(types))} (per-layer sliding windows; imported: full_attention only)")


def _llama_like(c: dict) -> dict:
    """Llama, Mistral, Qwen2: attention + SwiGLU."""
    _check_act(c)
    mt = c["model_type"]
    window = None
    if mt == "mistral":
        window = c.get(HF_WINDOW_FIELD)
    elif mt == "qwen2" and c.get("use_sliding_window"):
        raise _refuse("use_sliding_window", "true (Qwen2's sliding window applies above max_window_layers only)")
    if mt != "mistral":
        _check_full_attention(c)
    bias = bool(c.get("attention_bias", False))
    qkv_bias, out_bias = (True, False) if mt == "qwen2" else (bias, bias)
    m = _base(c, _position_from_hf(c))
    m["mixer"] = _attention_mixer(c, window, qkv_bias, out_bias)
    m["ffn"] = {"name": "swiglu", "d_ff": c["intermediate_size"], "bias": bool(c.get("mlp_bias", False))}
    return m


def _qwen3(c: dict) -> dict:
    """Qwen3 and Qwen3-MoE: Llama-like attention (attention_bias on all four projections) with q/k RMSNorm on
    every head, + SwiGLU, or (qwen3_moe) softmax top-k experts after the first len(mlp_only_layers) layers."""
    _check_act(c)
    if c.get("use_sliding_window"):
        raise _refuse("use_sliding_window", "true (Qwen3's sliding window applies above max_window_layers only)")
    _check_full_attention(c)
    bias = bool(c.get("attention_bias", False))
    m = _base(c, _position_from_hf(c))
    m["mixer"] = {**_attention_mixer(c, None, bias, bias), "qk_norm": True}
    E = int(c.get("num_experts", c.get("num_local_experts")) or 0) if c["model_type"] == "qwen3_moe" else 0
    if E == 0:
        m["ffn"] = {"name": "swiglu", "d_ff": c["intermediate_size"]}
        return m
    m["ffn"] = {"name": "moe", "n_experts": E, "top_k": c["num_experts_per_tok"], "d_ff": c["moe_intermediate_size"],
                "scoring": "softmax", "norm_topk_prob": bool(c.get("norm_topk_prob", False)),
                "first_k_dense": _dense_prefix(c), "dense_d_ff": c["intermediate_size"], "expert_type": "swiglu"}
    return m


def _dense_prefix(c: dict) -> int:
    """k, for `mlp_only_layers` = [0..k-1] with decoder_sparse_step 1 (attnzoo's dense layers are the first k)."""
    only = sorted(c.get("mlp_only_layers") or [])
    if int(c.get("decoder_sparse_step", 1)) != 1 or only != list(range(len(only))):
        step = c.get("decoder_sparse_step", 1)
        raise _refuse("mlp_only_layers", f"{only} with decoder_sparse_step={step} (attnzoo's "
                      f"dense layers are the first k: mlp_only_layers [0..k-1], decoder_sparse_step 1)")
    return len(only)


def _mixtral(c: dict) -> dict:
    _check_act(c)
    m = _base(c, _position_from_hf(c))
    m["mixer"] = _attention_mixer(c, c.get(HF_WINDOW_FIELD), False, False)
    m["ffn"] = {"name": "moe", "n_experts": c["num_local_experts"], "top_k": c["num_experts_per_tok"],
                "d_ff": c["intermediate_size"], "scoring": "softmax", "norm_topk_prob": True, "expert_type": "swiglu"}
    return m


def _deepseek_v3(c: dict) -> dict:
    _check_act(c)
    pos = _position_from_hf(c, rotary=False)
    if pos.get("scaling", "none") != "none":
        raise _refuse("rope_parameters.rope_type", f"{pos['scaling']!r} (DeepSeek-V3 rescales its softmax with the "
                      f"YaRN mscale; imported: default)")
    m = _base(c, pos)
    h, qk = c["num_attention_heads"], c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    m["n_kv_heads"] = h
    m["head_dim"] = None if c["hidden_size"] % h == 0 else qk  # MLA reads its own sizes below
    m["mixer"] = mixer_class(HF_LATENT_ATTENTION).hf_mixer_config(c)
    m["ffn"] = _deepseek_ffn(c, int(c.get("first_k_dense_replace", 0)))
    return m


def _deepseek_ffn(c: dict, k_dense: int) -> dict:
    """DeepSeek-V3's FFN section (V3.2's, Kimi Linear's): SwiGLU in every layer, or its sigmoid MoE after k dense."""
    if k_dense >= c["num_hidden_layers"] or not c.get("n_routed_experts"):
        return {"name": "swiglu", "d_ff": c["intermediate_size"]}
    return {"name": "moe", "n_experts": c["n_routed_experts"], "top_k": c["num_experts_per_tok"],
            "d_ff": c["moe_intermediate_size"], "scoring": "sigmoid",
            "norm_topk_prob": bool(c.get("norm_topk_prob", True)),
            "routed_scaling_factor": float(c.get("routed_scaling_factor", 1.0)), "n_group": c.get("n_group") or 1,
            "topk_group": c.get("topk_group") or 1, "n_shared_experts": int(c.get("n_shared_experts") or 0),
            "first_k_dense": k_dense, "dense_d_ff": c["intermediate_size"], "expert_type": "swiglu"}


def _deepseek_v32(c: dict) -> dict:
    """DeepSeek-V3.2: DeepSeek-V3 (its MoE, its RoPE rules) whose every layer is DSA, the main RoPE always interleaved
    (config.json has no rope_interleave), the query always through q_a_proj; `mlp_layer_types` (when given) decides
    the dense layers, which attnzoo has as the first k."""
    if c.get("q_lora_rank") is None:
        raise _refuse("q_lora_rank", "null (DeepSeek-V3.2's attention and indexer read a query latent; allowed: a rank)")
    types = c.get("layer_types")
    if types and set(types) != {HF_SPARSE_LATENT_ATTENTION}:
        raise _refuse("layer_types", f"{sorted(set(types))} (imported: {HF_SPARSE_LATENT_ATTENTION} only)")
    m = _deepseek_v3({**c, "first_k_dense_replace": _mlp_dense_prefix(c, 3)})  # transformers' default k: 3
    m["mixer"] = mixer_class(HF_SPARSE_LATENT_ATTENTION).hf_mixer_config(c)
    return m


def _mlp_dense_prefix(c: dict, k_default: int) -> int:
    """k, for `mlp_layer_types` = k x dense then sparse (absent: first_k_dense_replace, else `k_default`, as
    transformers derives it): attnzoo's dense layers are the first k."""
    n = c["num_hidden_layers"]
    k = min(int(c.get("first_k_dense_replace", k_default)), n)
    mlp = list(c.get("mlp_layer_types") or ["dense"] * k + ["sparse"] * (n - k))
    k = next((i for i, t in enumerate(mlp) if t != "dense"), len(mlp))
    if mlp != ["dense"] * k + ["sparse"] * (n - k):
        raise _refuse("mlp_layer_types", f"{mlp} (attnzoo's dense layers are the first k: k x dense, then sparse)")
    return k


def _period(types: list) -> list:
    """The shortest prefix of `types` that tiles it (model.pattern's length must divide n_layers)."""
    n = len(types)
    return types[:next(p for p in range(1, n + 1) if n % p == 0 and types == types[:p] * (n // p))]


# DeepSeek-V3's config.json names <- Kimi Linear's (KimiLinearConfig.attribute_map: it saves the latter, reads both)
KIMI_NAMES = {"n_routed_experts": ("num_experts", "num_local_experts"),
              "num_experts_per_tok": ("num_experts_per_token", "num_experts_per_tok"),
              "norm_topk_prob": ("moe_renormalize", "norm_topk_prob"), "n_group": ("num_expert_group", "n_group"),
              "n_shared_experts": ("num_shared_experts", "n_shared_experts"), "topk_group": ("topk_group",),
              "routed_scaling_factor": ("routed_scaling_factor",), "moe_intermediate_size": ("moe_intermediate_size",)}
# fields of Moonshot's config.json that transformers' KimiLinearForCausalLM reads as one value only
KIMI_FIXED = (("moe_router_activation_func", "sigmoid"), ("mla_use_nope", True), ("moe_layer_freq", 1))


def _kimi_layer_types(c: dict) -> list:
    """layer_types as transformers reads a Kimi Linear config.json: the field; else Moonshot's linear_attn_config
    full_attn_layers / kda_layers (1-indexed); else full attention at layers 4, 8, ... (0-indexed), KDA elsewhere."""
    n, lac = c["num_hidden_layers"], c.get("linear_attn_config") or {}
    if c.get("layer_types") is not None:
        return list(c["layer_types"])
    if "full_attn_layers" in lac and "kda_layers" in lac:
        types = [None] * n
        for key, kind in (("full_attn_layers", HF_FULL_ATTENTION), ("kda_layers", HF_LINEAR_ATTENTION)):
            for i in lac[key]:
                if not 1 <= i <= n:
                    raise _refuse(f"linear_attn_config.{key}", f"{lac[key]} (1-indexed layers; allowed: 1..{n})")
                types[i - 1] = kind
        return types
    return [HF_FULL_ATTENTION if i and i % 4 == 0 else HF_LINEAR_ATTENTION for i in range(n)]


def _kimi_linear(c: dict) -> dict:
    """Kimi Linear: KDA layers (layer_types linear_attention) and MLA layers (full_attention: DeepSeek-V3's MLA without
    RoPE, so no positions), model.pattern tiling the shortest period of layer_types over mixers.delta / mixers.latent
    (as Qwen3-Next's); DeepSeek-V3's FFN (Kimi's config names, KIMI_NAMES) after the dense layers of mlp_layer_types."""
    _check_act(c)
    for key, want in KIMI_FIXED:
        if c.get(key, want) != want:
            raise _refuse(key, f"{c[key]!r} (transformers' KimiLinearForCausalLM implements {want!r} only; allowed: "
                          f"{want!r})")
    n, types = c["num_hidden_layers"], _kimi_layer_types(c)
    if len(types) != n or not set(types) <= {HF_LINEAR_ATTENTION, HF_FULL_ATTENTION}:
        raise _refuse("layer_types", f"{types} (imported: {HF_LINEAR_ATTENTION} (KDA) or {HF_FULL_ATTENTION} (MLA) for "
                      f"each of the {n} layers)")
    k = _mlp_dense_prefix(c, 1)  # transformers' default first_k_dense_replace for Kimi Linear: 1
    d = {**c, "n_routed_experts": 0,  # transformers' default model_max_length: 1048576 (nothing sized by it here)
         "max_position_embeddings": c.get("model_max_length", c.get("max_position_embeddings", 1048576))}
    if k < n:  # sparse layers: the router's fields, each under either name, none defaulted
        for ds, names in KIMI_NAMES.items():
            if not any(name in c for name in names):
                raise KeyError(names[0])
            d[ds] = next(c[name] for name in names if name in c)
        if not d["n_routed_experts"] or not d["n_shared_experts"]:
            key = "num_experts" if not d["n_routed_experts"] else "num_shared_experts"
            raise _refuse(key, "0 with sparse layers (KimiLinearMoE routes to experts and always adds its shared "
                          "experts; allowed: >= 1)")
    m = _base(d, {"name": "none"})  # neither layer kind takes a position
    m["tie_embeddings"] = False  # whatever tie_word_embeddings says: KimiLinearForCausalLM ties nothing (no tied keys)
    h = c["num_attention_heads"]
    m["n_kv_heads"] = h  # MLA: every head its own key (num_key_value_heads is not read)
    m["head_dim"] = None if c["hidden_size"] % h == 0 else c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    kda = mixer_class(HF_KIMI_DELTA_ATTENTION).hf_mixer_config(c) if HF_LINEAR_ATTENTION in types else None
    mla = mixer_class(HF_LATENT_ATTENTION).hf_mixer_config(c) if HF_FULL_ATTENTION in types else None
    if mla is not None and mla["qk_rope_head_dim"] % 2:
        raise _refuse("qk_rope_head_dim", f"{mla['qk_rope_head_dim']} (attnzoo's MLA keeps an even count; allowed: "
                      f"even)")
    m["mixer"] = kda or mla
    if kda is not None and mla is not None:
        m["mixers"] = {"delta": kda, "latent": mla}
        m["pattern"] = ["delta" if t == HF_LINEAR_ATTENTION else "latent" for t in _period(types)]
    m["ffn"] = _deepseek_ffn(d, k)
    return m


def _qwen3_next(c: dict) -> dict:
    """Gated DeltaNet layers, and full-attention layers (q/k RMSNorm, sigmoid output gate, partial rotary) where
    `layer_types` has them: model.pattern tiles the shortest period of layer_types, [gdn, ..., attn]."""
    _check_act(c)
    types = list(c.get("layer_types") or [])
    if HF_LINEAR_ATTENTION not in types or not set(types) <= {HF_LINEAR_ATTENTION, HF_FULL_ATTENTION}:
        raise _refuse("layer_types", f"{sorted(set(types))} (imported: {HF_LINEAR_ATTENTION} layers, with or without "
                      f"{HF_FULL_ATTENTION} layers)")
    gdn = mixer_class(HF_LINEAR_ATTENTION).hf_mixer_config(c)
    if HF_FULL_ATTENTION not in types:
        m = _base(c, {"name": "none"})  # the linear layers take no position
        m["mixer"] = gdn
    else:
        pos = _position_from_hf(c, rotary=False)
        if pos.get("scaling", "none") != "none":
            raise _refuse("rope_parameters.rope_type", f"{pos['scaling']!r} (imported for Qwen3-Next: default)")
        rp = c.get("rope_parameters") or {}
        pos["rotary_fraction"] = float(rp.get("partial_rotary_factor", c.get("partial_rotary_factor")) or 1.0)
        m = _base(c, pos)
        bias = bool(c.get("attention_bias", False))
        m["mixer"] = gdn
        m["mixers"] = {"gdn": gdn, "attn": {**_attention_mixer(c, None, bias, bias), "qk_norm": True,
                                             "output_gate": True}}
        m["pattern"] = ["gdn" if t == HF_LINEAR_ATTENTION else "attn" for t in _period(types)]
    E = int(c.get("num_experts") or 0)
    if E == 0:
        m["ffn"] = {"name": "swiglu", "d_ff": c["intermediate_size"]}
        return m
    k_dense = _dense_prefix(c)
    if not c.get("shared_expert_intermediate_size"):
        raise _refuse("shared_expert_intermediate_size", "0 (imported: a gated shared expert)")
    m["ffn"] = {"name": "moe", "n_experts": E, "top_k": c["num_experts_per_tok"], "d_ff": c["moe_intermediate_size"],
                "scoring": "softmax", "norm_topk_prob": bool(c.get("norm_topk_prob", True)),
                "shared_d_ff": c["shared_expert_intermediate_size"], "shared_expert_gate": True,
                "first_k_dense": k_dense, "dense_d_ff": c["intermediate_size"], "expert_type": "swiglu"}
    return m


def _mamba2(c: dict) -> dict:
    """Mamba2ForCausalLM: every layer mamba2 (in_proj / out_proj without biases; dt unclamped), no FFN, no positions;
    transformers' layer_norm_epsilon is the blocks' RMSNorm eps and the gated norm's. Its residual_in_fp32 keeps the
    residual stream in fp32 between blocks, as an fp32 model does; in a 16-bit model attnzoo's stream is 16-bit."""
    if c.get("hidden_act", "silu") != "silu":
        raise _refuse("hidden_act", f"{c['hidden_act']!r} (Mamba-2's conv and gate are SiLU)")
    if c.get("use_bias", False):
        raise _refuse("use_bias", "true (in_proj / out_proj biases, which attnzoo's mamba2 has no option for)")
    # transformers writes a non-finite float as {"__float__": "Infinity"} in config.json
    num = lambda v: float(v["__float__"]) if isinstance(v, dict) and "__float__" in v else v  # noqa: E731
    lo, hi = (list(map(num, c.get("time_step_limit") or (0.0, float("inf")))) + [None, None])[:2]
    if lo not in (0, 0.0, None) or hi not in (float("inf"), None):
        raise _refuse("time_step_limit", f"{c.get('time_step_limit')} (a clamp of dt, which attnzoo's mamba2 has no "
                      f"option for; allowed: [0, inf])")
    H, P, d = c["num_heads"], c["head_dim"], c["hidden_size"]
    if H * P % d:
        raise _refuse("num_heads", f"{H} heads x head_dim {P} is not an integer multiple (expand) of hidden_size {d}")
    eps = c.get("layer_norm_epsilon", 1e-5)
    mixer = {"name": "mamba2", "expand": H * P // d, "head_dim": P, "d_state": c["state_size"],
             "n_groups": c.get("n_groups", 1), "chunk_size": c.get("chunk_size", 256),
             "conv_size": c.get("conv_kernel", 4), "conv_bias": bool(c.get("use_conv_bias", True)), "norm_eps": eps,
             "dt_init_range": [c.get("time_step_min", 0.001), c.get("time_step_max", 0.1)],
             "dt_init_floor": c.get("time_step_floor", 1e-4)}
    return {"name": "decoder", "d_model": d, "n_layers": c["num_hidden_layers"], "n_heads": H, "n_kv_heads": H,
            "head_dim": P, "vocab_size": c["vocab_size"], "max_seq_len": c.get("max_position_embeddings", 2048),
            "norm_position": "pre", "tie_embeddings": bool(c.get("tie_word_embeddings", False)),
            "norm": {"name": "rmsnorm", "eps": eps}, "position": {"name": "none"}, "pattern": None, "mixers": {},
            "mixer": mixer, "ffn": {"name": "none"}}


IMPORTERS: dict[str, Callable[[dict], dict]] = {
    "llama": _llama_like, "mistral": _llama_like, "qwen2": _llama_like, "mixtral": _mixtral,
    "deepseek_v3": _deepseek_v3, "deepseek_v32": _deepseek_v32, "qwen3_next": _qwen3_next, "qwen3": _qwen3, "qwen3_moe": _qwen3,
    KIMI_LINEAR.model_type: _kimi_linear, MAMBA2.model_type: _mamba2,
}


def config_from_hf(hf_config: Any) -> dict:
    """The attnzoo `model` section equivalent to a transformers config (a config.json dict or a
    PretrainedConfig). One-line ConfigError naming the config.json field attnzoo cannot represent."""
    c = _as_dict(hf_config)
    mt = c.get("model_type")
    if mt in MISSING:
        raise _refuse("model_type", f"{mt!r} needs {MISSING[mt]}")
    if mt not in IMPORTERS:
        raise _refuse("model_type", f"{mt!r} is not a supported architecture; allowed: {', '.join(IMPORTERS)}")
    try:
        return IMPORTERS[mt](c)
    except KeyError as e:
        raise ConfigError(f"has no {e.args[0]!r}, which a {mt} config needs", field="config.json") from None
