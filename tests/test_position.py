"""RoPE context extension (position interpolation, dynamic NTK, YaRN, Llama-3): frequencies equal to
transformers' ROPE_INIT_FUNCTIONS, whole models equal to LlamaForCausalLM with the same rope_parameters
beyond the original length, and the definitions' own properties."""
from __future__ import annotations

import pytest
import torch

from attnzoo.layers.position import RotaryEmbedding, rope_frequencies

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from attnzoo.models.decoder import DecoderLM  # noqa: E402
from tests.conftest import fp32_atol, gap_atol  # noqa: E402
from tests.test_hf_parity_attention import RTOL, V, build_hf, copy_attention, copy_common, hf_common  # noqa: E402

L0 = 16


def hf_config(params: dict, head_dim: int = 16, max_pos: int = L0):
    return transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, max_position_embeddings=max_pos,
                                    rope_parameters={"rope_theta": 10000.0, **params})


CASES = {
    "linear": ({"rope_type": "linear", "factor": 4.0}, {"factor": 4.0}),
    "yarn-4": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": L0},
               {"factor": 4.0, "original_max_len": L0}),
    "yarn-2.5-beta": ({"rope_type": "yarn", "factor": 2.5, "original_max_position_embeddings": L0, "beta_fast": 16.0,
                       "beta_slow": 2.0}, {"factor": 2.5, "original_max_len": L0, "beta_fast": 16.0, "beta_slow": 2.0}),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": L0}, {"factor": 8.0, "original_max_len": L0}),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("head_dim", [16, 64])
def test_frequencies_equal_transformers(case, head_dim):
    hf_params, ours = CASES[case]
    want, want_att = ROPE_INIT_FUNCTIONS[hf_params["rope_type"]](hf_config(hf_params, head_dim), "cpu")
    got, got_att = rope_frequencies(head_dim, 10000.0, hf_params["rope_type"], **ours)
    got64, _ = rope_frequencies(head_dim, 10000.0, hf_params["rope_type"], **ours, dtype=torch.float64)
    # transformers computes them in fp32: FP32_FACTOR x our own fp32-vs-fp64 gap
    torch.testing.assert_close(got, want.float(), atol=gap_atol(got, got64), rtol=0)
    assert got_att == pytest.approx(want_att, abs=1e-12)
    assert not torch.allclose(got, rope_frequencies(head_dim, 10000.0)[0])  # the scaling changed something


@pytest.mark.parametrize("seq_len", [L0 // 2, L0, 3 * L0, 10 * L0])
def test_dynamic_ntk_equals_transformers_at_every_length(seq_len):
    cfg = hf_config({"rope_type": "dynamic", "factor": 2.0})
    want, _ = ROPE_INIT_FUNCTIONS["dynamic"](cfg, "cpu", seq_len=seq_len)
    got, _ = rope_frequencies(16, 10000.0, "dynamic", factor=2.0, original_max_len=L0, seq_len=seq_len)
    got64, _ = rope_frequencies(16, 10000.0, "dynamic", factor=2.0, original_max_len=L0, seq_len=seq_len,
                                dtype=torch.float64)
    torch.testing.assert_close(got, want.float(), atol=gap_atol(got, got64), rtol=0)  # as above
    if seq_len <= L0:
        torch.testing.assert_close(got, rope_frequencies(16, 10000.0)[0])


def test_linear_interpolation_is_rotation_at_position_over_factor():
    x = torch.randn(1, 2, 5, 16, dtype=torch.float64)
    pos = torch.tensor([0, 3, 8, 40, 63])
    scaled = RotaryEmbedding(16, scaling="linear", factor=4.0)
    plain = RotaryEmbedding(16)
    a = scaled(x, pos)
    b = plain(x, pos.double() / 4.0)
    torch.testing.assert_close(a, b, atol=0, rtol=0)  # exact: / 4 only moves the exponent, on either side


@pytest.mark.parametrize("case", ["linear", "yarn-4", "llama3", "dynamic"])
def test_models_equal_llama_with_the_same_rope_parameters(case):
    """A GQA model with the scaling equals LlamaForCausalLM with the same rope_parameters, on a sequence 3x
    longer than the original length (where the scalings differ from plain RoPE)."""
    if case == "dynamic":
        hf_params, ours = {"rope_type": "dynamic", "factor": 2.0}, {"factor": 2.0, "original_max_len": L0}
    else:
        hf_params, ours = CASES[case]
    cfg = {**hf_common(), "max_position_embeddings": L0, "rope_parameters": {"rope_theta": 10000.0, **hf_params}}
    hf = build_hf(transformers.LlamaForCausalLM, transformers.LlamaConfig(**cfg), "eager")
    model = DecoderLM({**_our_cfg(), "position": {"name": "rope", "theta": 10000.0,
                                                     "scaling": hf_params["rope_type"], **ours}}, vocab_size=V).eval()
    copy_common(model, hf)
    copy_attention(model, hf)
    idx = torch.randint(0, V, (2, 3 * L0), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(input_ids=idx).logits
    got, atol = fp32_atol(model, lambda m: m(idx))
    torch.testing.assert_close(got, ref, atol=atol, rtol=RTOL)


def _our_cfg() -> dict:
    from tests.test_hf_parity_attention import D, FF, H, KV, LAYERS

    return {"d_model": D, "n_layers": LAYERS, "n_heads": H, "n_kv_heads": KV, "tie_embeddings": False,
            "mixer": {"name": "gqa"}, "ffn": {"name": "swiglu", "d_ff": FF}, "norm": {"name": "rmsnorm", "eps": 1e-6}}


@pytest.mark.parametrize("heads", [4, 6, 12, 16])
def test_alibi_slopes_equal_bloom(heads):
    """Our slopes against BLOOM's ALiBi tensor (slope_h * key position, the same scores up to a per-row
    constant under the causal softmax), including head counts that are not powers of two."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    from attnzoo.ops.attention import alibi_slopes

    T = 10
    bloom = build_alibi_tensor(torch.ones(1, T), heads, torch.float32).view(heads, T)
    ours = alibi_slopes(heads)[:, None] * torch.arange(T)
    ours64 = alibi_slopes(heads, torch.float64)[:, None] * torch.arange(T, dtype=torch.float64)
    # BLOOM computes its slopes in fp32: FP32_FACTOR x our own fp32-vs-fp64 gap
    torch.testing.assert_close(ours, bloom, atol=gap_atol(ours, ours64), rtol=0)


@pytest.mark.parametrize("mixer", ["mha", "gqa", "mqa"])
def test_alibi_model_decode_reference_and_effect(mixer):
    from attnzoo.api import build_model

    torch.manual_seed(0)
    m = build_model("default", vocab_size=64, overrides=["model/position=alibi", f"model/mixer={mixer}",
                                                          "model.d_model=32", "model.n_layers=2"]).double().eval()
    x = torch.randint(0, 64, (2, 15), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = m(x)
        cache = m.new_cache(2, 15, torch.float64)
        steps = [m(x[:, :6], cache=cache), m(x[:, 6:9], cache=cache)] + [m(x[:, t:t + 1], cache=cache) for t in range(9, 15)]
        torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-10, rtol=0)
        for mx in m.mixers:
            mx.impl = "reference"
        torch.testing.assert_close(m(x), full, atol=1e-10, rtol=0)
        assert all(mx.alibi is not None for mx in m.mixers)
        # the penalty is what orders the tokens: without it (NoPE) the same weights give other logits
        for mx in m.mixers:
            mx.alibi = None
        assert (m(x) - full).abs().max() > 1e-3


def test_alibi_bidirectional_is_symmetric():
    from attnzoo.ops.attention import alibi_bias, alibi_slopes

    b = alibi_bias(alibi_slopes(4), 6, 6, causal=False)
    torch.testing.assert_close(b, b.transpose(-1, -2))
    assert torch.isinf(alibi_bias(alibi_slopes(4), 6, 6, causal=True).triu(1)[:, 0, 1:]).all()
