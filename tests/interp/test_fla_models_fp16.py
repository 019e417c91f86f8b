"""Model level, continued (tests/interp/test_fla_models.py has the setup): under fp16 autocast the kernels compute in
fp16 as on a GPU (linear_attention with its normaliser: the odd value width fla's backward refuses unpadded, the
first GPU run's crash); a prefill through fla into a cache then cached decode steps equal the full forward."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import gap_atol
from tests.interp.test_fla_models import (DECODE_ONLY, FP16_FACTOR, FP16_KERNELS, FP16_ONLY, HYBRID, MIXERS,
                                          NO_FP16_MODEL, batches, build, count_fla_calls)


def fwd_bwd(model: DecoderLM, batch: torch.Tensor, autocast_dtype=None) -> dict:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None):
        logits = model(batch[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
    loss.backward()
    return {"loss": loss.detach().double(), **{n: p.grad.double() for n, p in model.named_parameters()
                                               if p.grad is not None}}


def module_of(name: str) -> str:
    """The module a gradient belongs to, the mixer as one: `blocks.0.mixer.qkv.weight` and `blocks.0.mixer.A_log`
    -> `blocks.0.mixer`; `blocks.0.ffn.down.weight` -> `blocks.0.ffn.down`."""
    return name.split(".mixer.")[0] + ".mixer" if ".mixer." in name else name.rsplit(".", 1)[0]


@pytest.mark.parametrize("case", [c for c in MIXERS if c not in NO_FP16_MODEL] + list(FP16_ONLY))
def test_fp16_forward_and_backward_equal_torch(case, monkeypatch):
    """Under fp16 autocast the fla path (kernels in fp16) against the fp64 torch path: the loss and every
    parameter's gradient within FP16_FACTOR x the torch path's own error under the same autocast, at least one
    fp16 rounding of the tensor's size, and at least the torch path's largest relative error over the tensors of
    the same module (the mixer as one). The last: a per-head gate parameter (A_log, dt_bias: 2 elements here) sums
    a cancelling per-token gradient over every token, computed in fp16 by the kernels and in fp32 by the torch
    path's op; its own 2-element error under-estimates the precision of that path (gated_deltaproduct's dt_bias on
    an AVX-512 Xeon: 8.5x its own, 0.37x the mixer's); a wrong gate gradient is off by about its size, ~70x that."""
    batch = batches(1)[0]
    ref = fwd_bwd(build(case, "torch", torch.float64), batch)
    base = fwd_bwd(build(case, "torch"), batch, torch.float16)
    calls = count_fla_calls(monkeypatch)
    got = fwd_bwd(build(case, "fla"), batch, torch.float16)
    assert calls, "the fla path did not run"
    assert set(got) == set(ref)
    size = {name: ref[name].abs().max().item() for name in ref}
    own = {name: (base[name] - ref[name]).abs().max().item() for name in ref}
    rel: dict = {}
    for name in ref:
        if size[name] > 0:
            rel[module_of(name)] = max(rel.get(module_of(name), 0.0), own[name] / size[name])
    for name in ref:
        tol = FP16_FACTOR * max(own[name], 2.0 ** -11 * size[name], rel.get(module_of(name), 0.0) * size[name])
        err = (got[name] - ref[name]).abs().max().item()
        assert err <= tol, f"{case} {name}: off by {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("case", [c for c in MIXERS if c not in FP16_KERNELS] + [HYBRID])
def test_prefill_through_fla_then_decode_equals_the_full_forward(case, monkeypatch):
    """A 20-token prefill (fla, fp32) into a cache, then 4 one-token steps, against the full forward on the torch
    path in fp64 (tolerance: the torch path's fp32-vs-fp64 gap of the same logits). GDN-2 on one row: its
    token-parallel kernel interprets one program per token and head (~0.1 s each); its batch of 2 is checked at op
    level (test_fla_ops.py)."""
    idx = batches(1)[0][:, :24]
    if case in DECODE_ONLY:
        idx = idx[:1]
    with torch.no_grad():
        ref = build(case, "torch", torch.float64)(idx)
        ref32 = build(case, "torch")(idx)
        model = build(case, "fla")
        calls = count_fla_calls(monkeypatch)
        cache = model.new_cache(idx.shape[0], 24)
        parts = [model(idx[:, :20], cache=cache)]
        prefill_calls = len(calls)
        parts += [model(idx[:, t:t + 1], cache=cache) for t in range(20, 24)]
    assert prefill_calls >= 1 and len(calls) == prefill_calls, "prefill through fla, decode steps on torch"
    got = torch.cat(parts, dim=1).double()
    torch.testing.assert_close(got, ref, atol=gap_atol(ref32, ref), rtol=0)
