"""The run life cycle: the checkpoints a run leaves are the model its summary describes, and no process it
started outlives it.

- last.ckpt is written at the final step even when max_steps is not a multiple of the checkpoint interval
  (with and without DDP), holds exactly the final weights, and a run resumed after a crash between two
  checkpoints ends on the same weights as an uninterrupted one; best.ckpt holds the best validation.
- SIGKILL of a DDP launcher takes its workers along (real signal; the run dir is free again), SIGTERM to it
  preempts them (last.ckpt, status preempted, exit 0), a lock whose launcher is dead but whose workers live
  is still live, and SIGTERM of attnzoo-sweep ends its loky workers and resource trackers and exits non-zero.
"""
import csv
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from attnzoo.config.schema import ConfigError
from attnzoo.distributed.processes import alive, descendants
from attnzoo.training.rundir import LOCK_NAME, record_workers, run_dir_lock
from attnzoo.training.run import train
from tests.conftest import SESSION_CACHE, compose_cfg
from tests.test_faults_ddp import ENV, cli, wait_for_checkpoint
from tests.test_resume import BASE

# checkpoints (and validations) every 3 steps, 8 steps: Lightning's schedule alone leaves last.ckpt at step 6
EVERY_3 = ["trainer.val_check_interval=3", "callbacks.checkpoint_every_n_steps=3", "trainer.max_steps=8"]


def ckpt(run: Path, name: str = "last") -> dict:
    return torch.load(run / "checkpoints" / f"{name}.ckpt", weights_only=True, map_location="cpu")


def model_weights(state_dict: dict) -> dict:
    return {k.removeprefix("model."): v for k, v in state_dict.items()}


def assert_same_weights(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:  # bit for bit: the same weights, not close ones
        assert torch.equal(a[k], b[k]), k


def val_losses(run: Path) -> list[float]:
    with open(run / "csv" / "metrics.csv", newline="") as f:
        return [float(r["val/loss"]) for r in csv.DictReader(f) if r.get("val/loss")]


@pytest.fixture
def final_weights(monkeypatch):
    """The weights the run ends with, as final_metrics (the summary's validation) sees them."""
    import attnzoo.training.run as train_mod

    seen = {}
    orig = train_mod.final_metrics

    def spy(trainer, lit, *args, **kwargs):
        seen.update({k: v.detach().clone() for k, v in lit.model.state_dict().items()})
        return orig(trainer, lit, *args, **kwargs)

    monkeypatch.setattr(train_mod, "final_metrics", spy)
    return seen


def test_last_checkpoint_is_the_final_model_and_best_the_best(tmp_path, final_weights):
    run = tmp_path / "r"
    train(compose_cfg(BASE + EVERY_3 + ["callbacks.save_best=true"], run))
    summary = json.loads((run / "summary.json").read_text())
    last = ckpt(run)
    assert summary["global_step"] == last["global_step"] == 8
    assert_same_weights(model_weights(last["state_dict"]), final_weights)
    assert not list((run / "checkpoints").glob("*.tmp"))  # written through a temp file and renamed
    # best.ckpt: the lowest val/loss of every validation (steps 3, 6 and the final one at 8)
    losses = val_losses(run)
    assert len(losses) == 3 and summary["metrics"]["val/loss"] == pytest.approx(losses[-1], abs=0)
    best = ckpt(run, "best")
    record = next(v for k, v in best["callbacks"].items() if "'monitor': 'val/loss'" in k)
    assert float(record["best_model_score"]) == min(losses)
    if losses[-1] == min(losses):  # the final weights are the best: best.ckpt holds them
        assert best["global_step"] == 8
        assert_same_weights(model_weights(best["state_dict"]), final_weights)


def test_resume_after_a_crash_between_checkpoints_ends_on_the_uninterrupted_weights(tmp_path, monkeypatch):
    from attnzoo.training.callbacks import ThroughputMonitor

    ref, crashed = tmp_path / "ref", tmp_path / "crashed"
    train(compose_cfg(BASE + EVERY_3, ref))
    orig = ThroughputMonitor.on_train_batch_start

    def crash_at_7(self, trainer, *args):
        if trainer.global_step == 7:
            raise RuntimeError("crash between checkpoints")
        return orig(self, trainer, *args)

    monkeypatch.setattr(ThroughputMonitor, "on_train_batch_start", crash_at_7)
    with pytest.raises(RuntimeError, match="crash between checkpoints"):
        train(compose_cfg(BASE + EVERY_3, crashed))
    monkeypatch.undo()
    assert ckpt(crashed)["global_step"] == 6  # what a kill at step 7 leaves: the last scheduled checkpoint
    train(compose_cfg(BASE + EVERY_3 + ["ckpt_path=last"], crashed))
    a, b = ckpt(ref), ckpt(crashed)
    assert a["global_step"] == b["global_step"] == 8
    assert_same_weights(model_weights(b["state_dict"]), model_weights(a["state_dict"]))


def test_ddp_last_checkpoint_is_the_final_model(tmp_path, monkeypatch):
    """trainer=ddp_cpu, 3 steps, checkpoints every 2: last.ckpt at step 3 holds the weights both ranks end
    with (read in the workers by a sitecustomize spy on finish())."""
    spy = tmp_path / "spy"
    spy.mkdir()
    (spy / "sitecustomize.py").write_text(textwrap.dedent("""
        import os
        if os.environ.get("ATTNZOO_WORKER"):
            import torch
            import attnzoo.training.run as t

            orig = t.finish

            def finish(trainer, out, summary, loggers):
                state = trainer.lightning_module.model.state_dict()
                torch.save(state, out / f"final_rank{trainer.global_rank}.pt")
                return orig(trainer, out, summary, loggers)

            t.finish = finish
    """))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(spy), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("ATTNZOO_WORKER_START", "spawn")  # fresh worker processes: they read the sitecustomize
    run = tmp_path / "ddp"
    train(compose_cfg(BASE + ["trainer=ddp_cpu", "trainer.max_steps=3", "trainer.val_check_interval=2",
                              "callbacks.checkpoint_every_n_steps=2"], run))
    summary = json.loads((run / "summary.json").read_text())
    last = ckpt(run)
    assert summary["world_size"] == 2 and summary["global_step"] == last["global_step"] == 3
    for rank in (0, 1):
        final = torch.load(run / f"final_rank{rank}.pt", weights_only=True)
        assert_same_weights(model_weights(last["state_dict"]), final)


# ---- no orphans ---------------------------------------------------------------------------------------------

def session_processes(sid: int) -> list[int]:
    """Processes of session `sid` (a test starts each command in its own session: its children, and theirs,
    stay in it even once reparented)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and alive(int(name)):
            try:
                if os.getsid(int(name)) == sid:
                    found.append(int(name))
            except ProcessLookupError:
                pass
    return found


def end_session(p) -> None:
    """Whatever the test asserted: the process and everything in its session end with the test."""
    if p.poll() is None:
        p.kill()
        p.wait()
    for pid in session_processes(p.pid):
        os.kill(pid, signal.SIGKILL)


def wait_until_gone(pids, sid: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)] + session_processes(sid)
        if not left:
            return
        time.sleep(0.2)
    raise AssertionError(f"still running {timeout:.0f} s after the signal: {sorted(set(left))}")


def wait_for(condition, proc, what: str, timeout: float = 180.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"ended before {what}:\n" + proc.stdout.read()[-3000:])
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"no {what} in {timeout:.0f} s")


needs_proc = pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds processes through /proc")


@needs_proc
def test_sigkill_of_a_ddp_launcher_kills_its_workers_and_frees_the_run_dir(tmp_path):
    run = tmp_path / "ddp"
    p = cli(BASE + ["trainer=ddp_cpu", "trainer.max_steps=1000", "trainer.val_check_interval=1000",
                    "callbacks.checkpoint_every_n_steps=2", f"hydra.run.dir={run}", f"paths.cache_dir={SESSION_CACHE}"],
            start_new_session=True, fresh=True)
    try:
        wait_for_checkpoint(run / "checkpoints" / "last.ckpt", 2, p)  # both workers are training
        # the lock records the 2 workers: the launcher's descendants (forked from its fork server, whose command
        # line names attnzoo.cli.worker as the lock's liveness check expects), and they and the server go with it
        lock = (run / LOCK_NAME).read_text()
        workers = [int(w) for w in lock.splitlines()[1].split()[1:]]
        tree = descendants(p.pid)
        assert lock.startswith(f"{p.pid} ") and len(workers) == 2 and set(workers) <= set(tree)
        assert all("attnzoo.cli.worker" in Path(f"/proc/{w}/cmdline").read_text() for w in workers)
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        wait_until_gone(tree, p.pid)
    finally:
        end_session(p)
    with run_dir_lock(run):  # the lock left behind is stale now: taken over
        assert (run / LOCK_NAME).read_text().startswith(str(os.getpid()))


@needs_proc
def test_sigterm_to_a_ddp_launcher_preempts_its_workers(tmp_path):
    """The launcher passes SIGTERM on and waits: the workers save last.ckpt at the step they stop at, the
    run is marked preempted and exits 0 (it used to die at once, leaving its workers training on)."""
    run = tmp_path / "ddp"
    p = cli(BASE + ["trainer=ddp_cpu", "trainer.max_steps=1000", "trainer.val_check_interval=1000",
                    "callbacks.checkpoint_every_n_steps=2", f"hydra.run.dir={run}", f"paths.cache_dir={SESSION_CACHE}"],
            start_new_session=True, fresh=True)
    try:
        wait_for_checkpoint(run / "checkpoints" / "last.ckpt", 2, p)
        workers = descendants(p.pid)
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out[-3000:]
        summary = json.loads((run / "summary.json").read_text())
        assert summary["status"] == "preempted" and ckpt(run)["global_step"] == summary["global_step"] < 1000
        wait_until_gone(workers, p.pid)
    finally:
        end_session(p)


@needs_proc
def test_a_lock_whose_launcher_died_is_live_while_its_workers_live(tmp_path):
    out = tmp_path / "r"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    # a stand-in for an orphaned worker (its command line names attnzoo.cli.worker), and an unrelated process
    # that happens to have a recorded pid (a pid reused after the worker ended)
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "attnzoo.cli.worker"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with run_dir_lock(out):
            record_workers(out, [worker.pid])
            assert (out / LOCK_NAME).read_text().splitlines()[1] == f"workers {worker.pid}"
        assert not (out / LOCK_NAME).exists()  # released by its owner, worker line or not
        (out / LOCK_NAME).write_text(f"{dead.pid} {os.uname().nodename}\nworkers {other.pid} {worker.pid}\n")
        with pytest.raises(ConfigError, match=rf"^hydra.run.dir: .*in use by a live run \(pid {dead.pid} .*, whose "
                                              rf"DDP workers {worker.pid} still run\)") as e:
            with run_dir_lock(out):
                pass
        assert "\n" not in str(e.value)
        worker.kill()
        worker.wait()
        with run_dir_lock(out):  # the launcher and its worker are gone, `other` is not one of them: stale
            assert (out / LOCK_NAME).read_text().startswith(str(os.getpid()))
    finally:
        for proc in (worker, other):
            proc.kill()
            proc.wait()


@needs_proc
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_sigterm_of_a_sweep_ends_its_workers_and_resource_trackers(tmp_path, sig):
    """SIGTERM: the sweep stops everything it started and says how to resume. SIGKILL (nothing of the sweep runs):
    each loky worker dies with the sweep process (cli/train._die_with_the_sweep), its job's resource trackers
    with it (issue 43 item 7: four processes outlived a SIGKILLed sweep)."""
    sweep = tmp_path / "sweep"
    exe = Path(sys.executable).parent / "attnzoo-sweep"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "attnzoo.cli.sweep"]
    p = subprocess.Popen([*cmd, "window", "debug=smoke", "model.mixer.window=4,8", "optim.lr=3e-3",
                          "trainer.max_steps=100000", "trainer.val_check_interval=100000",
                          f"hydra.sweep.dir={sweep}", f"paths.cache_dir={SESSION_CACHE}"],
                         env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        # a job is training in a loky worker (it holds its run dir's lock)
        wait_for(lambda: list(sweep.glob(f"*/{LOCK_NAME}")), p, "running job")
        started = descendants(p.pid)
        names = " ".join(Path(f"/proc/{c}/cmdline").read_text(errors="replace") for c in started if alive(c))
        assert len(started) >= 2 and "loky" in names, names  # the workers and a resource tracker
        p.send_signal(sig)
        out, _ = p.communicate(timeout=60)
        if sig == signal.SIGTERM:
            assert p.returncode == 128 + signal.SIGTERM, out[-3000:]
            assert "attnzoo-sweep: SIGTERM: stopped the sweep" in out and f"hydra.sweep.dir={sweep}" in out, out[-3000:]
        else:
            assert p.returncode == -signal.SIGKILL
        wait_until_gone(started, p.pid)
    finally:
        end_session(p)


class _Stuck(torch.utils.data.Dataset):
    """A read that never returns (a loader worker waiting on a shard), after writing the worker's pid."""

    def __init__(self, pid_file: str):
        self.pid_file = pid_file

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        Path(self.pid_file).write_text(str(os.getpid()))
        time.sleep(3600)


def _iterate_stuck(pid_file: str) -> None:
    from attnzoo.data.sampling import ResumableDataMixin

    next(iter(ResumableDataMixin.val_loader(_Stuck(pid_file), batch_size=1, num_workers=1)))


def test_a_loader_worker_ends_with_the_training_process_that_started_it(tmp_path):
    """SIGKILL of a training process whose loader worker is inside a read: the worker goes too (the kernel's
    SIGKILL, data/sampling.end_with_the_rank); torch's own watchdog looks at the parent only between batches, and
    a DDP rank killed mid-run left its litdata workers behind."""
    import multiprocessing

    pid_file = tmp_path / "worker.pid"
    trainer = multiprocessing.get_context("fork").Process(target=_iterate_stuck, args=(str(pid_file),))
    trainer.start()
    deadline = time.time() + 60
    while not pid_file.exists() and time.time() < deadline:
        time.sleep(0.05)
    worker = int(pid_file.read_text())
    assert alive(worker)
    os.kill(trainer.pid, signal.SIGKILL)
    trainer.join()
    deadline = time.time() + 10
    while alive(worker) and time.time() < deadline:
        time.sleep(0.05)
    survived = alive(worker)
    if survived:  # not left holding this session's output pipes
        os.kill(worker, signal.SIGKILL)
    assert not survived, "the loader worker outlived the SIGKILLed process that started it"
