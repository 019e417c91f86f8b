"""The recurrent mixers (linear_attention, deltanet, gated_deltanet) and the hybrid presets: cached decode ==
full forward over many option combinations, reference == chunkwise form on the same weights, constant cache
bytes, config errors, and a weights-copied transformers `Qwen3NextGatedDeltaNet` layer == our gated_deltanet."""
from __future__ import annotations

import copy

import pytest
import torch

from attnzoo.config.schema import ConfigError, resolve_model
from attnzoo.models.decoder import DecoderLM
from tests.conftest import compose_cfg, gap_atol, tiny_model_cfg

V = 61

# id -> mixer config; small chunk sizes so prompts cross several chunk boundaries
VARIANTS = {
    "la-elu-norm": {"name": "linear_attention", "chunk_size": 4},
    "la-identity": {"name": "linear_attention", "feature_map": "identity", "normalize": False, "chunk_size": 4},
    "la-relu-conv-gate-norm": {"name": "linear_attention", "feature_map": "relu", "conv_size": 3, "use_gate": True,
                               "use_output_norm": True, "qkv_activation": "silu", "chunk_size": 8},
    "la-taylor2": {"name": "linear_attention", "feature_map": "taylor2", "feature_dim": 4, "chunk_size": 5},
    "dn-default": {"name": "deltanet", "chunk_size": 4},
    "dn-noconv-gate-negeig": {"name": "deltanet", "conv_size": 0, "use_gate": True, "allow_neg_eigval": True,
                              "qkv_activation": "none", "chunk_size": 8},
    "dn-dv-no-norm": {"name": "deltanet", "v_head_dim": 4, "use_output_norm": False, "chunk_size": 5},
    "gdn-default": {"name": "gated_deltanet", "chunk_size": 4},
    "gdn-gva-k2-v4": {"name": "gated_deltanet", "n_heads": 2, "n_v_heads": 4, "chunk_size": 8},
    "gdn-conv2-nogate": {"name": "gated_deltanet", "conv_size": 2, "use_gate": False, "conv_bias": True},
}


def build(mixer, seed=0, **kw) -> DecoderLM:
    torch.manual_seed(seed)
    m = DecoderLM(tiny_model_cfg(mixer, **kw), vocab_size=V).eval()
    with torch.no_grad():  # widen the tiny init so that a wrong form would show
        for name, p in m.named_parameters():
            if "mixer" in name and p.dim() > 1:
                p.normal_(0.0, 0.3)
    return m


def decode_vs_full(m: DecoderLM, prompt: int, total: int, batch: int = 2):
    """Cached decode vs the full forward of `m` in float64 (the forms differ only in summation order)."""
    m = m.double()
    x = torch.randint(0, V, (batch, total), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = m(x)
        cache = m.new_cache(batch, total, torch.float64)
        steps = [m(x[:, :prompt], cache=cache)]
        for t in range(prompt, total):
            steps.append(m(x[:, t : t + 1], cache=cache))
    return torch.cat(steps, 1), full, cache


@pytest.mark.parametrize("variant", list(VARIANTS), ids=list(VARIANTS))
@pytest.mark.parametrize("prompt", [1, 9], ids=lambda p: f"prompt{p}")
def test_cached_decode_equals_full_forward(variant, prompt):
    m = build(VARIANTS[variant])
    dec, full, cache = decode_vs_full(m, prompt, prompt + 12)
    assert full.abs().max() > 0.1  # not vacuous
    torch.testing.assert_close(dec, full, atol=1e-10, rtol=0)
    assert cache.nbytes() == m.cache_bytes(prompt + 12, batch=2, dtype=torch.float64)


@pytest.mark.parametrize("variant", list(VARIANTS), ids=list(VARIANTS))
def test_reference_equals_chunkwise(variant):
    m = build(VARIANTS[variant]).double()
    x = torch.randint(0, V, (2, 23), generator=torch.Generator().manual_seed(2))
    fast = m(x)
    for mixer in m.mixers:
        mixer.impl = "reference"
    torch.testing.assert_close(m(x), fast, atol=1e-10, rtol=0)


@pytest.mark.parametrize("name", ["linear_attention", "deltanet", "gated_deltanet"])
def test_cache_bytes_constant_and_formula(name):
    m = build(name)
    mixer = m.mixers[0]
    dk, dv = mixer.state_shape
    conv = 0 if mixer.conv is None else mixer.conv.channels * (mixer.conv.kernel_size - 1)
    expect = mixer.n_v_heads * dk * dv * 4 + conv * 4
    assert mixer.cache_bytes(1) == mixer.cache_bytes(100_000) == expect
    assert mixer.cache_bytes(7, batch=3, dtype=torch.bfloat16) == 3 * (mixer.n_v_heads * dk * dv * 4 + conv * 2)
    # flops from the chunk algorithm: constant once the context exceeds one chunk
    assert m.flops_per_token(4096) == m.flops_per_token(64) > m.flops_per_token(8) > 0


def test_gradients_flow_to_every_parameter():
    for name in ("linear_attention", "deltanet", "gated_deltanet"):
        m = build({"name": name, "use_gate": True})
        m(torch.randint(0, V, (2, 20))).sum().backward()
        missing = [n for n, p in m.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
        assert not missing, (name, missing)


@pytest.mark.parametrize(
    "mixer,field",
    [
        ({"name": "gated_deltanet", "n_heads": 4, "n_v_heads": 6}, "n_v_heads"),
        ({"name": "deltanet", "chunk_size": 0}, "chunk_size"),
        ({"name": "linear_attention", "feature_map": "softmax"}, "feature_map"),
        ({"name": "deltanet", "qkv_activation": "gelu"}, "qkv_activation"),
    ],
    ids=["gva-not-multiple", "chunk0", "unknown-feature-map", "bad-activation"],
)
def test_config_errors_are_one_line(mixer, field):
    with pytest.raises(ConfigError) as e:
        resolve_model(tiny_model_cfg(mixer))
    msg = str(e.value)
    assert "\n" not in msg and field in msg


# ----------------------------------------------------------------------------- hybrid presets


TINY = ["model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2", "model.n_layers=4"]


@pytest.mark.parametrize(
    "preset,kinds",
    [
        ("hybrid_gdn", ["gated_deltanet", "gated_deltanet", "gated_deltanet", "gqa"]),
        ("hybrid_deltanet_swa", ["deltanet", "sliding_window", "deltanet", "sliding_window"]),
    ],
)
def test_hybrid_preset_decode_equals_full(preset, kinds):
    over = [f"model={preset}", *TINY]
    if preset == "hybrid_deltanet_swa":
        over.append("model.mixers.swa.window=5")  # shorter than the sequence: the ring buffer wraps
    else:
        over.append("model.mixers.gdn.chunk_size=4")
    cfg = compose_cfg(over).model
    torch.manual_seed(0)
    m = DecoderLM(cfg, vocab_size=V).eval()
    assert [type(mx).__name__ for mx in m.mixers] and [c.name for c in m.layer_mixers] == kinds
    dec, full, cache = decode_vs_full(m, 7, 20)
    torch.testing.assert_close(dec, full, atol=1e-10, rtol=0)
    assert cache.nbytes() == m.cache_bytes(20, batch=2, dtype=torch.float64)


def test_hybrid_pattern_from_the_command_line():
    from attnzoo.config.schema import layer_mixer_configs

    plain = resolve_model(compose_cfg([*TINY, "model.pattern=[deltanet,gqa]"]).model)
    assert [c.name for c in layer_mixer_configs(plain)] == ["deltanet", "gqa", "deltanet", "gqa"]
    cfg = compose_cfg([*TINY, "model.pattern=[dn,gqa]", "+model.mixers.dn={name: deltanet, chunk_size: 8}"])
    layers = layer_mixer_configs(resolve_model(cfg.model))
    assert [c.name for c in layers] == ["deltanet", "gqa", "deltanet", "gqa"] and layers[2].chunk_size == 8
    with pytest.raises(ConfigError, match="model.pattern"):
        resolve_model(compose_cfg([*TINY, "model.pattern=[deltanet,nope]"]).model)


# ----------------------------------------------------------------------------- transformers' Qwen3-Next layer


def test_matches_weights_copied_qwen3_next_gated_deltanet():
    """Our gated_deltanet with Qwen3-Next's layout: 2 q/k heads, 4 value heads, conv over [q | k | v] + SiLU,
    gated RMSNorm. Qwen3-Next interleaves its fused projections per q/k head group; we de-interleave."""
    mod = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    from transformers import Qwen3NextConfig

    Hk, Hv, Dk, Dv, D, K = 2, 4, 8, 6, 32, 4
    hf_cfg = Qwen3NextConfig(
        hidden_size=D, linear_num_key_heads=Hk, linear_num_value_heads=Hv, linear_key_head_dim=Dk,
        linear_value_head_dim=Dv, linear_conv_kernel_dim=K, num_hidden_layers=1, layer_types=["linear_attention"],
        rms_norm_eps=1e-6, hidden_act="silu",
    )
    torch.manual_seed(0)
    hf = mod.Qwen3NextGatedDeltaNet(hf_cfg, layer_idx=0).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)

    ours = build({"name": "gated_deltanet", "n_heads": Hk, "n_v_heads": Hv, "head_dim": Dk, "v_head_dim": Dv,
                  "conv_size": K, "chunk_size": 8}).mixers[0]
    r = Hv // Hk
    with torch.no_grad():
        qkvz = hf.in_proj_qkvz.weight.view(Hk, 2 * Dk + 2 * r * Dv, D)
        q, k, v, z = qkvz.split([Dk, Dk, r * Dv, r * Dv], dim=1)
        ours.qkv.weight.copy_(torch.cat([q.reshape(-1, D), k.reshape(-1, D), v.reshape(-1, D)]))
        ours.g_proj.weight.copy_(z.reshape(-1, D))
        b, a = hf.in_proj_ba.weight.view(Hk, 2 * r, D).split([r, r], dim=1)
        ours.b_proj.weight.copy_(b.reshape(-1, D))
        ours.a_proj.weight.copy_(a.reshape(-1, D))
        ours.conv.weight.copy_(hf.conv1d.weight[:, 0])
        ours.A_log.copy_(hf.A_log)
        ours.dt_bias.copy_(hf.dt_bias)
        ours.norm.weight.copy_(hf.norm.weight)
        ours.o_proj.weight.copy_(hf.out_proj.weight)

    x = torch.randn(2, 21, D, generator=torch.Generator().manual_seed(3))

    def run(m, x):
        """Full forward, and a 9-token prefill then single-token decode steps, in x's dtype."""
        cache = m.new_cache(2, 21, x.dtype, "cpu")
        steps = [m(x[:, :9], positions=torch.arange(9), cache=cache)]
        for t in range(9, 21):
            steps.append(m(x[:, t : t + 1], positions=torch.tensor([t]), cache=cache))
        return m(x, positions=torch.arange(21)), torch.cat(steps, 1)

    with torch.no_grad():
        ref = hf(x)
        out, steps = run(ours, x)
        out64, steps64 = run(copy.deepcopy(ours).double(), x.double())
    assert ref.abs().max() > 0.1
    # transformers' gated delta rule computes in fp32 whatever the input: FP32_FACTOR x our own fp32-vs-fp64 gap
    torch.testing.assert_close(out, ref, atol=gap_atol(out, out64), rtol=0)
    torch.testing.assert_close(steps, ref, atol=gap_atol(steps, steps64), rtol=0)


@pytest.mark.parametrize("feature_map,normalize", [("elu", True), ("elu", False), ("taylor2", True)])
def test_linear_attention_cache_is_the_readme_formula(feature_map, normalize):
    """README's mixer table: state n_heads · d_φ · (d_v + 1) values per layer (the + 1 is the normaliser's
    key-sum column, present only with normalize=true), d_φ = d_k (1 + d_k + d_k² for taylor2), fp32, no conv."""
    m = DecoderLM(tiny_model_cfg({"name": "linear_attention", "feature_map": feature_map, "normalize": normalize,
                                  "feature_dim": 4}), vocab_size=16)
    layer, h, dk, dv = m.mixers[0], 4, 4, 8  # tiny: 4 heads, head_dim 32 / 4 = 8
    d_phi = 1 + dk + dk * dk if feature_map == "taylor2" else dk
    assert layer.cache_bytes(100) == h * d_phi * (dv + int(normalize)) * 4
    cache = m.new_cache(1, 5)
    with torch.no_grad():
        m(torch.zeros(1, 5, dtype=torch.long), cache=cache)
    assert cache.nbytes() == 2 * layer.cache_bytes(5)
