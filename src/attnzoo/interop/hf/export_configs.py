"""config.json for export: `hf_config(model)`, an attnzoo DecoderLM -> the config.json of its `arch_for` architecture,
every field that matters written out, so that no transformers default decides anything (configs.py: import)."""
from __future__ import annotations

from attnzoo.interop.hf.archs import (DEEPSEEK, DEEPSEEK_V3, DEEPSEEK_V32, KIMI_LINEAR, LLAMA, MAMBA2, MISTRAL, MIXTRAL,
                                      QWEN2, QWEN3, QWEN3_MOE, QWEN3_NEXT, _dense_of, _moe_of, arch_for)
from attnzoo.mixers.base import (HF_FULL_ATTENTION, HF_KIMI_DELTA_ATTENTION, HF_LATENT_ATTENTION, HF_LINEAR_ATTENTION,
                                 HF_SPARSE_LATENT_ATTENTION, HF_WINDOW_FIELD)


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
    if arch is KIMI_LINEAR:
        return _kimi_config(model)
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


def _kimi_config(model) -> dict:
    """config.json of KimiLinearForCausalLM for a KDA / MLA model (archs._check_kimi_linear), in the names transformers
    saves (configs.KIMI_NAMES); layer_types and mlp_layer_types written out, Moonshot's linear_attn_config beside
    them."""
    cfg, dense, moe = model.cfg, _dense_of(model), _moe_of(model)
    kda = next((x for x in model.mixers if x.hf_layer == HF_KIMI_DELTA_ATTENTION), None)
    mla = next((x for x in model.mixers if x.hf_layer == HF_LATENT_ATTENTION), None)
    types = [HF_LINEAR_ATTENTION if x.hf_layer == HF_KIMI_DELTA_ATTENTION else HF_FULL_ATTENTION for x in model.mixers]
    k = cfg.n_layers if moe is None else cfg.ffn.first_k_dense
    c = {"architectures": [KIMI_LINEAR.cls], "model_type": KIMI_LINEAR.model_type, "vocab_size": cfg.vocab_size,
         "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
         "num_key_value_heads": cfg.n_heads, "model_max_length": cfg.max_seq_len, "rms_norm_eps": cfg.norm.eps,
         "hidden_act": "silu", "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.init_std,
         "attention_dropout": 0.0, "use_cache": True, "dtype": "float32", "pad_token_id": None, "bos_token_id": None,
         "eos_token_id": None, "layer_types": types, "mlp_layer_types": ["dense"] * k + ["sparse"] * (cfg.n_layers - k),
         "intermediate_size": (dense or moe).hidden}
    if kda is not None:
        c.update(linear_num_heads=kda.n_v_heads, linear_head_dim=kda.qk_dim,
                 linear_conv_kernel_dim=kda.conv.kernel_size)
        c["linear_attn_config"] = {
            "num_heads": kda.n_v_heads, "head_dim": kda.qk_dim, "short_conv_kernel_size": kda.conv.kernel_size,
            "kda_layers": [i + 1 for i, t in enumerate(types) if t == HF_LINEAR_ATTENTION],
            "full_attn_layers": [i + 1 for i, t in enumerate(types) if t == HF_FULL_ATTENTION]}
    if mla is not None:
        c.update(q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank, qk_nope_head_dim=mla.dn,
                 qk_rope_head_dim=mla.dr, v_head_dim=mla.dv, head_dim=mla.dr, attention_bias=mla.cfg.bias,
                 mla_use_nope=True)
    if moe is not None:
        f = cfg.ffn
        c.update(num_experts=moe.n_experts, num_experts_per_token=moe.top_k, moe_intermediate_size=moe.hidden,
                 num_expert_group=f.n_group or 1, topk_group=f.topk_group or 1, num_shared_experts=f.n_shared_experts,
                 routed_scaling_factor=f.routed_scaling_factor, moe_renormalize=f.norm_topk_prob,
                 moe_router_activation_func="sigmoid", output_router_logits=False)
    return c
