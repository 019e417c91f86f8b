"""The delta-rule and linear-attention ops (ops/delta_rule.py, ops/linear_attention.py): chunkwise form ==
per-token recurrence (outputs, final state, gradients), an fp64 oracle, state carrying, strong decay, and
parity with transformers' Qwen3-Next torch references and fla-core's naive.py references (outputs, final states and
the gradients w.r.t. every input, conftest.projected_grads).

Tolerances (conftest.gap_atol): comparisons of two of our forms run in fp64 (1e-10); the fp32 tests and the
references that compute in fp32 internally (transformers, fla) use FP32_FACTOR x the same computation's own
fp32-vs-fp64 gap - a wrong decay, beta or state update moves the outputs by O(0.1-1), far above it."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from attnzoo.ops.delta_rule import chunk_delta_rule, decay_exp, delta_rule_recurrent, delta_rule_step, solve_unit_lower
from attnzoo.ops.linear_attention import chunk_linear_attention, linear_attention_recurrent, linear_attention_step
from tests.conftest import assert_grads_close, gap_atol, outputs_and_grads

F64 = dict(atol=1e-10, rtol=0)  # two forms of the same computation, both in fp64


def pair_atol(a32, a64, b32, b64) -> float:
    """Two fp32 forms of one computation, each also run in fp64: FP32_FACTOR x the larger of their own
    fp32-vs-fp64 gaps (the chunk form rounds up to ~9x more than the recurrence with 64-token chunks)."""
    return max(gap_atol(a32, a64), gap_atol(b32, b64))


def inputs(B=2, H=3, T=50, Dk=16, Dv=12, *, gated=True, g_scale=1.0, init=False, dtype=torch.float32, seed=0):
    """Normalised q/k, beta in (0, 1), log-decay g <= 0 (about -g_scale per token), optional initial state."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q = F.normalize(r(B, H, T, Dk), dim=-1)
    k = F.normalize(r(B, H, T, Dk), dim=-1)
    v = r(B, H, T, Dv)
    beta = torch.sigmoid(r(B, H, T))
    g = -g_scale * F.softplus(r(B, H, T)) / 0.7 if gated else None
    s0 = r(B, H, Dk, Dv) if init else None
    cast = lambda x: None if x is None else x.to(dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), cast(beta), cast(g), cast(s0)


# id: (T, chunk, heads, gated, initial state)
CASES = {
    "T50-C16-H3-gated": (50, 16, 3, True, False),
    "T50-C16-H3-gated-init": (50, 16, 3, True, True),
    "T50-C16-H3-plain": (50, 16, 3, False, False),
    "T50-C16-H3-plain-init": (50, 16, 3, False, True),
    "T1-C64-gated-init": (1, 64, 2, True, True),
    "T64-C64-exact": (64, 64, 4, True, False),
    "T130-C64-H1": (130, 64, 1, True, True),
    "T7-C64-shorter-than-chunk": (7, 64, 2, False, True),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_chunk_matches_recurrent_fp32(case):
    """fp32 chunk form against the fp32 recurrence, within FP32_FACTOR x the larger of their own fp32 roundings."""
    T, C, H, gated, init = CASES[case]
    q, k, v, beta, g, s0 = inputs(H=H, T=T, gated=gated, init=init)
    as64 = inputs(H=H, T=T, gated=gated, init=init, dtype=torch.float64)
    o_ref, s_ref = delta_rule_recurrent(q, k, v, beta, g, s0)
    o_ref64, s_ref64 = delta_rule_recurrent(*as64)
    o, s = chunk_delta_rule(q, k, v, beta, g, s0, chunk_size=C)
    o64, s64 = chunk_delta_rule(*as64, chunk_size=C)
    assert o.shape == o_ref.shape == (2, H, T, 12) and s.shape == (2, H, 16, 12)
    torch.testing.assert_close(o, o_ref, atol=pair_atol(o_ref, o_ref64, o, o64), rtol=0)
    torch.testing.assert_close(s, s_ref, atol=pair_atol(s_ref, s_ref64, s, s64), rtol=0)


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
def test_fp64_tight_oracle(gated):
    q, k, v, beta, g, s0 = inputs(T=77, gated=gated, init=True, dtype=torch.float64)
    o_ref, s_ref = delta_rule_recurrent(q, k, v, beta, g, s0)
    o, s = chunk_delta_rule(q, k, v, beta, g, s0, chunk_size=16)
    torch.testing.assert_close(o, o_ref, **F64)
    torch.testing.assert_close(s, s_ref, **F64)
    # the fp32 chunk form is as accurate as the fp32 recurrence: within FP32_FACTOR x the recurrence's fp32 error
    as32 = [None if x is None else x.float() for x in (q, k, v, beta, g, s0)]
    o32, s32 = chunk_delta_rule(*as32, chunk_size=16)
    o_rec32, s_rec32 = delta_rule_recurrent(*as32)
    torch.testing.assert_close(o32.double(), o_ref, atol=gap_atol(o_rec32, o_ref), rtol=0)
    torch.testing.assert_close(s32.double(), s_ref, atol=gap_atol(s_rec32, s_ref), rtol=0)


@pytest.mark.parametrize("g_scale", [30.0, 300.0], ids=["g-30", "g-300"])
def test_strong_decay_is_finite_and_exact(g_scale):
    q, k, v, beta, g, s0 = inputs(T=45, g_scale=g_scale, init=True)
    assert g.mean() < -g_scale / 2
    as64 = inputs(T=45, g_scale=g_scale, init=True, dtype=torch.float64)
    o_ref, s_ref = delta_rule_recurrent(q, k, v, beta, g, s0)
    o_ref64, s_ref64 = delta_rule_recurrent(*as64)
    o, s = chunk_delta_rule(q, k, v, beta, g, s0, chunk_size=16)
    o64, s64 = chunk_delta_rule(*as64, chunk_size=16)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    # in fp32, where exp of the decays under- and overflows: within FP32_FACTOR x the larger fp32 rounding
    torch.testing.assert_close(o, o_ref, atol=pair_atol(o_ref, o_ref64, o, o64), rtol=0)
    torch.testing.assert_close(s, s_ref, atol=pair_atol(s_ref, s_ref64, s, s64), rtol=0)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, beta, g)]
    out, state = chunk_delta_rule(*leaves, s0, chunk_size=16)
    (out.sum() + state.sum()).backward()
    assert all(torch.isfinite(x.grad).all() for x in leaves)


@pytest.mark.parametrize("gated,init", [(True, True), (True, False), (False, True)], ids=["gated-init", "gated", "plain-init"])
def test_gradients_match_recurrent(gated, init):
    base = inputs(H=2, T=37, gated=gated, init=init, dtype=torch.float64)
    names = ["q", "k", "v", "beta", "g", "s0"]
    grads = {}
    for form in ("recurrent", "chunk"):
        leaves = [None if x is None else x.clone().requires_grad_() for x in base]
        fn = delta_rule_recurrent if form == "recurrent" else (lambda *a: chunk_delta_rule(*a, chunk_size=16))
        o, s = fn(*leaves)
        w_o = torch.randn(o.shape, generator=torch.Generator().manual_seed(5), dtype=o.dtype)
        w_s = torch.randn(s.shape, generator=torch.Generator().manual_seed(6), dtype=s.dtype)
        ((o * w_o).sum() + (s * w_s).sum()).backward()
        grads[form] = {n: x.grad for n, x in zip(names, leaves) if x is not None}
    assert set(grads["chunk"]) == {"q", "k", "v", "beta"} | ({"g"} if gated else set()) | ({"s0"} if init else set())
    for n, gr in grads["recurrent"].items():
        assert gr.abs().max() > 1e-3, n  # the comparison is not vacuous
        torch.testing.assert_close(grads["chunk"][n], gr, **F64, msg=f"grad of {n}")


@pytest.mark.parametrize("split", [1, 16, 29], ids=lambda s: f"split{s}")
def test_state_carrying(split):
    q, k, v, beta, g, s0 = inputs(T=45, init=True, dtype=torch.float64)
    o_all, s_all = chunk_delta_rule(q, k, v, beta, g, s0, chunk_size=16)
    a = slice(0, split)
    b = slice(split, None)
    o1, s1 = chunk_delta_rule(q[:, :, a], k[:, :, a], v[:, :, a], beta[:, :, a], g[:, :, a], s0, chunk_size=16)
    o2, s2 = chunk_delta_rule(q[:, :, b], k[:, :, b], v[:, :, b], beta[:, :, b], g[:, :, b], s1, chunk_size=16)
    torch.testing.assert_close(torch.cat([o1, o2], 2), o_all, **F64)
    torch.testing.assert_close(s2, s_all, **F64)


def test_prefill_then_steps_equals_full():
    q, k, v, beta, g, s0 = inputs(T=30, dtype=torch.float64)
    o_all, s_all = chunk_delta_rule(q, k, v, beta, g, chunk_size=8)
    o, s = chunk_delta_rule(q[:, :, :20], k[:, :, :20], v[:, :, :20], beta[:, :, :20], g[:, :, :20], chunk_size=8)
    outs = [o]
    for t in range(20, 30):
        o_t, s = delta_rule_step(q[:, :, t], k[:, :, t], v[:, :, t], beta[:, :, t], s, g[:, :, t])
        outs.append(o_t[:, :, None])
    torch.testing.assert_close(torch.cat(outs, 2), o_all, **F64)
    torch.testing.assert_close(s, s_all, **F64)


def test_unit_lower_solve_matches_torch_and_gradcheck():
    gen = torch.Generator().manual_seed(0)
    A = torch.randn(3, 9, 9, dtype=torch.float64, generator=gen) * 0.3
    R = torch.randn(3, 9, 5, dtype=torch.float64, generator=gen)
    ref = torch.linalg.solve_triangular(A.tril(-1) + torch.eye(9, dtype=A.dtype), R, upper=False)
    torch.testing.assert_close(solve_unit_lower(A, R), ref, atol=1e-12, rtol=0)
    assert torch.autograd.gradcheck(solve_unit_lower, (A.requires_grad_(), R.requires_grad_()))


def test_decay_exp_flushes_and_never_overflows():
    x = torch.tensor([0.0, -1.0, -29.0, -30.0, 1000.0])
    y = decay_exp(x, keep=torch.tensor([True, True, True, True, False]))
    assert torch.equal(y[[3, 4]], torch.zeros(2)) and y[2] > 0
    torch.testing.assert_close(y[:3], x[:3].exp())


# ----------------------------------------------------------------------------- linear attention


@pytest.mark.parametrize("T,C,init", [(50, 16, False), (50, 16, True), (1, 64, True), (64, 32, False)],
                         ids=["T50-C16", "T50-C16-init", "T1", "T64-C32"])
def test_linear_attention_chunk_matches_recurrent(T, C, init):
    q, k, v, _, _, s0 = inputs(T=T, gated=False, init=init, dtype=torch.float64)
    o_ref, s_ref = linear_attention_recurrent(q, k, v, s0)
    o, s = chunk_linear_attention(q, k, v, s0, chunk_size=C)
    torch.testing.assert_close(o, o_ref, **F64)
    torch.testing.assert_close(s, s_ref, **F64)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    grads = []
    for fn in (linear_attention_recurrent, lambda *a: chunk_linear_attention(*a, chunk_size=C)):
        o, s = fn(*leaves, s0)
        grads.append(torch.autograd.grad(o.pow(2).sum() + s.sum(), leaves))
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, **F64)
    # decode: chunk prefill then steps
    o_all, _ = linear_attention_recurrent(q, k, v, s0)
    o1, s1 = chunk_linear_attention(q[:, :, :-1], k[:, :, :-1], v[:, :, :-1], s0, chunk_size=C)
    o2, _ = linear_attention_step(q[:, :, -1], k[:, :, -1], v[:, :, -1], s1)
    torch.testing.assert_close(o2, o_all[:, :, -1], **F64)


# ----------------------------------------------------------------------------- transformers' Qwen3-Next


def _hf(name):
    mod = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    fn = getattr(mod, name)
    return getattr(fn, "__wrapped__", fn)


@pytest.mark.parametrize("form", ["torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"])
@pytest.mark.parametrize("group", [1, 2], ids=["H4", "Hk2-Hv4"])
def test_parity_transformers_qwen3_next(form, group):
    """transformers' references take (B, T, H, D) and L2-normalise q/k themselves (use_qk_l2norm_in_kernel): the
    outputs, the final state and the gradients w.r.t. q, k (before the norm), v, beta, g and the initial state."""
    fn = _hf(form)
    B, Hk, T, D = 2, 4 // group, 70, 16
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(B, T, Hk, D, generator=gen), torch.randn(B, T, Hk, D, generator=gen)
    v = torch.randn(B, T, 4, D, generator=gen)
    beta, g = torch.rand(B, T, 4, generator=gen), F.logsigmoid(torch.randn(B, T, 4, generator=gen))
    s0 = torch.randn(B, 4, D, D, generator=gen)
    x = dict(q=q, k=k, v=v, beta=beta, g=g, s0=s0)

    def theirs(q, k, v, beta, g, s0):
        return fn(q, k, v, g=g, beta=beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)

    def ours(q, k, v, beta, g, s0):
        l2 = lambda x: x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # noqa: E731  (their l2norm)
        qh = l2(q).repeat_interleave(group, 2).transpose(1, 2)
        kh = l2(k).repeat_interleave(group, 2).transpose(1, 2)
        o, s = chunk_delta_rule(qh, kh, v.transpose(1, 2), beta.transpose(1, 2), g.transpose(1, 2), s0)
        return o.transpose(1, 2), s

    (o_hf, s_hf), g_hf = outputs_and_grads(theirs, x)
    (o, s), grads = outputs_and_grads(ours, x)
    (o64, s64), g64 = outputs_and_grads(ours, x, torch.float64)
    # transformers computes in fp32 internally: FP32_FACTOR x our own fp32-vs-fp64 gap (of each gradient too)
    torch.testing.assert_close(o, o_hf, atol=gap_atol(o, o64), rtol=0)
    torch.testing.assert_close(s, s_hf, atol=gap_atol(s, s64), rtol=0)
    assert_grads_close(grads, g_hf, g64, form)


# ----------------------------------------------------------------------------- fla-core naive.py references


def _fla_naive(subdir: str):
    """Load fla's pure-torch naive.py by file path: `import fla.ops` would import triton (never on CPU)."""
    pytest.importorskip("einops")
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("fla-core not installed (pip install fla-core --no-deps)")
    path = Path(list(spec.submodule_search_locations)[0]) / "ops" / subdir / "naive.py"
    if not path.exists():
        pytest.skip(f"{path} not in this fla-core version")
    mod_spec = importlib.util.spec_from_file_location(f"fla_naive_{subdir}", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


def test_parity_fla_naive_delta_rule():
    """fla's recurrence (fp32 whatever the input, with an initial state) and its chunkwise form (its inputs' dtype, no
    initial state): the outputs, the final state and the gradients w.r.t. q, k, v, beta (and the initial state)."""
    naive = _fla_naive("delta_rule")
    q, k, v, beta, _, s0 = inputs(T=64, gated=False, init=True, dtype=torch.float64)
    x = dict(q=q, k=k, v=v, beta=beta, s0=s0)
    ours = lambda q, k, v, beta, s0: chunk_delta_rule(q, k, v, beta, None, s0, chunk_size=16)  # noqa: E731

    def theirs(q, k, v, beta, s0):
        return naive.delta_rule_recurrence(q, k, v, beta, initial_state=s0.clone())

    (o_ref, s_ref), g_ref = outputs_and_grads(theirs, x, torch.float32)
    (o, s), grads = outputs_and_grads(ours, x, torch.float32)
    (o64, s64), g64 = outputs_and_grads(ours, x)
    # fla's recurrence computes in fp32 whatever the input: FP32_FACTOR x our own fp32-vs-fp64 gap
    torch.testing.assert_close(o, o_ref, atol=gap_atol(o, o64), rtol=0)
    torch.testing.assert_close(s, s_ref, atol=gap_atol(s, s64), rtol=0)
    assert_grads_close(grads, g_ref, g64, "delta_rule_recurrence")
    # fla's chunkwise form follows its inputs' dtype: both in fp64
    del x["s0"]  # no initial state; T % 32 == 0
    (o_chunk, s_chunk), g_chunk = outputs_and_grads(lambda **a: naive.delta_rule_chunkwise(**a, chunk_size=32), x)
    assert o_chunk.dtype == s_chunk.dtype == torch.float64
    (o, s), grads = outputs_and_grads(lambda **a: chunk_delta_rule(**a, chunk_size=32), x)
    torch.testing.assert_close(o, o_chunk, **F64)
    torch.testing.assert_close(s, s_chunk, **F64)
    assert_grads_close(grads, g_chunk, what="delta_rule_chunkwise")


@pytest.mark.parametrize("form", ["naive_recurrent_gated_delta_rule", "naive_chunk_gated_delta_rule"])
def test_parity_fla_naive_gated_delta_rule(form):
    """The outputs, the final state and the gradients w.r.t. q, k, v, beta, g and the initial state."""
    naive = _fla_naive("gated_delta_rule")
    q, k, v, beta, g, s0 = inputs(T=70, init=True, dtype=torch.float64)
    x = dict(q=q, k=k, v=v, beta=beta, g=g, s0=s0)
    t = lambda x: x.transpose(1, 2)  # noqa: E731  fla takes (B, T, H, D)

    def theirs(q, k, v, beta, g, s0):
        o, s = getattr(naive, form)(t(q), t(k), t(v), beta=t(beta), g=t(g), initial_state=s0.clone(),
                                    output_final_state=True)
        return t(o), s

    ours = lambda q, k, v, beta, g, s0: chunk_delta_rule(q, k, v, beta, g, s0)  # noqa: E731
    (o_ref, s_ref), g_ref = outputs_and_grads(theirs, x, torch.float32)
    (o, s), grads = outputs_and_grads(ours, x, torch.float32)
    (o64, s64), g64 = outputs_and_grads(ours, x)
    # fla's naive forms compute in fp32 whatever the input: FP32_FACTOR x our own fp32-vs-fp64 gap
    torch.testing.assert_close(o, o_ref, atol=gap_atol(o, o64), rtol=0)
    torch.testing.assert_close(s, s_ref, atol=gap_atol(s, s64), rtol=0)
    assert_grads_close(grads, g_ref, g64, form)


def test_parity_fla_naive_linear_attention():
    """The outputs, the final state and the gradients w.r.t. q, k, v and the initial state."""
    naive = _fla_naive("linear_attn")
    q, k, v, _, _, s0 = inputs(T=50, gated=False, init=True, dtype=torch.float64)
    x = dict(q=q, k=k, v=v, s0=s0)
    t = lambda x: x.transpose(1, 2)  # noqa: E731

    def theirs(q, k, v, s0):
        o, s = naive.naive_recurrent_linear_attn(t(q), t(k), t(v), initial_state=s0, output_final_state=True)
        return t(o), s

    ours = lambda q, k, v, s0: chunk_linear_attention(q, k, v, s0, chunk_size=16)  # noqa: E731
    (o_ref, s_ref), g_ref = outputs_and_grads(theirs, x, torch.float32)
    (o, s), grads = outputs_and_grads(ours, x, torch.float32)
    (o64, s64), g64 = outputs_and_grads(ours, x)
    # fla's naive form computes in fp32 whatever the input: FP32_FACTOR x our own fp32-vs-fp64 gap
    torch.testing.assert_close(o, o_ref, atol=gap_atol(o, o64), rtol=0)
    torch.testing.assert_close(s, s_ref, atol=gap_atol(s, s64), rtol=0)
    assert_grads_close(grads, g_ref, g64, "naive_recurrent_linear_attn")
