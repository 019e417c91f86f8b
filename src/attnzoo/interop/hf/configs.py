"""config.json both ways: `config_from_hf` (a transformers config -> the attnzoo `model` section) and `hf_config`
(an attnzoo DecoderLM -> the config.json of its `arch_for` architecture, every field that matters written out)."""
from __future__ import annotations

from typing import Any, Callable, Optional

from attnzoo.config.errors import ConfigError
from attnzoo.interop.hf.archs import (DEEPSEEK, DEEPSEEK_V3, DEEPSEEK_V32, LLAMA, MAMBA2, MISSING, MISTRAL, MIXTRAL,
                                      QWEN2, QWEN3, QWEN3_MOE, QWEN3_NEXT, _dense_of, _moe_of, arch_for, mixer_class)
from attnzoo.mixers.base import (HF_FULL_ATTENTION, HF_LATENT_ATTENTION, HF_LINEAR_ATTENTION, HF_SLIDING_ATTENTION,
                                 HF_SPARSE_LATENT_ATTENTION, HF_WINDOW_FIELD)


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
    k_dense = int(c.get("first_k_dense_replace", 0))
    if k_dense >= c["num_hidden_layers"] or not c.get("n_routed_experts"):
        m["ffn"] = {"name": "swiglu", "d_ff": c["intermediate_size"]}
    else:
        m["ffn"] = {"name": "moe", "n_experts": c["n_routed_experts"], "top_k": c["num_experts_per_tok"],
                    "d_ff": c["moe_intermediate_size"], "scoring": "sigmoid",
                    "norm_topk_prob": bool(c.get("norm_topk_prob", True)),
                    "routed_scaling_factor": float(c.get("routed_scaling_factor", 1.0)),
                    "n_group": c.get("n_group") or 1, "topk_group": c.get("topk_group") or 1,
                    "n_shared_experts": int(c.get("n_shared_experts") or 0), "first_k_dense": k_dense,
                    "dense_d_ff": c["intermediate_size"], "expert_type": "swiglu"}
    return m


def _deepseek_v32(c: dict) -> dict:
    """DeepSeek-V3.2: DeepSeek-V3 (its MoE, its RoPE rules) whose every layer is DSA, the main RoPE always interleaved
    (config.json has no rope_interleave), the query always through q_a_proj; `mlp_layer_types` (when given) decides
    the dense layers, which attnzoo has as the first k."""
    if c.get("q_lora_rank") is None:
        raise _refuse("q_lora_rank", "null (DeepSeek-V3.2's attention and indexer read a query latent; allowed: a rank)")
    types = c.get("layer_types")
    if types and set(types) != {HF_SPARSE_LATENT_ATTENTION}:
        raise _refuse("layer_types", f"{sorted(set(types))} (imported: {HF_SPARSE_LATENT_ATTENTION} only)")
    n = c["num_hidden_layers"]
    k = min(int(c.get("first_k_dense_replace", 3)), n)  # transformers' default: 3
    mlp = list(c.get("mlp_layer_types") or ["dense"] * k + ["sparse"] * (n - k))
    k = next((i for i, t in enumerate(mlp) if t != "dense"), len(mlp))
    if mlp != ["dense"] * k + ["sparse"] * (n - k):
        raise _refuse("mlp_layer_types", f"{mlp} (attnzoo's dense layers are the first k: k x dense, then sparse)")
    m = _deepseek_v3({**c, "first_k_dense_replace": k})
    m["mixer"] = mixer_class(HF_SPARSE_LATENT_ATTENTION).hf_mixer_config(c)
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
        period = next(p for p in range(1, len(types) + 1) if len(types) % p == 0 and types == types[:p] * (len(types) // p))
        m["mixer"] = gdn
        m["mixers"] = {"gdn": gdn, "attn": {**_attention_mixer(c, None, bias, bias), "qk_norm": True,
                                             "output_gate": True}}
        m["pattern"] = ["gdn" if t == HF_LINEAR_ATTENTION else "attn" for t in types[:period]]
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
    MAMBA2.model_type: _mamba2,
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


# ----------------------------------------------------------------------------- export: model -> config.json


def _rope_parameters(pos) -> dict:
    rp = {"rope_type": "default", "rope_theta": float(pos.theta)}
    if pos.scaling == "linear":
        rp.update(rope_type="linear", factor=pos.factor)
    elif pos.scaling == "llama3":
        rp.update(rope_type="llama3", factor=pos.factor, low_freq_factor=pos.low_freq_factor,
                  high_freq_factor=pos.high_freq_factor, original_max_position_embeddings=pos.original_max_len)
    return rp


def hf_config(model) -> dict:
    """config.json for `model` under `arch_for(model)` (every field that matters written out, so no
    transformers default decides anything)."""
    arch = arch_for(model)
    if arch is MAMBA2:
        return _mamba2_config(model)
    cfg = model.cfg
    m, mc = model.mixers[0], model.layer_mixers[0]
    dense, moe = _dense_of(model), _moe_of(model)
    c = {
        "architectures": [arch.cls], "model_type": arch.model_type, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm.eps, "hidden_act": "silu", "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std, "attention_dropout": 0.0, "use_cache": True, "dtype": "float32",
        "rope_parameters": _rope_parameters(cfg.position),
        "intermediate_size": (dense or moe).hidden,
    }
    if arch in (LLAMA, QWEN2, MISTRAL, MIXTRAL, QWEN3, QWEN3_MOE):
        if cfg.position.scaling == "llama3" and cfg.position.original_max_len is None:
            c["rope_parameters"]["original_max_position_embeddings"] = cfg.max_seq_len
        c["num_key_value_heads"] = m.n_kv_heads
    if arch is LLAMA:
        c.update(attention_bias=mc.qkv_bias, mlp_bias=bool(cfg.ffn.bias))
    if arch in (QWEN3, QWEN3_MOE):
        c.update(attention_bias=mc.qkv_bias, use_sliding_window=False, sliding_window=None,
                 max_window_layers=cfg.n_layers, layer_types=["full_attention"] * cfg.n_layers)
    if arch is QWEN3_MOE:
        f = cfg.ffn
        c.update(num_experts=moe.n_experts, num_experts_per_tok=moe.top_k, moe_intermediate_size=moe.hidden,
                 norm_topk_prob=f.norm_topk_prob, mlp_only_layers=list(range(f.first_k_dense)), decoder_sparse_step=1,
                 output_router_logits=False)
    if arch is QWEN2:
        c.update(use_sliding_window=False, sliding_window=None, layer_types=["full_attention"] * cfg.n_layers)
    if arch in (MISTRAL, MIXTRAL):
        c[HF_WINDOW_FIELD] = getattr(mc, "window", None)
    if arch is MIXTRAL:
        c.update(num_local_experts=moe.n_experts, num_experts_per_tok=moe.top_k, router_jitter_noise=0.0,
                 output_router_logits=False)
    if arch in DEEPSEEK:
        c.update(num_key_value_heads=cfg.n_heads, head_dim=m.dr, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
                 qk_nope_head_dim=m.dn, qk_rope_head_dim=m.dr, v_head_dim=m.dv, attention_bias=mc.bias)
        if arch is DEEPSEEK_V3:
            c["rope_interleave"] = mc.rope_interleave
        else:  # V3.2's main RoPE is always interleaved (archs.arch_for refuses anything else): no such field
            c.update(index_n_heads=m.index_n_heads, index_head_dim=m.index_head_dim, index_topk=m.index_topk,
                     layer_types=[HF_SPARSE_LATENT_ATTENTION] * cfg.n_layers)
        if moe is None:  # every layer dense; a valid (unused) router description
            c.update(first_k_dense_replace=cfg.n_layers, n_routed_experts=1, num_experts_per_tok=1, n_group=1,
                     topk_group=1, moe_intermediate_size=dense.hidden, n_shared_experts=0)
        else:
            f = cfg.ffn
            c.update(first_k_dense_replace=f.first_k_dense, n_routed_experts=moe.n_experts,
                     num_experts_per_tok=moe.top_k, n_group=f.n_group or 1, topk_group=f.topk_group or 1,
                     moe_intermediate_size=moe.hidden,
                     n_shared_experts=f.n_shared_experts if moe.shared is not None else 0,
                     routed_scaling_factor=f.routed_scaling_factor, norm_topk_prob=f.norm_topk_prob)
        if arch is DEEPSEEK_V32:  # written out, so that no default decides the dense layers
            k = c["first_k_dense_replace"]
            c["mlp_layer_types"] = ["dense"] * k + ["sparse"] * (cfg.n_layers - k)
    if arch is QWEN3_NEXT:
        g = next(x for x in model.mixers if x.hf_layer == HF_LINEAR_ATTENTION)
        c.update(layer_types=[x.hf_layer for x in model.mixers], linear_num_key_heads=g.n_qk_heads,
                 linear_num_value_heads=g.n_v_heads, linear_key_head_dim=g.qk_dim, linear_value_head_dim=g.v_dim,
                 linear_conv_kernel_dim=g.conv.kernel_size, decoder_sparse_step=1)
        a = next((x for x in model.mixers if x.hf_layer != HF_LINEAR_ATTENTION), None)
        if a is not None:  # the gated attention layers
            c.update(num_key_value_heads=a.n_kv_heads, attention_bias=a.cfg.qkv_bias)
            c["rope_parameters"]["partial_rotary_factor"] = float(cfg.position.rotary_fraction)
        if moe is None:
            c.update(num_experts=0, mlp_only_layers=[])
        else:
            f = cfg.ffn
            c.update(num_experts=moe.n_experts, num_experts_per_tok=moe.top_k, moe_intermediate_size=moe.hidden,
                     shared_expert_intermediate_size=moe.shared.hidden, norm_topk_prob=f.norm_topk_prob,
                     mlp_only_layers=list(range(f.first_k_dense)), output_router_logits=False)
    return c


def _mamba2_config(model) -> dict:
    """config.json of Mamba2ForCausalLM for an all-mamba2 model (archs._check_mamba2); dt unclamped (time_step_limit
    [0, inf], written out: JSON's Infinity, which Python's json and transformers read)."""
    cfg, m, mc = model.cfg, model.mixers[0], model.layer_mixers[0]
    return {
        "architectures": [MAMBA2.cls], "model_type": MAMBA2.model_type, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers, "num_heads": m.n_v_heads, "head_dim": m.v_dim,
        "expand": m.n_v_heads * m.v_dim // cfg.d_model, "state_size": m.qk_dim, "n_groups": m.n_qk_heads,
        "conv_kernel": mc.conv_size, "use_conv_bias": mc.conv_bias, "use_bias": False, "chunk_size": mc.chunk_size,
        "layer_norm_epsilon": cfg.norm.eps, "hidden_act": "silu", "tie_word_embeddings": cfg.tie_embeddings,
        "residual_in_fp32": True, "time_step_limit": [0.0, float("inf")], "time_step_min": mc.dt_init_range[0],
        "time_step_max": mc.dt_init_range[1], "time_step_floor": mc.dt_init_floor, "rescale_prenorm_residual": False,
        "initializer_range": cfg.init_std, "use_cache": True, "dtype": "float32",
    }
