"""Gated linear attention (ops/gated_linear_attention.py) and the mixers over it, gla and retnet: chunkwise form ==
per-token recurrence (outputs, final state, gradients) in fp64, decode steps == recurrence, state resets, strong
decay, parity with fla-core's pure-torch naive references (op: outputs, final state and the gradients w.r.t. every
input; layer: the output and the gradients w.r.t. x and every parameter), packing over several chunks per document.
The generic contract (cached decode, chunked prefill, cache bytes, causality, reference switch) runs from
tests/test_mixers_contract.py, exact FLOPs from tests/test_flops_exact.py, context parallelism from
tests/test_context_parallel.py (bench/context_parallel.CASES).

Tolerances (conftest.gap_atol): two of our forms in fp64 (1e-10); fla's naive forms compute in fp32 whatever the
input, so FP32_FACTOR x our own fp32-vs-fp64 gap - a wrong decay or scale moves the outputs by O(0.1-1)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from attnzoo.mixers.retnet import retention_log_decays
from attnzoo.models.decoder import DecoderLM
from attnzoo.ops.gated_linear_attention import (chunk_gated_linear_attention, gated_linear_attention_recurrent,
                                                gated_linear_attention_step)
from tests.conftest import assert_grads_close, gap_atol, module_outputs_and_grads, outputs_and_grads, tiny_model_cfg
from tests.test_delta_rule import _fla_naive
from tests.test_packing import _model, packed_ids, strategy  # noqa: F401  (strategy: a fixture used below)
from tests.test_packing import test_a_packed_batch_equals_each_document_alone as packed_equals_alone

F64 = dict(atol=1e-10, rtol=0)


def inputs(B=2, H=3, T=50, Dk=16, Dv=12, *, per_key=True, g_scale=1.0, init=False, dtype=torch.float64, seed=0):
    """q, k, v ~ N(0, 1), log-decay g <= 0 (about -g_scale per token; (B, H, T, Dk) per key channel or (B, H, T, 1)
    per head), optional initial state."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = r(B, H, T, Dk), r(B, H, T, Dk), r(B, H, T, Dv)
    g = -g_scale * F.softplus(r(B, H, T, Dk if per_key else 1)) / 0.7
    s0 = r(B, H, Dk, Dv) if init else None
    return tuple(None if x is None else x.to(dtype) for x in (q, k, v, g, s0))


# id: (T, chunk, per-key decay, initial state, decay scale)
CASES = {
    "T50-C16-perkey": (50, 16, True, False, 1.0),
    "T50-C16-perkey-init": (50, 16, True, True, 1.0),
    "T50-C8-perhead-init": (50, 8, False, True, 1.0),
    "T64-C64-perhead": (64, 64, False, False, 1.0),
    "T1-C16-perkey-init": (1, 16, True, True, 1.0),
    "T7-C64-shorter-than-chunk": (7, 64, True, True, 1.0),
    "T40-C8-strong-decay": (40, 8, True, True, 30.0),  # ~-30 per token: e^{G} underflows, never overflows
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_chunk_equals_recurrent_fp64_outputs_and_gradients(case):
    T, C, per_key, init, g_scale = CASES[case]
    args = [x if x is None else x.requires_grad_() for x in inputs(T=T, per_key=per_key, init=init, g_scale=g_scale)]
    assert_forms_agree(args, gated_linear_attention_recurrent(*args), chunk_gated_linear_attention(*args, chunk_size=C))


@pytest.mark.parametrize("per_key", [True, False], ids=["perkey", "perhead"])
def test_decode_steps_equal_recurrent(per_key):
    """A prefill by the chunkwise form, then one-token steps: the recurrence over the whole sequence."""
    q, k, v, g, s0 = inputs(T=30, per_key=per_key, init=True)
    o_ref, s_ref = gated_linear_attention_recurrent(q, k, v, g, s0)
    o, state = chunk_gated_linear_attention(q[:, :, :11], k[:, :, :11], v[:, :, :11], g[:, :, :11], s0, chunk_size=4)
    outs = [o]
    for t in range(11, 30):
        o_t, state = gated_linear_attention_step(q[:, :, t], k[:, :, t], v[:, :, t], g[:, :, t], state)
        outs.append(o_t[:, :, None])
    torch.testing.assert_close(torch.cat(outs, 2), o_ref, **F64)
    torch.testing.assert_close(state, s_ref, **F64)


def test_resets_start_each_marked_chunk_from_zero():
    """resets (packed documents laid out chunk-aligned): the marked chunks run as if the sequence started there."""
    q, k, v, g, s0 = inputs(B=2, T=24, init=True)
    resets = torch.tensor([[False, True, False, True, False, False], [False, False, False, False, True, False]])
    o, s = chunk_gated_linear_attention(q, k, v, g, s0, chunk_size=4, resets=resets)
    for b in range(2):
        starts = [0] + [4 * i for i in range(6) if resets[b, i]] + [24]
        for lo, hi in zip(starts[:-1], starts[1:]):
            init = s0[b:b + 1] if lo == 0 else None
            o_seg, s_seg = gated_linear_attention_recurrent(*(x[b:b + 1, :, lo:hi] for x in (q, k, v, g)), init)
            torch.testing.assert_close(o[b:b + 1, :, lo:hi], o_seg, **F64)
        torch.testing.assert_close(s[b:b + 1], s_seg, **F64)


# ----------------------------------------------------------------------------- fla-core naive references
@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_parity_fla_naive_recurrent_gla(form):
    """The outputs, the final state and the gradients w.r.t. q, k, v, g and the initial state."""
    naive = _fla_naive("gla")
    q, k, v, g, s0 = inputs(T=70, init=True)
    x = dict(q=q, k=k, v=v, g=g, s0=s0)
    t = lambda x: x.transpose(1, 2)  # noqa: E731  fla takes (B, T, H, D)

    def theirs(q, k, v, g, s0):
        o, s = naive.naive_recurrent_gla(t(q), t(k), t(v), t(g), initial_state=s0.clone(), output_final_state=True)
        return t(o), s

    op = (lambda *a: chunk_gated_linear_attention(*a, chunk_size=16)) if form == "chunk" else gated_linear_attention_recurrent
    ours = lambda q, k, v, g, s0: op(q, k, v, g, s0)  # noqa: E731
    (o_ref, s_ref), g_ref = outputs_and_grads(theirs, x, torch.float32)
    (o, s), grads = outputs_and_grads(ours, x, torch.float32)
    (o64, s64), g64 = outputs_and_grads(ours, x)
    torch.testing.assert_close(o, o_ref, atol=gap_atol(o, o64), rtol=0)
    torch.testing.assert_close(s, s_ref, atol=gap_atol(s, s64), rtol=0)
    assert_grads_close(grads, g_ref, g64, "naive_recurrent_gla")


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_parity_fla_naive_retention(form):
    """fla's parallel retention (decay matrix gamma_h^(t-s), heads 0..H-1) == the op on the per-head log-decays: the
    outputs and the gradients w.r.t. q, k, v (the decays are constants, no initial state, no final state)."""
    naive = _fla_naive("retention")
    H, T = 5, 45
    q, k, v, _, _ = inputs(H=H, T=T)
    x = dict(q=q, k=k, v=v)

    def ours(q, k, v):
        g = torch.tensor(retention_log_decays(H), dtype=q.dtype)[None, :, None, None].expand(2, H, T, 1)
        op = (lambda *a: chunk_gated_linear_attention(*a, chunk_size=16)) if form == "chunk" else gated_linear_attention_recurrent
        return op(q, k, v, g)[0]

    (o_ref,), g_ref = outputs_and_grads(naive.naive_retention, x, torch.float32)
    (o,), grads = outputs_and_grads(ours, x, torch.float32)
    (o64,), g64 = outputs_and_grads(ours, x)
    torch.testing.assert_close(o, o_ref, atol=gap_atol(o, o64), rtol=0)
    assert_grads_close(grads, g_ref, g64, "naive_retention")


def test_retention_decays_are_the_papers():
    assert [math.exp(x) for x in retention_log_decays(3)] == pytest.approx([1 - 2**-5, 1 - 2**-6, 1 - 2**-7], rel=1e-15)


def _layer(name: str, **mixer):
    torch.manual_seed(0)
    m = DecoderLM(tiny_model_cfg({"name": name, **mixer}, position={"name": "rope"}), vocab_size=64)
    layer = m.mixers[0]
    for p in layer.parameters():  # away from the init (zero gate bias, unit norm weight), so every weight matters
        p.data.add_(0.3 * torch.randn_like(p))
    return layer


def _fla_layer_forward(layer, x, naive_op, rotate=None):
    """fla's GatedLinearAttention / MultiScaleRetention forward (fla/layers/gla.py, multiscale_retention.py: no
    conv, fused RMSNorm-swish gate, o_proj) on our layer's weights, with fla's naive op for the recurrence."""
    B, T, _ = x.shape
    H, Dk, Dv = layer.n_qk_heads, layer.qk_dim, layer.v_dim
    q, k, v = layer.qkv(x).split(layer.qkv_dims, dim=-1)
    q, k, v = q.reshape(B, T, H, Dk), k.reshape(B, T, H, Dk), v.reshape(B, T, H, Dv)
    if rotate is not None:
        q, k = rotate(q, k)
    o = naive_op(q, k, v)  # (B, T, H, Dv)
    g = layer.g_proj(x).reshape(B, T, H, Dv)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + layer.cfg.norm_eps) * layer.norm.weight * F.silu(g)
    return layer.o_proj(o.reshape(B, T, H * Dv))


def check_layer_matches(layer, x, reference, what: str) -> torch.Tensor:
    """Our fp32 layer (its default chunkwise form) against `reference(layer, x)` (fla's layer math on our layer's
    weights over a naive op, fp32 inside): the output, and the gradients of a fixed random projection of it w.r.t. x
    and every parameter of our layer by name, each within FP32_FACTOR x our own fp32-vs-fp64 gap of that tensor
    (our layer run again in fp64 on the same weights and input). Returns the reference output."""
    ours = lambda m, x: m(x, positions=torch.arange(x.shape[1]))  # noqa: E731
    ref, g_ref = module_outputs_and_grads(layer, reference, x)
    out, grads = module_outputs_and_grads(layer, ours, x)
    out64, g64 = module_outputs_and_grads(layer.double(), ours, x.double())
    layer.float()
    torch.testing.assert_close(out, ref, atol=gap_atol(out, out64), rtol=0)
    assert_grads_close(grads, g_ref, g64, what)
    return ref


def test_gla_layer_matches_fla_layer_with_naive_op():
    naive = _fla_naive("gla")
    layer = _layer("gla")
    x = torch.randn(2, 33, layer.d_model, generator=torch.Generator().manual_seed(1))

    def reference(layer, x):
        def op(q, k, v):
            gk = F.logsigmoid(layer.gk_proj(x).reshape(q.shape)) / 16  # fla: logsigmoid(gk) / gate_logit_normalizer
            return naive.naive_recurrent_gla(q, k, v, gk)[0]

        return _fla_layer_forward(layer, x, op)

    check_layer_matches(layer, x, reference, "gla layer")


def test_retnet_layer_matches_fla_layer_with_naive_op():
    """RoPE on q, k (rotate-half, fla's RotaryEmbedding default, base 10000) then fla's parallel retention."""
    naive = _fla_naive("retention")
    layer = _layer("retnet")
    T = 33
    x = torch.randn(2, T, layer.d_model, generator=torch.Generator().manual_seed(1))

    def rotate(q, k):
        inv = 1.0 / 10000 ** (torch.arange(0, layer.qk_dim, 2, dtype=torch.float32) / layer.qk_dim)
        ang = torch.arange(T, dtype=torch.float32)[:, None] * inv
        cos, sin = (f(torch.cat([ang, ang], -1))[:, None, :] for f in (torch.cos, torch.sin))  # (T, 1, Dk)
        rot = lambda u: torch.cat([-u[..., u.shape[-1] // 2:], u[..., :u.shape[-1] // 2]], -1)  # noqa: E731
        return q * cos + rot(q) * sin, k * cos + rot(k) * sin

    def op(q, k, v):
        t = lambda u: u.transpose(1, 2)  # noqa: E731  naive_retention takes (B, H, T, D)
        return t(naive.naive_retention(t(q), t(k), t(v)))

    check_layer_matches(layer, x, lambda layer, x: _fla_layer_forward(layer, x, op, rotate), "retnet layer")


# ----------------------------------------------------------------------------- mixers
PACKED = [("gla", {"chunk_size": 4}, "none"), ("gla", {"chunk_size": 4, "conv_size": 3}, "none"),
          ("retnet", {"chunk_size": 4}, "rope"), ("retnet", {"chunk_size": 8}, "none")]


@pytest.mark.parametrize("impl", ["fast", "reference"])
@pytest.mark.parametrize("name, extra, pos", PACKED, ids=lambda v: str(v) if not isinstance(v, dict) else
                         "-".join(f"{k}{w}" for k, w in v.items()))
def test_packed_documents_over_several_chunks_equal_each_alone(name, extra, pos, impl, strategy):  # noqa: F811
    """Documents longer than a chunk (state resets entering each document's first chunk; RoPE per document)."""
    packed_equals_alone(name, extra, pos, impl, strategy)


@pytest.mark.parametrize("name", ["gla", "retnet", "hgrn2"])
def test_cache_holds_the_state_and_conv_tail(name):
    """n_heads * d_k * d_v state values (fp32) + the conv tail (hgrn2: over [q | f | i]); d_v taken from
    v_head_dim. (The shared op's mixers: hgrn2 is tested with them here.)"""
    torch.manual_seed(0)
    m = DecoderLM(tiny_model_cfg({"name": name, "head_dim": 4, "v_head_dim": 6, "conv_size": 3}), vocab_size=64)
    layer = m.mixers[0]
    assert layer.layer_shape()["state_shape"] == [4, 6]
    channels = 4 * (4 + 4 + 6)
    assert layer.cache_bytes(100, batch=2) == 2 * 4 * (4 * 4 * 6 + channels * 2)
    cache = m.new_cache(2, 10)
    with torch.no_grad():
        m(torch.randint(0, 64, (2, 10)), cache=cache)
    assert cache.nbytes() == m.cache_bytes(10, batch=2)


def assert_forms_agree(args: list, ref: tuple, fast: tuple) -> None:
    """Two forms' (output, final state) on the same inputs `args` agree in fp64 (1e-10), and so do the gradients of a
    random linear loss over both w.r.t. every input."""
    (o_ref, s_ref), (o, s) = ref, fast
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    torch.testing.assert_close(o, o_ref, **F64)
    torch.testing.assert_close(s, s_ref, **F64)
    wo, ws = torch.randn_like(o), torch.randn_like(s)
    leaves = [x for x in args if x is not None]
    g_ref = torch.autograd.grad((o_ref * wo).sum() + (s_ref * ws).sum(), leaves)
    g_chunk = torch.autograd.grad((o * wo).sum() + (s * ws).sum(), leaves)
    for a, b in zip(g_ref, g_chunk):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(b, a, **F64)
