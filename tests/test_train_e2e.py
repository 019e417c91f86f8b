"""End-to-end runs of train(): loss falls, summary/metrics/checkpoints written, resume continues."""
import csv
import json
import math
import sys

import pytest
import torch

from attnzoo.training.run import train
from tests.conftest import SMALL_TEXT, assert_learns, compose_cfg

FAST = ["debug=smoke", *SMALL_TEXT, "data.tokenizer=char", "data.seq_len=32", "data.batch_size=8",
        "optim.lr=3e-3", "perf.decode_tokens=4"]


def read_metrics(run_dir):
    with open(run_dir / "csv" / "metrics.csv") as f:
        return list(csv.DictReader(f))


def test_a_library_call_times_from_the_call_whatever_sys_argv_says(monkeypatch):
    """sys.argv is a global an in-process caller may rewrite (attnzoo-lm-eval passes lm_eval its command line
    through it): a library call in pytest stays a library call (the failure of a CI run, where an earlier test in
    the same worker had left sys.argv[0] = "attnzoo-lm-eval")."""
    from attnzoo.training.callbacks import command_start

    monkeypatch.setattr(sys, "argv", ["attnzoo-train", "debug=smoke"])
    assert command_start()[0] == "train()"


def test_train_loss_falls_and_writes_summary(tmp_path):
    out = tmp_path / "run"
    cfg = compose_cfg(FAST + ["trainer.max_steps=60", "trainer.val_check_interval=20", "model.n_layers=2",
                              "perf.peak_flops=1e12"], out)
    metrics = train(cfg)
    summary = json.loads((out / "summary.json").read_text())
    vocab = summary["model"]["vocab_size"]
    # a random init sits at ~ln(vocab); 60 steps of a char model must be far below it
    assert metrics["val/loss"] < math.log(vocab) - 1.0
    assert metrics["val/ppl"] == pytest.approx(math.exp(metrics["val/loss"]), rel=1e-4)
    for key in ("perf/tokens_per_sec", "perf/step_ms", "perf/flops_per_token", "perf/mfu", "params/total",
                "cache/bytes_per_token", "cache/bytes_at_ctx", "perf/decode_tokens_per_sec", "train/loss"):
        assert key in metrics and metrics[key] > 0, key
        assert summary["metrics"][key] == pytest.approx(metrics[key])
    # GQA: 2 layers x 2 (k,v) x 2 kv heads x 8 head_dim x 4 bytes
    assert metrics["cache/bytes_per_token"] == 2 * 2 * 2 * 8 * 4
    assert metrics["cache/bytes_at_ctx"] == 32 * metrics["cache/bytes_per_token"]
    assert 0 < metrics["perf/mfu"] < 1
    assert (summary["compute_dtype"], summary["compute_dtype_source"]) == ("float32", "trainer.precision")
    # in process (a library call): the wait for the first step is counted from train()'s call, within its wall time
    assert summary["first_step_origin"] == "train()" and 0 < summary["first_step_seconds"] < summary["wall_seconds"]
    # training = forward + backward = 3 x the forward FLOPs (tests/test_flops_exact.py counts the 3x), and MFU is
    # computed from exactly that figure and the overridden peak
    import attnzoo

    forward = attnzoo.load(out).model.flops_per_token(32)
    assert metrics["perf/flops_per_token"] == pytest.approx(3 * forward, rel=1e-12)
    assert metrics["perf/mfu"] == pytest.approx(metrics["perf/tokens_per_sec"] * 3 * forward / 1e12, rel=1e-9)
    assert summary["sample"] and summary["sample"].startswith("def ")
    assert summary["model"]["family"] == "decoder"
    assert summary["model"]["layers"] == [{"mixer": "gqa", "n_heads": 4, "n_kv_heads": 2, "head_dim": 8}] * 2
    rows = read_metrics(out)
    val = [float(r["val/loss"]) for r in rows if r.get("val/loss")]
    assert len(val) >= 3 and val[-1] < val[0]
    assert any(r.get("perf/tokens_per_sec") for r in rows)
    assert (out / "checkpoints" / "last.ckpt").exists() and (out / "checkpoints" / "best.ckpt").exists()


def test_resume_continues_from_saved_step(tmp_path):
    first = tmp_path / "a"
    base = [*FAST, "scheduler=constant"]  # extended 8 -> 12 -> 14: a schedule the length does not stretch
    train(compose_cfg(base + ["trainer.max_steps=8", "trainer.val_check_interval=4"], first))
    ckpt = first / "checkpoints" / "last.ckpt"
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert state["global_step"] == 8
    second = tmp_path / "b"
    train(compose_cfg(base + ["trainer.max_steps=12", "trainer.val_check_interval=4", f"ckpt_path={ckpt}"], second))
    summary = json.loads((second / "summary.json").read_text())
    assert summary["global_step"] == 12
    steps = [int(r["step"]) for r in read_metrics(second) if r.get("train/loss")]
    assert steps and min(steps) >= 8  # the resumed run logs only the new steps
    # `ckpt_path=last` finds this run dir's own last.ckpt
    train(compose_cfg(base + ["trainer.max_steps=14", "trainer.val_check_interval=4", "ckpt_path=last"], second))
    assert json.loads((second / "summary.json").read_text())["global_step"] == 14


def test_missing_checkpoint_fails_before_work(tmp_path):
    from attnzoo.config.schema import ConfigError

    out = tmp_path / "c"
    with pytest.raises(ConfigError, match="ckpt_path"):
        train(compose_cfg(FAST + ["ckpt_path=last"], out))
    assert not (out / "checkpoints").exists()


@pytest.mark.parametrize("extra", [["logger=tensorboard"], ["model=vaswani", "scheduler=noam"], ["trainer.precision=bf16-mixed"],
                                   ["trainer.accumulate_grad_batches=2"]], ids=["tensorboard", "vaswani-noam", "bf16", "accum"])
def test_variants_train(tmp_path, extra):
    out = tmp_path / "v"
    train(compose_cfg(FAST + extra, out))
    assert_learns(out)
    if "logger=tensorboard" in extra:
        assert list((out / "tensorboard").glob("events.out.tfevents.*"))
