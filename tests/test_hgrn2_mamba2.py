"""hgrn2 and mamba2, two more mixers on gated linear attention (ops/gated_linear_attention.py): the layer's chunkwise
form == its per-token recurrence in fp64 (1e-10, outputs and every gradient; strong decays, a lower bound, a conv),
prefill + one-token steps == the full forward, packing over several chunks == each document alone, cache bytes,
parity with the references: fla's HGRN2Attention layer math rebuilt on our weights over fla-core's naive GLA
recurrence; fla-core's naive simple-GLA (SSD) forms for Mamba-2's op; transformers' Mamba2Mixer (its torch path) with
our weights copied in. The generic contract runs from tests/test_mixers_contract.py, exact FLOPs from
tests/test_flops_exact.py, context parallelism from tests/test_context_parallel.py (bench/context_parallel.CASES).

Tolerances (conftest.gap_atol): two of our forms in fp64 (1e-10); fla's naive forms and transformers' torch path
compute in fp32 whatever the input, so FP32_FACTOR x our own fp32-vs-fp64 gap."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnzoo.models.decoder import DecoderLM
from tests.conftest import gap_atol, tiny_model_cfg
from tests.test_delta_rule import _fla_naive
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
    naive = _fla_naive("gla")
    layer = _layer({"name": "hgrn2", "lower_bound": lower_bound})
    x = _x(layer, 33, dtype=torch.float32)
    with torch.no_grad():
        ref = _fla_hgrn2_forward(layer, x, naive, lower_bound)
        out = layer(x, positions=torch.arange(33))
        out64 = layer.double()(x.double(), positions=torch.arange(33))
    torch.testing.assert_close(out, ref, atol=gap_atol(out, out64), rtol=0)


# ----------------------------------------------------------------------------- both
PACKED = [("hgrn2", {"chunk_size": 4}, "none"), ("hgrn2", {"chunk_size": 4, "conv_size": 3, "lower_bound": 0.5}, "none")]


@pytest.mark.parametrize("impl", ["fast", "reference"])
@pytest.mark.parametrize("name, extra, pos", PACKED, ids=lambda v: str(v) if not isinstance(v, dict) else
                         "-".join(f"{k}{w}" for k, w in v.items()))
def test_packed_documents_over_several_chunks_equal_each_alone(name, extra, pos, impl, strategy):  # noqa: F811
    """Documents longer than a chunk: the conv masked and the state reset entering each document's first chunk."""
    packed_equals_alone(name, extra, pos, impl, strategy)


def test_hgrn2_cache_holds_the_state_and_conv_tail():
    """n_heads * d_k * d_v state values (fp32) + the conv tail over [q | f | i]; d_v taken from v_head_dim."""
    torch.manual_seed(0)
    m = DecoderLM(tiny_model_cfg({"name": "hgrn2", "head_dim": 4, "v_head_dim": 6, "conv_size": 3}), vocab_size=64)
    layer = m.mixers[0]
    assert layer.layer_shape()["state_shape"] == [4, 6]
    channels = 4 * (4 + 4 + 6)
    assert layer.cache_bytes(100, batch=2) == 2 * 4 * (4 * 4 * 6 + channels * 2)
    cache = m.new_cache(2, 10)
    with torch.no_grad():
        m(torch.randint(0, 64, (2, 10)), cache=cache)
    assert cache.nbytes() == m.cache_bytes(10, batch=2)
