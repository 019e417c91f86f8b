"""Kernel dispatch (ops/dispatch.py, model.impl): the choice table for every family, request, device, dtype and
availability (mocked); explicit fla / flex refused in one line where they cannot run; the CPU paths unchanged
bit for bit; the fast wrappers' conventions checked on CPU (fla's ops replaced by fla's own naive references,
flex_attention forward); summary.json records the kernels; the gpu_check harness on the torch paths.
Nothing here needs a GPU; scripts/gpu_check.sh runs the real kernels (docs/gpu.md)."""
from __future__ import annotations

import copy
import importlib.util
import json
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

from attnzoo.config.errors import ConfigError
from attnzoo.ops import dispatch
from attnzoo.ops.dispatch import FAMILY_NAMES, choose_kernel
from tests.conftest import compose_cfg, gap_atol

IMPLS = ("auto", "torch", "fla", "flex")
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# CUDA, both libraries available, a dtype both support (bf16): what each family runs for each request
ON_CUDA = {
    "softmax": {"auto": "torch", "torch": "torch", "fla": "torch", "flex": "torch"},  # SDPA (flash) is torch's
    "window": {"auto": "flex", "torch": "torch", "fla": "torch", "flex": "flex"},
    "block_sparse": {"auto": "torch", "torch": "torch", "fla": "torch", "flex": "torch"},  # data-dependent top-k
    "linear": {"auto": "fla", "torch": "torch", "fla": "fla", "flex": "torch"},
    "latent": {"auto": "torch", "torch": "torch", "fla": "torch", "flex": "torch"},
    "forgetting": {"auto": "fla", "torch": "torch", "fla": "fla", "flex": "torch"},  # FoX: fla's parallel kernel
    "other": {"auto": "torch", "torch": "torch", "fla": "torch", "flex": "torch"},
}


def expected(request, family, device, dtype, fla_ok, flex_ok) -> str:
    if request == "fla" and not (device == "cuda" and fla_ok):
        return "refused"
    if request == "flex" and not (device == "cuda" and flex_ok):
        return "refused"
    if device == "cpu":
        return "torch"
    want = ON_CUDA[family][request]
    if want == "fla" and not (fla_ok and dtype in (torch.float16, torch.bfloat16)):
        return "torch"  # fla's chunk kernels: fp16 / bf16 only
    if want == "flex" and not (flex_ok and dtype != torch.float64):
        return "torch"
    return want


@pytest.mark.parametrize("flex_ok", [True, False], ids=["flex", "noflex"])
@pytest.mark.parametrize("fla_ok", [True, False], ids=["fla", "nofla"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("request_", IMPLS)
def test_choice_table(request_, family, device, dtype, fla_ok, flex_ok):
    want = expected(request_, family, device, dtype, fla_ok, flex_ok)
    if want == "refused":
        with pytest.raises(ConfigError) as e:
            choose_kernel(request_, family, device, dtype, fla_ok=fla_ok, flex_ok=flex_ok)
        msg = str(e.value)
        assert msg.startswith("model.impl: ") and "\n" not in msg and "allowed here: auto, torch" in msg
        return
    assert choose_kernel(request_, family, device, dtype, fla_ok=fla_ok, flex_ok=flex_ok) == want


def test_mixer_families():
    """Every registered mixer class has a family (`kernel_family`); the layers a fast kernel does not cover fall
    to "other"."""
    from attnzoo.models.decoder import DecoderLM
    from attnzoo.config.registry import MIXERS

    assert all(MIXERS.get(n).cls.kernel_family in FAMILY_NAMES for n in MIXERS.names())
    assert set(ON_CUDA) == set(FAMILY_NAMES)

    def family(mixer: dict, **model) -> str:
        cfg = {"d_model": 32, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "mixer": mixer, **model}
        return dispatch.family_of(DecoderLM(cfg, vocab_size=16).mixers[0])

    assert family({"name": "sliding_window"}, d_model=64) == "window" and family({"name": "mla"}) == "latent"
    assert family({"name": "sliding_window"}) == "other"  # head size 8: Inductor's flex needs >= 16
    assert family({"name": "gqa"}) == "softmax"
    assert family({"name": "sliding_window", "sink_tokens": 4}) == "other"  # sinks: their own torch forward
    assert family({"name": "sliding_window"}, dropout=0.1) == "other"  # flex has no dropout
    assert family({"name": "gated_deltanet", "head_dim": 512}) == "other"  # fla's key size limit, 256
    assert family({"name": "linear_attention", "feature_map": "taylor2", "feature_dim": 16}) == "other"  # Df 273
    assert family({"name": "linear_attention"}) == "linear" and family({"name": "moba"}) == "block_sparse"


def test_bad_impl_is_one_line():
    from attnzoo.config.schema import resolve_model

    with pytest.raises(ConfigError, match=r"^model.impl: got 'triton'; allowed: auto, torch, fla, flex$"):
        resolve_model({"d_model": 32, "n_heads": 4, "impl": "triton"})


@pytest.mark.parametrize("request_", ["fla", "flex"])
def test_explicit_fast_kernel_on_cpu_is_refused_in_one_line(request_, make_cfg, tmp_path):
    """At the start of a run (nothing written), and at a call on a CPU tensor."""
    from attnzoo.models.decoder import DecoderLM
    from attnzoo.training.run import train

    out = tmp_path / "run"
    with pytest.raises(ConfigError) as e:
        train(make_cfg("experiment=mqar", "debug=smoke", f"model.impl={request_}", output_dir=out))
    assert str(e.value).startswith(f"model.impl: {request_} needs a CUDA device") and "\n" not in str(e.value)
    assert str(e.value).endswith("allowed here: auto, torch") and not out.exists()
    model = DecoderLM({"d_model": 32, "n_layers": 1, "n_heads": 4, "mixer": {"name": "deltanet"}, "impl": request_},
                      vocab_size=16)
    with pytest.raises(ConfigError, match=f"^model.impl: {request_} needs"):
        model(torch.randint(0, 16, (1, 8)))


def test_probes_never_import_triton_without_cuda():
    """DESIGN 6.7: triton beside fla-core on a CPU machine breaks transformers' dispatch; the probes check CUDA
    first (run in a fresh process, so no other test's imports count)."""
    code = ("import sys, torch; from attnzoo.ops import dispatch; "
            "assert not torch.cuda.is_available(); "
            "assert not dispatch.fla_available() and not dispatch.flex_available(); "
            "from attnzoo.models.decoder import DecoderLM; "
            "m = DecoderLM({'d_model': 32, 'n_layers': 1, 'n_heads': 4, 'mixer': {'name': 'deltanet'}}, vocab_size=16); "
            "m(torch.randint(0, 16, (1, 8))); "
            "assert 'triton' not in sys.modules and 'fla' not in sys.modules, 'imported'")
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: the probes may import triton here")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=120)


def test_probes_are_constants_under_compile():
    """compile=true: the availability probes run once, eagerly, as graph constants (no find_spec / import traced)."""
    def f(x):
        return x + 1 if (dispatch.fla_available() or dispatch.flex_available()) else x * 3

    torch._dynamo.reset()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # e.g. dynamo's "lru_cache-wrapped function" warning
            out = torch.compile(f, fullgraph=True, backend="eager")(torch.ones(2))
    finally:
        torch._dynamo.reset()
    assert torch.equal(out, f(torch.ones(2)))


MIXER_CASES = ["gqa", "sliding_window", "moba", "nsa", "linear_attention", "deltanet", "gated_deltanet", "mla"]


@pytest.mark.parametrize("mixer", MIXER_CASES)
def test_cpu_outputs_bit_identical_for_auto_and_torch(mixer, monkeypatch):
    """On the CPU model.impl=auto and torch are today's path: bit-identical outputs and gradients, and the
    fast wrappers are never entered (they raise here)."""
    from attnzoo.models.decoder import DecoderLM
    from attnzoo.ops import fla_kernels, flex

    def boom(*a, **kw):
        raise AssertionError("a fast kernel was called on the CPU")

    for mod, name in ((fla_kernels, "fla_chunk_delta_rule"), (fla_kernels, "fla_chunk_linear_attention"),
                      (flex, "flex_sliding_window")):
        monkeypatch.setattr(mod, name, boom)
    x = torch.randint(0, 64, (2, 40))
    results = []
    for impl in (None, "auto", "torch"):  # None: a config without the key (the dataclass default)
        torch.manual_seed(0)
        cfg = {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "mixer": {"name": mixer}}
        if mixer == "sliding_window":
            cfg["mixer"]["window"] = 8
        model = DecoderLM(cfg if impl is None else {**cfg, "impl": impl}, vocab_size=64)
        out = model(x)
        out.square().mean().backward()
        results.append((out.detach(), [p.grad.clone() for p in model.parameters()]))
    for out, grads in results[1:]:
        assert torch.equal(out, results[0][0])
        assert all(torch.equal(a, b) for a, b in zip(grads, results[0][1]))


def test_resolution_follows_the_device_per_call(monkeypatch):
    """kernel_request comes from model.impl; the backend is resolved per call from the tensor's device and
    compute dtype (nothing cached on the module: a model moved between devices picks anew)."""
    from attnzoo.models.decoder import DecoderLM

    monkeypatch.setattr(dispatch, "fla_available", lambda: True)
    monkeypatch.setattr(dispatch, "flex_available", lambda: True)
    model = DecoderLM({"d_model": 64, "n_layers": 2, "n_heads": 4, "pattern": ["gated_deltanet", "swa"],
                       "mixers": {"swa": {"name": "sliding_window", "window": 8}}}, vocab_size=16)
    gdn, swa = model.mixers
    assert gdn.kernel_request == swa.kernel_request == "auto"
    assert dispatch.model_kernels(model, "cuda", torch.bfloat16) == ["fla", "flex"]
    assert dispatch.model_kernels(model, "cuda", torch.float32) == ["torch", "flex"]  # fla: fp16 / bf16 only
    assert dispatch.model_kernels(model, "cpu", torch.bfloat16) == ["torch", "torch"]
    x = torch.zeros(1, 4, 64)
    assert dispatch.mixer_kernel(gdn, x) == "torch"  # a CPU tensor, whatever is installed
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert dispatch.compute_dtype(x) == torch.bfloat16
    assert dispatch.compute_dtype(x) == torch.float32
    assert dispatch.precision_compute_dtype("bf16-mixed") == torch.bfloat16
    assert dispatch.precision_compute_dtype("16-mixed") == torch.float16
    assert dispatch.precision_compute_dtype("32-true") == torch.float32


# ----------------------------------------------------------------------------- fla wrappers, on CPU


def _fla_naive(subdir: str):
    """fla's pure-torch naive.py loaded by file path (`import fla.ops` would import triton)."""
    pytest.importorskip("einops")
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("fla-core not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "ops" / subdir / "naive.py"
    if not path.exists():
        pytest.skip(f"{path} not in this fla-core version")
    mod_spec = importlib.util.spec_from_file_location(f"fla_naive_{subdir}_dispatch", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def fake_fla(monkeypatch):
    """fla.ops.{delta_rule, gated_delta_rule, simple_gla} with fla's own naive recurrences standing in for the
    Triton kernels (same sequence-first API, scale, state and gate conventions), the mixers routed to them,
    and the wrappers allowed fp32 (the kernels run fp16 / bf16 only; the conventions are what is tested)."""
    from attnzoo.ops import fla_kernels

    gdn, gla = _fla_naive("gated_delta_rule"), _fla_naive("simple_gla")
    calls = []

    def gated(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, chunk_size=64):
        calls.append(("gated_delta_rule", q.shape, v.shape, chunk_size))
        return gdn.naive_recurrent_gated_delta_rule(q, k, v, beta, g, scale=scale, initial_state=initial_state,
                                                    output_final_state=output_final_state)

    def delta(q, k, v, beta, scale=None, initial_state=None, output_final_state=False, chunk_size=64):
        calls.append(("delta_rule", q.shape, v.shape, chunk_size))
        g = torch.zeros_like(beta)
        return gdn.naive_recurrent_gated_delta_rule(q, k, v, beta, g, scale=scale, initial_state=initial_state,
                                                    output_final_state=output_final_state)

    def simple_gla(q, k, v, g=None, scale=None, initial_state=None, output_final_state=False):
        calls.append(("simple_gla", q.shape, v.shape, None))
        g = torch.zeros(q.shape[:3], dtype=q.dtype, device=q.device)
        return gla.naive_recurrent_simple_gla(q, k, v, g, scale=scale, initial_state=initial_state,
                                              output_final_state=output_final_state)

    for name, attr, fn in (("fla.ops.gated_delta_rule", "chunk_gated_delta_rule", gated),
                           ("fla.ops.delta_rule", "chunk_delta_rule", delta),
                           ("fla.ops.simple_gla", "chunk_simple_gla", simple_gla)):
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(**{attr: fn}))
    monkeypatch.setattr(fla_kernels, "_check_dtype", lambda *a: None)
    # the recurrent mixers' one mode ladder (RecurrentMixer.recur) asks dispatch there
    monkeypatch.setattr("attnzoo.mixers.recurrent_base.mixer_kernel",
                        lambda mixer, x: "fla" if mixer.kernel_request == "fla" else "torch")
    return calls


FLA_MIXERS = {
    "deltanet": {"name": "deltanet"},
    "deltanet-neg-eigval-chunk16": {"name": "deltanet", "allow_neg_eigval": True, "chunk_size": 16},
    "gated_deltanet": {"name": "gated_deltanet"},
    "gated_deltanet-gva": {"name": "gated_deltanet", "n_heads": 2, "n_v_heads": 4},
    "linear_attention-elu-normalized": {"name": "linear_attention"},
    "linear_attention-identity": {"name": "linear_attention", "feature_map": "identity", "normalize": False},
}


@pytest.mark.parametrize("case", list(FLA_MIXERS))
def test_fla_path_matches_the_torch_path(case, fake_fla):
    """A mixer through fla_kernels (layout [B, T, H, D], scale, beta / gate conventions, grouped value heads,
    the normaliser's ones column, initial / final state) equals its torch chunk path: outputs, gradients,
    and the state a cached prefill leaves (then continued by a second chunk)."""
    from attnzoo.models.decoder import DecoderLM

    torch.manual_seed(0)
    cfg = {"d_model": 32, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "mixer": FLA_MIXERS[case]}
    assert_fla_path_matches_torch(DecoderLM(cfg, vocab_size=16).mixers[0])
    assert fake_fla, "the fla path was not taken"
    assert all(call[1][1] == 20 or call[1][1] == 17 or call[1][1] == 37 for call in fake_fla)  # (B, T, H, D) layout


def assert_fla_path_matches_torch(mixer) -> None:
    """`mixer` (fp32 weights, d_model 32) run three times on the same input - its torch path in fp64 and fp32, its
    fla path (`kernel_request = "fla"`, under a fake_fla fixture) in fp64: the output, the input and parameter
    gradients, the state a cached 20-token prefill leaves and a 17-token chunk from it. fla's naive references
    compute in fp32 whatever the input: the fla path (fp64 around an fp32 kernel) against the fp64 torch path,
    within FP32_FACTOR x the torch path's own fp32-vs-fp64 gap, output by output."""
    x = torch.randn(2, 37, 32, dtype=torch.float64)  # 37: not a multiple of any chunk size
    pos = torch.arange(37)
    runs = {}
    for request, dtype in (("torch", torch.float64), ("torch", torch.float32), ("fla", torch.float64)):
        m = copy.deepcopy(mixer).to(dtype)
        m.kernel_request = request
        xi = x.to(dtype).clone().requires_grad_(True)
        y = m(xi, positions=pos)
        (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
        cache = m.new_cache(2, 37, dtype, "cpu")
        with torch.no_grad():
            m(xi[:, :20], positions=pos[:20], cache=cache)  # prefill: chunk mode from an empty state
            y2 = m(xi[:, 20:], positions=pos[20:], cache=cache)  # a second chunk from the cached state
        state = list(cache.state) if isinstance(cache.state, (tuple, list)) else [cache.state]
        runs[request, dtype] = [y.detach(), xi.grad, *(p.grad for p in m.parameters()), *state, y2]
    ref, ref32, got = runs["torch", torch.float64], runs["torch", torch.float32], runs["fla", torch.float64]
    assert len(got) == len(ref) == len(ref32)
    for i, (a, b, b32) in enumerate(zip(got, ref, ref32)):
        torch.testing.assert_close(a, b, atol=gap_atol(b32, b), rtol=0, msg=f"output {i}")


def test_fla_wrappers_refuse_fp32():
    from attnzoo.ops.fla_kernels import fla_chunk_delta_rule

    q = torch.zeros(1, 1, 4, 8)
    with pytest.raises(ValueError, match="fp16 / bf16"):
        fla_chunk_delta_rule(q, q, q, torch.zeros(1, 1, 4), dtype=torch.float32)


# ----------------------------------------------------------------------------- flex_attention, on CPU (forward)


@pytest.fixture
def quiet_flex():
    with warnings.catch_warnings():  # eager flex on CPU warns that it is unfused (it is, here)
        warnings.simplefilter("ignore", UserWarning)
        yield


@pytest.mark.parametrize("q_len,kv_len,window,sinks,kv_heads", [
    (200, 200, 32, 0, 2), (200, 200, 32, 4, 2), (50, 200, 32, 4, 4), (130, 130, 300, 0, 1), (129, 129, 1, 0, 2),
], ids=["band", "sinks", "offset-queries", "window-over-T", "window-1"])
def test_flex_masks_match_the_reference_forward(q_len, kv_len, window, sinks, kv_heads, quiet_flex):
    """The band / sink block masks (ops/flex.py) against the explicit masked softmax, fp64, forward only:
    torch 2.13 has no flex_attention backward on CPU (scripts/gpu_check.sh checks the gradients on a GPU)."""
    from attnzoo.mixers.attention import sink_window_attention
    from attnzoo.ops.attention import attention_mask, attention_reference
    from attnzoo.ops.flex import flex_causal, flex_sliding_window

    torch.manual_seed(0)
    q = torch.randn(2, 4, q_len, 16, dtype=torch.float64)
    k, v = (torch.randn(2, kv_heads, kv_len, 16, dtype=torch.float64) for _ in range(2))
    got = flex_sliding_window(q, k, v, window=window, sinks=sinks)
    ref = sink_window_attention(q, k, v, q_start=kv_len - q_len, key_start=0, window=window, sinks=sinks,
                                reference=True)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    if not sinks:
        causal = attention_reference(q, k, v, mask=attention_mask(q_len, kv_len, causal=True))
        torch.testing.assert_close(flex_causal(q, k, v), causal, rtol=1e-10, atol=1e-12)


def test_sliding_window_mixer_flex_path_forward(monkeypatch, quiet_flex):
    """SlidingWindowAttention.attend routed to flex (as on CUDA) equals its torch path, forward; decode with a
    cache stays on the torch path."""
    from attnzoo.models.decoder import DecoderLM
    from attnzoo.ops import flex

    torch.manual_seed(0)
    mixer = DecoderLM({"d_model": 32, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2,
                       "mixer": {"name": "sliding_window", "window": 16}}, vocab_size=16).mixers[0].eval().double()
    x, pos = torch.randn(2, 150, 32, dtype=torch.float64), torch.arange(150)  # both paths in fp64
    with torch.no_grad():
        ref = mixer(x, positions=pos)
        monkeypatch.setattr("attnzoo.mixers.attention.mixer_kernel", lambda m, t: "flex")
        calls = []
        original = flex.flex_sliding_window
        monkeypatch.setattr(flex, "flex_sliding_window", lambda *a, **kw: calls.append(1) or original(*a, **kw))
        got = mixer(x, positions=pos)
        cache = mixer.new_cache(2, 151, torch.float64, "cpu")
        mixer(x, positions=pos, cache=cache)
        n_prefill = len(calls)
        mixer(x[:, :1], positions=torch.tensor([150]), cache=cache)
    assert calls and len(calls) == n_prefill == 2  # the plain forward and the cached prefill; not the decode step
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------------------- torch paths under bf16 autocast


@pytest.mark.parametrize("mixer", ["deltanet", "gated_deltanet"])
def test_delta_rule_torch_path_trains_under_bf16_autocast(mixer):
    """fp32 calls (and CPU / no-fla machines) run the torch chunk form under autocast: its triangular solve
    has no bf16 kernel and runs in fp32 (ops/delta_rule.solve_unit_lower)."""
    from attnzoo.models.decoder import DecoderLM

    torch.manual_seed(0)
    m = DecoderLM({"d_model": 32, "n_layers": 1, "n_heads": 4, "mixer": {"name": mixer}}, vocab_size=16).mixers[0]
    x = torch.randn(2, 40, 32)
    ref = m(x, positions=torch.arange(40))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x, positions=torch.arange(40))
    y.float().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())
    assert (y.float() - ref).norm() / ref.norm() < 0.05


# ----------------------------------------------------------------------------- summary.json and the summary


def test_summary_json_records_the_kernels(tmp_path):
    from attnzoo.training.run import train
    from attnzoo.training.summary import format_summary

    out = tmp_path / "run"
    train(compose_cfg(["experiment=mqar", "debug=smoke", "trainer.max_steps=2", "trainer.val_check_interval=2",
                       "model.pattern=[gated_deltanet,sliding_window]", "model.impl=torch", "sample.max_new_tokens=0",
                       "perf.measure_decode=false"], out))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"]["impl"] == "torch" and summary["model"]["kernels"] == ["torch", "torch"]
    assert "kernels" not in format_summary(summary)  # all torch: no line
    summary["model"].update(impl="auto", kernels=["fla", "flex"])
    assert "  kernels    fla,flex   (model.impl=auto)" in format_summary(summary).splitlines()


# ----------------------------------------------------------------------------- the gpu_check harness


def test_gpu_check_refuses_without_a_gpu_in_one_line(tmp_path, capsys):
    from attnzoo.bench import cli

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(SystemExit) as e:
        cli.main(["--out", str(tmp_path), "gpu_check"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == ("attnzoo-bench gpu_check: error: --device: no CUDA device is visible; allowed here: --device cpu "
                   "(the harness on the torch paths)")


def test_gpu_check_harness_on_cpu(tmp_path, capsys, quiet_flex):
    """The whole check list on the CPU (the torch paths against the reference forms; fla cases skipped, flex
    forward only): every case ok or skipped, JSON + markdown written, exit status 0."""
    from attnzoo.bench import cli

    cli.main(["--out", str(tmp_path), "gpu_check", "--device", "cpu", "--quick"])
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    status = {r["case"]: r["status"] for r in res["rows"]}
    assert {c for c, s in status.items() if s.startswith("skip")} == {
        "fla/op-delta_rule-states", "fla/op-gated_delta_rule-states", "fla/op-linear_attention-states"}
    assert all(s == "ok" or s.startswith("skip") for s in status.values()), status
    assert "| flex/op-sinks | torch | fp32 | yes |" in (tmp_path / "gpu_check.md").read_text()


def test_gpu_check_statuses_and_failure_exit(tmp_path, monkeypatch):
    """A case over its tolerance, one whose fast kernel did not run, and one that raises each fail; the
    results are written and the command exits 1."""
    from attnzoo.bench import cli, gpu_check as gc

    assert gc.rel_err(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0])) == 0.0
    assert gc.rel_err(torch.tensor([3.0, 4.0]), torch.tensor([0.0, 0.0])) == 5.0
    assert gc.tolerance(0.02, None) == 0.02 and gc.tolerance(0.02, 0.03) == 0.06
    assert gc.worst({"a": torch.ones(2), "b": 2 * torch.ones(2)}, {"a": torch.ones(2), "b": torch.ones(2)}) == (1.0, "b")

    def result(ran=True, out=0.0, grad=0.0, base=None):
        return lambda ctx: {"ran": ran, "out": (out, base), "grad": (grad, "w", base), "bounds": (0.02, 0.04)}

    def raises(ctx):
        raise RuntimeError("no kernel image\nsecond line")

    cases = [gc.Case("ok", "fla", "bf16", result(out=0.01)), gc.Case("ok-by-baseline", "fla", "bf16", result(out=0.05, base=0.03)),
             gc.Case("too-far", "fla", "bf16", result(grad=0.5)), gc.Case("not-run", "fla", "bf16", result(ran=False)),
             gc.Case("raises", "flex", "bf16", raises), gc.Case("skipped", "fla", "bf16", lambda ctx: {"skip": "no fla"})]
    monkeypatch.setattr(gc, "CASES", cases)
    with pytest.raises(SystemExit) as e:
        cli.main(["--out", str(tmp_path), "gpu_check", "--device", "cpu"])
    assert e.value.code == 1
    status = {r["case"]: r["status"] for r in json.loads((tmp_path / "gpu_check.json").read_text())["rows"]}
    assert status == {"ok": "ok", "ok-by-baseline": "ok", "too-far": "FAIL", "not-run": "FAIL (fast kernel did not run)",
                      "raises": "error: RuntimeError: no kernel image", "skipped": "skip (no fla)"}


def test_compiled_flex_serves_every_length_with_two_graphs_and_masks_are_not_inference_tensors(quiet_flex):
    """ops/flex.py (issue 51 item 6): ten lengths through the compiled flex_attention (a counting backend on CPU,
    forward only) compile 2 graphs (the first length, then symbolic lengths), not one per length up to Dynamo's
    recompile limit; a mask first built under inference mode (validation) is made of ordinary tensors, so the
    training step that reuses it from the cache can save it for backward."""
    from attnzoo.ops import flex

    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    fn = flex._compiled_flex(counting)
    try:
        for T in (16, 24, 32, 40, 48, 56, 64, 72, 80, 96):
            q = torch.randn(1, 2, T, 16)
            with torch.no_grad():
                out = fn(q, q, q, block_mask=flex.block_mask(T, T, window=8, device="cpu"))
            assert out.shape == q.shape
        assert len(graphs) == 2
    finally:
        torch._dynamo.reset()
        flex._compiled_flex.cache_clear()
    with torch.inference_mode():
        mask = flex.block_mask(40, 40, window=5, sinks=2, device="cpu")
    assert not mask.kv_num_blocks.is_inference() and not mask.kv_indices.is_inference()


def test_no_cuda_is_decided_without_torch_only_where_it_is_certain(monkeypatch):
    """config/machine.py answers "no CUDA" before torch's import (issue 45): a CPU build of torch (read from
    torch/version.py), a CUDA build without the NVIDIA driver, CUDA_VISIBLE_DEVICES empty; a ROCm build, or a
    driver present, is torch's to answer. Wherever it says no, torch agrees."""
    from attnzoo.config import machine

    if machine.no_cuda_reason():
        assert not torch.cuda.is_available()
    assert machine.cuda_available() == torch.cuda.is_available()
    build = dict(machine.torch_build() or {"__version__": "2.13.0"})
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for facts, loadable, says_no in [({"cuda": None, "hip": None}, True, "is a CPU build"),
                                     ({"cuda": "12.8", "hip": None}, False, "no NVIDIA driver"),
                                     ({"cuda": "12.8", "hip": None}, True, None),
                                     ({"cuda": None, "hip": "6.3"}, False, None)]:
        monkeypatch.setattr(machine, "torch_build", lambda facts=facts: {**build, **facts})
        monkeypatch.setattr(machine, "_loadable", lambda lib, ok=loadable: ok)
        reason = machine.no_cuda_reason()
        assert (reason is None) if says_no is None else says_no in reason, (facts, loadable, reason)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert machine.no_cuda_reason() == "CUDA_VISIBLE_DEVICES is empty"
