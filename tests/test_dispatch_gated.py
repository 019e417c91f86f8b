"""fla's kernels for the gated linear mixers (gla, retnet, hgrn2, mamba2: `chunk_gla` / `chunk_simple_gla`) and for
rwkv7 (`chunk_dplr_delta_rule`, what fla's `chunk_rwkv7` calls), checked on CPU: fla's Triton ops replaced by fla's
own pure-torch naive references (same sequence-first API, scale, gate and state conventions), each mixer through
ops/fla_kernels.py against its torch chunk path - outputs, gradients and the state a cached prefill leaves. On the
CPU `model.impl=auto` never enters them (bit-identical to `torch`). scripts/gpu_check.sh runs the real kernels.
"""
from __future__ import annotations

import sys
import types

import pytest
import torch

from attnzoo.ops import dispatch
from tests.test_dispatch import _fla_naive, assert_fla_path_matches_torch

MIXERS = {
    "gla": {"name": "gla"},
    "gla-conv": {"name": "gla", "conv_size": 4, "qkv_activation": "silu"},
    "retnet": {"name": "retnet"},
    "hgrn2": {"name": "hgrn2"},
    "hgrn2-lower-bound": {"name": "hgrn2", "lower_bound": 0.9},
    "mamba2": {"name": "mamba2", "head_dim": 8, "d_state": 16},
    "mamba2-groups": {"name": "mamba2", "head_dim": 8, "d_state": 16, "n_groups": 2},
    # value_residual off: layer 1 runs alone here (the residual is model-level, the same on both kernel paths)
    "rwkv7": {"name": "rwkv7", "value_residual": False},
    "rwkv7-conv": {"name": "rwkv7", "conv_size": 4, "decay_init_range": [0.99, 0.9999], "value_residual": False},
}


@pytest.fixture
def fake_fla(monkeypatch):
    """fla.ops.{gla, simple_gla, generalized_delta_rule} with fla's naive recurrences standing in for the kernels,
    the recurrent mixers routed to them where kernel_request is "fla", and the wrappers allowed fp64 inputs."""
    from attnzoo.ops import fla_kernels

    gla, simple, dplr = _fla_naive("gla"), _fla_naive("simple_gla"), _fla_naive("generalized_delta_rule/dplr")
    calls = []

    def chunk_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False):
        calls.append(("gla", q.shape, g.shape, g.dtype))
        K = q.shape[-1]  # fla's naive GLA reads at K^-1/2: scale q by scale * K^1/2 to read at `scale`
        q = q if scale is None else q * (scale * K**0.5)
        return gla.naive_recurrent_gla(q, k, v, g, initial_state=initial_state, output_final_state=output_final_state)

    def chunk_simple_gla(q, k, v, g=None, scale=None, initial_state=None, output_final_state=False):
        calls.append(("simple_gla", q.shape, g.shape, g.dtype))
        assert g.shape == q.shape[:3] and g.is_contiguous()  # (B, T, H): one gate per head and token
        return simple.naive_recurrent_simple_gla(q, k, v, g, scale=scale, initial_state=initial_state,
                                                 output_final_state=output_final_state)

    def chunk_dplr_delta_rule(q, k, v, a, b, gk, scale=None, initial_state=None, output_final_state=False):
        calls.append(("dplr", q.shape, gk.shape, gk.dtype))
        t = lambda u: u.transpose(1, 2).float()  # noqa: E731  (B, H, T, D), fp32 as the naive form computes
        K = q.shape[-1]  # it reads at K^-1/2
        q = q if scale is None else q * (scale * K**0.5)
        o, s = dplr.dplr_recurrence(t(q), t(k), t(v), t(a), t(b), t(gk), initial_state=initial_state,
                                    output_final_state=output_final_state)
        return o.transpose(1, 2), s

    for name, attr, fn in (("fla.ops.gla", "chunk_gla", chunk_gla),
                           ("fla.ops.simple_gla", "chunk_simple_gla", chunk_simple_gla),
                           ("fla.ops.generalized_delta_rule", "chunk_dplr_delta_rule", chunk_dplr_delta_rule)):
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(**{attr: fn}))
    monkeypatch.setattr(fla_kernels, "_check_dtype", lambda *a: None)
    monkeypatch.setattr("attnzoo.mixers.recurrent_base.mixer_kernel",
                        lambda mixer, x: "fla" if mixer.kernel_request == "fla" else "torch")
    return calls


def _mixer(case: str):
    from attnzoo.models.decoder import DecoderLM

    torch.manual_seed(0)
    cfg = {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "mixer": MIXERS[case]}
    return DecoderLM(cfg, vocab_size=16).mixers[1]  # layer 1 of 2: RWKV-7's per-layer init away from layer 0


@pytest.mark.parametrize("case", list(MIXERS))
def test_fla_path_matches_the_torch_path(case, fake_fla):
    """A mixer through ops/fla_kernels.py (layout, scale, the per-channel or per-head gate, the DPLR a / b / gk, the
    initial and final state) equals its torch chunk path (test_dispatch.assert_fla_path_matches_torch: outputs,
    input and parameter gradients, the state a cached prefill leaves and a second chunk from it), through the op
    its decay's shape asks for."""
    assert_fla_path_matches_torch(_mixer(case))
    kind = {"gla": "gla", "retnet": "simple_gla", "hgrn2": "gla", "mamba2": "simple_gla", "rwkv7": "dplr"}
    want = kind[MIXERS[case]["name"]]
    assert fake_fla and {c[0] for c in fake_fla} == {want}, fake_fla
    assert all(c[3] == torch.float32 for c in fake_fla)  # the log-decay stays fp32 whatever the compute dtype
    assert {c[1][1] for c in fake_fla} == {37, 20, 17}  # sequence-first: the full call, the prefill, the chunk


@pytest.mark.parametrize("case", ["gla", "retnet", "hgrn2-lower-bound", "mamba2", "rwkv7"])
def test_cpu_auto_is_torch_and_never_enters_fla(case, monkeypatch):
    """On the CPU model.impl=auto resolves to torch for these mixers (their family is "linear" now): bit-identical
    outputs and gradients to impl=torch, and the fla wrappers are never called (they raise here)."""
    from attnzoo.models.decoder import DecoderLM
    from attnzoo.ops import fla_kernels

    def boom(*a, **kw):
        raise AssertionError("an fla kernel was called on the CPU")

    for name in ("fla_chunk_gated_linear_attention", "fla_chunk_generalized_delta_rule"):
        monkeypatch.setattr(fla_kernels, name, boom)
    x = torch.randint(0, 64, (2, 40))
    results = []
    for impl in ("auto", "torch"):
        torch.manual_seed(0)
        model = DecoderLM({"d_model": 32, "n_layers": 2, "n_heads": 4, "mixer": MIXERS[case], "impl": impl},
                          vocab_size=64)
        assert dispatch.family_of(model.mixers[0]) == "linear"
        out = model(x)
        out.square().mean().backward()
        results.append((out.detach(), [p.grad.clone() for p in model.parameters()]))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))


def test_model_kernels_on_cuda_pick_fla_for_them(monkeypatch):
    """With fla available, a CUDA bf16 model picks fla for each of the five mixers (fp32: torch); a key size over
    fla's limit falls to the torch forms."""
    from attnzoo.models.decoder import DecoderLM

    monkeypatch.setattr(dispatch, "fla_available", lambda: True)
    names = ["gla", "retnet", "hgrn2", "mamba2", "rwkv7"]
    model = DecoderLM({"d_model": 32, "n_layers": 5, "n_heads": 4, "pattern": names}, vocab_size=16)
    assert dispatch.model_kernels(model, "cuda", torch.bfloat16) == ["fla"] * 5
    assert dispatch.model_kernels(model, "cuda", torch.float32) == ["torch"] * 5
    wide = DecoderLM({"d_model": 32, "n_layers": 1, "n_heads": 1, "mixer": {"name": "gla", "head_dim": 512}},
                     vocab_size=16)
    assert dispatch.model_kernels(wide, "cuda", torch.bfloat16) == ["torch"]
