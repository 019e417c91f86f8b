"""transformers interchange (attnzoo.interop.hf): import tiny random-init transformers checkpoints saved with
save_pretrained, export attnzoo models and read them back with AutoModelForCausalLM, refusals in one line,
and `model.init_from` through train(). fp32 throughout; logits within 10x the computation's own fp32-vs-fp64 gap (conftest.fp32_atol)."""
from __future__ import annotations

import csv
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from attnzoo.cli import export  # noqa: E402
from attnzoo.interop import hf  # noqa: E402
from attnzoo.config.schema import resolve_model  # noqa: E402
from attnzoo.config.errors import ConfigError  # noqa: E402
from attnzoo.models.decoder import DecoderLM  # noqa: E402

from tests.conftest import compose_cfg, fp32_atol  # noqa: E402

V = 97
RTOL = 1e-5  # absolute tolerances: conftest.fp32_atol (10x this computation's own fp32-vs-fp64 gap)
COMMON = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)
MOE = dict(experts_implementation="eager")


def widen(model, seed: int = 0) -> None:
    """Random-init weights are tiny (std 0.02): widen them so that a wrong mapping would show."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)


def hf_forward(model, idx):
    # an all-linear Qwen3-Next cannot build transformers' cache (it needs one attention layer): no cache here
    with torch.no_grad():
        return model(input_ids=idx, use_cache=False).logits


# name -> a tiny random-init transformers model of that architecture
HF_CASES = {
    "llama-gqa": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)),
    "llama-mha-bias-tied-llama3rope": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **{**COMMON, "num_key_value_heads": 4, "tie_word_embeddings": True}, attention_bias=True, mlp_bias=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8})),
    "qwen2-mqa": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**{**COMMON,
                                                                                   "num_key_value_heads": 1})),
    "qwen3-gqa": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**COMMON, head_dim=8)),
    "qwen3-mqa-bias-tied": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **{**COMMON, "num_key_value_heads": 1, "tie_word_embeddings": True}, head_dim=8, attention_bias=True)),
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **COMMON, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[0],
        **MOE)),
    "mistral-swa4": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**COMMON, sliding_window=4)),
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **COMMON, num_local_experts=4, num_experts_per_tok=2, **MOE)),
    "deepseek_v3-mla-moe": lambda: transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4}, kv_lora_rank=16, q_lora_rank=12, qk_rope_head_dim=4,
        qk_nope_head_dim=8, v_head_dim=6, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
        n_group=2, topk_group=1, moe_intermediate_size=16, n_shared_experts=1, routed_scaling_factor=2.5, **MOE)),
    "deepseek_v3-mla-dense": lambda: transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4}, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4,
        qk_nope_head_dim=8, v_head_dim=6, first_k_dense_replace=2, rope_interleave=False)),
    "qwen3_next-gdn-moe": lambda: transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
        **COMMON, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
        layer_types=["linear_attention"] * 2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, mlp_only_layers=[0], **MOE)),
    # hybrids: gated attention layers (q/k norm, output gate, partial rotary) between the GDN layers
    "qwen3_next-hybrid": lambda: transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
        **{**COMMON, "num_hidden_layers": 4}, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=6, num_experts=0)),  # layer_types: 3 linear, 1 full
    "qwen3_next-hybrid-moe-bias": lambda: transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
        **{**COMMON, "num_key_value_heads": 1}, head_dim=8, attention_bias=True, linear_num_key_heads=2,
        linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        layer_types=["full_attention", "linear_attention"], num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=24, mlp_only_layers=[0],
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}, **MOE)),
    # Mamba2ForCausalLM: no FFN, no positions; B and C in 2 groups, chunks of 8 (the test sequences cross them)
    "mamba2-groups2": lambda: transformers.Mamba2ForCausalLM(transformers.Mamba2Config(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_heads=8, head_dim=8, expand=2, state_size=16,
        n_groups=2, conv_kernel=4, chunk_size=8, layer_norm_epsilon=1e-5, tie_word_embeddings=False)),
}


def save_hf(model, path):
    model.save_pretrained(path)
    return path


def import_dir(path) -> DecoderLM:
    section = hf.config_from_hf(hf.read_hf_config(path))
    ours = DecoderLM(resolve_model(section, vocab_size=section["vocab_size"])).eval()
    hf.load_hf_weights(ours, hf.read_hf_state_dict(path))
    return ours


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_import_logits_equal_transformers(case, tmp_path):
    ref = HF_CASES[case]().eval()
    widen(ref)
    if case.startswith("deepseek_v3-mla-moe"):  # a non-zero selection bias, so that it must be carried over
        with torch.no_grad():
            ref.model.layers[1].mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
    ours = import_dir(save_hf(ref, tmp_path / case))
    idx = torch.randint(0, V, (2, 13), generator=torch.Generator().manual_seed(1))
    want = hf_forward(ref, idx)
    got, atol = fp32_atol(ours, lambda m: m(idx))
    assert want.abs().max() > 1.0  # not two near-zero tensors
    torch.testing.assert_close(got, want, atol=atol, rtol=RTOL)


@pytest.mark.parametrize("case", ["qwen3-gqa", "qwen3_next-hybrid", "mamba2-groups2"])
def test_import_cached_decode_equals_transformers(case, tmp_path):
    """q/k norms and Qwen3-Next's gated attention through the caches: prefill 9 tokens, then decode 7 one at
    a time on both sides (transformers with its own cache: KV for attention, conv + recurrent state for GDN and
    Mamba-2)."""
    ref = HF_CASES[case]().eval()
    widen(ref)
    check_cached_decode(ref, import_dir(save_hf(ref, tmp_path / case)))


def check_cached_decode(ref, ours) -> None:
    """Prefill 9 tokens then decode 7 one at a time, transformers through its own cache and ours through ours:
    the logits within the fp32 gap."""
    from tests.test_hf_parity_attention import CACHE_KW, hf_cache

    idx = torch.randint(0, V, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = ref(input_ids=idx[:, :9], use_cache=True)
        want = [out.logits]
        for t in range(9, 16):
            out = ref(input_ids=idx[:, t: t + 1], use_cache=True, **{CACHE_KW: hf_cache(out)})
            want.append(out.logits)

    def decode(m):
        cache = m.new_cache(1, 16, dtype=m.embed.weight.dtype)
        return torch.cat([m(idx[:, :9], cache=cache)] + [m(idx[:, t: t + 1], cache=cache) for t in range(9, 16)], 1)

    got, atol = fp32_atol(ours, decode)
    torch.testing.assert_close(got, torch.cat(want, 1), atol=atol, rtol=RTOL)


def test_sharded_checkpoint_is_read(tmp_path):
    ref = HF_CASES["llama-gqa"]().eval()
    widen(ref)
    ref.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(list(tmp_path.glob("*.safetensors"))) > 1
    idx = torch.randint(0, V, (1, 9))
    got, atol = fp32_atol(import_dir(tmp_path), lambda m: m(idx))
    torch.testing.assert_close(got, hf_forward(ref, idx), atol=atol, rtol=RTOL)


# ----------------------------------------------------------------------------- export round trip

TINY = {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "tie_embeddings": False, "max_seq_len": 64,
        "ffn": {"name": "swiglu", "d_ff": 64}}
MOE_FFN = {"name": "moe", "n_experts": 4, "top_k": 2, "d_ff": 16}
EXPORT_CASES = {  # name -> (attnzoo model section, the transformers class it becomes)
    "gqa": ({**TINY}, "LlamaForCausalLM"),
    "mha-tied": ({**TINY, "mixer": {"name": "mha"}, "tie_embeddings": True}, "LlamaForCausalLM"),
    "mqa-qkv_bias": ({**TINY, "mixer": {"name": "mqa", "qkv_bias": True}}, "Qwen2ForCausalLM"),
    "sliding_window": ({**TINY, "mixer": {"name": "sliding_window", "window": 3}}, "MistralForCausalLM"),
    "gqa-moe": ({**TINY, "ffn": MOE_FFN}, "MixtralForCausalLM"),
    "gqa-qknorm": ({**TINY, "mixer": {"name": "gqa", "qk_norm": True}}, "Qwen3ForCausalLM"),
    "mha-qknorm-bias-tied": ({**TINY, "mixer": {"name": "mha", "qk_norm": True, "qkv_bias": True, "out_bias": True},
                              "tie_embeddings": True}, "Qwen3ForCausalLM"),
    "gqa-qknorm-moe": ({**TINY, "mixer": {"name": "gqa", "qk_norm": True},
                        "ffn": {**MOE_FFN, "norm_topk_prob": False, "first_k_dense": 1, "dense_d_ff": 48}},
                       "Qwen3MoeForCausalLM"),
    "sliding_window-moe": ({**TINY, "mixer": {"name": "sliding_window", "window": 4}, "ffn": MOE_FFN},
                           "MixtralForCausalLM"),
    "mla-moe": ({**TINY, "mixer": {"name": "mla", "q_lora_rank": 12, "kv_lora_rank": 16, "qk_rope_head_dim": 4,
                                   "qk_nope_head_dim": 8, "v_head_dim": 6, "rope_interleave": True},
                 "ffn": {**MOE_FFN, "scoring": "sigmoid", "n_group": 2, "topk_group": 1, "n_shared_experts": 1,
                         "routed_scaling_factor": 2.5, "first_k_dense": 1, "dense_d_ff": 48}},
                "DeepseekV3ForCausalLM"),
    "gdn-moe": ({**TINY, "position": {"name": "none"},
                 "mixer": {"name": "gated_deltanet", "n_heads": 2, "n_v_heads": 4, "head_dim": 8, "v_head_dim": 6},
                 "ffn": {**MOE_FFN, "shared_d_ff": 24, "shared_expert_gate": True, "first_k_dense": 1}},
                "Qwen3NextForCausalLM"),
    "gdn-dense": ({**TINY, "mixer": {"name": "gated_deltanet", "n_heads": 2, "head_dim": 8}}, "Qwen3NextForCausalLM"),
    "gdn-gqa-hybrid": ({**TINY, "n_layers": 4, "pattern": ["gdn", "gdn", "gdn", "attn"],
                        "position": {"name": "rope", "rotary_fraction": 0.25},
                        "mixers": {"gdn": {"name": "gated_deltanet", "n_heads": 2, "n_v_heads": 4, "head_dim": 8,
                                           "v_head_dim": 6},
                                   "attn": {"name": "gqa", "qk_norm": True, "output_gate": True}}},
                       "Qwen3NextForCausalLM"),
    "mqa-gdn-hybrid-bias-moe": ({**TINY, "pattern": ["attn", "gdn"], "position": {"name": "rope", "rotary_fraction": 0.5},
                                 "mixers": {"gdn": {"name": "gated_deltanet", "n_heads": 2, "head_dim": 8},
                                            "attn": {"name": "mqa", "qk_norm": True, "output_gate": True,
                                                     "qkv_bias": True, "out_bias": True}},
                                 "ffn": {**MOE_FFN, "shared_d_ff": 24, "shared_expert_gate": True, "first_k_dense": 1}},
                                "Qwen3NextForCausalLM"),
    "mamba2": ({**TINY, "position": {"name": "none"}, "ffn": {"name": "none"}, "norm": {"name": "rmsnorm", "eps": 1e-5},
                "mixer": {"name": "mamba2", "head_dim": 8, "d_state": 16, "n_groups": 2, "chunk_size": 8}},
               "Mamba2ForCausalLM"),
    "mamba2-tied-nobias": ({**TINY, "position": {"name": "none"}, "ffn": {"name": "none"}, "tie_embeddings": True,
                            "norm": {"name": "rmsnorm", "eps": 1e-5},
                            "mixer": {"name": "mamba2", "head_dim": 16, "d_state": 8, "conv_bias": False,
                                      "chunk_size": 4}},
                           "Mamba2ForCausalLM"),
}


def our_model(section: dict, seed: int = 0) -> DecoderLM:
    torch.manual_seed(seed)
    model = DecoderLM(section, vocab_size=V).eval()
    widen(model, seed)
    for b in model.blocks:  # DeepSeek-V3's selection bias travels too
        if section["ffn"].get("scoring") == "sigmoid" and hasattr(b.ffn, "expert_bias"):
            b.ffn.expert_bias.normal_(0.0, 0.1)
    return model


@pytest.mark.parametrize("case", sorted(EXPORT_CASES))
def test_export_round_trip(case, tmp_path):
    section, cls = EXPORT_CASES[case]
    ours = our_model(section)
    hf.export_model(ours, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [cls]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(theirs).__name__ == cls
    idx = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(2))
    want, atol = fp32_atol(ours, lambda m: m(idx))
    got = hf_forward(theirs, idx)
    assert want.abs().max() > 1.0
    torch.testing.assert_close(got, want, atol=atol, rtol=RTOL)
    # greedy decoding picks the same tokens (all-linear Qwen3-Next: transformers' cache needs an attention layer)
    theirs.generation_config.eos_token_id = None
    prompt = idx[:, :5]
    ref = theirs.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0,
                          use_cache=cls != "Qwen3NextForCausalLM" or bool(section.get("pattern")))
    assert torch.equal(ours.generate(prompt, 8, temperature=0.0), ref)
    # and back: importing the export gives the same tensors
    again = import_dir(tmp_path)
    for k, v in ours.state_dict().items():
        # copies, except Qwen3-Next's zero-centred norms (w - 1 out, + 1 back): one fp32 rounding at size 1
        torch.testing.assert_close(again.state_dict()[k], v, atol=torch.finfo(torch.float32).eps, rtol=0, msg=k)


# ----------------------------------------------------------------------------- refusals, one line each


def one_line(err: pytest.ExceptionInfo, *needles: str) -> str:
    msg = str(err.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, msg
    return msg


@pytest.mark.parametrize("section,needles", [
    ({**TINY, "mixer": {"name": "linear_attention"}}, ["model.mixer.name", "linear_attention"]),
    ({**TINY, "mixer": {"name": "deltanet"}}, ["model.mixer.name", "deltanet"]),
    ({**TINY, "mixer": {"name": "nsa", "block_size": 4, "block_counts": 3, "window": 4}}, ["model.mixer.name", "nsa"]),
    ({**TINY, "mixer": {"name": "moba", "block_size": 4, "topk": 2}}, ["model.mixer.name", "moba"]),
    ({**TINY, "position": {"name": "alibi"}}, ["model.position.name", "alibi"]),
    ({**TINY, "position": {"name": "learned"}}, ["model.position.name"]),
    ({**TINY, "norm": {"name": "layernorm"}}, ["model.norm.name", "layernorm"]),
    ({**TINY, "norm_position": "post"}, ["model.norm_position", "post"]),
    ({**TINY, "mixer": {"name": "gqa", "conv_size": 3}}, ["model.mixer.conv_size"]),
    ({**TINY, "ffn": {"name": "mlp"}}, ["model.ffn.name", "mlp"]),
    ({**TINY, "position": {"name": "rope", "rotary_fraction": 0.5}}, ["model.position.rotary_fraction"]),
    ({**TINY, "pattern": ["gated_deltanet", "gqa"]}, ["model.mixers.gqa.qk_norm", "Qwen3-Next"]),
    ({**TINY, "pattern": ["gated_deltanet", "sliding_window"]}, ["model.pattern", "Qwen3-Next"]),
    ({**TINY, "mixer": {"name": "gqa", "qk_norm": True, "output_gate": True}}, ["model.mixer.output_gate"]),
    ({**TINY, "position": {"name": "rope", "rotary_fraction": 0.25}, "pattern": ["gdn", "attn"],
      "mixers": {"gdn": {"name": "gated_deltanet", "n_heads": 2, "head_dim": 8},
                 "attn": {"name": "gqa", "qk_norm": True}}}, ["model.mixers.attn.output_gate", "Qwen3-Next"]),
    ({**TINY, "mixer": {"name": "sliding_window", "window": 4, "qk_norm": True}}, ["model.mixer.qk_norm", "Qwen3"]),
    ({**TINY, "mixer": {"name": "gqa", "qk_norm": True, "qkv_bias": True}}, ["model.mixer.out_bias", "Qwen3"]),
    ({**TINY, "mixer": {"name": "gqa", "qk_norm": True}, "ffn": {**MOE_FFN, "n_shared_experts": 1}},
     ["model.ffn.n_shared_experts", "Qwen3-MoE"]),
    ({**TINY, "ffn": {**MOE_FFN, "scoring": "sigmoid"}}, ["model.ffn.scoring", "Mixtral"]),
    ({**TINY, "ffn": {**MOE_FFN, "n_shared_experts": 1}}, ["model.ffn.n_shared_experts", "Mixtral"]),
    ({**TINY, "mixer": {"name": "gated_deltanet", "n_heads": 2, "head_dim": 8}, "ffn": MOE_FFN},
     ["model.ffn.shared_expert_gate", "Qwen3-Next"]),
    ({**TINY, "position": {"name": "none"}, "mixer": {"name": "mamba2"}}, ["model.ffn.name", "Mamba2ForCausalLM"]),
    ({**TINY, "ffn": {"name": "none"}, "mixer": {"name": "mamba2"}}, ["model.position.name", "Mamba2ForCausalLM"]),
    ({**TINY, "ffn": {"name": "none"}, "position": {"name": "none"}, "mixer": {"name": "mamba2", "norm_eps": 1e-3}},
     ["model.mixer.norm_eps", "layer_norm_epsilon"]),
    ({**TINY, "ffn": {"name": "none"}, "position": {"name": "none"}, "pattern": ["mamba2", "gqa"]},
     ["mamba2", "Mamba2ForCausalLM"]),
])
def test_export_refusals(section, needles, tmp_path):
    with pytest.raises(ConfigError) as err:
        hf.export_model(DecoderLM(section, vocab_size=V), tmp_path / "out")
    one_line(err, *needles, "no transformers architecture")
    assert not (tmp_path / "out").exists()  # refused before anything is written


def _config_json(tmp_path, config) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict() if hasattr(config, "to_dict") else config))
    return str(tmp_path)


@pytest.mark.parametrize("make,needles", [
    (lambda: transformers.Qwen3Config(**COMMON, use_sliding_window=True, sliding_window=8), ["use_sliding_window"]),
    (lambda: transformers.Qwen3MoeConfig(**COMMON, num_experts=4, mlp_only_layers=[1]), ["mlp_only_layers"]),
    (lambda: transformers.Qwen3NextConfig(**COMMON, layer_types=["full_attention"] * 2),
     ["layer_types", "full_attention"]),
    (lambda: transformers.LlamaConfig(**COMMON, hidden_act="gelu"), ["hidden_act", "gelu"]),
    (lambda: transformers.LlamaConfig(**COMMON, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4,
                                                                  "factor": 2.0}),
     ["rope_type", "yarn"]),
    (lambda: transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=8), ["use_sliding_window"]),
    (lambda: transformers.GPT2Config(), ["model_type", "gpt2"]),
    (lambda: {"model_type": "mamba"}, ["model_type", "mamba", "allowed: llama"]),
    (lambda: transformers.Mamba2Config(hidden_size=32, num_heads=8, head_dim=8, use_bias=True), ["use_bias"]),
    (lambda: transformers.Mamba2Config(hidden_size=32, num_heads=8, head_dim=8, time_step_limit=(0.0, 1.0)),
     ["time_step_limit"]),
])
def test_import_refusals(make, needles):
    with pytest.raises(ConfigError) as err:
        hf.config_from_hf(make())
    one_line(err, *needles, "config.json:")


def test_import_refuses_unused_tensors_and_bad_dirs(tmp_path):
    ref = HF_CASES["llama-gqa"]()
    ref.save_pretrained(tmp_path / "m")
    section = hf.config_from_hf(hf.read_hf_config(tmp_path / "m"))
    sd = hf.read_hf_state_dict(tmp_path / "m")
    sd["model.layers.0.self_attn.q_norm.weight"] = torch.ones(8)  # a Qwen3-style tensor attnzoo has no place for
    with pytest.raises(ConfigError) as err:
        hf.load_hf_weights(DecoderLM(resolve_model(section, vocab_size=V)), sd)
    one_line(err, "model.init_from", "q_norm")
    with pytest.raises(ConfigError) as err:
        hf.read_hf_config(tmp_path / "nope")
    one_line(err, "model.init_from", "not a directory")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ConfigError) as err:
        hf.safetensors_files(tmp_path / "bin")
    one_line(err, "model.init_from", "pytorch_model.bin")


# ----------------------------------------------------------------------------- tokenizers


SAMPLE = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\tünïcode ✓"


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_tokenizer_export_reads_back_with_autotokenizer(kind, tmp_path):
    from attnzoo.data.tokenizer import BPETokenizer, CharTokenizer

    text = SAMPLE * 20
    tok = CharTokenizer.train(text[:-3]) if kind == "char" else BPETokenizer.train(text, 300)  # char: '✓' unknown
    eos = hf.write_tokenizer(tok, tmp_path, 64)
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert auto.encode(SAMPLE, add_special_tokens=False) == tok.encode(SAMPLE)
    assert eos == 0 and auto.eos_token_id == 0
    ids = tok.encode(SAMPLE[:-2])
    assert auto.decode(ids) == tok.decode(ids)


# ----------------------------------------------------------------------------- model.init_from through train()


def _init_overrides(src, out, steps=4):
    return [f"model.init_from={src}", "debug=smoke", "data=mqar", f"data.vocab_size={V}", "data.train_size=64",
            "data.val_size=16", f"trainer.max_steps={steps}", "trainer.val_check_interval=2",
            "perf.measure_decode=false",
            "sample.max_new_tokens=0", "logger=csv", f"paths.output_dir={out}"]


def test_init_from_trains_from_the_imported_weights_then_exports(tmp_path):
    """model.init_from=DIR through train(): the model built for training equals the transformers model
    (logits and first-batch loss), a few steps run, and the run exports back to a transformers directory."""
    import lightning as L
    import torch.nn.functional as F

    from attnzoo.training.build import build_module, prepare_data
    from attnzoo.training.run import train
    from attnzoo.training.config_checks import validate

    ref = HF_CASES["llama-gqa"]().eval()
    widen(ref)
    src = save_hf(ref, tmp_path / "hf")
    cfg = hf.apply_init_from(compose_cfg(_init_overrides(src, tmp_path / "run")), overrides=[])
    assert cfg.model.n_layers == 2 and cfg.model.d_model == 32 and cfg.model.mixer.name == "gqa"

    # the model train() builds, before any step: the transformers model's logits and loss
    parts = validate(cfg)
    container = __import__("omegaconf").OmegaConf.to_container(cfg, resolve=True)
    L.seed_everything(parts["run"].seed, verbose=False)
    dm, _ = prepare_data(parts, container)
    _, lit = build_module(container, dm, parts["run"])
    x, y, mask = next(iter(dm.val_dataloader()))[:3]
    want = hf_forward(ref, x)
    got, atol = fp32_atol(lit.model, lambda m: m(x))
    torch.testing.assert_close(got, want, atol=atol, rtol=RTOL)
    ce = F.cross_entropy(want.view(-1, V), y.reshape(-1), reduction="none")
    hf_loss = (ce * mask.reshape(-1)).sum() / mask.sum()
    # |d CE / d logits|_1 <= 2: logits within atol move the mean cross-entropy by at most 2 atol
    with torch.no_grad():
        torch.testing.assert_close(lit._loss((x, y, mask))[0], hf_loss, atol=2 * atol, rtol=RTOL)

    # then training proceeds as usual
    metrics = train(compose_cfg(_init_overrides(src, tmp_path / "run")))
    assert metrics["params/total"] == sum(p.numel() for p in ref.parameters())
    rows = list(csv.DictReader(open(tmp_path / "run" / "csv" / "metrics.csv")))
    assert any(r.get("train/loss") for r in rows)

    # and the fine-tuned run goes back to transformers (synthetic data: no tokenizer, weights and config)
    export.main([str(tmp_path / "run"), str(tmp_path / "export")])
    model, tokenizer, _ = export.load_run_model(tmp_path / "run")
    assert tokenizer is None and not (tmp_path / "export" / "tokenizer.json").exists()
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    ours, atol = fp32_atol(model, lambda m: m(x))
    torch.testing.assert_close(hf_forward(back, x), ours, atol=atol, rtol=RTOL)
    assert not torch.allclose(ours, want)  # the steps changed the weights


def test_init_from_refusals(tmp_path):
    ref = HF_CASES["llama-gqa"]()
    src = save_hf(ref, tmp_path / "hf")
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as err:  # a command-line override that contradicts config.json
        hf.apply_init_from(compose_cfg(_init_overrides(src, out) + ["model.n_layers=3"]),
                           overrides=["model.n_layers=3"])
    one_line(err, "model.n_layers", "contradicts")
    with pytest.raises(ConfigError) as err:  # a model preset would be silently replaced
        hf.apply_init_from(compose_cfg(_init_overrides(src, out) + ["model=moe"]), overrides=["model=moe"])
    one_line(err, "model=moe", "init_from")
    knob = hf.apply_init_from(compose_cfg(_init_overrides(src, out) + ["model.ffn.multiple_of=16"]),
                              overrides=["model.ffn.multiple_of=16"])  # keys config.json does not set: applied
    assert knob.model.ffn.multiple_of == 16 and knob.model.ffn.d_ff == 64
    again = hf.apply_init_from(knob, overrides=[])  # a derived config (a DDP worker's) is kept as it is
    assert again is knob and again.model.ffn.multiple_of == 16
    from attnzoo.training.run import train

    with pytest.raises(ConfigError) as err:  # a path that does not exist, before any work
        train(compose_cfg(_init_overrides(tmp_path / "missing", out)))
    one_line(err, "model.init_from", "not a directory")
    assert not out.exists()
    with pytest.raises(ConfigError) as err:  # the data's vocabulary must be the imported model's
        train(compose_cfg(_init_overrides(src, out) + ["data.vocab_size=128"]))
    one_line(err, "model.init_from", "vocab_size=97")


def test_export_cli_text_run_with_its_tokenizer(tmp_path):
    """attnzoo-export on a char-level text run: AutoTokenizer encodes as the run does, AutoModelForCausalLM
    gives the run's logits."""
    import attnzoo
    from attnzoo.training.run import train

    out = tmp_path / "run"
    train(compose_cfg(["debug=smoke", "data.tokenizer=char", "data.max_chars=20000", "model.n_layers=2",
                       "trainer.max_steps=2", "trainer.val_check_interval=2", "perf.measure_decode=false",
                       "sample.max_new_tokens=0", "logger=csv", f"paths.output_dir={out}"]))
    export.main([str(out), str(tmp_path / "export")])
    run = attnzoo.load(out)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    text = "def fib(n):\n    return n"
    assert tok.encode(text, add_special_tokens=False) == run.encode(text)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    x = torch.tensor([run.encode(text)])
    ours, atol = fp32_atol(run.model, lambda m: m(x))
    torch.testing.assert_close(hf_forward(theirs, x), ours, atol=atol, rtol=RTOL)
    with pytest.raises(SystemExit) as err:  # a non-empty output dir is refused (exit 2), nothing overwritten
        export.main([str(out), str(tmp_path / "export")])
    assert err.value.code == 2
