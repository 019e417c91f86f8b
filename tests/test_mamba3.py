"""Mamba-3 (`mamba3`, mixers/mamba3.py, ops/trapezoidal_ssd.py; Lahoti et al. 2026, arXiv:2603.15569).

The op: the chunkwise form (the "RoPE trick": rotated C / B, the trapezoid folded into the key weights) and the
one-token step == the per-token recurrence written in complex numbers (fp64, 1e-10: outputs, the final state and the
gradients w.r.t. every input and the initial state; SISO and MIMO, T = 1, T < chunk, strong decays, no rotation, all
channels rotated); that recurrence == mamba_ssm's own statement of it (its step reference: a running angle, q and k
rotated by it, the state and the cached k in the rotated frame), rewritten here; two tokens by hand (the trapezoid);
at the Euler end (lambda = 1) with no rotation it *is* Mamba-2's SSD without a conv (gated linear attention read
unscaled, v = dt x), exactly; planted bugs caught: the rotation dropped from the chunkwise form, an angle ignored.
The layer: fast == reference in fp64 (outputs and the gradients of x and every parameter), prefill + one-token
steps == the full forward, packed documents == each alone, cache bytes, init, exact FLOPs, refusals. The contract
of every mixer (tests/test_mixers_contract.py, test_static_decode.py, ...) picks the yaml up by itself."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnzoo.config.errors import ConfigError
from attnzoo.models.decoder import DecoderLM
from attnzoo.ops import trapezoidal_ssd as op
from attnzoo.ops.gated_linear_attention import chunk_gated_linear_attention
from tests.conftest import outputs_and_grads, tiny_model_cfg
from tests.test_flops_exact import counter
from tests.test_hgrn2_mamba2 import _forward_and_grads, _layer, _x, check_decode_equals_full
from tests.test_packing import strategy  # noqa: F401  (a fixture used below)
from tests.test_packing import test_a_packed_batch_equals_each_document_alone as packed_equals_alone

F64 = dict(atol=1e-10, rtol=0)
NAMES = ("q", "k", "v", "g", "gamma", "w", "psi")


def _inputs(B=2, H=3, T=23, R=1, N=8, P=6, A=2, seed=0, decay=1.0, state=True) -> dict:
    """Random op inputs in fp64: q, k (B, H, T, R, N), v (B, H, T, R, P), a log-decay ~ -decay per token, the
    trapezoid's weights lambda dt and (1 - lambda) dt, angles psi ~ 1 rad per token, and an initial state."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    dt = F.softplus(r(B, H, T))
    lam = torch.sigmoid(r(B, H, T))
    x = dict(q=r(B, H, T, R, N), k=r(B, H, T, R, N), v=r(B, H, T, R, P), g=-decay * F.softplus(r(B, H, T)),
             gamma=lam * dt, w=(1 - lam) * dt, psi=r(B, H, T, A))
    if state:
        x.update(s0=r(B, H, N, P), k0=r(B, H, R, N), v0=r(B, H, R, P))
    return x


def _form(name: str, chunk: int = 8):
    def run(q, k, v, g, gamma, w, psi, s0=None, k0=None, v0=None):
        state = None if s0 is None else (s0, k0, v0)
        if name == "chunk":
            y, s = op.chunk_trapezoidal_ssd(q, k, v, g, gamma, w, psi, state, chunk_size=chunk)
        elif name == "reference":
            y, s = op.trapezoidal_ssd_recurrent(q, k, v, g, gamma, w, psi, state)
        else:  # one-token steps
            B, H, T, R, N = k.shape
            s = state or (k.new_zeros(B, H, N, v.shape[-1]), k.new_zeros(B, H, R, N), v.new_zeros(B, H, R, v.shape[-1]))
            ys = []
            for t in range(T):
                y, s = op.trapezoidal_ssd_step(*(u[:, :, t] for u in (q, k, v, g, gamma, w, psi)), s)
                ys.append(y)
            y = torch.stack(ys, 2)
        return (y, *s)
    return run


# id: (_inputs arguments, chunk size)
CASES = {
    "T23-C8": (dict(), 8), "T23-C8-R3": (dict(R=3), 8), "T1": (dict(T=1), 8), "T5-C8": (dict(T=5), 8),
    "T32-C8-nostate": (dict(T=32, state=False), 8), "T40-C16-strong": (dict(T=40, decay=30.0), 16),
    "T17-C4-norotation": (dict(T=17, A=0), 4), "T17-C4-allrotated-R2": (dict(T=17, A=4, R=2), 4),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("form", ["chunk", "step"])
def test_forms_equal_the_complex_recurrence(case, form):
    """Outputs, the final state (H, the last k and v) and, for the chunkwise form, the gradients w.r.t. every
    input and the initial state, fp64."""
    kw, chunk = CASES[case]
    x = _inputs(**kw)
    empty = {n: x.pop(n) for n in list(x) if x[n].numel() == 0}  # psi without rotation: no leaf to differentiate
    ref, g_ref = outputs_and_grads(lambda **t: _form("reference")(**t, **empty), x)
    if form == "step":
        with torch.no_grad():
            out = _form("step")(**x, **empty)
        for a, b in zip(out, ref):
            torch.testing.assert_close(a, b, **F64)
        return
    out, grads = outputs_and_grads(lambda **t: _form("chunk", chunk)(**t, **empty), x)
    assert all(torch.isfinite(o).all() for o in out)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, **F64)
    for name in g_ref:
        assert g_ref[name].abs().max() > 0, name
        torch.testing.assert_close(grads[name], g_ref[name], **F64, msg=lambda m, n=name: f"d/d{n}: {m}")


def _mamba_ssm_statement(q, k, v, g, gamma, w, psi, s0, k0, v0):
    """The recurrence as mamba_ssm's Mamba-3 step reference states it (its tests' mamba3_siso_step_ref and
    mamba3_MIMO_step_ref, rewritten): a running angle phi += psi; q and k rotated by +phi on the pairs (2j, 2j+1);
    h <- alpha h + (1 - lambda) dt alpha k~_prev v_prev^T + lambda dt k~ v^T in that rotated frame; y = h^T q~; the
    cached k~_prev the *rotated* previous key. The initial state is ours (unrotated frame, phi = 0)."""
    B, H, T, R, N = k.shape
    phi = psi.new_zeros(B, H, psi.shape[-1])
    h, k_prev, v_prev = s0, k0, v0
    ys = []
    for t in range(T):
        phi = phi + psi[:, :, t]
        qr, kr = (op.rotate_pairs(u[:, :, t], phi[:, :, None]) for u in (q, k))  # (B, H, R, N)
        alpha = g[:, :, t].exp()[..., None, None]
        h = (alpha * h + (w[:, :, t, None, None] * alpha) * torch.einsum("bhrn,bhrp->bhnp", k_prev, v_prev)
             + gamma[:, :, t, None, None] * torch.einsum("bhrn,bhrp->bhnp", kr, v[:, :, t]))
        ys.append(torch.einsum("bhnp,bhrn->bhrp", h, qr))
        k_prev, v_prev = kr, v[:, :, t]
    return torch.stack(ys, 2)


@pytest.mark.parametrize("R, A", [(1, 2), (2, 4), (1, 0)])
def test_recurrence_is_mamba_ssm_statement(R, A):
    x = _inputs(T=19, R=R, A=A)
    with torch.no_grad():
        torch.testing.assert_close(_form("reference")(**x)[0], _mamba_ssm_statement(**x), **F64)


def test_two_tokens_by_hand():
    """No rotation, one rank, from a zero state: h_0 = gamma_0 k_0 v_0^T (no previous token), h_1 = alpha_1 (h_0 +
    w_1 k_0 v_0^T) + gamma_1 k_1 v_1^T: the exponential-trapezoidal rule, the previous token's term decayed."""
    x = _inputs(T=2, A=0, state=False)
    q, k, v = (x[n][:, :, :, 0] for n in ("q", "k", "v"))  # (B, H, 2, N / P)
    g, gm, w = x["g"], x["gamma"], x["w"]
    outer = lambda t: k[:, :, t, :, None] * v[:, :, t, None, :]  # noqa: E731
    h0 = gm[:, :, 0, None, None] * outer(0)
    h1 = g[:, :, 1].exp()[..., None, None] * (h0 + w[:, :, 1, None, None] * outer(0)) + gm[:, :, 1, None, None] * outer(1)
    expected = torch.stack([(q[:, :, t, :, None] * h).sum(-2) for t, h in ((0, h0), (1, h1))], 2)
    for form in ("chunk", "reference", "step"):
        with torch.no_grad():
            torch.testing.assert_close(_form(form)(**x)[0][:, :, :, 0], expected, **F64)


def test_euler_end_without_rotation_is_mamba2_ssd():
    """lambda = 1 (gamma = dt, w = 0) and psi = 0: Mamba-2's SSD without a conv, i.e. gated linear attention with
    one log-decay per head read unscaled, q = C, k = B, v = dt x (ops/gated_linear_attention.py): equal to fp64
    rounding (1e-12). With lambda < 1 it is not (the trapezoid is seen)."""
    x = _inputs(T=37, A=0, state=False)
    dt = x["gamma"] + x["w"]
    t = lambda u: u[:, :, :, 0]  # noqa: E731  (B, H, T, D): one rank
    ssd, _ = chunk_gated_linear_attention(t(x["q"]), t(x["k"]), t(x["v"]) * dt[..., None], x["g"][..., None],
                                          scale=1.0, chunk_size=16)
    euler = dict(x, gamma=dt, w=torch.zeros_like(dt))
    with torch.no_grad():
        for form in ("chunk", "reference"):
            torch.testing.assert_close(t(_form(form)(**euler)[0]), ssd, atol=1e-12, rtol=0)
        assert (t(_form("chunk")(**x)[0]) - ssd).abs().max() > 1e-2
    # the layer's switches reach the op so: w = 0, gamma = dt, no angles
    layer = _layer({"name": "mamba3", "trapezoid": False, "rope_fraction": 0.0, "d_state": 8})
    u = _x(layer, 5, dtype=torch.float32)
    with torch.no_grad():
        _, _, _, _, gamma, w, psi = layer.features(layer.qkv(u), u)
        dt = F.softplus(layer.dt_proj(u) + layer.dt_bias)
    assert layer.trap_proj is None and layer.angle_proj is None and psi.shape[-1] == 0
    assert (w == 0).all() and torch.equal(gamma, dt)


def test_planted_bugs_are_caught():
    """The rotation dropped from the chunkwise form, or angles of 0 instead of psi: both far from the reference."""
    x = _inputs(T=21, R=2)
    with torch.no_grad():
        ref = _form("reference")(**x)[0]
        no_angle = _form("reference")(**dict(x, psi=torch.zeros_like(x["psi"])))[0]
        assert (no_angle - ref).abs().max() > 1e-1 * ref.abs().max()
        real = op.rotate_pairs
        try:  # a chunkwise form that never rotates (q, k nor the handed-over state)
            op.rotate_pairs = lambda u, angle: u
            assert (_form("chunk")(**x)[0] - ref).abs().max() > 1e-1 * ref.abs().max()
        finally:
            op.rotate_pairs = real
    layer = _layer({"name": "mamba3", "d_state": 8}).double()
    xx = _x(layer, 12)
    with torch.no_grad():
        out = layer(xx, positions=torch.arange(12))
        layer.angle_proj.weight.zero_()
        assert (layer(xx, positions=torch.arange(12)) - out).abs().max() > 1e-3 * out.abs().max()


# ----------------------------------------------------------------------------- the layer
LAYERS = {
    "C8-T40": ({"name": "mamba3", "chunk_size": 8, "d_state": 16}, 40),
    "C4-T23-mimo2-groups2": ({"name": "mamba3", "chunk_size": 4, "d_state": 8, "mimo_rank": 2, "n_groups": 2}, 23),
    "C8-T40-conv4-norm": ({"name": "mamba3", "chunk_size": 8, "d_state": 16, "conv_size": 4, "conv_bias": True,
                           "use_output_norm": True}, 40),
    "C8-T7-allrotated": ({"name": "mamba3", "chunk_size": 8, "d_state": 8, "rope_fraction": 1.0}, 7),
    "C8-T24-euler-real": ({"name": "mamba3", "chunk_size": 8, "d_state": 8, "trapezoid": False,
                           "rope_fraction": 0.0}, 24),
    "C64-T70-defaults": ({"name": "mamba3"}, 70),
    "C8-T40-strong": ({"name": "mamba3", "chunk_size": 8, "d_state": 8, "mimo_rank": 3}, 40),
}


def _mamba3(case: str):
    mixer, T = LAYERS[case]
    layer = _layer(mixer)
    if case.endswith("strong"):
        with torch.no_grad():
            layer.a_proj.weight.mul_(300.0)  # |A| in the hundreds: dt A ~ -10 .. -100 per token
            layer.dt_bias.fill_(1.0)
    return layer, T


@pytest.mark.parametrize("case", list(LAYERS))
def test_layer_fast_equals_reference_fp64_outputs_and_gradients(case):
    """Outputs and the gradients of x and every parameter, fp64, within 1e-12 of each tensor's largest value (the
    perturbed weights make gradients of ~1e4 here: 1e-10 absolute would ask for 1e-14 relative)."""
    layer, T = _mamba3(case)
    if case.endswith("strong"):  # the decays really are that strong
        with torch.no_grad():
            u = _x(layer, T, dtype=torch.float32)
            _, _, _, g, *_ = layer.features(layer.qkv(u), u)
        assert g.median() < -10
    layer = layer.double()
    x = _x(layer, T)
    out_ref, g_ref = _forward_and_grads(layer, x, "reference")
    out, g = _forward_and_grads(layer, x, "fast")
    for name, a, b in zip(["output", "x", *(n for n, _ in layer.named_parameters())], (out_ref, *g_ref), (out, *g)):
        assert torch.isfinite(b).all() and a.abs().max() > 0, name
        torch.testing.assert_close(b, a, atol=1e-12 * a.abs().max().item(), rtol=0, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("case", ["C8-T40", "C4-T23-mimo2-groups2", "C8-T40-conv4-norm"])
@pytest.mark.parametrize("prompt", [1, 9])
def test_decode_steps_equal_full_forward(case, prompt):
    layer, T = _mamba3(case)
    check_decode_equals_full(layer, prompt, T)


@pytest.mark.parametrize("impl", ["fast", "reference"])
@pytest.mark.parametrize("extra", [{"chunk_size": 4, "d_state": 8}, {"chunk_size": 8, "d_state": 8, "mimo_rank": 2,
                                                                      "conv_size": 3}], ids=["C4", "C8-mimo2-conv3"])
def test_packed_documents_equal_each_alone(extra, impl, strategy):  # noqa: F811
    """Documents longer than a chunk: the state, the rotation and the trapezoid's previous-token term restart at each
    document (outputs and every parameter gradient, fp64)."""
    packed_equals_alone("mamba3", extra, "none", impl, strategy)


def test_cache_holds_state_previous_token_and_conv_tail():
    """n_heads (N P + R N + P) values in fp32 (state, last B~, last x) + the conv tail over [C | B | x]
    (2 R G N + d_inner channels, K - 1 each, in the cache dtype): constant in the context, == measured."""
    torch.manual_seed(0)
    m = DecoderLM(tiny_model_cfg({"name": "mamba3", "d_state": 6, "n_groups": 2, "mimo_rank": 2, "conv_size": 3}),
                  vocab_size=64)
    layer = m.mixers[0]
    H, P, N, R = 8, 8, 6, 2  # d_inner = 2 * 32 = 64 = 8 heads of the model's head size 8
    assert layer.layer_shape()["state_shape"] == [N, P] and layer.n_v_heads == H and layer.n_angles == 1
    channels = 2 * R * 2 * N + H * P
    for L in (1, 100, 10_000):
        assert layer.cache_bytes(L, batch=2) == 2 * (4 * H * (N * P + R * N + P) + 4 * channels * 2)
    assert layer.cache_bytes(5, batch=1, dtype=torch.bfloat16) == 4 * H * (N * P + R * N + P) + 2 * channels * 2
    cache = m.new_cache(2, 10)
    with torch.no_grad():
        m(torch.randint(0, 64, (2, 10)), cache=cache)
    assert cache.nbytes() == m.cache_bytes(10, batch=2)


def test_initialisation_is_mamba_ssm_s():
    """softplus(dt_bias) ~ logU[0.001, 0.1], B / C biases 1, D 1, MIMO x / z / o 1/R, 1, 1/R; lambda about 0.5 at
    init (no bias on its projection, the model's 0.02 init); rope_fraction 0.5 of d_state 64 -> 16 angles; dt_bias, D, the biases and MIMO scales
    outside weight decay."""
    from attnzoo.training.lit_lm import param_groups

    torch.manual_seed(0)
    m = DecoderLM(tiny_model_cfg({"name": "mamba3", "mimo_rank": 4}, d_model=256, n_heads=2), vocab_size=64)
    layer = m.mixers[0]
    assert layer.n_v_heads == 4 and layer.v_dim == 128 and layer.state_shape == (64, 128) and layer.n_angles == 16
    dt = F.softplus(layer.dt_bias)
    assert ((dt >= 1e-3 * (1 - 1e-6)) & (dt <= 0.1 * (1 + 1e-6))).all() and dt.std() > 0
    assert torch.equal(layer.B_bias, torch.ones(4, 4, 64)) and torch.equal(layer.C_bias, torch.ones(4, 4, 64))
    assert torch.equal(layer.D, torch.ones(4))
    assert torch.equal(layer.mimo_x, torch.full((4, 4, 128), 0.25)) and torch.equal(layer.mimo_z, torch.ones(4, 4, 128))
    with torch.no_grad():
        lam = torch.sigmoid(layer.trap_proj(torch.randn(64, 256)))
    assert abs(lam.mean() - 0.5) < 0.05 and (lam - 0.5).abs().max() < 0.25  # logits ~ N(0, 0.02^2 d_model)
    no_decay = {id(p) for g in param_groups(m, 0.1) if g["weight_decay"] == 0 for p in g["params"]}
    named = (layer.dt_bias, layer.D, layer.B_bias, layer.C_bias, layer.mimo_x, layer.mimo_z, layer.mimo_o)
    assert {id(p) for p in named} <= no_decay and id(layer.qkv.weight) not in no_decay


@pytest.mark.parametrize("mixer", [{"chunk_size": 8, "d_state": 16}, {"chunk_size": 4, "d_state": 8, "mimo_rank": 2,
                                                                     "n_groups": 2, "conv_size": 3}],
                         ids=["C8", "C4-mimo2-groups2-conv3"])
@pytest.mark.parametrize("L", [16, 40])
def test_flops_exact_for_the_chunkwise_form(mixer, L):
    """FlopCounterMode over the chunkwise training forward == flops_per_token * L: every projection, the conv, and
    per head 2 C R^2 (N + P) + 4 R N P (docs/linear_mixers.md)."""
    torch.manual_seed(0)
    m = DecoderLM(tiny_model_cfg({"name": "mamba3", **mixer}), vocab_size=64).eval()
    layer = m.mixers[0]
    x = torch.randn(1, L, m.cfg.d_model, requires_grad=True)
    with counter() as fc:
        layer(x, positions=torch.arange(L))
    assert fc.get_total_flops() == pytest.approx(layer.flops_per_token(L) * L, rel=1e-12)


@pytest.mark.parametrize("key, value, message", [
    ("mimo_rank", 0, "must be >= 1, got 0"),
    ("n_groups", 3, "does not divide n_heads = 8"), ("dt_init_range", [0.1, 0.001], "must be [low, high]"),
    ("A_floor", -1.0, "must be >= 0, got -1.0")])
def test_bad_values_are_refused_naming_the_field(key, value, message):
    from attnzoo.config.schema import resolve_model

    with pytest.raises(ConfigError) as e:
        resolve_model({"d_model": 32, "n_heads": 4, "mixer": {"name": "mamba3", key: value}})
    assert str(e.value).startswith(f"model.layers[0].mixer.{key}: {message}"), str(e.value)
