"""What a GPU run gets by default (issue 50), decided by small functions tested here on the CPU: TF32 for fp32
matmuls under trainer=gpu (trainer.tf32), fused AdamW on CUDA (also under bf16-mixed, clipping included), the run
summary's decode figure from the compiled CUDA-graph step (perf.decode_compile), and litdata imported only by
data=shards. docs/gpu.md#gpu-defaults-tf32-fused-adamw-decode."""
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import SMALL_TEXT, compose_cfg

ROOT = Path(__file__).resolve().parents[1]
FAST = ["debug=smoke", *SMALL_TEXT, "data.tokenizer=char", "trainer.max_steps=2", "trainer.val_check_interval=2",
        "sample.max_new_tokens=0", "callbacks.save_best=false"]


# ----------------------------------------------------------------------------- decode on CUDA


@pytest.mark.parametrize("device,setting,mode", [
    ("cuda", "auto", "compiled"), ("cuda", True, "compiled"), ("cuda", False, "eager"),
    ("cpu", "auto", "eager"), ("cpu", True, "compiled"), ("cpu", False, "eager"),
])
def test_decode_mode_is_compiled_on_cuda_unless_turned_off(device, setting, mode):
    from attnzoo.training.measure import decode_compile, decode_mode

    assert decode_mode(device, setting) == mode
    run = SimpleNamespace(perf=SimpleNamespace(decode_compile=setting))
    assert decode_compile(run, torch.device(device)) == (mode == "compiled")


def test_the_default_config_compiles_the_measured_decode_on_cuda():
    from attnzoo.training.measure import decode_mode

    cfg = compose_cfg(["trainer=gpu"])
    assert cfg.perf.decode_compile == "auto" and decode_mode("cuda", cfg.perf.decode_compile) == "compiled"


def test_decode_rate_takes_two_untimed_steps_on_cuda_and_the_cache_holds_them(monkeypatch):
    """Under CUDA graphs the first compiled call warms up and the second records: the timing starts at the third.
    Faked on the CPU (the untimed count CUDA gets): measure_inference's cache (context + steps + 2 positions) holds
    the extra step, and the rate counts the timed steps only."""
    from attnzoo.models import decoding
    from attnzoo.models.decoder import DecoderLM
    from attnzoo.training.measure import measure_inference

    assert decoding.untimed_steps("cuda") == 2 and decoding.untimed_steps("cpu") == 1
    monkeypatch.setattr(decoding, "untimed_steps", lambda device_type: 2)
    calls = []
    step = decoding.Decoder.step
    monkeypatch.setattr(decoding.Decoder, "step", lambda self, *a: calls.append(1) or step(self, *a))
    torch.manual_seed(0)
    model = DecoderLM({"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "mixer": {"name": "gqa"},
                       "max_seq_len": 64}, vocab_size=50)
    got = measure_inference(model, 16, 5, 50)
    assert len(calls) == 2 + 5 and got["perf/decode_compiled"] == 0.0 and got["perf/decode_tokens_per_sec"] > 0


# ----------------------------------------------------------------------------- TF32


def test_tf32_is_on_under_trainer_gpu_and_off_elsewhere():
    from attnzoo.training.trainer import matmul_precision

    assert compose_cfg(["trainer=gpu"]).trainer.tf32 is True
    assert compose_cfg(["trainer=ddp"]).trainer.tf32 is True  # the GPU presets inherit trainer=gpu
    assert compose_cfg([]).trainer.tf32 is False
    assert matmul_precision(True, "cuda") == "high"
    assert matmul_precision(False, "cuda") == "highest"  # trainer.tf32=false: full fp32 matmuls
    assert matmul_precision(True, "cpu") is None  # a CPU run leaves torch's setting alone


def test_tf32_is_not_part_of_lightnings_trainer_kwargs():
    from omegaconf import OmegaConf

    from attnzoo.config.schema import TrainerConfig

    t = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainerConfig), compose_cfg(["trainer=gpu"]).trainer))
    assert t.tf32 is True and "tf32" not in t.lightning_kwargs()


# ----------------------------------------------------------------------------- fused AdamW


def fake(device: str, floating: bool = True):
    return SimpleNamespace(device=torch.device(device), is_floating_point=lambda: floating)


@pytest.mark.parametrize("params,precision,fused", [
    ([fake("cuda")] * 3, "bf16-mixed", True),
    ([fake("cuda")] * 3, "32-true", True),
    ([fake("cuda")] * 3, "bf16-true", True),
    ([fake("cuda")] * 3, "16-mixed", False),  # GradScaler: a fused step unscales inside, after Lightning clips
    ([fake("cuda"), fake("cpu")], "32-true", False),  # one device type, or no fused kernel
    ([fake("cuda"), fake("cuda", floating=False)], "32-true", False),
    ([fake("meta")], "32-true", False),
    ([fake("cpu")] * 2, "32-true", True),  # CPU as before: fused without mixed precision
    ([fake("cpu")] * 2, "bf16-mixed", False),
], ids=["cuda-bf16-mixed", "cuda-32", "cuda-bf16-true", "cuda-16-mixed", "two-devices", "not-floating", "meta",
        "cpu-32", "cpu-bf16-mixed"])
def test_fused_adamw_choice(params, precision, fused):
    from attnzoo.training.lit_lm import fused_adamw

    assert fused_adamw(params, precision) is fused


def test_fused_adamw_under_bf16_mixed_clips_its_gradients(tmp_path, monkeypatch):
    """What trainer=gpu does on CUDA, on the CPU: fused AdamW under bf16-mixed with gradient clipping. Lightning's
    mixed precision refuses to clip for a fused optimizer; bf16 has no GradScaler, so the LightningModule clips
    (configure_gradient_clipping): the run trains, fused, every step's gradients clipped to the configured norm."""
    from lightning.pytorch.plugins.precision import Precision

    from attnzoo.training import optimizers
    from attnzoo.training.run import train

    monkeypatch.setattr(optimizers, "fused_adamw", lambda params, precision: True)  # as on CUDA
    fused, clipped = [], []
    adamw = torch.optim.AdamW.__init__

    def init(self, *a, **kw):
        fused.append(kw.get("fused"))
        adamw(self, *a, **kw)

    clip = Precision.clip_gradients

    def spy(self, optimizer, clip_val=0.0, gradient_clip_algorithm=None):
        clipped.append((type(self).__name__, clip_val, optimizer.defaults["fused"]))
        return clip(self, optimizer, clip_val, gradient_clip_algorithm)

    monkeypatch.setattr(torch.optim.AdamW, "__init__", init)
    monkeypatch.setattr(Precision, "clip_gradients", spy)
    train(compose_cfg(FAST + ["trainer.precision=bf16-mixed", "trainer.gradient_clip_val=0.5",
                              "perf.measure_decode=false"], tmp_path / "run"))
    assert fused == [True]
    assert clipped == [("MixedPrecision", 0.5, True)] * 2  # the base clip, called for the bf16 plugin, each step


# ----------------------------------------------------------------------------- litdata


def test_a_text_run_does_not_import_litdata(tmp_path):
    """data=text trains without importing litdata (the data registry skips data/_shards_loader.py, and
    data/shards.py imports litdata only where it reads shards); data=shards' module still registers."""
    code = (
        "import sys\n"
        "from tests.conftest import compose_cfg\n"
        "from attnzoo.training.run import train\n"
        "from attnzoo.data import DATAMODULES\n"
        f"train(compose_cfg({FAST + ['perf.measure_decode=false']!r}, {str(tmp_path / 'run')!r}))\n"
        "assert 'shards' in DATAMODULES.names()\n"
        "print('litdata imported:', 'litdata' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "run" / "summary.json").is_file()
    assert "litdata imported: False" in out.stdout
