"""rwkv7 and its op, the generalized delta rule (ops/generalized_delta_rule.py): the chunkwise form == the per-token
recurrence in fp64 (1e-10, outputs, final state and every gradient; the op with RWKV-7's a = -kk, b = kk lr and with
general a, b; strong decays), prefill + one-token steps == the recurrence / the full forward, resets == each segment
alone, packing over several chunks == each document alone; parity with fla-core's pure-torch naive DPLR references
(`dplr_recurrence`, `dplr_chunkwise`; the op, and fla's RWKV7Attention forward rebuilt on our weights over them: fla's
rwkv7 ops and modules import triton, never installed here; outputs and gradients); the paper's / fla's initialisation
by layer; cache bytes.
The generic contract runs from tests/test_mixers_contract.py, exact FLOPs from tests/test_flops_exact.py, context
parallelism from tests/test_context_parallel.py (bench/context_parallel.CASES).

Tolerances (conftest.gap_atol): two of our forms in fp64 (1e-10); fla's naive forms compute in fp32 whatever the
input, so FP32_FACTOR x our own fp32-vs-fp64 gap - a wrong sign of a or b, a decay applied after the removal, or a
missing bonus moves the outputs by O(0.1-1)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnzoo.config.errors import ConfigError
from attnzoo.models.decoder import DecoderLM
from attnzoo.ops.generalized_delta_rule import (chunk_generalized_delta_rule, generalized_delta_rule_recurrent,
                                                generalized_delta_rule_step)
from tests.conftest import assert_grads_close, gap_atol, outputs_and_grads, tiny_model_cfg
from tests.test_delta_rule import _fla_naive
from tests.test_gla_retnet import assert_forms_agree, check_layer_matches
from tests.test_hgrn2_mamba2 import _layer, _x, check_chunk_equals_recurrent, check_decode_equals_full
from tests.test_packing import _model, packed_ids, strategy  # noqa: F401  (strategy: a fixture used below)
from tests.test_packing import test_a_packed_batch_equals_each_document_alone as packed_equals_alone

F64 = dict(atol=1e-10, rtol=0)


def inputs(B=2, H=3, T=50, Dk=8, Dv=6, *, rwkv=True, g_scale=1.0, init=False, dtype=torch.float64, seed=0):
    """q, k, v ~ N(0, 1), log-decay g <= 0 per key channel (RWKV-7's range, times g_scale), a and b: RWKV-7's -kk and
    kk * lr (kk unit per head, lr in (0, 1)) or general small vectors (`rwkv=False`), optional initial state."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = r(B, H, T, Dk), r(B, H, T, Dk), r(B, H, T, Dv)
    g = -g_scale * math.exp(-0.5) * torch.sigmoid(r(B, H, T, Dk))
    if rwkv:
        kk = F.normalize(r(B, H, T, Dk), dim=-1)
        a, b = -kk, kk * torch.sigmoid(r(B, H, T, Dk))
    else:  # |b a^T| ~ 0.3: the transition stays near diag(w)
        a, b = 0.3 * r(B, H, T, Dk) / Dk**0.5, r(B, H, T, Dk) / Dk**0.5
    s0 = r(B, H, Dk, Dv) if init else None
    return tuple(None if x is None else x.to(dtype) for x in (q, k, v, a, b, g, s0))


# ----------------------------------------------------------------------------- the op
# id: (T, chunk, RWKV-7's a / b, initial state, decay scale)
CASES = {
    "T50-C16": (50, 16, True, False, 1.0),
    "T50-C8-init": (50, 8, True, True, 1.0),
    "T50-C8-general-ab-init": (50, 8, False, True, 1.0),
    "T64-C64": (64, 64, True, False, 1.0),
    "T1-C16-init": (1, 16, True, True, 1.0),
    "T7-C64-shorter-than-chunk": (7, 64, False, True, 1.0),
    "T40-C8-strong-decay": (40, 8, True, True, 50.0),  # ~ -15 per token (e^{G} ~ e^-120 per chunk): underflows only
}


@pytest.mark.parametrize("case", list(CASES))
def test_chunk_equals_recurrent_fp64_outputs_and_gradients(case):
    T, C, rwkv, init, g_scale = CASES[case]
    args = [x if x is None else x.requires_grad_() for x in inputs(T=T, rwkv=rwkv, init=init, g_scale=g_scale)]
    assert_forms_agree(args, generalized_delta_rule_recurrent(*args, scale=1.0),
                       chunk_generalized_delta_rule(*args, scale=1.0, chunk_size=C))


def test_the_step_is_the_papers_rule():
    """One step on the (d_k, d_v) state == the paper's S_t = S_{t-1} (diag(w) + a b^T) + v k^T on the (d_v, d_k) state,
    read o = S_t r (here S_t^T q), written out with explicit matrices."""
    *seq, s0 = inputs(T=1, init=True)
    q, k, v, a, b, g = (x[:, :, 0] for x in seq)
    o, s = generalized_delta_rule_step(q, k, v, a, b, g, s0, scale=1.0)
    paper = s0.transpose(-1, -2)  # (B, H, Dv, Dk)
    transition = torch.diag_embed(g.exp()) + a[..., :, None] * b[..., None, :]
    paper = paper @ transition + v[..., :, None] * k[..., None, :]
    torch.testing.assert_close(s, paper.transpose(-1, -2), **F64)
    torch.testing.assert_close(o, (paper @ q[..., None])[..., 0], **F64)


@pytest.mark.parametrize("rwkv", [True, False], ids=["rwkv-ab", "general-ab"])
def test_decode_steps_equal_recurrent(rwkv):
    """A prefill by the chunkwise form, then one-token steps: the recurrence over the whole sequence."""
    q, k, v, a, b, g, s0 = inputs(T=30, rwkv=rwkv, init=True)
    o_ref, s_ref = generalized_delta_rule_recurrent(q, k, v, a, b, g, s0)
    o, state = chunk_generalized_delta_rule(*(x[:, :, :11] for x in (q, k, v, a, b, g)), s0, chunk_size=4)
    outs = [o]
    for t in range(11, 30):
        o_t, state = generalized_delta_rule_step(*(x[:, :, t] for x in (q, k, v, a, b, g)), state)
        outs.append(o_t[:, :, None])
    torch.testing.assert_close(torch.cat(outs, 2), o_ref, **F64)
    torch.testing.assert_close(state, s_ref, **F64)


def test_resets_start_each_marked_chunk_from_zero():
    """resets (packed documents laid out chunk-aligned): the marked chunks run as if the sequence started there."""
    q, k, v, a, b, g, s0 = inputs(B=2, T=24, init=True)
    resets = torch.tensor([[False, True, False, True, False, False], [False, False, False, False, True, False]])
    o, s = chunk_generalized_delta_rule(q, k, v, a, b, g, s0, chunk_size=4, resets=resets)
    for i in range(2):
        starts = [0] + [4 * c for c in range(6) if resets[i, c]] + [24]
        for lo, hi in zip(starts[:-1], starts[1:]):
            init = s0[i:i + 1] if lo == 0 else None
            seg = (x[i:i + 1, :, lo:hi] for x in (q, k, v, a, b, g))
            o_seg, s_seg = generalized_delta_rule_recurrent(*seg, init)
            torch.testing.assert_close(o[i:i + 1, :, lo:hi], o_seg, **F64)
        torch.testing.assert_close(s[i:i + 1], s_seg, **F64)


@pytest.mark.parametrize("form", ["dplr_recurrence", "dplr_chunkwise"])
@pytest.mark.parametrize("rwkv", [True, False], ids=["rwkv-ab", "general-ab"])
def test_parity_fla_naive_dplr(form, rwkv):
    """fla's naive DPLR forms (S_t = S_{t-1} diag(e^gk) + beta alpha^T S_{t-1} + k v^T on its (K, V) state, q read at
    d_k^-1/2: our default scale) with alpha = a, beta = b; T = 64, a multiple of dplr_chunkwise's chunk. The outputs,
    the final state and the gradients w.r.t. q, k, v, a, b, g and the initial state."""
    naive = _fla_naive("generalized_delta_rule/dplr")
    x = dict(zip(("q", "k", "v", "a", "b", "g", "s0"), inputs(T=64, rwkv=rwkv, init=True)))
    kw = dict(chunk_size=16) if form == "dplr_chunkwise" else {}

    def theirs(q, k, v, a, b, g, s0):
        return getattr(naive, form)(q, k, v, a, b, g, initial_state=s0.clone(), **kw)

    ours = lambda q, k, v, a, b, g, s0: chunk_generalized_delta_rule(q, k, v, a, b, g, s0)  # noqa: E731
    (o_ref, s_ref), g_ref = outputs_and_grads(theirs, x, torch.float32)
    (o, s), grads = outputs_and_grads(ours, x, torch.float32)
    (o64, s64), g64 = outputs_and_grads(ours, x)
    torch.testing.assert_close(o, o_ref, atol=gap_atol(o, o64), rtol=0)
    torch.testing.assert_close(s, s_ref, atol=gap_atol(s, s64), rtol=0)
    assert_grads_close(grads, g_ref, g64, form)


# ----------------------------------------------------------------------------- the layer
# id: (mixer section, T); chunks of 4-16 so T spans several
LAYERS = {
    "C16-T50": ({"name": "rwkv7"}, 50),
    "C4-T23-conv3": ({"name": "rwkv7", "chunk_size": 4, "conv_size": 3, "conv_bias": True}, 23),
    "C8-T40-dk6-dv12": ({"name": "rwkv7", "chunk_size": 8, "head_dim": 6, "v_head_dim": 12}, 40),
    "C16-T7-ranks": ({"name": "rwkv7", "decay_low_rank_dim": 4, "a_low_rank_dim": 6, "gate_low_rank_dim": 8}, 7),
    "C8-T40-strongest": ({"name": "rwkv7", "chunk_size": 8}, 40),
}


def _rwkv7(case: str):
    mixer, T = LAYERS[case]
    layer = _layer(mixer)
    if case.endswith("strongest"):
        with torch.no_grad():  # sigmoid -> 1: log w = -e^{-1/2} on every channel, RWKV-7's strongest decay
            layer.w_lora.bias.fill_(40.0)
    return layer, T


@pytest.mark.parametrize("case", list(LAYERS))
def test_rwkv7_chunk_equals_recurrent_fp64_outputs_and_gradients(case):
    layer, T = _rwkv7(case)
    check_chunk_equals_recurrent(layer, T)


@pytest.mark.parametrize("case", ["C4-T23-conv3", "C8-T40-dk6-dv12"])
@pytest.mark.parametrize("prompt", [1, 9])
def test_rwkv7_decode_steps_equal_full_forward(case, prompt):
    """A prefill, then one-token steps: the state, the token shift's tail and the input conv's tail carried."""
    layer, T = _rwkv7(case)
    check_decode_equals_full(layer, prompt, T)


def _fla_rwkv7_forward(layer, x, op):
    """fla's RWKV7Attention.forward (fla/layers/rwkv7.py, fuse_norm=False, as layer 0: no value residual) on our
    layer's weights, line by line: the token shift (ZeroPad2d) and fused_addcmul_rwkv7; the LoRAs (fla's LoRA:
    Linear, activation, Linear); kk = F.normalize(k * k_k) per head, k_update_ref's k.addcmul(k * (a - 1), k_a);
    chunk_rwkv7(r, w, k, v, a=-kk, b=kk * a, scale=1) computed by fla's naive DPLR form `op` (which reads q * d_k^-1/2,
    so r goes in times d_k^1/2); nn.GroupNorm(H, value_dim, eps=head_dim * norm_eps); gate_output_correction_ref
    (o + (r k r_k) v) * g; o_proj."""
    B, T, _ = x.shape
    H, K, V = layer.n_qk_heads, layer.qk_dim, layer.v_dim
    lora = lambda m, u, act: act(u @ m.down) @ m.up + (0 if m.bias is None else m.bias)  # noqa: E731
    delta = nn.ZeroPad2d((0, 0, 1, -1))(x) - x
    xr, xw, xk, xv, xa, xg = (x + delta * getattr(layer, n) for n in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"))
    r = layer.r_proj(xr)
    w = -0.6065306597126334 * lora(layer.w_lora, xw, torch.tanh).sigmoid()
    k, v = layer.k_proj(xk), layer.v_proj(xv)
    a = lora(layer.a_lora, xa, lambda u: u).sigmoid()
    g = lora(layer.g_lora, xg, torch.sigmoid)
    kk = F.normalize((k * layer.k_k).view(B, T, H, K), dim=-1, p=2.0)
    k = k.addcmul(k * (a - 1), layer.k_a)
    r, w, k, a = (u.view(B, T, H, K) for u in (r, w, k, a))
    v = v.view(B, T, H, V)
    t = lambda u: u.transpose(1, 2)  # noqa: E731  the naive forms take (B, H, T, D)
    o = t(op(t(r) * K**0.5, t(k), t(v), t(-kk), t(kk * a), t(w))[0])
    norm = nn.GroupNorm(H, H * V, eps=K * layer.cfg.norm_eps)
    norm.weight, norm.bias = layer.g_norm.weight, layer.g_norm.bias  # our parameters themselves: gradients reach them
    o = norm(o.reshape(B * T, H * V)).view(B, T, -1)
    o = (o + ((r * k * layer.r_k).sum(-1, keepdim=True) * v).view(B, T, -1)) * g
    return layer.o_proj(o)


@pytest.mark.parametrize("form", ["dplr_recurrence", "dplr_chunkwise"])
@pytest.mark.parametrize("case", ["C16-T50", "C8-T40-dk6-dv12"])
def test_rwkv7_layer_matches_fla_layer_with_naive_op(form, case):
    """The output and the gradients w.r.t. x and every parameter (tests/test_gla_retnet.check_layer_matches)."""
    naive = _fla_naive("generalized_delta_rule/dplr")
    layer, _ = _rwkv7(case)
    T = 32  # a multiple of dplr_chunkwise's chunk
    op = (lambda *u: naive.dplr_chunkwise(*u, chunk_size=16)) if form == "dplr_chunkwise" else naive.dplr_recurrence
    x = _x(layer, T, dtype=torch.float32)
    ref = check_layer_matches(layer, x, lambda layer, x: _fla_rwkv7_forward(layer, x, op), f"rwkv7 {case} {form}")
    assert ref.abs().max() > 0.1  # the weights moved off the init: o_proj is not zero


PACKED = [("rwkv7", {"chunk_size": 4}, "none"), ("rwkv7", {"chunk_size": 8, "conv_size": 3}, "rope")]


@pytest.mark.parametrize("impl", ["fast", "reference"])
@pytest.mark.parametrize("name, extra, pos", PACKED, ids=lambda v: str(v) if not isinstance(v, dict) else
                         "-".join(f"{k}{w}" for k, w in v.items()))
def test_packed_documents_over_several_chunks_equal_each_alone(name, extra, pos, impl, strategy):  # noqa: F811
    """Documents longer than a chunk: the token shift and the conv read zeros at each document start, the state is
    reset entering each document's first chunk."""
    packed_equals_alone(name, extra, pos, impl, strategy)


# ----------------------------------------------------------------------------- init, cache, config
def _fla_init(d: int, H: int, K: int, layer: int, n_layers: int) -> dict:
    """fla's RWKV7Attention._initialize_weights, its loop as written (hidden_size = H K = d here)."""
    ratio_0_to_1, ratio_1_to_almost0 = layer / (n_layers - 1), 1.0 - layer / n_layers
    ddd, www, zigzag, linear = torch.ones(d), torch.zeros(d), torch.zeros(d), torch.zeros(d)
    for n in range(d):
        linear[n] = n / (d - 1) - 0.5
        zigzag[n] = ((n % K) - ((K - 1) / 2)) / ((K - 1) / 2)
        zigzag[n] = zigzag[n] * abs(zigzag[n])
        www[n] = -6 + 6 * (n / (d - 1)) ** (1 + 1 * ratio_0_to_1 ** 0.3)
        ddd[n] = n / d
    mixes = {f"x_{c}": 1.0 - torch.pow(ddd, p * ratio_1_to_almost0) for c, p in zip("rwkvag", (0.2, 0.9, 0.7, 0.7, 0.9, 0.2))}
    return {**mixes, "k_k": 0.71 - linear * 0.1, "w_lora.bias": www + 0.5 + zigzag * 2.5,
            "a_lora.bias": -0.19 + zigzag * 0.3 + linear * 0.4, "k_a": torch.full((d,), 1.02),
            "r_k": torch.full((H, K), -0.04), "g_norm.weight": torch.full((d,), ((layer + 1) / n_layers) ** 0.7),
            "g_norm.bias": torch.zeros(d), "w_lora.down": torch.zeros(d, 32), "a_lora.down": torch.zeros(d, 32)}


@pytest.mark.parametrize("init", ["gpt2", "pytorch"])
def test_initialisation_is_the_papers_by_layer(init):
    """Every RWKV-7 parameter as fla's _initialize_weights sets it, per layer of 3, under either model.init (the gpt2
    init re-draws nn.Linear weights only); r, k, v orthogonal (k x 0.1) and o_proj zero where model.init=pytorch keeps
    them; the LoRAs' up matrices orthogonal x 0.1; r_k outside weight decay."""
    from attnzoo.training.lit_lm import param_groups

    torch.manual_seed(0)
    m = DecoderLM(tiny_model_cfg({"name": "rwkv7"}, d_model=64, n_heads=4, n_layers=3, init=init), vocab_size=64)
    for i, layer in enumerate(m.mixers):
        assert layer.w_lora.rank == layer.a_lora.rank == layer.g_lora.rank == 32  # fla's ranks at d_model 64
        state = layer.state_dict()
        for name, want in _fla_init(64, 4, 16, i, 3).items():
            torch.testing.assert_close(state[name], want, atol=1e-6, rtol=0, msg=f"layer {i} {name}")
        for lora in (layer.w_lora, layer.a_lora, layer.g_lora):
            up = lora.up.detach()  # (rank 32, 64): orthonormal rows x 0.1
            torch.testing.assert_close(up @ up.T, 0.01 * torch.eye(32), atol=1e-5, rtol=0)
        if init == "pytorch":
            for proj, gain in ((layer.r_proj, 1.0), (layer.k_proj, 0.1), (layer.v_proj, 1.0)):
                w = proj.weight.detach()
                torch.testing.assert_close(w @ w.T, gain**2 * torch.eye(64), atol=1e-5, rtol=0)
            assert not layer.o_proj.weight.any()
    decay_mixes = [layer.w_lora.bias for layer in m.mixers]
    assert decay_mixes[0].min() < -5 and decay_mixes[2].max() > 2  # a spread of forgetting rates across channels
    no_decay = {id(p) for g in param_groups(m, 0.1) if g["weight_decay"] == 0 for p in g["params"]}
    assert id(m.mixers[0].r_k) in no_decay and id(m.mixers[0].x_w) in no_decay


def test_one_layer_model_initialises():
    """fla divides by n_layers - 1; a one-layer model takes l / (L - 1) = 0: the first layer of any depth, with the
    GroupNorm weight (1 / 1)^0.7 = 1."""
    torch.manual_seed(0)
    layer = DecoderLM(tiny_model_cfg({"name": "rwkv7"}, n_layers=1), vocab_size=16).mixers[0]
    state = layer.state_dict()
    for name, want in _fla_init(32, 4, 8, 0, 2).items():
        want = torch.ones(32) if name == "g_norm.weight" else want
        torch.testing.assert_close(state[name], want, atol=1e-6, rtol=0, msg=name)


def test_cache_holds_the_state_the_token_shift_and_the_conv_tail():
    """n_heads * d_k * d_v state values (fp32) + d_model token-shift values + d_model * (K - 1) input-conv values;
    after a prefill the token-shift tail is the last input of the layer (here the conv's output)."""
    torch.manual_seed(0)
    m = DecoderLM(tiny_model_cfg({"name": "rwkv7", "head_dim": 4, "v_head_dim": 6, "conv_size": 3}), vocab_size=64)
    layer = m.mixers[0]
    assert layer.layer_shape()["state_shape"] == [4, 6] and layer.layer_shape()["conv"] == 3
    assert layer.cache_bytes(100, batch=2) == 2 * 4 * (4 * 4 * 6 + 32 + 32 * 2)
    cache = m.new_cache(2, 10)
    with torch.no_grad():
        m(torch.randint(0, 64, (2, 10)), cache=cache)
    assert cache.nbytes() == m.cache_bytes(10, batch=2)
    x = torch.randn(2, 5, 32)
    c = layer.new_cache(2, 5, torch.float32, "cpu")
    with torch.no_grad():
        layer(x, positions=torch.arange(5), cache=c)
        h, _ = layer.input_conv(x)
    torch.testing.assert_close(c.shift_tail[..., 0], h[:, -1])
    torch.testing.assert_close(c.conv_tail, x[:, -2:].transpose(1, 2))


def test_decay_init_range_starts_each_heads_channels_in_the_range():
    """decay_init_range [low, high]: at init (the decay LoRA is 0) every head's key channels decay per token from high
    (channel 0) down to low, the forgetting rates -log w geometric, in every layer, read through the layer's own
    features (log w = -e^{-1/2} sigmoid(w_0)); every other parameter as the paper's init (same seed, same values)."""
    low, high, H, dk = 0.99, 0.9999, 4, 16
    base = tiny_model_cfg({"name": "rwkv7"}, d_model=64, n_heads=H, n_layers=2)
    slow = tiny_model_cfg({"name": "rwkv7", "decay_init_range": [low, high]}, d_model=64, n_heads=H, n_layers=2)
    models = []
    for cfg in (base, slow):
        torch.manual_seed(0)
        models.append(DecoderLM(cfg, vocab_size=16).double())
    for paper, layer in zip(*(m.mixers for m in models)):
        h, prev = torch.randn(2, 5, 64, dtype=torch.float64), torch.randn(2, 5, 64, dtype=torch.float64)
        with torch.no_grad():  # (layer 1 reads layer 0's values for its value residual: any will do for w)
            w = layer.features(h, prev, {"rwkv7.v_first": torch.zeros(2, 5, H, dk, dtype=torch.float64)})[1]
            # (B, T, H, dk) log decays: the same at every token at init
        rate = -w[0, 0]  # (H, dk)
        want = torch.logspace(math.log10(-math.log(high)), math.log10(-math.log(low)), dk, dtype=torch.float64)
        torch.testing.assert_close(rate, want.expand(H, dk), rtol=1e-6, atol=0)  # fp32 bias: ~1e-7 relative
        torch.testing.assert_close(w, w[:1, :1].expand_as(w), atol=0, rtol=0)
        state, paper_state = layer.state_dict(), paper.state_dict()
        assert not torch.equal(state["w_lora.bias"], paper_state["w_lora.bias"])
        for name, value in paper_state.items():
            if name != "w_lora.bias":
                torch.testing.assert_close(state[name], value, atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("key, value, match", [
    ("decay_init_range", [0.5, 0.9], r"mixer.decay_init_range: must be null or \[low, high\] per-token decays with "
                                      r"0.54524 < low <= high < 1, got \[0.5, 0.9\]"),
    ("decay_init_range", [0.999, 0.99], r"mixer.decay_init_range: must be null or \[low, high\]"),
    ("decay_init_range", [0.99, 1.0], r"mixer.decay_init_range: must be null or \[low, high\]"),
    ("decay_init_range", [0.99], r"mixer.decay_init_range: must be null or \[low, high\]"),
    ("chunk_size", 0, r"mixer.chunk_size: must be >= 1, got 0"),
    ("decay_low_rank_dim", 0, r"mixer.decay_low_rank_dim: must be >= 1 or null, got 0"),
    ("norm_eps", 0.0, r"mixer.norm_eps: must be > 0, got 0.0"),
    ("conv_size", -1, r"mixer.conv_size: must be >= 0"),
])
def test_bad_config_is_refused_in_one_line(key, value, match):
    with pytest.raises(ConfigError, match=match):
        DecoderLM(tiny_model_cfg({"name": "rwkv7", key: value}), vocab_size=16)


def _two_layers(value_residual: bool = True, pattern=None, **kw):
    mixer = {"name": "rwkv7", "value_residual": value_residual}
    cfg = tiny_model_cfg(mixer, d_model=64, n_heads=4, **kw)
    if pattern:
        cfg.update(pattern=pattern, mixers={"a": {"name": "gqa"}, "r": mixer})
    torch.manual_seed(0)
    return DecoderLM(cfg, vocab_size=16).double()


def test_value_residual_mixes_the_first_rwkv7_layers_values():
    """The paper's v_first: the stack's first RWKV-7 layer (layer 1 behind an attention layer here) has no v_lora
    and leaves its values in the forward's carry; each later one computes v + (v_first - v) sigmoid(v_0 + x W_1 W_2),
    v_0 = 1 at init (sigmoid(1) = 0.73 of v_first). value_residual=false: no LoRA, each layer its own values."""
    m = _two_layers(pattern=["a", "r", "r", "r"], n_layers=4)
    first, *later = m.mixers[1:]
    assert first.v_lora is None and all(x.v_lora is not None for x in later)
    assert all((x.v_lora.bias == 1).all() and (x.v_lora.down == 0).all() for x in later)
    h, prev = torch.randn(2, 5, 64, dtype=torch.float64), torch.randn(2, 5, 64, dtype=torch.float64)
    carry = {}
    with torch.no_grad():
        v_first = first.features(h, prev, carry)[3]
        assert carry["rwkv7.v_first"] is v_first
        layer = later[0]
        layer.v_lora.down.normal_()  # a LoRA off its init, so the mix depends on the input
        v = layer.features(h, prev, carry)[3]
        delta = prev - h
        xv = h + delta * layer.x_v
        own = (xv @ layer.v_proj.weight.T).reshape(2, 5, 4, 16)
        mix = torch.sigmoid(layer.v_lora(xv)).reshape(2, 5, 4, 16)
        torch.testing.assert_close(v, own + (v_first - own) * mix, atol=1e-12, rtol=0)
    plain = _two_layers(value_residual=False, n_layers=3)
    assert all(x.v_lora is None for x in plain.mixers)
