"""hgrn2 and mamba2, two more mixers on gated linear attention (ops/gated_linear_attention.py): the layer's chunkwise
form == its per-token recurrence in fp64 (1e-10, outputs and every gradient; strong decays, a lower bound, a conv),
prefill + one-token steps == the full forward, packing over several chunks == each document alone, cache bytes,
parity with the references, outputs and gradients: fla's HGRN2Attention layer math rebuilt on our weights over
fla-core's naive GLA recurrence (w.r.t. x and every parameter); fla-core's naive simple-GLA (SSD) forms for Mamba-2's
op (w.r.t. every input); transformers' Mamba2Mixer (its torch path) with our weights copied in (w.r.t. x and every
parameter). The generic contract runs from tests/test_mixers_contract.py, exact FLOPs from tests/test_flops_exact.py,
context parallelism from tests/test_context_parallel.py (bench/context_parallel.CASES).

Tolerances (conftest.gap_atol): two of our forms in fp64 (1e-10); fla's naive forms and transformers' torch path
compute in fp32 whatever the input, so FP32_FACTOR x our own fp32-vs-fp64 gap."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnzoo.models.decoder import DecoderLM
from tests.conftest import assert_grads_close, gap_atol, outputs_and_grads, tiny_model_cfg
from tests.test_delta_rule import _fla_naive
from tests.test_gla_retnet import check_layer_matches
from tests.test_packing import _model, packed_ids, strategy  # noqa: F401  (strategy: a fixture used below)
from tests.test_packing import test_a_packed_batch_equals_each_document_alone as packed_equals_alone

F64 = dict(atol=1e-10, rtol=0)


def _layer(mixer: dict, d_model: int = 32, noise: float = 0.3, seed: int = 0):
    """The first mixer of a tiny model, its weights moved away from the init (unit norm weights, zero biases) so
    every weight matters."""
    torch.manual_seed(seed)
    m = DecoderLM(tiny_model_cfg(mixer, d_model=d_model), vocab_size=64)
    layer = m.mixers[0]
    for p in layer.parameters():
        p.data.add_(noise * torch.randn_like(p))
    return layer


def _x(layer, T: int, B: int = 2, dtype=torch.float64, seed: int = 1):
    return torch.randn(B, T, layer.d_model, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _forward_and_grads(layer, x, impl: str):
    """The layer's output on x and the gradients of a random linear loss over it w.r.t. x and every parameter."""
    layer.impl = impl
    x = x.clone().requires_grad_()
    out = layer(x, positions=torch.arange(x.shape[1]))
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
    leaves = [x, *layer.parameters()]
    return out, torch.autograd.grad((out * w).sum(), leaves)


def check_chunk_equals_recurrent(layer, T: int):
    layer = layer.double()
    x = _x(layer, T)
    out_ref, g_ref = _forward_and_grads(layer, x, "reference")
    out, g = _forward_and_grads(layer, x, "fast")
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, out_ref, **F64)
    for a, b in zip(g_ref, g):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(b, a, **F64)


def check_decode_equals_full(layer, prompt: int, T: int):
    """A prefill of `prompt` tokens, then one-token steps (the state and the conv tail carried): the full forward."""
    layer = layer.double().eval()
    x = _x(layer, T)
    with torch.no_grad():
        full = layer(x, positions=torch.arange(T))
        cache = layer.new_cache(2, T, torch.float64, "cpu")
        outs = [layer(x[:, :prompt], positions=torch.arange(prompt), cache=cache)]
        for t in range(prompt, T):
            outs.append(layer(x[:, t:t + 1], positions=torch.arange(t, t + 1), cache=cache))
    torch.testing.assert_close(torch.cat(outs, 1), full, **F64)
    assert cache.seq_len == T


# ----------------------------------------------------------------------------- hgrn2
# id: (mixer section, T); chunks of 4-16 so T spans several; "strong": forget logits ~ +-30 (f ~ e^-30 or ~ 1)
HGRN2 = {
    "C16-T50": ({"name": "hgrn2"}, 50),
    "C4-T23-lb0.5": ({"name": "hgrn2", "chunk_size": 4, "lower_bound": 0.5}, 23),
    "C8-T40-conv4": ({"name": "hgrn2", "chunk_size": 8, "conv_size": 4, "conv_bias": True}, 40),
    "C8-T7-dv12": ({"name": "hgrn2", "chunk_size": 8, "head_dim": 6, "v_head_dim": 12}, 7),
    "C8-T40-strong": ({"name": "hgrn2", "chunk_size": 8}, 40),
}


def _hgrn2(case: str):
    mixer, T = HGRN2[case]
    layer = _layer(mixer)
    if case.endswith("strong"):
        with torch.no_grad():  # the forget logits' rows of the fused [q | f | i] projection
            dq, df, _ = layer.qkv_dims
            layer.qkv.weight[dq:dq + df] *= 100.0
    return layer, T


@pytest.mark.parametrize("case", list(HGRN2))
def test_hgrn2_chunk_equals_recurrent_fp64_outputs_and_gradients(case):
    layer, T = _hgrn2(case)
    if case.endswith("strong"):  # the logits really are that large
        with torch.no_grad():
            f = layer.qkv(_x(layer.double(), T)).split(layer.qkv_dims, -1)[1]
        assert f.abs().max() > 30
    check_chunk_equals_recurrent(layer, T)


@pytest.mark.parametrize("case", ["C4-T23-lb0.5", "C8-T40-conv4"])
@pytest.mark.parametrize("prompt", [1, 9])
def test_hgrn2_decode_steps_equal_full_forward(case, prompt):
    layer, T = _hgrn2(case)
    check_decode_equals_full(layer, prompt, T)


def test_hgrn2_gates_are_the_papers():
    """f = lb + (1 - lb) sigmoid(logit), k = 1 - f, q = swish(W_q x): read off the tensors mix() hands the op."""
    layer = _layer({"name": "hgrn2", "lower_bound": 0.25}).double()
    x = _x(layer, 5)
    seen = {}
    layer.gated = lambda q, k, v, g, *rest, **kw: seen.update(q=q, k=k, v=v, g=g) or (v, None)
    with torch.no_grad():
        layer(x, positions=torch.arange(5))
        q, f, i = layer.qkv(x).split(layer.qkv_dims, -1)
    shape = (2, 5, layer.n_qk_heads, layer.qk_dim)
    forget = 0.25 + 0.75 * torch.sigmoid(f).reshape(shape)
    torch.testing.assert_close(seen["g"], forget.log().transpose(1, 2), **F64)
    torch.testing.assert_close(seen["k"], 1 - forget, **F64)
    torch.testing.assert_close(seen["q"], F.silu(q).reshape(shape), **F64)
    torch.testing.assert_close(seen["v"], i.reshape(2, 5, layer.n_v_heads, layer.v_dim), **F64)


def _fla_hgrn2_forward(layer, x, naive, lower_bound: float = 0.0):
    """fla's HGRN2Attention.forward (fla/layers/hgrn2.py: no conv; q = swish(q_proj x), g = logsigmoid(f_proj x) with
    its lower bound, k = 1 - exp(g), chunk_gla at its default scale, RMSNorm over the hidden size, o_proj) on our
    layer's weights, with fla-core's naive GLA recurrence for the op."""
    B, T, _ = x.shape
    H, Dk, Dv = layer.n_qk_heads, layer.qk_dim, layer.v_dim
    q, f, i = layer.qkv(x).split(layer.qkv_dims, dim=-1)  # fla's q_proj, f_proj, i_proj
    q = F.silu(q)
    g = F.logsigmoid(f)
    if lower_bound:
        lb = torch.full_like(g, lower_bound)
        g = torch.logaddexp(lb.log(), torch.log1p(-lb) + g)
    k = 1 - g.exp()
    q, k, g = (t.reshape(B, T, H, Dk) for t in (q, k, g))
    o = naive.naive_recurrent_gla(q, k, i.reshape(B, T, H, Dv), g)[0].reshape(B, T, H * Dv)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + layer.cfg.norm_eps) * layer.norm.weight
    return layer.o_proj(o)


@pytest.mark.parametrize("lower_bound", [0.0, 0.3])
def test_hgrn2_layer_matches_fla_layer_with_naive_op(lower_bound):
    """The output and the gradients w.r.t. x and every parameter (tests/test_gla_retnet.check_layer_matches)."""
    naive = _fla_naive("gla")
    layer = _layer({"name": "hgrn2", "lower_bound": lower_bound})
    x = _x(layer, 33, dtype=torch.float32)
    check_layer_matches(layer, x, lambda layer, x: _fla_hgrn2_forward(layer, x, naive, lower_bound),
                        f"hgrn2 layer, lower bound {lower_bound}")


# ----------------------------------------------------------------------------- mamba2
# id: (mixer section, T); tiny model d_model 32, head_dim 8 -> 8 heads of P = 8; "strong": dt A ~ -50 per token
MAMBA2 = {
    "C8-T50": ({"name": "mamba2", "chunk_size": 8, "d_state": 16}, 50),
    "C8-T40-groups2": ({"name": "mamba2", "chunk_size": 8, "d_state": 12, "n_groups": 2}, 40),
    "C4-T23-groups8-noconv": ({"name": "mamba2", "chunk_size": 4, "d_state": 6, "n_groups": 8, "conv_size": 0}, 23),
    "C64-T7-P16": ({"name": "mamba2", "head_dim": 16, "d_state": 8}, 7),
    "C8-T40-strong": ({"name": "mamba2", "chunk_size": 8, "d_state": 16, "n_groups": 2}, 40),
}


def _mamba2(case: str):
    mixer, T = MAMBA2[case]
    layer = _layer(mixer)
    if case.endswith("strong"):
        with torch.no_grad():
            layer.A_log.fill_(8.0)  # A ~ -3000: dt A ~ -50 per token (median), the values dt x as they were
    return layer, T


@pytest.mark.parametrize("case", list(MAMBA2))
def test_mamba2_chunk_equals_recurrent_fp64_outputs_and_gradients(case):
    layer, T = _mamba2(case)
    if case.endswith("strong"):  # the decays really are that strong
        with torch.no_grad():
            dt = F.softplus(layer.dt_proj(_x(layer, T, dtype=torch.float32)) + layer.dt_bias)
        assert (dt * layer.A_log.exp()).median() > 30
    check_chunk_equals_recurrent(layer, T)


@pytest.mark.parametrize("case", ["C8-T40-groups2", "C4-T23-groups8-noconv"])
@pytest.mark.parametrize("prompt", [1, 9])
def test_mamba2_decode_steps_equal_full_forward(case, prompt):
    layer, T = _mamba2(case)
    check_decode_equals_full(layer, prompt, T)


def test_mamba2_initialisation_is_the_papers():
    """A = exp(A_log) ~ U[1, 16], dt = softplus(dt_bias) ~ logU[0.001, 0.1] (floored at 1e-4), D = 1, none of them
    weight-decayed; the model's GPT-2 init (Linear layers only) leaves them alone."""
    from attnzoo.training.lit_lm import param_groups

    torch.manual_seed(0)
    m = DecoderLM(tiny_model_cfg({"name": "mamba2"}, d_model=256, n_heads=2), vocab_size=64)
    layer = m.mixers[0]
    assert layer.n_v_heads == 4 and layer.v_dim == 128 and layer.state_shape == (64, 128)
    A, dt = layer.A_log.exp(), F.softplus(layer.dt_bias)
    assert ((A >= 1) & (A <= 16)).all() and A.std() > 0
    assert ((dt >= 1e-3 * (1 - 1e-6)) & (dt <= 0.1 * (1 + 1e-6))).all() and dt.std() > 0
    assert torch.equal(layer.D, torch.ones(4))
    no_decay = {id(p) for g in param_groups(m, 0.1) if g["weight_decay"] == 0 for p in g["params"]}
    assert {id(p) for p in (layer.A_log, layer.dt_bias, layer.D)} <= no_decay
    with torch.no_grad():  # the floor: dt sampled below it is lifted to it
        from attnzoo.mixers.mamba2 import ssm_decay_init
        _, dt_bias = ssm_decay_init(1000, (1, 16), (1e-6, 1e-5), 1e-4)
    torch.testing.assert_close(F.softplus(dt_bias.double()), torch.full((1000,), 1e-4, dtype=torch.float64))


@pytest.mark.parametrize("form", ["naive_recurrent_simple_gla", "naive_chunk_simple_gla"])
def test_ssd_op_matches_fla_naive_simple_gla(form):
    """Mamba-2's SSD is fla's simple GLA (one log-decay per head and token) read unscaled: q = C, k = B, v = dt x. The
    outputs, the final state and the gradients w.r.t. C, B, v, the log-decays g and an initial state."""
    from attnzoo.ops.gated_linear_attention import chunk_gated_linear_attention

    naive = _fla_naive("simple_gla")
    gen = torch.Generator().manual_seed(0)
    B, H, T, N, P = 2, 3, 45, 16, 8
    c, b, x = (torch.randn(B, T, H, d, generator=gen, dtype=torch.float64) for d in (N, N, P))
    dt = F.softplus(torch.randn(B, T, H, generator=gen, dtype=torch.float64) - 1)
    g = -torch.rand(H, generator=gen, dtype=torch.float64).mul(15).add(1) * dt  # A ~ -U[1, 16]
    s0 = torch.randn(B, H, N, P, generator=gen, dtype=torch.float64)
    inputs = dict(c=c, b=b, v=x * dt[..., None], g=g, s0=s0)
    t = lambda u: u.transpose(1, 2)  # noqa: E731  (B, H, T, D)

    def ours(c, b, v, g, s0):
        return chunk_gated_linear_attention(t(c), t(b), t(v), t(g)[..., None], s0, scale=1.0, chunk_size=16)

    def theirs(c, b, v, g, s0):
        kw = dict(chunk_size=16) if "chunk" in form else {}
        o, s = getattr(naive, form)(c, b, v, g, scale=1.0, initial_state=s0, output_final_state=True, **kw)
        return t(o), s

    (o_ref, s_ref), g_ref = outputs_and_grads(theirs, inputs, torch.float32)
    (o, s), grads = outputs_and_grads(ours, inputs, torch.float32)
    (o64, s64), g64 = outputs_and_grads(ours, inputs)
    torch.testing.assert_close(o, o_ref, atol=gap_atol(o, o64), rtol=0)
    torch.testing.assert_close(s, s_ref, atol=gap_atol(s, s64), rtol=0)
    assert_grads_close(grads, g_ref, g64, form)


def _transformers_mamba2(layer):
    """transformers' Mamba2Mixer of the same sizes with our layer's weights: in_proj = [z | x | B | C | dt] (ours:
    g_proj, qkv's [C | B | x] reordered, dt_proj), the conv over [x | B | C], out_proj = o_proj."""
    Mamba2Config = pytest.importorskip("transformers").Mamba2Config
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

    H, P, G, N = layer.n_v_heads, layer.v_dim, layer.n_qk_heads, layer.qk_dim
    cfg = Mamba2Config(hidden_size=layer.d_model, num_heads=H, head_dim=P, expand=H * P // layer.d_model, state_size=N,
                       n_groups=G, conv_kernel=layer.conv.kernel_size, use_conv_bias=layer.conv.bias is not None,
                       use_bias=False, chunk_size=layer.chunk_size, layer_norm_epsilon=layer.cfg.norm_eps,
                       num_hidden_layers=1)
    ref = Mamba2Mixer(cfg, 0).double().eval()
    cc, bb, xx = layer.qkv.weight.split(layer.qkv_dims, dim=0)
    wc, wb, wx = layer.conv.weight.split(layer.qkv_dims, dim=0)
    with torch.no_grad():
        ref.in_proj.weight.copy_(torch.cat([layer.g_proj.weight, xx, bb, cc, layer.dt_proj.weight]))
        ref.conv1d.weight.copy_(torch.cat([wx, wb, wc])[:, None, :])
        if layer.conv.bias is not None:
            bc, bb_, bx = layer.conv.bias.split(layer.qkv_dims)
            ref.conv1d.bias.copy_(torch.cat([bx, bb_, bc]))
        for name in ("dt_bias", "A_log", "D"):
            getattr(ref, name).copy_(getattr(layer, name))
        ref.norm.weight.copy_(layer.norm.weight)
        ref.out_proj.weight.copy_(layer.o_proj.weight)
    return ref


@pytest.mark.parametrize("case", ["C8-T50", "C8-T40-groups2", "C64-T7-P16"])
def test_mamba2_layer_matches_transformers_mamba2_mixer(case):
    """transformers' torch path (no mamba_ssm / causal_conv1d on CPU) computes its scan and norm in fp32 whatever
    the input: ours in fp32 within FP32_FACTOR x our own fp32-vs-fp64 gap."""
    layer, T = _mamba2(case)
    layer = layer.double()
    ref = _transformers_mamba2(layer)
    x = _x(layer, T)
    with torch.no_grad():
        expected = ref(x)
        out64 = layer(x, positions=torch.arange(T))
        out = layer.float()(x.float(), positions=torch.arange(T))
    torch.testing.assert_close(out.double(), expected.double(), atol=gap_atol(out, out64), rtol=0)


def _transformers_mamba2_grads_in_our_layout(layer, g: dict) -> dict:
    """Gradients w.r.t. transformers' Mamba2Mixer parameters (`g`, keyed by its parameter names) keyed by our layer's
    parameter names instead: `_transformers_mamba2`'s weight mapping run backwards (in_proj's [z | x | B | C | dt]
    rows split into g_proj, qkv = [C | B | x] and dt_proj; the conv's [x | B | C] channels reordered to [C | B | x])."""
    conv_bias = ["conv1d.bias"] if layer.conv.bias is not None else []
    assert sorted(g) == sorted(["in_proj.weight", "conv1d.weight", *conv_bias, "out_proj.weight", "norm.weight",
                                "dt_bias", "A_log", "D"])  # every parameter of theirs mapped below
    H, GN, inner = layer.n_v_heads, layer.n_qk_heads * layer.qk_dim, layer.n_v_heads * layer.v_dim
    z, xx, bb, cc, dt = g["in_proj.weight"].split([inner, inner, GN, GN, H], dim=0)
    wx, wb, wc = g["conv1d.weight"][:, 0, :].split([inner, GN, GN], dim=0)
    ours = {"g_proj.weight": z, "qkv.weight": torch.cat([cc, bb, xx]), "dt_proj.weight": dt,
            "conv.weight": torch.cat([wc, wb, wx]), "o_proj.weight": g["out_proj.weight"],
            "norm.weight": g["norm.weight"], **{n: g[n] for n in ("dt_bias", "A_log", "D")}}
    if conv_bias:
        bx, bb_, bc = g["conv1d.bias"].split([inner, GN, GN])
        ours["conv.bias"] = torch.cat([bc, bb_, bx])
    return ours


@pytest.mark.parametrize("case", ["C8-T50", "C8-T40-groups2", "C64-T7-P16"])
def test_mamba2_layer_gradients_match_transformers_mamba2_mixer(case):
    """The backward of the output test above: the gradients of a random linear loss (fixed seed) w.r.t. the input x
    and every parameter, transformers' (its torch path, scan and norm in fp32 whatever the input) mapped into our
    layout, against ours in fp32 within FP32_FACTOR x our own fp32-vs-fp64 gap on each gradient. Ours runs its
    default chunkwise form (impl "fast", as the output test), whose mix() holds the D skip."""
    layer, T = _mamba2(case)
    layer = layer.double()
    ref = _transformers_mamba2(layer)
    x = _x(layer, T)
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)  # the upstream grad

    def grads(module, x, **kw):  # d(sum(out * w)) / d[x, *parameters]
        x = x.clone().requires_grad_()
        out = module(x, **kw)
        return torch.autograd.grad((out * w.to(out.dtype)).sum(), [x, *module.parameters()])

    names = ["x", *(n for n, _ in layer.named_parameters())]
    layer.impl = "fast"
    g64 = grads(layer, x, positions=torch.arange(T))
    g32 = grads(layer.float(), x.float(), positions=torch.arange(T))
    gx, *g = grads(ref, x)
    theirs = {"x": gx, **_transformers_mamba2_grads_in_our_layout(layer, dict(zip(dict(ref.named_parameters()), g)))}
    assert sorted(theirs) == sorted(names)
    for name, a32, a64 in zip(names, g32, g64):
        expected = theirs[name].double().reshape(a64.shape)
        assert expected.abs().max() > 0, name  # every gradient carries signal
        torch.testing.assert_close(a32.double(), expected, atol=gap_atol(a32, a64), rtol=0,
                                   msg=lambda m, name=name: f"{case}: d/d{name}: {m}")


# ----------------------------------------------------------------------------- both
PACKED = [("hgrn2", {"chunk_size": 4}, "none"),
          ("hgrn2", {"chunk_size": 4, "conv_size": 3, "lower_bound": 0.5}, "none"),
          ("mamba2", {"chunk_size": 4, "d_state": 8}, "none"), ("mamba2", {"chunk_size": 8, "n_groups": 2}, "rope")]


@pytest.mark.parametrize("impl", ["fast", "reference"])
@pytest.mark.parametrize("name, extra, pos", PACKED, ids=lambda v: str(v) if not isinstance(v, dict) else
                         "-".join(f"{k}{w}" for k, w in v.items()))
def test_packed_documents_over_several_chunks_equal_each_alone(name, extra, pos, impl, strategy):  # noqa: F811
    """Documents longer than a chunk: the conv masked and the state reset entering each document's first chunk."""
    packed_equals_alone(name, extra, pos, impl, strategy)


def test_mamba2_cache_holds_the_state_and_conv_tail():
    """n_heads * d_state * head_dim state values (fp32) + the conv tail over [C | B | x] (2 n_groups d_state +
    d_inner channels, K - 1 = 3 each)."""
    torch.manual_seed(0)
    m = DecoderLM(tiny_model_cfg({"name": "mamba2", "d_state": 6, "n_groups": 2}), vocab_size=64)
    layer = m.mixers[0]
    H, P = 8, 8  # d_inner = 2 * 32 = 64 = 8 heads of the model's head size 8
    assert layer.layer_shape()["state_shape"] == [6, 8] and layer.n_v_heads == H
    channels = 2 * 2 * 6 + H * P
    assert layer.cache_bytes(100, batch=2) == 2 * 4 * (H * 6 * P + channels * 3)
    cache = m.new_cache(2, 10)
    with torch.no_grad():
        m(torch.randint(0, 64, (2, 10)), cache=cache)
    assert cache.nbytes() == m.cache_bytes(10, batch=2)
