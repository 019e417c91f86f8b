"""fla's runtime gates decide `auto` (ops/dispatch.py fla_gates): the first GPU run's crash (fla 0.6.0 refuses its
gated chunk_bwd_dqkwg on Hopper with Triton in [3.4.0, 3.7.1): gated_deltanet, retnet and mamba2 died in their
first backward) faked on this CPU: a CUDA device of capability 9.0 and Triton 3.6.0. `auto` runs those layers
on torch with one line saying why; an explicit model.impl=fla is refused in one line before any work."""
from __future__ import annotations

import importlib.metadata

import pytest
import torch

from attnzoo.config.errors import ConfigError
from attnzoo.ops import dispatch

GATED = {"chunk_gated_delta_rule", "chunk_simple_gla(g)", "chunk_gated_delta_product"}


@pytest.mark.parametrize("capability,triton,gated", [
    ((9, 0), "3.6.0", True), ((9, 0), "3.4.0", True), ((9, 0), "3.7.0", True), ((9, 0), "3.7.1", False),
    ((9, 0), "3.3.1", False), ((8, 0), "3.6.0", False), ((10, 0), "3.6.0", False), ((9, 0), "3.6.0+git1a2b", True),
    (None, "3.6.0", False), ((9, 0), None, False),
])
def test_gate_table(capability, triton, gated):
    """fla's own condition: IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1, for g given."""
    gates = dispatch.fla_gates(capability, triton, "0.6.0")
    assert set(gates) == (GATED if gated else set())
    if gated:
        why = gates["chunk_gated_delta_rule"]
        assert why.startswith(f"fla 0.6.0 refuses its gated chunk_bwd_dqkwg backward on Hopper (sm_90) with Triton {triton}")
        assert "Triton >= 3.7.1" in why and "#640" in why and "\n" not in why
    assert dispatch.fla_gates(capability, triton, "0.6.0", hopper_gate=False) == {}  # an fla without the check


def test_the_gated_kernels_are_the_ones_fla_gates():
    """Which layers take a gated chunk_bwd_dqkwg backward (fla 0.6.0: chunk_gated_delta_rule and chunk_simple_gla
    with g, and chunk_gated_delta_product through chunk_gated_delta_rule_bwd, call it with g; chunk_delta_rule and chunk_simple_gla without g with g=None; chunk_gla, the DPLR rule,
    chunk_kda and chunk_gdn2 their own backward)."""
    from attnzoo.config.registry import MIXERS

    kernels = {n: MIXERS.get(n).cls.fla_kernel for n in MIXERS.names()}
    gated = sorted(n for n, k in kernels.items() if k in GATED)
    assert gated == ["gated_deltanet", "gated_deltaproduct", "mamba2", "retnet"]
    assert {n for n, k in kernels.items() if k} == {"deltanet", "fox", "gated_deltanet", "gated_deltaproduct", "gdn2", "gla", "hgrn2", "kda",
                                                     "linear_attention", "mamba2", "retnet", "rwkv7"}


@pytest.fixture
def hopper_triton_3_6(monkeypatch):
    """A CUDA device of capability 9.0, fla importable, Triton 3.6.0 (the first GPU run's machine)."""
    versions = {"triton": "3.6.0", "fla-core": "0.6.0"}
    real_version = importlib.metadata.version
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(importlib.metadata, "version", lambda name: versions.get(name) or real_version(name))
    monkeypatch.setattr(dispatch, "fla_available", lambda: True)
    monkeypatch.setattr(dispatch, "flex_available", lambda: False)
    monkeypatch.setattr(dispatch, "_GATES", {})
    yield
    dispatch._GATES.clear()


def test_auto_runs_the_gated_layers_on_torch_and_says_so(hopper_triton_3_6):
    from attnzoo.models.decoder import DecoderLM

    model = DecoderLM({"d_model": 32, "n_layers": 4, "n_heads": 2,
                       "pattern": ["gated_deltanet", "deltanet", "retnet", "gla"]}, vocab_size=16)
    assert dispatch.model_kernels(model, "cuda", torch.bfloat16) == ["torch", "fla", "torch", "fla"]
    notices = dispatch.gate_notices(model, "cuda", torch.bfloat16)
    assert len(notices) == 1 and "\n" not in notices[0], notices
    assert notices[0].startswith("attnzoo: layers 0:gated_deltanet, 2:retnet run the torch chunk form, not fla: "
                                 "fla 0.6.0 refuses its gated chunk_bwd_dqkwg backward on Hopper (sm_90) with "
                                 "Triton 3.6.0"), notices
    assert dispatch.gate_notices(model, "cuda", torch.float32) == []  # fp32: auto runs torch anyway, nothing to say
    assert dispatch.gate_notices(model, "cpu", torch.bfloat16) == []


def test_explicit_fla_is_refused_before_any_work(hopper_triton_3_6, make_cfg, tmp_path):
    from attnzoo.training.build import check_kernels_present
    from attnzoo.training.config_checks import validate

    for mixer, refused in (("gated_deltanet", True), ("retnet", True), ("mamba2", True), ("deltanet", False),
                           ("gla", False), ("rwkv7", False)):
        parts = validate(make_cfg("debug=smoke", "trainer=gpu", f"model/mixer={mixer}", "model.impl=fla"))
        if not refused:
            check_kernels_present(parts)
            continue
        with pytest.raises(ConfigError) as e:
            check_kernels_present(parts)
        msg = str(e.value)
        assert msg.startswith("model.impl: fla cannot run this layer here: fla 0.6.0 refuses its gated "
                              "chunk_bwd_dqkwg") and "\n" not in msg, msg
        assert msg.endswith("allowed here: auto, torch"), msg
    # and at a call (a model built outside a run)
    from attnzoo.models.decoder import DecoderLM

    model = DecoderLM({"d_model": 32, "n_layers": 1, "n_heads": 2, "mixer": {"name": "retnet"}, "impl": "fla"},
                      vocab_size=16)
    with pytest.raises(ConfigError, match="^model.impl: fla cannot run this layer here"):
        dispatch.layer_kernel(model.mixers[0], "cuda", torch.bfloat16)


def test_no_gate_off_cuda_or_without_fla(monkeypatch):
    """The probe reads nothing off CUDA (no triton import, no metadata) and finds no gate there."""
    monkeypatch.setattr(dispatch, "_GATES", {})
    assert dispatch.fla_gate("chunk_gated_delta_rule", "cpu") is None
    assert dispatch.fla_gate(None, "cuda") is None
    if not torch.cuda.is_available():
        assert dispatch._probe_gates() == {}
