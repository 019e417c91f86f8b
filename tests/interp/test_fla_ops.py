"""Op level: every fla function the project calls (ops/fla_kernels.py, through its wrappers: layout, dtype casts,
scale, gate conventions, initial and final states, padding) against the project's torch op, run by Triton's
interpreter: the output, the final state and the gradient of every input, in fp32 where the kernel takes it and
in fp16, at T below one chunk, T not a multiple of the chunk and several chunks, batch and heads 2, with and
without an initial state.

Tolerances, derived per tensor from the same computation:
- fp32: the torch op in fp32 against the torch op in fp64 (conftest.gap_atol: FP32_FACTOR x that gap), the fla
  result against the fp64 torch op;
- fp16: what one fp16 rounding of the inputs does to the fp64 torch op (its result on the inputs rounded to fp16
  against its result on the inputs), at least one fp16 rounding of the result's size, times FP16_FACTOR: fla
  rounds its inputs once and keeps some intermediates in 16 bits (the chunk's attention matrix, the corrected
  values), a few roundings of the same size more.
The project's forms that the mixers call are the chunk forms (tests/test_*: equal to the recurrences in fp64).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnzoo.ops import fla_kernels
from attnzoo.ops.delta_product import chunk_delta_product
from attnzoo.ops.delta_rule import chunk_delta_rule
from attnzoo.ops.gated_linear_attention import chunk_gated_linear_attention
from attnzoo.ops.generalized_delta_rule import chunk_generalized_delta_rule
from attnzoo.ops.linear_attention import chunk_linear_attention
from attnzoo.mixers.kda import gdn2_as_generalized, kda_as_generalized
from tests.conftest import gap_atol

FP16_FACTOR = 8.0
FP16_EPS = 2.0 ** -11  # one fp16 rounding, relative


def _l2(x):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def inputs(kind: str, B: int, H: int, T: int, D: int, h0: bool, seed: int = 0) -> dict:
    """fp64 inputs of one op as the mixers prepare them (heads-first (B, H, T, D))."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    if kind in ("delta_rule", "gated_delta_rule"):
        t = {"q": _l2(r(B, H, T, D)), "k": _l2(r(B, H, T, D)), "v": r(B, H, T, D), "beta": torch.sigmoid(r(B, H, T))}
        if kind == "gated_delta_rule":
            t["g"] = -0.5 * F.softplus(r(B, H, T))  # log-decays <= 0
        Dv = D
    elif kind == "linear_attention":  # phi = elu + 1; the normaliser's ones column: V = D + 1, odd on purpose
        t = {"q": F.elu(r(B, H, T, D)) + 1, "k": F.elu(r(B, H, T, D)) + 1,
             "v": torch.cat([r(B, H, T, D), torch.ones(B, H, T, 1, dtype=torch.float64)], -1)}
        Dv = D + 1
    elif kind in ("gla", "simple_gla"):  # a log-decay per key channel / one per head
        t = {"q": r(B, H, T, D), "k": r(B, H, T, D), "v": r(B, H, T, D),
             "g": F.logsigmoid(r(B, H, T, D if kind == "gla" else 1) + 3.0)}
        Dv = D
    elif kind == "kda":  # KDA: the gated delta rule with a log-decay per key channel
        t = {"q": _l2(r(B, H, T, D)), "k": _l2(r(B, H, T, D)), "v": r(B, H, T, D), "beta": torch.sigmoid(r(B, H, T)),
             "g": -0.5 * F.softplus(r(B, H, T, D))}
        Dv = D
    elif kind == "gated_delta_product":  # n_h = 2 delta-rule steps per token (keys, values, betas), one decay
        n = 2
        t = {"q": _l2(r(B, H, T, D)), "k": _l2(r(B, H, T, n, D)), "v": r(B, H, T, n, D),
             "beta": torch.sigmoid(r(B, H, T, n)), "g": -0.5 * F.softplus(r(B, H, T))}
        Dv = D
    elif kind == "gdn2":  # Gated DeltaNet-2: KDA's decay, an erase gate per key channel, a write gate per value channel
        t = {"q": _l2(r(B, H, T, D)), "k": _l2(r(B, H, T, D)), "v": r(B, H, T, D), "g": -0.5 * F.softplus(r(B, H, T, D)),
             "erase": torch.sigmoid(r(B, H, T, D)), "write": torch.sigmoid(r(B, H, T, D))}
        Dv = D
    elif kind == "dplr":  # RWKV-7: a = -kk, b = kk * lr, a decay per key channel
        kk = _l2(r(B, H, T, D))
        t = {"q": r(B, H, T, D), "k": _l2(r(B, H, T, D)) * 0.5, "v": r(B, H, T, D), "a": -kk,
             "b": kk * torch.sigmoid(r(B, H, T, D)), "g": -0.6 * torch.sigmoid(r(B, H, T, D))}
        Dv = D
    else:
        raise ValueError(kind)
    t["h0"] = 0.1 * r(B, H, D, Dv) if h0 else None
    return t


def torch_op(kind: str, t: dict, chunk_size: int):
    """The project's chunk form (what the mixers' torch path runs)."""
    if kind in ("delta_rule", "gated_delta_rule"):
        return chunk_delta_rule(t["q"], t["k"], t["v"], t["beta"], t.get("g"), t["h0"], chunk_size=chunk_size)
    if kind == "linear_attention":
        return chunk_linear_attention(t["q"], t["k"], t["v"], t["h0"], chunk_size=chunk_size)
    if kind in ("gla", "simple_gla"):
        return chunk_gated_linear_attention(t["q"], t["k"], t["v"], t["g"], t["h0"], chunk_size=chunk_size)
    if kind == "kda":  # KDA as the mixer runs it on torch: the generalized rule on kda_as_generalized's inputs
        kw, a, b = kda_as_generalized(t["k"], t["beta"], t["g"])
        return chunk_generalized_delta_rule(t["q"], kw, t["v"], a, b, t["g"], t["h0"], chunk_size=chunk_size)
    if kind == "gated_delta_product":
        return chunk_delta_product(t["q"], t["k"], t["v"], t["beta"], t["g"], t["h0"], chunk_size=chunk_size)
    if kind == "gdn2":  # as the mixer runs it on torch: the generalized rule on gdn2_as_generalized's inputs
        kw, vw, a, b = gdn2_as_generalized(t["k"], t["erase"], t["write"], t["v"], t["g"])
        return chunk_generalized_delta_rule(t["q"], kw, vw, a, b, t["g"], t["h0"], chunk_size=chunk_size)
    return chunk_generalized_delta_rule(t["q"], t["k"], t["v"], t["a"], t["b"], t["g"], t["h0"], 1.0, chunk_size)


def fla_op(kind: str, t: dict, dtype: torch.dtype, chunk_size: int):
    """The same op through the project's fla wrapper, computing in `dtype`."""
    if kind in ("delta_rule", "gated_delta_rule"):
        return fla_kernels.fla_chunk_delta_rule(t["q"], t["k"], t["v"], t["beta"], t.get("g"), t["h0"],
                                                chunk_size=chunk_size, dtype=dtype)
    if kind == "linear_attention":
        return fla_kernels.fla_chunk_linear_attention(t["q"], t["k"], t["v"], t["h0"], dtype=dtype)
    if kind in ("gla", "simple_gla"):
        return fla_kernels.fla_chunk_gated_linear_attention(t["q"], t["k"], t["v"], t["g"], t["h0"], dtype=dtype)
    if kind == "kda":
        return fla_kernels.fla_chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], t["h0"], dtype=dtype)
    if kind == "gated_delta_product":
        return fla_kernels.fla_chunk_gated_delta_product(t["q"], t["k"], t["v"], t["beta"], t["g"], t["h0"], dtype=dtype)
    if kind == "gdn2":
        return fla_kernels.fla_chunk_gdn2(t["q"], t["k"], t["v"], t["g"], t["erase"], t["write"], t["h0"], dtype=dtype)
    return fla_kernels.fla_chunk_generalized_delta_rule(t["q"], t["k"], t["v"], t["a"], t["b"], t["g"], t["h0"], 1.0,
                                                        dtype=dtype)


def run(fn, t: dict, dtype: torch.dtype = torch.float64, state_dtype: torch.dtype | None = None) -> dict:
    """fn on leaf copies of t in `dtype` -> {"o", "state", "d<input>": grad} (all fp64), for the loss
    <o, do> + <state, dS> with fixed random do, dS. The output must come back in q's dtype and the state in
    `state_dtype` (default: q's)."""
    leaves = {k: None if v is None else v.to(dtype).detach().clone().requires_grad_(True) for k, v in t.items()}
    o, state = fn(leaves)
    assert (o.dtype, state.dtype) == (dtype, state_dtype or dtype), (o.dtype, state.dtype)
    g = torch.Generator().manual_seed(99)
    do = torch.randn(o.shape, generator=g, dtype=torch.float64)
    ds = torch.randn(state.shape, generator=g, dtype=torch.float64)
    ((o.double() * do).sum() + (state.double() * ds).sum()).backward()
    out = {"o": o.detach().double(), "state": state.detach().double()}
    out.update({f"d{k}": v.grad.double() for k, v in leaves.items() if v is not None})
    return out


def fp16_atol(rounded: torch.Tensor, exact: torch.Tensor) -> float:
    """FP16_FACTOR x (what one fp16 rounding of the inputs moves this result, at least one fp16 rounding of it)."""
    size = exact.abs().max().item()
    return FP16_FACTOR * max((rounded - exact).abs().max().item(), FP16_EPS * size)


KINDS = ["delta_rule", "gated_delta_rule", "linear_attention", "simple_gla", "gla", "dplr", "kda", "gdn2",
         "gated_delta_product"]
FP16_ONLY_KINDS = ("delta_rule", "gated_delta_product")  # fla asserts against fp32
FLA_CHUNK = {"dplr": 16}  # fla's chunk length per kernel (chunk_dplr_delta_rule: 16; the others 64)
# the interpreter runs every block in numpy (seconds per call): two shapes per kernel, between them below one chunk,
# several chunks with a ragged last one, batch 2 and heads 2, with and without an initial state:
# name: (T from fla's chunk length, initial state, batch)
SHAPES = {"below-chunk": (lambda c: c // 2 + 4, False, 2), "3-chunks-ragged": (lambda c: 2 * c + c // 3, True, 1),
          "2-chunks-ragged": (lambda c: c + c // 3, True, 1)}


def shape(kind: str, name: str) -> tuple[int, bool, int]:
    length, h0, batch = SHAPES[name]
    return length(FLA_CHUNK.get(kind, 64)), h0, batch


def compare(kind: str, dtype: torch.dtype, T: int, h0: bool, B: int = 2, chunk_size: int = 64, H: int = 2, D: int = 16):
    t = inputs(kind, B, H, T, D, h0)
    ref = run(lambda x: torch_op(kind, x, chunk_size), t)
    # the wrappers' contract (ops/fla_kernels.py): o in q's dtype (fp64 here), the final state in fp32
    got = run(lambda x: fla_op(kind, x, dtype, chunk_size), t, state_dtype=torch.float32)
    assert set(got) == set(ref) and got["o"].shape == ref["o"].shape and got["state"].shape == ref["state"].shape
    if dtype == torch.float32:
        ref32 = run(lambda x: torch_op(kind, x, chunk_size), t, torch.float32)
        tols = {k: gap_atol(ref32[k], ref[k]) for k in ref}
    else:
        rounded = run(lambda x: torch_op(kind, x, chunk_size), {k: None if v is None else v.half().double()
                                                                for k, v in t.items()})
        tols = {k: fp16_atol(rounded[k], ref[k]) for k in ref}
    for k in ref:
        err = (got[k] - ref[k]).abs().max().item()
        assert err <= tols[k], f"{kind} {dtype} T={T} h0={h0}: {k} off by {err:.3g} > {tols[k]:.3g}"


# KDA's and GDN-2's kernels are the slowest under the interpreter (4-11 s a call; GDN-2's token-parallel intra-chunk
# kernel runs one program per token and head): one shape per dtype, below one chunk in fp32, in fp16 (the dtype a
# GPU runs them in) across one chunk boundary into a ragged second chunk with an initial state (the state handed
# between chunks and the masked tail, as three chunks would check them, in two thirds of the programs)
ONE_SHAPE = {(k, d): "below-chunk" if d == "fp32" else "2-chunks-ragged" for k in ("kda", "gdn2") for d in ("fp32", "fp16")}


def cases(kinds, dtype: str) -> list:
    return [(k, s) for k in kinds for s in ("below-chunk", "3-chunks-ragged") if (k, dtype) not in ONE_SHAPE] + \
        [(k, ONE_SHAPE[k, dtype]) for k in kinds if (k, dtype) in ONE_SHAPE]


@pytest.mark.parametrize("kind,shape_name", cases([k for k in KINDS if k not in FP16_ONLY_KINDS], "fp32"))
def test_fp32_equals_the_torch_op(kind, shape_name):
    compare(kind, torch.float32, *shape(kind, shape_name))


@pytest.mark.parametrize("kind,shape_name", cases(KINDS, "fp16"))
def test_fp16_equals_the_torch_op(kind, shape_name):
    compare(kind, torch.float16, *shape(kind, shape_name))


@pytest.mark.parametrize("chunk_size,fla_chunk", [(16, 16), (128, 64)], ids=["chunk16", "chunk128-as-64"])
@pytest.mark.parametrize("kind", ["delta_rule", "gated_delta_rule"])
def test_delta_rules_take_the_mixers_chunk_size(kind, chunk_size, fla_chunk, monkeypatch):
    """The mixer's chunk size reaches fla when fla takes it (16 / 32 / 64), else 64; equal to the torch op at the
    mixer's own chunk size (the result does not depend on it beyond rounding)."""
    import fla.ops.delta_rule
    import fla.ops.gated_delta_rule

    module = fla.ops.gated_delta_rule if kind == "gated_delta_rule" else fla.ops.delta_rule
    name = "chunk_" + kind
    seen, original = [], getattr(module, name)

    def spy(*a, **kw):
        seen.append(kw.get("chunk_size"))
        return original(*a, **kw)

    monkeypatch.setattr(module, name, spy)
    compare(kind, torch.float16, 40, True, B=1, chunk_size=chunk_size)
    assert seen == [fla_chunk], seen


def test_plain_delta_rule_refuses_fp32_in_one_line():
    """fla's chunk_delta_rule asserts against fp32; the wrapper says so first (dispatch sends fp32 to torch)."""
    t = inputs("delta_rule", 1, 1, 8, 16, False)
    with pytest.raises(ValueError, match=r"^fla's chunk_delta_rule runs in fp16 / bf16, got torch.float32"):
        fla_op("delta_rule", t, torch.float32, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_forgetting_attention_equals_the_torch_op(dtype):
    """FoX's fla path (parallel_forgetting_attn through fla_forgetting_attention; GQA: 4 query heads on 2 KV heads,
    T 40) against ops/forgetting_attention's SDPA under the forget bias: the output and the gradients of q, k, v and
    the log forget gates, tolerances derived as the ops' above."""
    from attnzoo.ops.forgetting_attention import forgetting_attention

    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    t = {"q": r(2, 4, 40, 16), "k": r(2, 2, 40, 16), "v": r(2, 2, 40, 16), "log_f": F.logsigmoid(r(2, 4, 40) + 2.0)}

    def grads(fn, inputs, cast=torch.float64) -> dict:
        leaves = {k: v.to(cast).detach().clone().requires_grad_(True) for k, v in inputs.items()}
        o = fn(leaves)
        assert o.dtype == cast
        do = torch.randn(o.shape, generator=torch.Generator().manual_seed(99), dtype=torch.float64)
        (o.double() * do).sum().backward()
        return {"o": o.detach().double(), **{f"d{k}": v.grad.double() for k, v in leaves.items()}}

    torch_fn = lambda x: forgetting_attention(x["q"], x["k"], x["v"], x["log_f"])  # noqa: E731
    ref = grads(torch_fn, t)
    got = grads(lambda x: fla_kernels.fla_forgetting_attention(x["q"], x["k"], x["v"], x["log_f"], dtype=dtype), t)
    if dtype == torch.float32:
        ref32 = grads(torch_fn, t, torch.float32)
        tols = {k: gap_atol(ref32[k], ref[k]) for k in ref}
    else:
        rounded = grads(torch_fn, {k: v.half().double() for k, v in t.items()})
        tols = {k: fp16_atol(rounded[k], ref[k]) for k in ref}
    for k in ref:
        err = (got[k] - ref[k]).abs().max().item()
        assert err <= tols[k], f"fox {dtype}: {k} off by {err:.3g} > {tols[k]:.3g}"
