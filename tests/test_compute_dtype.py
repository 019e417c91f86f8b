"""One source for a run's compute dtype (issue 51 item 1): autocast's under a mixed precision, FSDP's
`param_dtype` under `trainer.precision=32-true` (the matmuls run in bf16 while the master weights stay fp32),
else the parameters'. The MFU peak and the per-layer kernels (`model.kernels`) are taken for it."""
import pytest
import torch

from attnzoo.ops import dispatch
from attnzoo.ops.dispatch import run_compute_dtype
from tests.conftest import compose_cfg


def trainer(tmp_path, *overrides):
    from attnzoo.training.config_checks import validate

    return validate(compose_cfg(["debug=smoke", *overrides], tmp_path))["run"].trainer


@pytest.mark.parametrize("overrides, dtype, source", [
    ([], torch.float32, "trainer.precision"),
    (["trainer.precision=bf16-mixed"], torch.bfloat16, "trainer.precision"),
    (["trainer=fsdp_cpu", "trainer.fsdp.param_dtype=bf16"], torch.bfloat16, "trainer.fsdp.param_dtype"),
])
def test_the_compute_dtype_of_a_run(overrides, dtype, source, tmp_path):
    assert run_compute_dtype(trainer(tmp_path, *overrides)) == (dtype, source)


def test_the_gpu_fsdp_preset_computes_in_bf16_and_its_peak_and_kernels_follow(monkeypatch):
    """conf/trainer/fsdp.yaml (precision 32-true, param_dtype bf16): the peak is bf16's (989 TFLOP/s on an H200,
    not the fp32 67) and a Gated DeltaNet layer is reported on fla, as its bf16 inputs send it there."""
    from attnzoo.models.decoder import DecoderLM
    from attnzoo.models.flops import datasheet_peak
    from attnzoo.training.summary import kernels_of

    run_trainer = OmegaConfLike(precision="32-true", strategy="fsdp", param_dtype="bf16")
    dtype, _ = run_compute_dtype(run_trainer)
    assert datasheet_peak("NVIDIA H200", dtype)[0] == 989e12
    monkeypatch.setattr(dispatch, "fla_available", lambda: True)
    monkeypatch.setattr(dispatch, "fla_gates", lambda *a, **k: {})
    model = DecoderLM({"d_model": 64, "n_layers": 1, "n_heads": 4, "mixer": {"name": "gated_deltanet"}}, vocab_size=16)
    assert kernels_of(model, run_trainer, torch.device("cuda")) == ["fla"]
    assert kernels_of(model, OmegaConfLike(precision="32-true", strategy="ddp", param_dtype="bf16"),
                      torch.device("cuda")) == ["torch"]  # fp32: fla's kernels take 16-bit only


class OmegaConfLike:
    def __init__(self, precision, strategy, param_dtype):
        self.precision, self.strategy = precision, strategy
        self.fsdp = type("F", (), {"param_dtype": param_dtype})()
