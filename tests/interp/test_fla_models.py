"""Model level: every mixer with a fla path (and a hybrid) trained and decoded with `model.impl=fla` under Triton's
interpreter equals `model.impl=torch`:
- training steps (fp32, SGD so a gradient error shows in the next loss undamped): the per-step losses, within the
  derived fp32 tolerance (conftest.gap_atol: the torch path's fp32-vs-fp64 gap of the same losses);
- fp16 (autocast, the kernels computing in fp16, as on a GPU; linear_attention with its normaliser, the odd value
  width that fla's backward refuses unpadded): loss and every gradient within the fp16 rounding measured on the
  torch path under the same autocast (FP16_FACTOR x its error against fp64);
- a prefill through fla (with a cache) and cached decode steps after it equal the full forward;
- packed documents (resets) and context parallelism do not reach fla: refused in one line for an explicit fla.
The model sizes are tiny (d_model 32, heads of 16): the interpreter runs every kernel block in numpy.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnzoo.config.errors import ConfigError
from attnzoo.models.decoder import DecoderLM
from attnzoo.ops import dispatch, fla_kernels
from tests.conftest import gap_atol

FP16_FACTOR = 8.0
VOCAB, T = 32, 24  # 24: across RWKV-7's 16-token chunks, below the others' 64 (the op tests cross those)

MIXERS = {
    "linear_attention": {"name": "linear_attention"},  # normalize=true (the default): V = 16 + 1
    "linear_attention-unnormalized": {"name": "linear_attention", "normalize": False},
    "deltanet": {"name": "deltanet"},
    "gated_deltanet": {"name": "gated_deltanet"},
    "gla": {"name": "gla"},
    "retnet": {"name": "retnet"},
    "hgrn2": {"name": "hgrn2"},
    "mamba2": {"name": "mamba2"},
    "rwkv7": {"name": "rwkv7"},
    "kda": {"name": "kda"},  # fla's own chunk_kda (the mixer hands it the raw q, k, v, g, beta)
    "gdn2": {"name": "gdn2"},  # fla's own chunk_gdn2 (the raw q, k, v, g and the erase / write gates)
    "gated_deltaproduct": {"name": "gated_deltaproduct"},  # fla's chunk_gated_delta_product, n_h = 2
    "fox": {"name": "fox"},  # fla's parallel_forgetting_attn (training and a prefill into an empty cache)
}
FP16_KERNELS = {"deltanet", "gated_deltaproduct"}  # fla asserts against fp32: their fp16 cases alone
HYBRID = "hybrid-gated_deltanet+gqa"
# KDA's and GDN-2's kernels are the slowest under the interpreter (GDN-2: ~25 s for two training steps): their fp16
# is checked at op level (test_fla_ops.py: every input's gradient), KDA's model-level training steps and prefill +
# decode here, GDN-2's prefill + decode alone (its gradients at op level; the mixer adds only transposes)
DECODE_ONLY = {"gdn2"}
NO_FP16_MODEL = {"kda", "gdn2"}
# fp16 only (tests/interp/test_fla_models_fp16.py): taylor2's feature size 1 + d + d^2 is always odd (73 at
# feature_dim 8), which fla's 16-bit backward refuses unpadded (issue 51 item 7; ops/fla_kernels.py pads it)
FP16_ONLY = {"linear_attention-taylor2": {"name": "linear_attention", "feature_map": "taylor2", "feature_dim": 8}}


def model_cfg(case: str) -> dict:
    base = {"d_model": 32, "n_heads": 2, "n_kv_heads": 1, "max_seq_len": 64, "ffn": {"name": "swiglu"}}
    if case == HYBRID:
        return {**base, "n_layers": 2, "pattern": ["gated_deltanet", "gqa"]}
    return {**base, "n_layers": 1, "mixer": {**MIXERS, **FP16_ONLY}[case]}


def build(case: str, impl: str, dtype=torch.float32) -> DecoderLM:
    torch.manual_seed(0)
    model = DecoderLM({**model_cfg(case), "impl": impl}, vocab_size=VOCAB).to(dtype)
    return model


def batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (2, T + 1), generator=g) for _ in range(n)]


def count_fla_calls(monkeypatch) -> list:
    """A spy on the eight wrappers (the mixers import them at call time): the fla path really ran."""
    calls = []
    for name in ("fla_chunk_delta_rule", "fla_chunk_linear_attention", "fla_chunk_gated_linear_attention",
                 "fla_chunk_generalized_delta_rule", "fla_chunk_kda", "fla_chunk_gdn2", "fla_chunk_gated_delta_product",
                 "fla_forgetting_attention"):
        original = getattr(fla_kernels, name)

        def spy(*a, _original=original, _name=name, **kw):
            calls.append(_name)
            return _original(*a, **kw)

        monkeypatch.setattr(fla_kernels, name, spy)
    return calls


def train_losses(model: DecoderLM, steps: int) -> list[float]:
    """The losses of `steps` SGD steps on fixed batches, each taken before its update (the last step's backward
    and update are left out: nothing reads them)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    out = []
    for i, batch in enumerate(batches(steps)):
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        out.append(loss.detach().double())
        if i < steps - 1:
            opt.zero_grad()
            loss.backward()
            opt.step()
    return out


@pytest.mark.parametrize("case", [c for c in MIXERS if c not in FP16_KERNELS | DECODE_ONLY] + [HYBRID])
def test_training_steps_fp32_equal_torch(case, monkeypatch):
    """Per-step losses of 2 SGD steps (the second reads the first's gradients): fla (fp32 kernels) against torch
    fp64, within the torch path's own fp32-vs-fp64 gap x FP32_FACTOR (deltanet: fla's plain delta rule takes no
    fp32; its fp16 case below)."""
    ref64 = train_losses(build(case, "torch", torch.float64), 2)
    ref32 = train_losses(build(case, "torch"), 2)
    calls = count_fla_calls(monkeypatch)
    got = train_losses(build(case, "fla"), 2)
    assert len(calls) >= 2, f"the fla path did not run: {calls}"
    for step, (a, b, b32) in enumerate(zip(got, ref64, ref32)):
        tol = gap_atol(b32, b)
        assert abs(a - b).item() <= tol, f"{case} step {step}: loss {a.item():.9f} vs {b.item():.9f} (tol {tol:.3g})"


def test_explicit_fla_refuses_packing_and_context_parallel(make_cfg, tmp_path):
    """The project routes packed documents (resets) and context parallelism to the torch chunk form: an explicit
    model.impl=fla is refused in one line before any work rather than silently not running fla."""
    from attnzoo.training.run import train

    for extra, field in ((["data.packing=true"], "model.impl"),
                         (["trainer=ddp_cpu", "trainer.context_parallel=2"], "model.impl")):
        out = tmp_path / f"run{len(extra)}"
        with pytest.raises(ConfigError) as e:
            train(make_cfg("debug=smoke", "model/mixer=gated_deltanet", "model.impl=fla", *extra, output_dir=out))
        msg = str(e.value)
        assert msg.startswith(f"{field}: fla") and "\n" not in msg and "allowed" in msg, msg
        assert not out.exists()


def test_bf16_is_refused_under_the_interpreter():
    """numpy has no bf16: an explicit fla call computing in bf16 on the interpreter is refused in one line."""
    model = build("gated_deltanet", "fla")
    with pytest.raises(ConfigError, match=r"^model.impl: fla under the Triton interpreter computes in numpy, which has "
                                          r"no bf16"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(batches(1)[0][:, :8])
    with pytest.raises(ConfigError, match="no bf16"):
        dispatch.check_request("fla", "cpu", torch.bfloat16, ("chunk_gated_delta_rule",))
