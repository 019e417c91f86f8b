"""transformers' KimiLinearForCausalLM through interop/hf: KDA layers (`kda`) and NoPE MLA layers (`mla`, its
layer_types <-> model.pattern) with DeepSeek-V3's sigmoid MoE (routing groups, a shared expert, a dense first layer,
a selection bias). A tiny random-init checkpoint saved with save_pretrained is imported as `model.init_from` does
(config_from_hf + load_hf_weights): logits within 10x our fp32-vs-fp64 gap (conftest.fp32_atol), the same through
both caches, the same greedy tokens; attnzoo models exported (attnzoo-export's export_model) and read back by
transformers' own loader: the same logits and greedy tokens, and imported again tensor for tensor; what does not map
is refused in one line naming the field. The KDA layer alone: tests/test_kda.py."""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.kimi_linear")
pytest.importorskip("safetensors")

from attnzoo.config.errors import ConfigError  # noqa: E402
from attnzoo.interop import hf  # noqa: E402
from attnzoo.models.decoder import DecoderLM  # noqa: E402
from tests.conftest import fp32_atol  # noqa: E402
from tests.test_hf_io import (RTOL, V, check_cached_decode, hf_forward, import_dir, one_line, our_model,  # noqa: E402
                              widen)

LINEAR, FULL = "linear_attention", "full_attention"  # KimiLinearConfig.layer_types: KDA, MLA


def _hf_config(**over) -> "transformers.KimiLinearConfig":
    """4 layers [KDA, KDA, MLA, KDA] (Kimi Linear's 3:1, no shorter period), KDA 4 heads of 8 with a conv of 3, MLA
    without a query latent (as Kimi-Linear-48B), layer 0 dense, then 4 experts top-2 in 2 groups + 1 shared."""
    kw = dict(vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4,
              qk_nope_head_dim=8, v_head_dim=6, num_local_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
              n_shared_experts=1, routed_scaling_factor=2.5, rms_norm_eps=1e-5, tie_word_embeddings=False,
              linear_attn_config={"num_heads": 4, "head_dim": 8, "short_conv_kernel_size": 3},
              layer_types=[LINEAR, LINEAR, FULL, LINEAR], mlp_layer_types=["dense"] + ["sparse"] * 3,
              pad_token_id=None, bos_token_id=None, eos_token_id=None, experts_implementation="eager")
    return transformers.KimiLinearConfig(**{**kw, **over})


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(transformers' model, its save_pretrained directory, ours imported from it)."""
    torch.manual_seed(0)
    ref = transformers.KimiLinearForCausalLM(_hf_config()).eval()
    widen(ref)
    with torch.no_grad():  # a non-zero selection bias, so that it must be carried over
        for layer in ref.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
    ref.generation_config.eos_token_id = None
    path = tmp_path_factory.mktemp("kimi")
    ref.save_pretrained(path)
    return ref, path, import_dir(path)


def test_import_logits_equal_transformers(imported):
    """20 tokens (past our KDA chunk of 16): logits within the fp32 gap; the layers are the ones layer_types names."""
    ref, path, ours = imported
    assert [type(m).__name__ for m in ours.mixers] == ["KimiDeltaAttention"] * 2 + ["MLA", "KimiDeltaAttention"]
    assert ours.cfg.pattern == ["delta", "delta", "latent", "delta"] and ours.cfg.position.name == "none"
    assert type(ours.blocks[0].ffn).__name__ == "SwiGLU" and ours.blocks[1].ffn.shared is not None
    idx = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(1))
    want = hf_forward(ref, idx)
    got, atol = fp32_atol(ours, lambda m: m(idx))
    assert want.abs().max() > 1.0  # not two near-zero tensors
    torch.testing.assert_close(got, want, atol=atol, rtol=RTOL)


def test_import_cached_decode_and_greedy_tokens_equal_transformers(imported):
    """Each side through its own cache (transformers: conv + recurrent state for KDA, the latent for MLA; ours the
    same): prefill 9 tokens then 7 one at a time, logits within the fp32 gap; and 10 greedy tokens from 2 prompts."""
    ref, _, ours = imported
    check_cached_decode(ref, ours)
    prompt = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        greedy = ref.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False,
                              pad_token_id=0)
    assert torch.equal(ours.generate(prompt, 10, temperature=0.0), greedy)


def test_moonshot_config_names_import_as_transformers_reads_them(imported):
    """Moonshot's config.json (no layer_types / mlp_layer_types: linear_attn_config's 1-indexed kda_layers /
    full_attn_layers and first_k_dense_replace) gives the same layers transformers builds, and the same section."""
    _, path, _ = imported
    saved = json.loads((path / "config.json").read_text())
    moonshot = {k: v for k, v in saved.items() if k not in ("layer_types", "mlp_layer_types", "linear_num_heads",
                                                             "linear_head_dim", "linear_conv_kernel_dim")}
    lac = {**saved["linear_attn_config"], "kda_layers": [1, 2, 4], "full_attn_layers": [3]}
    moonshot.update(first_k_dense_replace=1, moe_router_activation_func="sigmoid", mla_use_nope=True,
                    linear_attn_config=lac)
    theirs = transformers.KimiLinearConfig.from_dict(moonshot)
    assert theirs.layer_types == saved["layer_types"] and theirs.mlp_layer_types == saved["mlp_layer_types"]
    assert hf.config_from_hf(moonshot) == hf.config_from_hf(saved)


def test_tie_word_embeddings_imports_untied(tmp_path):
    """KimiLinearForCausalLM ties nothing whatever tie_word_embeddings says (its _tied_weights_keys is empty): its own
    lm_head is imported (tie_embeddings false). Also: every layer dense, [KDA, MLA] tiled as model.pattern."""
    torch.manual_seed(1)
    ref = transformers.KimiLinearForCausalLM(_hf_config(num_hidden_layers=2, layer_types=[LINEAR, FULL],
                                                        mlp_layer_types=["dense"] * 2, tie_word_embeddings=True)).eval()
    widen(ref)
    assert not torch.equal(ref.lm_head.weight, ref.model.embed_tokens.weight)
    ref.save_pretrained(tmp_path)
    ours = import_dir(tmp_path)
    assert not ours.cfg.tie_embeddings and ours.cfg.pattern == ["delta", "latent"] and ours.cfg.ffn.name == "swiglu"
    idx = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(1))
    got, atol = fp32_atol(ours, lambda m: m(idx))
    torch.testing.assert_close(got, hf_forward(ref, idx), atol=atol, rtol=RTOL)


# ----------------------------------------------------------------------------- export

KDA = {"name": "kda", "n_heads": 2, "head_dim": 8, "conv_size": 3}
MLA = {"name": "mla", "q_lora_rank": 12, "kv_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 8,
       "v_head_dim": 6}
SIGMOID_MOE = {"name": "moe", "n_experts": 4, "top_k": 2, "d_ff": 16, "scoring": "sigmoid", "n_group": 2,
               "topk_group": 1, "n_shared_experts": 1, "routed_scaling_factor": 2.5, "first_k_dense": 1,
               "dense_d_ff": 48}
BASE = {"d_model": 32, "n_layers": 4, "n_heads": 4, "tie_embeddings": False, "max_seq_len": 64,
        "position": {"name": "none"}}
EXPORT_CASES = {  # name -> (attnzoo model section, its layer_types)
    "kda-mla-moe": ({**BASE, "pattern": ["delta", "latent"], "mixers": {"delta": KDA, "latent": MLA},
                     "ffn": SIGMOID_MOE}, [LINEAR, FULL] * 2),
    "kda-swiglu": ({**BASE, "n_layers": 2, "mixer": KDA, "ffn": {"name": "swiglu", "d_ff": 48}}, [LINEAR] * 2),
    # every layer MLA without positions: no DeepSeek-V3 (whose MLA rotates), a Kimi Linear of full_attention layers
    "mla-nope-moe": ({**BASE, "n_layers": 2, "mixer": {**MLA, "q_lora_rank": None}, "ffn": SIGMOID_MOE}, [FULL] * 2),
}


@pytest.mark.parametrize("case", sorted(EXPORT_CASES))
def test_export_round_trip(case, tmp_path):
    """Exported, read by AutoModelForCausalLM (every tensor used and filled): logits within the fp32 gap, 8 greedy
    tokens equal (each side through its own cache; all-KDA: transformers without one); imported back, every tensor
    exactly ours."""
    section, types = EXPORT_CASES[case]
    ours = our_model(section)  # widened, with a non-zero selection bias
    config = hf.export_model(ours, tmp_path)
    assert config["architectures"] == ["KimiLinearForCausalLM"] and config["layer_types"] == types
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                                     output_loading_info=True)
    assert type(theirs).__name__ == "KimiLinearForCausalLM" and not any(info.values()), info
    theirs.eval()
    idx = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(2))
    want, atol = fp32_atol(ours, lambda m: m(idx))
    got = hf_forward(theirs, idx)
    assert want.abs().max() > 1.0
    torch.testing.assert_close(got, want, atol=atol, rtol=RTOL)
    prompt = idx[:, :5]
    with torch.no_grad():  # transformers cannot cache an all-KDA model (its cache needs an attention layer)
        ref = theirs.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                              pad_token_id=0, use_cache=FULL in types)
    assert torch.equal(ours.generate(prompt, 8, temperature=0.0), ref)
    again = import_dir(tmp_path).state_dict()
    for k, v in ours.state_dict().items():
        assert torch.equal(again[k], v), k


# ----------------------------------------------------------------------------- refusals, one line each

HYBRID = EXPORT_CASES["kda-mla-moe"][0]


@pytest.mark.parametrize("section,needles", [
    ({**HYBRID, "position": {"name": "rope"}}, ["model.position.name", "NoPE"]),
    ({**HYBRID, "tie_embeddings": True}, ["model.tie_embeddings", "never ties"]),
    ({**HYBRID, "mixers": {"delta": {**KDA, "n_v_heads": 4}, "latent": MLA}}, ["model.mixers.delta.n_v_heads"]),
    ({**HYBRID, "mixers": {"delta": {**KDA, "gate_low_rank_dim": 4}, "latent": MLA}},
     ["model.mixers.delta.gate_low_rank_dim"]),
    ({**HYBRID, "ffn": {**SIGMOID_MOE, "n_shared_experts": 0}}, ["model.ffn.n_shared_experts", "KimiLinearMoE"]),
    ({**HYBRID, "mixers": {"delta": KDA, "latent": {"name": "gqa"}}}, ["model.pattern", "Kimi Linear"]),
])
def test_export_refusals(section, needles, tmp_path):
    with pytest.raises(ConfigError) as err:
        hf.export_model(DecoderLM(section, vocab_size=V), tmp_path / "out")
    one_line(err, *needles, "no transformers architecture")
    assert not (tmp_path / "out").exists()  # refused before anything is written


@pytest.mark.parametrize("over,needles", [
    ({"mlp_layer_types": ["sparse", "dense", "sparse", "sparse"]}, ["config.json:mlp_layer_types", "first k"]),
    ({"moe_router_activation_func": "softmax"}, ["config.json:moe_router_activation_func", "sigmoid"]),
    ({"num_shared_experts": 0}, ["config.json:num_shared_experts"]),
    ({"layer_types": [LINEAR, "sliding_attention", FULL, LINEAR]}, ["config.json:layer_types"]),
    ({"hidden_act": "gelu"}, ["config.json:hidden_act"]),
])
def test_import_refusals(over, needles):
    with pytest.raises(ConfigError) as err:
        hf.config_from_hf({**_hf_config().to_dict(), **over})
    one_line(err, *needles, "not imported")
