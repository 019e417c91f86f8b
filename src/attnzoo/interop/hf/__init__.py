"""Hugging Face transformers interchange: import a local transformers checkpoint, export a run to one.

    model.init_from=/path/to/hf_dir          (attnzoo-train) the model config from its config.json, the
                                             weights from its *.safetensors, then training as usual
    attnzoo-export RUN_DIR OUT_DIR           a save_pretrained-style directory: config.json,
                                             model.safetensors, tokenizer files (text runs)

    config_from_hf(config.json dict) -> attnzoo `model` section      load_hf_weights(model, state_dict)
    hf_config(model) -> config.json dict                             hf_state_dict(model) -> state dict

Architectures (docs/hf.md has the table, the measured parity and the departures):

    transformers              attnzoo
    LlamaForCausalLM          mha / gqa / mqa + swiglu  (attention_bias: qkv_bias + out_bias, mlp_bias)
    Qwen2ForCausalLM          mha / gqa / mqa with qkv_bias (no out_bias) + swiglu
    Qwen3ForCausalLM          mha / gqa / mqa with qk_norm (attention_bias: qkv_bias + out_bias) + swiglu
    Qwen3MoeForCausalLM       the same + moe (softmax top-k, norm_topk_prob, mlp_only_layers = first_k_dense)
    MistralForCausalLM        sliding_window + swiglu          (sliding_window: null imports as gqa)
    MixtralForCausalLM        gqa / sliding_window + moe (softmax top-k, renormalised)
    DeepseekV3ForCausalLM     mla + swiglu / moe (sigmoid, groups, shared experts, first_k_dense, bias)
    DeepseekV32ForCausalLM    dsa (q_lora_rank, rope_interleave; its indexer) + DeepSeek-V3's swiglu / moe
    Qwen3NextForCausalLM      gated_deltanet in every layer, or GDN + attention (qk_norm, output_gate) hybrids
                              + swiglu / moe (gated shared expert)
    KimiLinearForCausalLM     kda and / or mla (NoPE: position none) in layer_types' order (<-> pattern)
                              + DeepSeek-V3's swiglu / moe (shared experts required); never tied embeddings
    Mamba2ForCausalLM         mamba2 in every layer, no FFN, no positions

Only local directories are read (config.json + model.safetensors or a sharded index; never the hub, never
pickles). One set of rules per architecture maps tensor names both ways (`weights._rules`): attnzoo fuses
[q | k | v] and SwiGLU's [gate | up], stores expert weights input-major, and Qwen3-Next stores its RMSNorm
weights as w - 1 and interleaves its GDN projections per key head; Kimi Linear keeps q / k / v and their convs
apart and its checkpoints use Moonshot's names (`Arch.aliases`: other names a tensor may have). Anything without
an exact equivalent is refused in one line naming the field (`ConfigError`), never imported or exported
approximately. config.json export: export_configs.py (re-exported by configs.py).
"""
from attnzoo.interop.hf.archs import ARCHS, FIELD, Arch, arch_for
from attnzoo.interop.hf.convert import (apply_init_from, check_init_vocab, export_model, hf_tokenizer_json,
                                        init_weights_from, write_tokenizer)
from attnzoo.interop.hf.configs import config_from_hf, hf_config
from attnzoo.interop.hf.weights import hf_state_dict, load_hf_weights, read_hf_config, read_hf_state_dict, safetensors_files

__all__ = ["ARCHS", "FIELD", "Arch", "apply_init_from", "arch_for", "check_init_vocab", "config_from_hf",
           "export_model", "hf_config", "hf_state_dict", "hf_tokenizer_json", "init_weights_from", "load_hf_weights",
           "read_hf_config", "read_hf_state_dict", "safetensors_files", "write_tokenizer"]
