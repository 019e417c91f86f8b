"""DDP on 2 CPU processes, multirun + DDP isolation, kill/resume, SIGTERM, NaN, checkpoint safety."""
import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from attnzoo.training.checkpoint_io import AtomicCheckpointIO, check_checkpoint
from attnzoo.config.schema import ConfigError
from attnzoo.data.sampling import ResumableShuffleSampler
from attnzoo.training.run import train
from tests.conftest import SESSION_CACHE, SMALL_TEXT, compose_cfg
from scripts.warm_run import run_python, start_python

FAST = ["debug=smoke", *SMALL_TEXT, "data.tokenizer=char", "data.seq_len=32", "data.batch_size=8", "optim.lr=3e-3",
        "perf.measure_decode=false", "sample.max_new_tokens=0"]
# OMP_NUM_THREADS=1: a run in a subprocess must use the thread count of the in-process runs it is compared
# with (conftest sets torch.set_num_threads(1)); other counts change fp32 summation order, so the losses differ
ENV = {**os.environ, "ATTNZOO_CACHE": str(SESSION_CACHE), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def losses(run_dir: Path) -> dict:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")}


def cli(args, fresh: bool = False, **kw):
    """`attnzoo-train ARGS` started, not waited for (output: stdout and stderr together). Forked from the warm fork
    server (scripts/warm_run.start_python: no ~5 s of imports) unless `fresh`: a real interpreter, for the tests
    about the process tree a launcher leaves (tests/test_lifecycle.py)."""
    if fresh:
        return subprocess.Popen([sys.executable, "-m", "attnzoo.cli.train", *args], env=ENV, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, **kw)
    return start_python(["-m", "attnzoo.cli.train", *args], env=ENV, **kw)


def wait_for_checkpoint(path: Path, min_step: int, proc, timeout=180):
    start = time.time()
    while time.time() - start < timeout:
        if proc.poll() is not None:
            raise AssertionError("run ended before it could be interrupted:\n" + proc.stdout.read()[-3000:])
        if path.exists():
            try:
                if torch.load(path, weights_only=True)["global_step"] >= min_step:
                    return
            except Exception:
                pass
        time.sleep(0.2)
    raise AssertionError("no checkpoint in time")


def test_sampler_shards_ranks_and_resumes_exactly(monkeypatch):
    import attnzoo.data.sampling as sampling

    shards = []
    for rank in range(2):
        monkeypatch.setattr(sampling, "_rank_world", lambda r=rank: (r, 2))
        s = ResumableShuffleSampler(21, seed=3, batch_size=2)
        s.set_epoch(1)
        shards.append(list(s))
    assert len(shards[0]) == len(shards[1]) == 10 and not set(shards[0]) & set(shards[1])
    monkeypatch.setattr(sampling, "_rank_world", lambda: (0, 1))
    full = ResumableShuffleSampler(21, seed=3, batch_size=2)
    full.set_epoch(1)
    order = list(full)
    resumed = ResumableShuffleSampler(21, seed=3, batch_size=2)
    resumed.resume(epoch=1, batches_done=4)
    assert list(resumed) == order[8:]
    assert list(resumed) == order  # the skip applies once


def test_ddp_cpu_two_processes(tmp_path):
    out = tmp_path / "ddp"
    metrics = train(compose_cfg(FAST + ["trainer=ddp_cpu", "trainer.max_steps=4", "trainer.val_check_interval=2"], out))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_step"] == 4 and summary["status"] == "ok"
    assert metrics["val/loss"] > 0 and metrics["perf/tokens_per_sec"] > 0
    assert (out / "launch" / "rank1.log").exists()
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "csv", "launch", "summary.json", "train.log"]
    assert (out / "train.log").read_text().count("attnzoo run summary") == 1  # rank 0's console, once
    assert len(list((out / "csv").glob("metrics.csv"))) == 1


def test_multirun_ddp_jobs_are_isolated(tmp_path):
    """3 jobs with trainer=ddp_cpu, the first one failing at run time (lr 1e30 without clipping: a non-finite loss;
    a value any job would refuse is refused before the first job instead): the others train, exactly 3 job dirs."""
    sweep = tmp_path / "sweep"
    r = run_python(["-m", "attnzoo.cli.train", "-m", *FAST, "trainer=ddp_cpu", "trainer.max_steps=3",
                    "trainer.val_check_interval=3", "trainer.gradient_clip_val=null", "optim.lr=1e30,3e-3,1e-3",
                    f"hydra.sweep.dir={sweep}"], env=ENV, timeout=600)
    # the sweep runs every job, then exits non-zero because one failed
    assert r.returncode == 1 and "attnzoo: 2 ok, 1 failed" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert jobs == ["0", "1", "2"], jobs
    status = [json.loads((sweep / j / "summary.json").read_text())["status"] for j in jobs]
    assert status == ["failed", "ok", "ok"]
    assert "DDP worker rank" in (sweep / "0" / "error.txt").read_text()  # its rank stopped on the non-finite loss
    for j in ("1", "2"):
        s = json.loads((sweep / j / "summary.json").read_text())
        assert s["world_size"] == 2 and s["config"]["optim"]["lr"] == {"1": 3e-3, "2": 1e-3}[j]
        assert len(list((sweep / j / "csv").glob("metrics.csv"))) == 1
    assert not (Path.cwd() / "outputs").exists() or not any((Path.cwd() / "outputs").glob("**/launch"))


def test_sigkill_then_resume_matches_uninterrupted(tmp_path):
    common = FAST + ["trainer.max_steps=60", "trainer.val_check_interval=100", "callbacks.checkpoint_every_n_steps=4",
                     "callbacks.save_best=false", "trainer.limit_val_batches=1"]
    ref = tmp_path / "ref"
    train(compose_cfg(common, ref))
    run = tmp_path / "killed"
    p = cli(common + [f"hydra.run.dir={run}", f"paths.cache_dir={SESSION_CACHE}"])
    wait_for_checkpoint(run / "checkpoints" / "last.ckpt", 8, p)
    p.send_signal(signal.SIGKILL)
    p.wait()
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    assert 8 <= saved < 60  # complete and loadable even if the kill hit a write (that leaves only a .tmp)
    train(compose_cfg(common + ["ckpt_path=last"], run))
    assert not list((run / "checkpoints").glob("*.tmp"))  # the resumed run's saves removed any stray temp file
    a, b = losses(ref), losses(run)
    after = [s for s in a if s >= saved]
    assert after and all(s in b for s in after)
    for s in after:
        assert b[s] == pytest.approx(a[s], abs=1e-6), (s, a[s], b[s])


def test_sigterm_saves_checkpoint_and_exits_cleanly(tmp_path):
    # scheduler=constant: resumed to a shorter length, a cosine schedule would give the steps taken other rates
    common = FAST + ["scheduler=constant", "trainer.max_steps=400", "trainer.val_check_interval=1000",
                     "callbacks.checkpoint_every_n_steps=2",
                     "callbacks.save_best=false"]
    run = tmp_path / "term"
    p = cli(common + [f"hydra.run.dir={run}", f"paths.cache_dir={SESSION_CACHE}"])
    wait_for_checkpoint(run / "checkpoints" / "last.ckpt", 2, p)
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "preempted"
    step = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    assert step == summary["global_step"] and step < 400
    assert "SIGTERM at step" in out
    train(compose_cfg(common + ["trainer.max_steps=" + str(step + 2), "ckpt_path=last"], run))
    assert json.loads((run / "summary.json").read_text())["global_step"] == step + 2


def test_nonfinite_loss_stops_naming_the_step_or_skips(tmp_path):
    from attnzoo.training.lit_lm import NonFiniteLossError

    with pytest.raises(NonFiniteLossError, match=r"at step \d+"):
        train(compose_cfg(FAST + ["optim.lr=1e30", "trainer.gradient_clip_val=null"], tmp_path / "nan"))
    metrics = train(compose_cfg(FAST + ["optim.lr=1e30", "trainer.gradient_clip_val=null", "on_nonfinite=skip"],
                                tmp_path / "skip"))
    assert "val/loss" in metrics


def test_atomic_checkpoint_write_keeps_previous_on_failure(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}, "global_step": 1}, path)

    def broken_save(obj, f, *a, **k):
        f.write(b"PK\x03\x04partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError):
        io.save_checkpoint({"state_dict": {"w": torch.zeros(3)}, "global_step": 2}, path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=True)["global_step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_corrupt_and_truncated_checkpoints_fail_with_one_line(tmp_path):
    good = tmp_path / "good.ckpt"
    AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(1000)}, "global_step": 1}, good)
    data = good.read_bytes()
    (tmp_path / "trunc.ckpt").write_bytes(data[: len(data) // 2])
    (tmp_path / "junk.ckpt").write_bytes(b"not a checkpoint")
    (tmp_path / "empty.ckpt").write_bytes(b"")
    check_checkpoint(good)
    for name in ("trunc.ckpt", "junk.ckpt", "empty.ckpt", "missing.ckpt"):
        with pytest.raises(ConfigError) as e:
            check_checkpoint(tmp_path / name)
        assert str(e.value).startswith("ckpt_path:") and "\n" not in str(e.value)


def test_deferred_nonfinite_check_names_the_step(tmp_path):
    """The GPU path keeps the finiteness flag on the device and checks it one step later (no host sync)."""
    from omegaconf import OmegaConf

    from attnzoo.training.lit_lm import LitLM, NonFiniteLossError

    cfg = OmegaConf.to_container(compose_cfg(FAST, tmp_path / "d"), resolve=False)
    cfg["paths"]["output_dir"] = str(tmp_path)
    lit = LitLM(OmegaConf.to_container(OmegaConf.create(cfg), resolve=True), vocab_size=32)
    lit._pending = (torch.tensor(True), torch.tensor(1.0), 6)
    lit._check_deferred()  # finite: nothing happens
    lit._pending = (torch.tensor(False), torch.tensor(float("nan")), 7)
    with pytest.raises(NonFiniteLossError, match="at step 7"):
        lit.on_train_end()


def test_sigterm_stops_a_local_sweep(tmp_path):
    """SIGTERM ends the process: the current job saves last.ckpt and is marked preempted, no next job starts."""
    sweep = tmp_path / "sweep"
    common = FAST + ["trainer.max_steps=400", "trainer.val_check_interval=1000", "callbacks.checkpoint_every_n_steps=2",
                     "callbacks.save_best=false"]
    p = cli(["-m", *common, "seed=1,2", f"hydra.sweep.dir={sweep}", f"paths.cache_dir={SESSION_CACHE}"])
    wait_for_checkpoint(sweep / "0" / "checkpoints" / "last.ckpt", 2, p)
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out[-3000:]
    assert json.loads((sweep / "0" / "summary.json").read_text())["status"] == "preempted"
    assert not (sweep / "1").exists()
