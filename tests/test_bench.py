"""Smoke tests of the performance benchmarks (bench/train.py, hf.py, mixers.py, ddp.py): each runs on tiny
sizes and writes well-formed JSON + markdown. Performance itself is reported, never asserted."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from attnzoo.bench import cli
from attnzoo.bench import decode as decode_mod
from attnzoo.bench.mixers import PeakMemory
from attnzoo.config.registry import MIXERS

from tests.conftest import SESSION_CACHE

CACHE = [f"paths.cache_dir={SESSION_CACHE}"]


def run_bench(tmp_path, *argv: str) -> dict:
    threads = torch.get_num_threads()
    try:
        cli.main(["--out", str(tmp_path), "--threads", "1", *argv])
    finally:
        torch.set_num_threads(threads)
    name = argv[0]
    result = json.loads((tmp_path / f"{name}.json").read_text())
    md = (tmp_path / f"{name}.md").read_text()
    assert result["rows"] and result["columns"] and result["command"].startswith("attnzoo-bench")
    assert md.count("\n|") >= len(result["rows"]) + 1  # header + separator + one line per row
    for row in result["rows"]:
        assert set(row) <= set(result["columns"]), row
    return result


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_train_overhead_and_mfu(tmp_path):
    res = run_bench(tmp_path, "train", "--quick", "--precisions", "32-true", "--overrides", *CACHE)
    paths = {r["path"]: r for r in res["rows"]}
    assert set(paths) == {"bare", "attnzoo"}
    assert paths["bare"]["vs bare"] == 1.0
    for r in paths.values():
        assert positive(r["tokens/s"]) and positive(r["MFU"]) and r["MFU"] < 1.5
        assert r["GFLOP/s"] == pytest.approx(r["MFU"] * r["peak GFLOP/s"])


def test_hf_same_weights_same_tokens(tmp_path):
    pytest.importorskip("transformers")
    res = run_bench(tmp_path, "hf", "--quick")
    measures = [r["measure"] for r in res["rows"]]
    assert measures[:4] == ["prefill fp32", "train fp32", "prefill bf16", "train bf16"]
    decode = [r for r in res["rows"] if r["measure"] == "decode fp32"]
    assert len(decode) == 2 and all(r["same tokens"] == "yes" for r in decode)  # greedy decoding agrees
    assert all(positive(r["attnzoo / transformers"]) for r in res["rows"])
    assert (tmp_path / "hf.png").stat().st_size > 0


def test_mixers_every_registered_mixer_with_plot(tmp_path):
    res = run_bench(tmp_path, "mixers", "--quick")
    seen = {(r["mixer"], r["T"]) for r in res["rows"]}
    assert seen == {(m, T) for m in MIXERS.names() for T in (32, 64)}
    assert all(positive(r["fwd tokens/s"]) and positive(r["peak MiB"]) for r in res["rows"])
    assert (tmp_path / "mixers.png").stat().st_size > 0


@pytest.mark.slow  # starts 2 worker processes (~30-60 s on 2 busy cores)
def test_ddp_one_and_two_processes(tmp_path):
    res = run_bench(tmp_path, "ddp", "--quick", "--overrides", *CACHE)
    by_procs = {r["processes"]: r for r in res["rows"]}
    assert set(by_procs) == {1, 2}
    two = by_procs[2]
    assert two["tokens/s per process"] == pytest.approx(two["tokens/s (all)"] / 2)
    assert positive(two["per process vs 1 process"])


def test_peak_memory_counts_live_storages_once():
    x = torch.randn(256, 256)  # 256 KiB, created outside: not counted
    with PeakMemory() as pm:
        a = x + 1  # 256 KiB
        b = a.view(-1)  # a view: same storage, not counted again
        c = (b * 2).sum()  # 256 KiB temporary, then 4 bytes
        del a, b
        d = x * 3  # a's storage is free again: the peak stays at 2 tensors
    assert pm.peak == 2 * 256 * 256 * 4 + 4  # a + the temporary b * 2 + the scalar sum
    assert pm.live == 256 * 256 * 4 + 4  # d and c remain
    del c, d


# torch.compile (the `compile=true` training path): the whole model must trace without graph breaks and
# give the eager forward and gradients. aot_eager runs dynamo + AOTAutograd (where graph breaks and
# stride bugs show) without inductor's C++ build, so it takes seconds; the default model runs always.
# Under aot_eager only (PyTorch 2.13): a pointwise backward's real output strides differ from its traced
# meta strides and the following `view` fails. With inductor, compile=true's backend, both compile and
# match eager (checked by hand: 47-88 s of C++ builds each, too slow for this file).
COMPILE_XFAIL = {
    "linear_attention": "elu_backward -> view in the compiled backward (use .reshape/.contiguous in the mixer)",
    "gated_deltanet": "softplus_backward -> view in the compiled backward (use .reshape/.contiguous in the mixer)",
    # the same Mamba-2 decay (softplus of a projection), the same failure: not run (~10 s each to fail); the
    # gated_deltanet case runs and shows when torch fixes it
    "kda": "softplus_backward -> view in the compiled backward (as gated_deltanet; not run)",
    "gdn2": "softplus_backward -> view in the compiled backward (as gated_deltanet; not run)",
    "gated_deltaproduct": "softplus_backward -> view in the compiled backward (as gated_deltanet; not run)",
}


def compile_case(name: str):
    marks = [] if name == "gqa" else [pytest.mark.slow]
    if name in COMPILE_XFAIL:
        marks.append(pytest.mark.xfail(reason=COMPILE_XFAIL[name], raises=RuntimeError,
                                       run="not run" not in COMPILE_XFAIL[name]))
    return pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("mixer", [compile_case(n) for n in MIXERS.names()])
def test_compile_fullgraph_matches_eager(mixer):
    from attnzoo.models.decoder import DecoderLM

    torch.manual_seed(0)
    # one layer (dynamo traces every layer again: two take twice as long), two where a layer hands the next one a
    # carry (Mixer.carries: RWKV-7's value residual), so that the hand-over is in the graph too
    layers = 2 if MIXERS.get(mixer).cls.carries else 1
    model = DecoderLM({"d_model": 32, "n_layers": layers, "n_heads": 4, "n_kv_heads": 2, "mixer": {"name": mixer}},
                      vocab_size=64).double()  # compiled and eager compared in fp64
    x = torch.randint(0, 64, (2, 16))

    def loss(out):  # with the submodules' auxiliary losses, as training adds them (DSA's indexer learns from one)
        aux = model.aux_loss()
        return out.square().mean() + (0.0 if aux is None else aux)

    ref = model(x)
    loss(ref).backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    try:
        out = torch.compile(model, backend="aot_eager", fullgraph=True)(x)
        loss(out).backward()
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
    for p, g in zip(model.parameters(), ref_grads):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=1e-10)


@pytest.mark.parametrize("argv", [["cache", "--quick"], ["cache", "--quick", "--n-layers", "2"], ["delta", "--quick"],
                                  ["moe", "--quick"], ["sliding_window", "--quick"]],
                         ids=["cache", "cache-2-layers", "delta", "moe", "sliding_window"])
def test_every_subcommand_has_quick(tmp_path, argv):
    """`--quick` on every subcommand (docs/benchmarks.md promises it); `cache --n-layers 2` used to crash on
    local_global's 4-layer pattern."""
    res = run_bench(tmp_path, *argv)
    assert all(any(positive(v) for k, v in row.items() if k not in ("mixer",)) for row in res["rows"])


def test_decode_bench_rows_follow_the_bytes(tmp_path):
    """`attnzoo-bench decode --quick` (the eager compile backend: the whole path, the transformers peer included,
    without inductor's minutes): every row measured; bytes per token = (weights + batch x analytic cache) / batch;
    the roofline is the measured bandwidth over it; full attention's bytes grow with the context, the state's not."""
    from attnzoo.bench.decode import model_for, weight_bytes

    res = run_bench(tmp_path, "decode", "--quick", "--backend", "eager")
    assert len(res["rows"]) == 8 and len(res["peers"]) == 2 and (tmp_path / "decode.png").stat().st_size > 0
    args = SimpleNamespace(**{**decode_mod.QUICK, "window": 512, "steps": 4, "device": "cpu"})
    for row in res["rows"]:
        m = model_for(args, row["mixer"])
        want = (weight_bytes(m) + row["batch"] * m.decode_read_bytes(row["context"], 1, torch.float32)) / row["batch"]
        assert m.decode_read_bytes(row["context"]) == m.cache_bytes(row["context"])  # gqa, gdn: the whole cache
        assert row["bytes/token MB"] == pytest.approx(want / 1e6, rel=1e-12)
        assert row["roofline tok/s"] == pytest.approx(res["bandwidth_bytes_per_sec"] / want, rel=1e-9)
        assert row["GEMV roofline tok/s"] == pytest.approx(row["GEMV GB/s"] * 1e9 / want, rel=1e-9)
        assert row["compiled % GEMV roofline"] == pytest.approx(100 * row["compiled tok/s"] / row["GEMV roofline tok/s"])
        assert all(positive(row[k]) for k in ("eager tok/s", "compiled tok/s", "compiled / eager", "GEMV GB/s"))
    by = {(r["mixer"], r["context"], r["batch"]): r["bytes/token MB"] for r in res["rows"]}
    assert by[("gqa", 64, 1)] > by[("gqa", 32, 1)] and by[("gated_deltanet", 64, 1)] == by[("gated_deltanet", 32, 1)]
    assert all(positive(p["attnzoo / transformers"]) for p in res["peers"])


@pytest.mark.parametrize("argv,field", [(["--mixers", "nsa"], "--mixers"), (["--mixers", "softmaxx"], "mixer.name"),
                                        (["--contexts", "0"], "--contexts"), (["--steps", "0"], "--steps")])
def test_decode_bench_refuses_before_work(tmp_path, capsys, monkeypatch, argv, field):
    """(nsa made a mixer without a static cache, as a user's may be.)"""
    from attnzoo.mixers.base import Mixer
    from attnzoo.mixers.nsa import NativeSparseAttention

    monkeypatch.setattr(NativeSparseAttention, "new_static_cache", Mixer.new_static_cache)
    with pytest.raises(SystemExit) as e:
        cli.main(["--out", str(tmp_path), "decode", "--quick", *argv])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.count("\n") == 0 and f"error: {field}:" in err, err
    assert not (tmp_path / "decode.json").exists()


def test_bad_bench_flags_are_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--out", str(tmp_path), "cache", "--quick", "--n-heads", "3"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.count("\n") == 0 and err.startswith("attnzoo-bench cache: error:")


def test_data_prepare_train_and_loader(tmp_path):
    """`attnzoo-bench data --quick`: a corpus written, prepared with the tokenizer trained once, a default-model
    run on its shards and the loader alone; every figure measured (positive), the prepared folder's manifest
    agrees with the row, and the loader outruns training."""
    res = run_bench(tmp_path, "data", "--quick", "--work", str(tmp_path / "work"))
    (row,) = res["rows"]
    measured = ["tokens", "prepare tokens/s", "tokenizing tokens/s", "prepare peak PSS MB", "train peak RSS MB",
                "train peak PSS MB", "train tokens/s", "loader tokens/s"]
    assert all(positive(row[k]) for k in measured), row
    manifest = json.loads((tmp_path / "work" / "shards_0.3mb" / "manifest.json").read_text())
    assert row["tokens"] == sum(s["tokens"] for s in manifest["splits"].values()) and row["dtype"] == "uint16"
    assert row["loader / train"] > 1 and res["load"]["before"] and res["load"]["after"]
