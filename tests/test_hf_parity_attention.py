"""Parity of the attention zoo with transformers' mature implementations (tiny random-init models).

GQA vs LlamaForCausalLM, GQA with per-head q/k RMSNorm (`qk_norm`) vs Qwen3ForCausalLM, sliding window vs
MistralForCausalLM, MLA vs DeepseekV3ForCausalLM (its attention is DeepseekV3Attention): our weights are copied from the HF model, then logits (full forward and cached
decode) must agree in fp32 to 10x the computation's own fp32-vs-fp64 gap and greedy generation must pick identical tokens.
Mapping: our QKV projection is fused [q | k | v]; our SwiGLU gate_up is fused [gate | up].
"""
from __future__ import annotations

import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attnzoo.models.decoder import DecoderLM  # noqa: E402

from tests.conftest import fp32_atol  # noqa: E402

D, H, KV, LAYERS, FF, V = 32, 4, 2, 2, 64, 97
RTOL = 1e-5  # fp32 vs fp32 in another summation order: rounding grows with |logit|
# absolute tolerances: tests.conftest.fp32_atol (10x this computation's own fp32-vs-fp64 gap, at least 1e-5)


def our_model(mixer: dict) -> DecoderLM:
    cfg = {
        "d_model": D, "n_layers": LAYERS, "n_heads": H, "n_kv_heads": KV, "tie_embeddings": False,
        "mixer": mixer, "ffn": {"name": "swiglu", "d_ff": FF}, "norm": {"name": "rmsnorm", "eps": 1e-6},
        "position": {"name": "rope", "theta": 10000.0},
    }
    return DecoderLM(cfg, vocab_size=V).eval()


def hf_common() -> dict:
    return dict(
        vocab_size=V, hidden_size=D, intermediate_size=FF, num_hidden_layers=LAYERS, num_attention_heads=H,
        num_key_value_heads=KV, rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def build_hf(cls, config, attn: str):
    config._attn_implementation = attn
    torch.manual_seed(0)
    model = cls(config).eval()
    model.generation_config.eos_token_id = None  # greedy runs the full length (ours has no EOS here)
    with torch.no_grad():  # random-init is tiny (std 0.02): widen it so differences would show
        for p in model.parameters():
            p.normal_(0.0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return model


@torch.no_grad()
def copy_common(ours: DecoderLM, hf) -> None:
    """Embedding, norms, SwiGLU, head: identical structure in every decoder here."""
    base = hf.model
    ours.embed.weight.copy_(base.embed_tokens.weight)
    ours.norm.weight.copy_(base.norm.weight)
    ours.lm_head.weight.copy_(hf.lm_head.weight)
    for block, layer in zip(ours.blocks, base.layers):
        block.norm1.weight.copy_(layer.input_layernorm.weight)
        block.norm2.weight.copy_(layer.post_attention_layernorm.weight)
        mlp = layer.mlp
        block.ffn.gate_up.weight.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], dim=0))
        block.ffn.down.weight.copy_(mlp.down_proj.weight)


@torch.no_grad()
def copy_attention(ours: DecoderLM, hf) -> None:
    for block, layer in zip(ours.blocks, hf.model.layers):
        a = layer.self_attn
        block.mixer.qkv.weight.copy_(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], dim=0))
        block.mixer.o_proj.weight.copy_(a.o_proj.weight)
        if getattr(a, "q_norm", None) is not None:  # Qwen3: per-head RMSNorm of q and k, weights of size head_dim
            block.mixer.q_norm.weight.copy_(a.q_norm.weight)
            block.mixer.k_norm.weight.copy_(a.k_norm.weight)


@torch.no_grad()
def copy_mla(ours: DecoderLM, hf) -> None:
    names = ["q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    for block, layer in zip(ours.blocks, hf.model.layers):
        m, a = block.mixer, layer.self_attn
        for name in names:
            src = getattr(a, name, None)
            if src is None:
                continue
            dst = getattr(m, "kv_a_proj" if name == "kv_a_proj_with_mqa" else name)
            dst.weight.copy_(src.weight)
        if a.q_a_layernorm is not None:
            m.q_a_norm.weight.copy_(a.q_a_layernorm.weight)
        m.kv_a_norm.weight.copy_(a.kv_a_layernorm.weight)


# transformers 5.x renamed `past_key_values` to `cache` (input and output); accept both
CACHE_KW = "cache" if "cache" in inspect.signature(transformers.LlamaForCausalLM.forward).parameters else "past_key_values"


def hf_cache(out):
    return getattr(out, "cache", None) or out.past_key_values


def hf_llama(attn):
    return build_hf(transformers.LlamaForCausalLM, transformers.LlamaConfig(**hf_common()), attn)


def hf_qwen3(attn):
    config = transformers.Qwen3Config(**hf_common(), head_dim=D // H)  # Qwen3's head_dim defaults to 128
    return build_hf(transformers.Qwen3ForCausalLM, config, attn)


def hf_mistral(attn, window):
    return build_hf(transformers.MistralForCausalLM, transformers.MistralConfig(**hf_common(), sliding_window=window), attn)


def hf_deepseek(attn, q_lora_rank, interleave):
    config = transformers.DeepseekV3Config(
        **{**hf_common(), "num_key_value_heads": H}, kv_lora_rank=16, q_lora_rank=q_lora_rank, qk_rope_head_dim=4, qk_nope_head_dim=8,
        v_head_dim=6, first_k_dense_replace=LAYERS, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, rope_interleave=interleave,
    )
    return build_hf(transformers.DeepseekV3ForCausalLM, config, attn)


# name -> (build the HF model, our mixer config, copy the attention weights)
CASES = {
    "gqa-llama-eager": (lambda: hf_llama("eager"), {"name": "gqa"}, copy_attention),
    "gqa-llama-sdpa": (lambda: hf_llama("sdpa"), {"name": "gqa"}, copy_attention),
    "gqa-qknorm-qwen3-eager": (lambda: hf_qwen3("eager"), {"name": "gqa", "qk_norm": True}, copy_attention),
    "gqa-qknorm-qwen3-sdpa": (lambda: hf_qwen3("sdpa"), {"name": "gqa", "qk_norm": True}, copy_attention),
    "swa5-mistral-sdpa": (lambda: hf_mistral("sdpa", 5), {"name": "sliding_window", "window": 5}, copy_attention),
    "swa3-mistral-eager": (lambda: hf_mistral("eager", 3), {"name": "sliding_window", "window": 3}, copy_attention),
    "mla-deepseek-interleave": (
        lambda: hf_deepseek("eager", None, True),
        {"name": "mla", "kv_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 8, "v_head_dim": 6,
         "rope_interleave": True},
        copy_mla,
    ),
    "mla-qlora-deepseek-halves": (
        lambda: hf_deepseek("sdpa", 12, False),
        {"name": "mla", "q_lora_rank": 12, "kv_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 8,
         "v_head_dim": 6, "rope_interleave": False},
        copy_mla,
    ),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request):
    build, mixer, copy_mixer = CASES[request.param]
    hf = build()
    ours = our_model(mixer)
    copy_common(ours, hf)
    copy_mixer(ours, hf)
    return ours, hf


def test_logits_match_full_forward(pair):
    ours, hf = pair
    idx = torch.randint(0, V, (2, 14), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(input_ids=idx).logits
    got, atol = fp32_atol(ours, lambda m: m(idx))
    assert ref.abs().max() > 1.0  # the comparison is not between two near-zero tensors
    torch.testing.assert_close(got, ref, atol=atol, rtol=RTOL)


def test_logits_match_cached_decode(pair):
    """Prefill 9 tokens, then decode 7 one at a time, on both sides (HF with its own cache)."""
    ours, hf = pair
    idx = torch.randint(0, V, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = hf(input_ids=idx[:, :9], use_cache=True)
        ref = [out.logits]
        for t in range(9, 16):
            out = hf(input_ids=idx[:, t : t + 1], use_cache=True, **{CACHE_KW: hf_cache(out)})
            ref.append(out.logits)

    def decode(m):
        cache = m.new_cache(1, 16, dtype=m.embed.weight.dtype)
        return torch.cat([m(idx[:, :9], cache=cache)] + [m(idx[:, t : t + 1], cache=cache) for t in range(9, 16)], 1)

    got, atol = fp32_atol(ours, decode)
    torch.testing.assert_close(got, torch.cat(ref, 1), atol=atol, rtol=RTOL)


def test_greedy_tokens_identical(pair):
    ours, hf = pair
    idx = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf.generate(idx, max_new_tokens=12, do_sample=False, pad_token_id=0)
    got = ours.generate(idx, 12, temperature=0.0)
    assert torch.equal(got, ref)
