"""Kimi Delta Attention (`kda`, mixers/kda.py; Kimi Linear 2025): the rule, run through the generalized delta rule's
three forms, against fla-core's pure-torch `naive_recurrent_kda` and `naive_chunk_kda` (outputs, final state and the
gradients w.r.t. q, k, v, the per-channel log-decays, beta and the initial state); the layer against transformers'
`KimiLinearDeltaAttention` on the same weights (output and the gradients of x and every parameter); a decay per
channel, not per head: with one decay across a head's channels the layer is Gated DeltaNet's rule. The mixer
contract (decode == forward, chunked prefill, static cache, cache bytes, reference == fast, FLOPs, packing, context
parallel) is that of every registered mixer (tests/test_mixers_contract.py and the others)."""
import pytest
import torch
import torch.nn.functional as F

from attnzoo.mixers.kda import kda_as_generalized
from attnzoo.models.decoder import DecoderLM
from attnzoo.ops.delta_rule import chunk_delta_rule
from attnzoo.ops.generalized_delta_rule import chunk_generalized_delta_rule, generalized_delta_rule_recurrent
from tests.conftest import assert_grads_close, gap_atol, module_outputs_and_grads, outputs_and_grads, tiny_model_cfg
from tests.test_delta_rule import _fla_naive


def _inputs(B=2, H=3, T=40, Dk=8, Dv=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k = F.normalize(r(B, H, T, Dk), dim=-1), F.normalize(r(B, H, T, Dk), dim=-1)
    g = -F.softplus(r(B, H, T, Dk)) / 0.7  # a log-decay per key channel, about -1 per token
    return dict(q=q, k=k, v=r(B, H, T, Dv), g=g, beta=torch.sigmoid(r(B, H, T)), s0=r(B, H, Dk, Dv))


def _ours(form):
    def run(q, k, v, g, beta, s0):
        kw, a, b = kda_as_generalized(k, beta, g)
        if form == "chunk":
            return chunk_generalized_delta_rule(q, kw, v, a, b, g, s0, chunk_size=16)
        return generalized_delta_rule_recurrent(q, kw, v, a, b, g, s0)
    return run


@pytest.mark.parametrize("theirs", ["naive_recurrent_kda", "naive_chunk_kda"])
@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_parity_fla_naive_kda(form, theirs):
    """fla's forms compute in fp32 whatever their input ((B, T, H, D) layout; its chunk form whole chunks of 16)."""
    _assert_equals_fla(_fla_naive("kda"), theirs, _ours(form), _inputs(T=48))


def _assert_equals_fla(naive, theirs: str, ours, x: dict) -> None:
    """fla's `naive.<theirs>` ((B, T, H, D) layout, its gates after k: g then beta, or g then both gates; chunk forms
    in chunks of 16) against `ours` on x in fp32: outputs and final state within ours' fp32-vs-fp64 gap, and the
    gradients w.r.t. every input by name."""
    t = lambda a: a.transpose(1, 2)  # noqa: E731

    def fla(**leaves):
        q, k, v, s0 = (leaves.pop(n) for n in ("q", "k", "v", "s0"))
        kw = dict(chunk_size=16) if "chunk" in theirs else {}
        o, s = getattr(naive, theirs)(t(q), t(k), t(v), *(t(g) for g in leaves.values()), initial_state=s0.clone(),
                                      output_final_state=True, **kw)
        return t(o), s

    (o_ref, s_ref), g_ref = outputs_and_grads(fla, x, torch.float32)
    (o, s), grads = outputs_and_grads(ours, x, torch.float32)
    (o64, s64), g64 = outputs_and_grads(ours, x)
    torch.testing.assert_close(o, o_ref, atol=gap_atol(o, o64), rtol=0)
    torch.testing.assert_close(s, s_ref, atol=gap_atol(s, s64), rtol=0)
    assert_grads_close(grads, g_ref, g64, theirs)


def test_one_decay_per_head_is_gated_deltanet():
    """A decay equal across a head's channels turns the rule into Gated DeltaNet's (ops/delta_rule.py), fp64."""
    x = _inputs(T=37)
    x["g"] = x["g"][..., :1].expand_as(x["g"]).contiguous()
    o, s = _ours("chunk")(**x)
    o_gdn, s_gdn = chunk_delta_rule(x["q"], x["k"], x["v"], x["beta"], x["g"][..., 0], x["s0"], chunk_size=16)
    torch.testing.assert_close(o, o_gdn, atol=1e-10, rtol=0)
    torch.testing.assert_close(s, s_gdn, atol=1e-10, rtol=0)


def _hf_layer_and_ours(seed=0):
    from transformers import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

    torch.manual_seed(seed)
    m = DecoderLM(tiny_model_cfg({"name": "kda"}, n_layers=1), vocab_size=64)
    ours = m.mixers[0]
    d, H, D = 32, ours.n_v_heads, ours.v_dim
    with torch.no_grad():  # the norm weight and A_log off their init, so a swapped mapping shows
        ours.norm.weight.uniform_(0.5, 1.5)
        ours.A_log.uniform_(-1.0, 1.0)
    c = KimiLinearConfig(hidden_size=d, num_hidden_layers=1, num_attention_heads=4, linear_attn_config={
        "head_dim": D, "num_heads": H, "short_conv_kernel_size": ours.conv.kernel_size}, rms_norm_eps=ours.norm.eps,
        layer_types=["linear_attention"])
    hf = KimiLinearDeltaAttention(c, 0)
    qd = H * D
    with torch.no_grad():
        hf.q_proj.weight.copy_(ours.qkv.weight[:qd])
        hf.k_proj.weight.copy_(ours.qkv.weight[qd:2 * qd])
        hf.v_proj.weight.copy_(ours.qkv.weight[2 * qd:])
        hf.conv1d.weight.copy_(ours.conv.weight[:, None, :])
        hf.forget_gate.f_a_proj.weight.copy_(ours.f_proj[0].weight)
        hf.forget_gate.f_b_proj.weight.copy_(ours.f_proj[1].weight)
        hf.forget_gate.dt_bias.copy_(ours.dt_bias)
        hf.forget_gate.A_log.copy_(ours.A_log.view(1, 1, H, 1))
        hf.b_proj.weight.copy_(ours.b_proj.weight)
        hf.g_a_proj.weight.copy_(ours.g_proj[0].weight)
        hf.g_b_proj.weight.copy_(ours.g_proj[1].weight)
        hf.o_norm.weight.copy_(ours.norm.weight)
        hf.o_proj.weight.copy_(ours.o_proj.weight)
    return ours, hf


def test_layer_matches_transformers_kimi_delta_attention():
    """Our layer (chunkwise form, fp32) == transformers' KimiLinearDeltaAttention (its torch chunk form, fp32 inside)
    on the same weights, within ours' fp32-vs-fp64 gap: output and the gradients of x and every parameter."""
    pytest.importorskip("transformers.models.kimi_linear")
    ours, hf = _hf_layer_and_ours()
    x = torch.randn(2, 32, 32, generator=torch.Generator().manual_seed(3))
    fwd = lambda layer, x: layer(x, positions=torch.arange(x.shape[1]))  # noqa: E731
    out, grads = module_outputs_and_grads(ours, fwd, x)
    out64, grads64 = module_outputs_and_grads(ours.double(), fwd, x.double())
    ours.float()
    ref, ref_grads = module_outputs_and_grads(hf, lambda layer, x: layer(x), x)
    torch.testing.assert_close(out, ref, atol=gap_atol(out, out64), rtol=0)
    names = {"qkv.weight": None, "conv.weight": "conv1d.weight", "f_proj.0.weight": "forget_gate.f_a_proj.weight",
             "f_proj.1.weight": "forget_gate.f_b_proj.weight", "dt_bias": "forget_gate.dt_bias",
             "A_log": "forget_gate.A_log", "b_proj.weight": "b_proj.weight", "g_proj.0.weight": "g_a_proj.weight",
             "g_proj.1.weight": "g_b_proj.weight", "norm.weight": "o_norm.weight", "o_proj.weight": "o_proj.weight",
             "x": "x"}
    mapped = {}
    for ours_name, hf_name in names.items():
        if hf_name is None:  # our fused qkv: transformers' three projections stacked
            mapped[ours_name] = torch.cat([ref_grads[f"{p}_proj.weight"] for p in "qkv"])
        else:
            mapped[ours_name] = ref_grads[hf_name].reshape(grads[ours_name].shape)
    assert sorted(mapped) == sorted(grads)
    assert_grads_close(grads, mapped, grads64, "KimiLinearDeltaAttention")


def test_decay_is_per_key_channel():
    """The gate holds n_v_heads x d_k decays per token (Gated DeltaNet: n_v_heads)."""
    torch.manual_seed(0)
    m = DecoderLM(tiny_model_cfg({"name": "kda"}), vocab_size=64)
    mixer = m.mixers[0]
    g = mixer.gate(torch.randn(2, 5, 32))
    assert g.shape == (2, 5, mixer.n_v_heads, mixer.state_shape[0]) and (g <= 0).all()
    assert g.std(-1).min() > 0  # channels of one head decay differently


# ----------------------------------------------------------------------------- gdn2
from attnzoo.mixers.kda import gdn2_as_generalized  # noqa: E402


def _gdn2_inputs(seed=1):
    x = _inputs(T=48, seed=seed)
    gen = torch.Generator().manual_seed(seed + 10)
    B, H, T, Dk = x["k"].shape
    x.pop("beta")
    x["erase"] = 2 * torch.sigmoid(torch.randn(B, H, T, Dk, generator=gen, dtype=torch.float64))
    x["write"] = torch.sigmoid(torch.randn(B, H, T, x["v"].shape[-1], generator=gen, dtype=torch.float64))
    return x


def _ours_gdn2(form):
    def run(q, k, v, g, erase, write, s0):
        kw, vw, a, b = gdn2_as_generalized(k, erase, write, v, g)
        if form == "chunk":
            return chunk_generalized_delta_rule(q, kw, vw, a, b, g, s0, chunk_size=16)
        return generalized_delta_rule_recurrent(q, kw, vw, a, b, g, s0)
    return run


@pytest.mark.parametrize("theirs", ["naive_recurrent_gdn2", "naive_chunk_gdn2"])
@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_parity_fla_naive_gdn2(form, theirs):
    """fla's GDN-2 references (fp32 inside): outputs, state and the gradients of q, k, v, g, both gates and s0."""
    _assert_equals_fla(_fla_naive("gdn2"), theirs, _ours_gdn2(form), _gdn2_inputs())


def test_gdn2_with_both_gates_beta_is_kda():
    """erase = write = beta (one scalar per head and token) is KDA's rule, fp64."""
    x = _inputs(T=33)
    beta = x["beta"]
    o, s = _ours_gdn2("chunk")(x["q"], x["k"], x["v"], x["g"], beta[..., None].expand_as(x["k"]),
                               beta[..., None].expand_as(x["v"]), x["s0"])
    o_kda, s_kda = _ours("chunk")(**x)
    torch.testing.assert_close(o, o_kda, atol=1e-10, rtol=0)
    torch.testing.assert_close(s, s_kda, atol=1e-10, rtol=0)


def test_gdn2_layer_equals_its_math_on_fla_naive_op():
    """The gdn2 layer (chunkwise form, fp64) == its projections written out around fla's `naive_recurrent_gdn2`: the
    erase gate per key channel (b_proj), the write gate per value channel (w_proj), the per-channel decay, then the
    gated output norm, so a gate broadcast on the wrong axis or a wrong gate shows."""
    naive = _fla_naive("gdn2")
    torch.manual_seed(0)
    m = DecoderLM(tiny_model_cfg({"name": "gdn2"}, n_layers=1), vocab_size=64).double()
    layer = m.mixers[0]
    x = torch.randn(2, 24, 32, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    B, T, _ = x.shape
    H, dk, dv = layer.n_v_heads, layer.state_shape[0], layer.v_dim
    with torch.no_grad():
        ours = layer(x, positions=torch.arange(T))
        qkv, _ = layer.conv(layer.qkv(x))
        q, k, v = F.silu(qkv).split(layer.qkv_dims, dim=-1)
        q, k = (t.reshape(B, T, H, dk) for t in (q, k))
        q, k = (t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))  # fla's l2norm
        erase = torch.sigmoid(layer.b_proj(x)).reshape(B, T, H, dk)
        write = torch.sigmoid(layer.w_proj(x)).reshape(B, T, H, dv)
        g = -layer.A_log.exp()[:, None] * F.softplus((layer.f_proj(x) + layer.dt_bias).reshape(B, T, H, dk))
        o, _ = naive.naive_recurrent_gdn2(q, k, v.reshape(B, T, H, dv), g, erase, write)
        theirs = layer._output(o.double(), x)
    # fla's naive runs in fp32: within our layer's own fp32-vs-fp64 gap
    with torch.no_grad():
        ours32 = layer.float()(x.float(), positions=torch.arange(T))
    torch.testing.assert_close(theirs, ours, atol=gap_atol(ours32, ours), rtol=0)
