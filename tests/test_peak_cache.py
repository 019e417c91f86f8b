"""The MFU peak measured on a CPU is kept per machine, torch version, thread count and dtype in
`<paths.cache_dir>/matmul_peak.json` (models/flops.cached_measurement): measured once, read by every later run (a
sweep's jobs, each DDP rank, each test run) instead of ~0.5 s of matmuls each, so their MFUs share a denominator."""
import json

import torch

from attnzoo.models import flops
from attnzoo.training.run import train
from tests.conftest import SESSION_CACHE, compose_cfg


def counting(value: float):
    calls = []
    return calls, lambda: calls.append(1) or value


def test_measured_once_then_read_and_a_bad_file_is_measured_again(tmp_path):
    calls, measure = counting(7e10)
    assert flops.cached_measurement("k", measure, tmp_path) == 7e10 and len(calls) == 1
    assert flops.cached_measurement("k", counting(1.0)[1], tmp_path) == 7e10  # read, not measured
    entry = json.loads((tmp_path / flops.PEAK_CACHE).read_text())["k"]
    assert entry["flops"] == 7e10 and entry["measured"]
    calls, measure = counting(5e10)
    assert flops.cached_measurement("other", measure, tmp_path) == 5e10 and len(calls) == 1  # another key measures
    assert set(json.loads((tmp_path / flops.PEAK_CACHE).read_text())) == {"k", "other"}  # and keeps the first
    for bad in ("{not json", '{"k": {"flops": -1}}', '{"k": {"flops": "NaN"}}', '{"k": 3}', "[]"):
        (tmp_path / flops.PEAK_CACHE).write_text(bad)
        calls, measure = counting(6e10)
        assert flops.cached_measurement("k", measure, tmp_path) == 6e10 and len(calls) == 1, bad
        assert json.loads((tmp_path / flops.PEAK_CACHE).read_text())["k"]["flops"] == 6e10
    calls, measure = counting(4e10)
    assert [flops.cached_measurement("k", measure, None) for _ in range(2)] == [4e10, 4e10] and len(calls) == 2


def test_an_unwritable_cache_folder_still_gives_the_measurement(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the folder would be: nothing can be written under it
    calls, measure = counting(3e10)
    assert flops.cached_measurement("k", measure, blocked / "cache") == 3e10 and len(calls) == 1


def test_the_key_names_what_the_figure_depends_on(monkeypatch):
    key = flops.peak_key(torch.device("cpu"), torch.float32)
    assert key.startswith("cpu | ") and f"torch {torch.__version__}" in key and key.endswith("fp32")
    assert flops.peak_key(torch.device("cpu"), torch.bfloat16) != key
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert flops.peak_key(torch.device("cpu"), torch.float32) != key
    finally:
        torch.set_num_threads(threads)


def test_a_run_divides_by_the_cached_peak(tmp_path, monkeypatch):
    """A run's MFU peak is the cache's figure for its key (written here first, under a file name of this test's
    own in the session's cache folder: the run reads it and does not measure)."""
    key = flops.peak_key(torch.device("cpu"), torch.float32)
    monkeypatch.setattr(flops, "PEAK_CACHE", f"matmul_peak.{tmp_path.name}.json")
    cached = SESSION_CACHE / flops.PEAK_CACHE
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps({key: {"flops": 1.234e11}}))
    monkeypatch.setattr(flops, "measure_matmul_peak", lambda *a, **k: (_ for _ in ()).throw(AssertionError("measured")))
    try:
        out = tmp_path / "run"
        train(compose_cfg(["debug=smoke", "trainer.max_steps=2", "perf.decode_tokens=0"], out))
    finally:
        cached.unlink()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["peak_flops"] == 1.234e11 and summary["peak_source"] == "measured-matmul"
