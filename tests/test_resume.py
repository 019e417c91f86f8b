"""Resume keeps everything: a run split in two by a checkpoint equals the uninterrupted run step for step
(MoE aux-loss-free bias included), its metrics.csv continues instead of restarting, a checkpoint is
refused under another model/data config in one line, `--resume RUN_DIR` re-composes the run's own
overrides, and a run directory has one live owner."""
import csv
import re
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from attnzoo.config.schema import ConfigError
from attnzoo.training.rundir import LOCK_NAME, run_dir_lock
from attnzoo.cli.train import resume_argv
from attnzoo.training.run import train
from tests.conftest import SMALL_TEXT, cli_train, compose_cfg

# constant LR after warmup: a run stopped at step 4 and resumed to 8 follows the same schedule as one run to 8
BASE = ["debug=smoke", *SMALL_TEXT, "data.tokenizer=char", "data.seq_len=32", "data.batch_size=8", "optim.lr=3e-3",
        "perf.measure_decode=false", "sample.max_new_tokens=0", "scheduler=constant", "trainer.val_check_interval=4",
        "callbacks.checkpoint_every_n_steps=4", "callbacks.save_best=false", "trainer.limit_val_batches=1"]
MOE = ["model/ffn=moe", "model.ffn.n_experts=4", "model.ffn.top_k=1", "model.ffn.bias_update_speed=0.01",
       "model.ffn.aux_loss_coef=0.0"]


def rows(run_dir) -> list[dict]:
    with open(run_dir / "csv" / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def train_losses(run_dir) -> dict[int, float]:
    return {int(r["step"]): float(r["train/loss"]) for r in rows(run_dir) if r.get("train/loss")}


DROPOUT = ["model.dropout=0.2"]  # draws from the global torch generator at every step: its state must be restored


@pytest.mark.parametrize("extra", [[], MOE, DROPOUT], ids=["dense", "moe-aux-free-bias", "dropout"])
def test_stop_and_resume_equals_uninterrupted(tmp_path, extra):
    ref, split = tmp_path / "ref", tmp_path / "split"
    a = train(compose_cfg(BASE + extra + ["trainer.max_steps=8"], ref))
    train(compose_cfg(BASE + extra + ["trainer.max_steps=4"], split))
    b = train(compose_cfg(BASE + extra + ["trainer.max_steps=8", "ckpt_path=last"], split))
    la, lb = train_losses(ref), train_losses(split)
    assert sorted(lb) == sorted(la) == list(range(8))  # the curve is continuous: steps 0-3 kept, 4-7 appended
    for s in la:
        assert lb[s] == pytest.approx(la[s], abs=1e-6), (s, la[s], lb[s])
    assert b["val/loss"] == pytest.approx(a["val/loss"], abs=1e-6)
    if extra == MOE:  # the checkpoint holds the bias the next step uses: both runs end on the same bias
        def bias(run):
            sd = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
            return torch.stack([v for k, v in sorted(sd.items()) if k.endswith("expert_bias")])

        assert bias(ref).abs().sum() > 0
        torch.testing.assert_close(bias(split), bias(ref), atol=0, rtol=0)


def test_checkpoint_restores_the_random_generators_and_the_throughput_window(tmp_path):
    """The generators continue where the checkpoint left them (a dropout run resumed equals the uninterrupted
    one, above); the throughput window in progress is restored, so perf rows come at the same steps."""
    from attnzoo.training.callbacks import ThroughputMonitor

    ref, split = tmp_path / "ref", tmp_path / "split"
    extra = ["trainer.val_check_interval=8", "callbacks.checkpoint_every_n_steps=8"]
    train(compose_cfg(BASE + extra + ["trainer.max_steps=24"], ref))
    train(compose_cfg(BASE + extra + ["trainer.max_steps=16"], split))
    ckpt = torch.load(split / "checkpoints" / "last.ckpt", weights_only=True)
    assert {"python", "numpy", "torch"} <= set(ckpt["rng_states"])
    window = ckpt["callbacks"][ThroughputMonitor.__qualname__]
    assert window["steps"] == 6 and window["tokens"] == 6 * 8 * 32 and window["elapsed"] > 0  # 16 = 10 + 6
    train(compose_cfg(BASE + extra + ["trainer.max_steps=24", "ckpt_path=last"], split))

    def perf_steps(run):  # the steps where a window's measurement lands (the rows after it repeat it)
        seen = [(int(r["step"]), r["perf/step_ms"]) for r in rows(run) if r.get("perf/step_ms")]
        return [s for i, (s, v) in enumerate(seen) if i == 0 or v != seen[i - 1][1]]

    assert perf_steps(split) == perf_steps(ref) == [9, 19]  # without the window's state: [9, 25] (past the end)


def _generator_states() -> dict:
    """Every global generator's full state, comparable with ==: python, numpy (with its cached gaussian),
    torch CPU, and each CUDA device's when CUDA is up."""
    import random

    import numpy as np

    name, keys, pos, has_gauss, cached = np.random.get_state()
    out = {"python": random.getstate(), "numpy": (name, keys.tolist(), pos, has_gauss, cached),
           "torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return out


def _draw_from_every_generator() -> None:
    import random

    import numpy as np

    random.gauss(0, 1)  # gauss caches its second value: the cache is part of the state
    np.random.standard_normal()  # numpy's legacy gaussian cache too
    torch.rand(3)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.rand(3, device="cuda")


def test_checkpoint_round_trip_restores_every_generator(tmp_path):
    """The states a checkpoint file holds (saved, written, read back with weights_only=True) are restored
    exactly for every generator after they have all moved on."""
    from attnzoo.training.lit_lm import TrainingModule

    _draw_from_every_generator()
    ckpt: dict = {}
    outside_a_run = SimpleNamespace(_trainer=None, schedule_record=lambda steps: {"steps": steps})
    TrainingModule.on_save_checkpoint(outside_a_run, ckpt)
    at_save = _generator_states()
    torch.save(ckpt, tmp_path / "c.pt")
    for _ in range(3):
        _draw_from_every_generator()
    assert all(_generator_states()[k] != at_save[k] for k in at_save)
    TrainingModule.on_load_checkpoint(None, torch.load(tmp_path / "c.pt", weights_only=True))
    after = _generator_states()
    for k in at_save:
        assert after[k] == at_save[k], k


def test_resume_restores_every_generator_to_the_checkpoint(tmp_path, monkeypatch):
    """Through a real `ckpt_path=last` resume: right after Lightning hands the checkpoint to the module, each
    global generator is in the state the checkpoint recorded (python, numpy, torch CPU, CUDA if present)."""
    import random

    import numpy as np

    from lightning.pytorch import seed_everything

    from attnzoo.training.lit_lm import TrainingModule, set_rng_states

    run = tmp_path / "r"
    with monkeypatch.context() as m:  # every generator drawn from at each step (a numpy augmentation, say), so
        # none is left in its seeded state, which a resume that forgot it would reproduce by seeding again
        m.setattr(TrainingModule, "on_train_batch_start", lambda self, *a: _draw_from_every_generator(), raising=False)
        train(compose_cfg(BASE + ["trainer.max_steps=4"], run))
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["rng_states"]
    set_rng_states(saved)
    expected = _generator_states()
    seed_everything(compose_cfg(BASE, tmp_path / "x").seed, verbose=False)
    seeded = _generator_states()
    assert all(seeded[k] != expected[k] for k in expected)
    random.seed(1), np.random.seed(1), torch.manual_seed(1)  # somewhere else entirely before the resume
    seen = []
    original = TrainingModule.on_load_checkpoint

    def recording(self, checkpoint):
        original(self, checkpoint)
        seen.append(_generator_states())

    monkeypatch.setattr(TrainingModule, "on_load_checkpoint", recording)
    train(compose_cfg(BASE + ["trainer.max_steps=8", "ckpt_path=last"], run))
    assert len(seen) == 1 and set(seen[0]) == set(expected)
    for k in expected:
        assert seen[0][k] == expected[k], k


def test_finished_run_resumed_changes_nothing(tmp_path):
    """The issue's reproduction: finish a MoE run, rerun it with ckpt_path=last: val/loss must not change."""
    a = train(compose_cfg(BASE + MOE + ["trainer.max_steps=8"], tmp_path / "r"))
    b = train(compose_cfg(BASE + MOE + ["trainer.max_steps=8", "ckpt_path=last"], tmp_path / "r"))
    assert b["val/loss"] == a["val/loss"]


def test_resume_under_another_model_config_is_refused_and_touches_nothing(tmp_path):
    run = tmp_path / "r"
    train(compose_cfg(BASE + ["trainer.max_steps=4"], run))
    before = (run / "csv" / "metrics.csv").read_bytes()
    for change, field in [("model/mixer=mla", "model.mixer.name"), ("model.d_model=64", "model.d_model"),
                          ("model/position=none", "model.position.name"), ("model/ffn=moe", "model.ffn.name")]:
        with pytest.raises(ConfigError, match=rf"^ckpt_path: .*{field} ") as e:
            train(compose_cfg(BASE + ["trainer.max_steps=8", "ckpt_path=last", change], run))
        assert "\n" not in str(e.value)
    assert (run / "csv" / "metrics.csv").read_bytes() == before
    assert not (run / LOCK_NAME).exists()  # released after the refusal


def test_extending_a_run_is_exact_or_refused(tmp_path):
    """A finished run resumed with a larger trainer.max_steps: on a schedule that does not depend on the length
    (constant: test_stop_and_resume_equals_uninterrupted) it equals the longer run; on cosine, whose decay the new
    length would stretch over the steps already taken, it is refused in one line before anything is written, while
    its own length still resumes (a finished run rerun changes nothing)."""
    run, cosine = tmp_path / "r", [*BASE, "scheduler=cosine", "scheduler.warmup_steps=2"]
    first = train(compose_cfg(cosine + ["trainer.max_steps=4"], run))
    before = (run / "csv" / "metrics.csv").read_bytes()
    with pytest.raises(ConfigError, match=r"^trainer\.max_steps: .*last\.ckpt took its 4 steps on the cosine schedule "
                                          r"of a 4-step run; this run's schedule \(cosine, 8 steps\) gives those steps "
                                          r"other learning rates.*allowed: the checkpoint's trainer\.max_steps=4") as e:
        train(compose_cfg(cosine + ["trainer.max_steps=8", "ckpt_path=last"], run))
    assert "\n" not in str(e.value) and (run / "csv" / "metrics.csv").read_bytes() == before
    with pytest.raises(ConfigError, match=r"^trainer\.max_steps: .*this run's schedule \(constant, 8 steps\)"):
        train(compose_cfg(BASE + ["trainer.max_steps=8", "ckpt_path=last"], run))  # a schedule changed mid-run
    assert train(compose_cfg(cosine + ["trainer.max_steps=4", "ckpt_path=last"], run))["val/loss"] == first["val/loss"]


def test_resume_argv_recomposes_the_runs_own_overrides(tmp_path):
    run = tmp_path / "r"
    (run / ".hydra").mkdir(parents=True)
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "last.ckpt").write_bytes(b"")
    (run / ".hydra" / "overrides.yaml").write_text("- model/mixer=mla\n- model.d_model=64\n- ckpt_path=last\n")
    assert resume_argv(["--resume", str(run), "trainer.max_steps=9"]) == [
        "model/mixer=mla", "model.d_model=64", "trainer.max_steps=9", f"hydra.run.dir={run.resolve()}", "ckpt_path=last"]
    assert resume_argv(["model.d_model=8"]) == ["model.d_model=8"]
    with pytest.raises(ConfigError, match="^--resume: .* is not a run directory"):
        resume_argv(["--resume", str(tmp_path)])


def test_resume_hint_printed_after_a_run_works_when_pasted(tmp_path, monkeypatch, capsys):
    """`attnzoo-train --resume RUN_DIR` through the CLI's main: the run's overrides come back, so the model
    matches its checkpoint and the run continues to a larger max_steps."""
    run = tmp_path / "r"
    common = [f"paths.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={run}"]
    code, out, err = cli_train([*BASE, "model.d_model=48", "model.n_heads=4", "trainer.max_steps=4", *common],
                               monkeypatch, capsys)
    assert code == 0, out[-2000:] + err[-2000:]
    code, out, err = cli_train(["--resume", str(run), "trainer.max_steps=8"], monkeypatch, capsys)
    assert code == 0, out[-2000:] + err[-2000:]
    assert sorted(train_losses(run)) == list(range(8))


def test_a_live_run_owns_its_dir_and_a_stale_lock_is_taken_over(tmp_path):
    out = tmp_path / "r"
    with run_dir_lock(out):
        holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            (out / LOCK_NAME).write_text(f"{holder.pid} {os.uname().nodename}\n")  # as if another live run held it
            with pytest.raises(ConfigError, match=rf"^hydra.run.dir: .* in use by a live run \(pid {holder.pid}"):
                with run_dir_lock(out):
                    pass
        finally:
            holder.kill()
            holder.wait()
    (out / LOCK_NAME).write_text(f"{holder.pid} {os.uname().nodename}\n")  # its owner is dead now: stale
    with run_dir_lock(out):
        assert (out / LOCK_NAME).read_text().startswith(str(os.getpid()))
    assert not (out / LOCK_NAME).exists()


def test_refused_run_keeps_the_run_dirs_hydra_record(tmp_path, monkeypatch, capsys):
    """A resume refused in one line must not rewrite <run>/.hydra (the report reads the job's overrides
    there): Hydra's own writing is off (output_subdir: null) and attnzoo writes the record once accepted."""
    run = tmp_path / "r"
    common = [f"paths.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={run}"]
    code, out, err = cli_train([*BASE, "trainer.max_steps=4", *common], monkeypatch, capsys)
    assert code == 0, err[-2000:]
    record = {p.name: p.read_bytes() for p in (run / ".hydra").iterdir()}
    assert set(record) == {"config.yaml", "hydra.yaml", "overrides.yaml"} and b"trainer.max_steps=4" in record["overrides.yaml"]
    code, out, err = cli_train([*BASE, "trainer.max_steps=8", "model/mixer=mla", "ckpt_path=last", *common],
                               monkeypatch, capsys)
    assert code == 2 and "another model/data config" in err
    assert {p.name: p.read_bytes() for p in (run / ".hydra").iterdir()} == record
    code, out, err = cli_train([*BASE, "trainer.max_steps=8", "ckpt_path=last", *common], monkeypatch, capsys)
    assert code == 0, err[-2000:]
    assert b"trainer.max_steps=8" in (run / ".hydra" / "overrides.yaml").read_bytes()  # the accepted run's record


def test_metrics_csv_is_on_disk_at_every_checkpoint_and_rewritten_atomically(tmp_path, monkeypatch):
    """The kill/resume trials found metrics.csv missing rows after a SIGKILL: Lightning flushed the CSV every
    100 steps and rewrote it in place (open 'w', then write) whenever a column appeared. Now every checkpoint
    flushes the rows logged so far, and rewrites go through a temp file and os.replace."""
    from attnzoo.training.csv_logger import _write_atomically

    out = tmp_path / "r"
    train(compose_cfg(BASE + ["trainer.max_steps=8"], out))
    ckpt_step = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    logged = {int(r["step"]) for r in rows(out) if r.get("train/loss")}
    assert set(range(ckpt_step)) <= logged  # every step before the last checkpoint is in the file
    # a kill during a header rewrite leaves the old file whole
    path = out / "csv" / "metrics.csv"
    before = path.read_bytes()

    def dies(*a, **k):
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr("os.fsync", dies)
    with pytest.raises(KeyboardInterrupt):
        _write_atomically(str(path), ["step", "x"], [{"step": 1, "x": 2}])
    assert path.read_bytes() == before


def test_each_step_row_is_on_disk_before_its_checkpoint(tmp_path, monkeypatch):
    """Lightning runs the checkpoint callbacks of a batch before it logs that batch's row: RowBeforeCheckpoint
    writes the row first, so when last.ckpt for step N exists, the rows of every step before N are on disk
    (what a SIGKILL right after the checkpoint leaves); the loop's repeat adds no duplicate row."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    seen = {}
    orig = ModelCheckpoint._save_checkpoint

    def spy(self, trainer, filepath):
        orig(self, trainer, filepath)
        if filepath.endswith("last.ckpt"):
            seen[trainer.global_step] = {int(r["step"]) for r in rows(tmp_path / "r") if r.get("train/loss")}

    monkeypatch.setattr(ModelCheckpoint, "_save_checkpoint", spy)
    train(compose_cfg(BASE + ["trainer.max_steps=12", "callbacks.checkpoint_every_n_steps=2",
                              "trainer.log_every_n_steps=1"], tmp_path / "r"))
    assert seen and all(set(range(step)) <= logged for step, logged in seen.items()), seen
    steps = [int(r["step"]) for r in rows(tmp_path / "r") if r.get("train/loss")]
    assert sorted(steps) == list(range(12))  # one train/loss row per step


def test_resume_continues_the_tensorboard_folder_and_the_wandb_run(tmp_path, monkeypatch, capfd):
    """A resumed run writes into its own TensorBoard folder (events after the checkpoint step purged, so every
    step appears once) and continues its wandb run (same id, `resume="allow"`)."""
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    run = tmp_path / "r"
    loggers = ["logger=[csv,tensorboard,wandb]", "trainer.log_every_n_steps=1"]
    import attnzoo.training.trainer as trainer_mod

    # under Hydra the folder is named from the overrides, which the resume changes (a larger max_steps)
    monkeypatch.setattr(trainer_mod, "run_label", lambda: "max_steps=4")
    train(compose_cfg(BASE + loggers + ["trainer.max_steps=4"], run))
    monkeypatch.setattr(trainer_mod, "run_label", lambda: "max_steps=8")
    first_id = (run / "wandb_run_id").read_text()
    capfd.readouterr()
    train(compose_cfg(BASE + loggers + ["trainer.max_steps=8", "ckpt_path=last"], run))
    out = capfd.readouterr().out
    assert f"continuing run {first_id}" in out and (run / "wandb_run_id").read_text() == first_id
    # one run id: offline-run-<YYYYMMDD_HHMMSS>-<id>, and wandb appends -1 when the resumed run starts within the
    # same second as the first (its folder name would collide)
    ids = {re.match(r"offline-run-\d{8}_\d{6}-([a-z0-9]+)", p.name).group(1) for p in (run / "wandb").glob("offline-run-*")}
    assert ids == {first_id}
    folders = {p.parent for p in (run / "tensorboard").rglob("events.out.tfevents.*")}
    assert len(folders) == 1
    steps = []
    for f in sorted(next(iter(folders)).glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(f))
        acc.Reload()
        steps += [e.step for e in acc.Scalars("train/loss")] if "train/loss" in acc.Tags()["scalars"] else []
    assert sorted(steps) == list(range(8))


def test_the_training_loader_is_stateful_and_its_state_alone_resumes_mid_epoch(tmp_path, recwarn):
    """Lightning sees the training loader as resumable (no "dataloader is not resumable" warning after a mid-epoch
    resume): its state (epoch, batches consumed) is in the checkpoint's fit loop, and that state alone, with the
    datamodule's own entry removed, resumes at the next batch of the uninterrupted run."""
    ref, split = tmp_path / "ref", tmp_path / "split"
    train(compose_cfg(BASE + ["trainer.max_steps=8"], ref))
    train(compose_cfg(BASE + ["trainer.max_steps=4"], split))
    path = split / "checkpoints" / "last.ckpt"
    ckpt = torch.load(path, weights_only=False)
    state = ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert len(state) == 1 and state[0]["batches"] == 4 and state[0]["epoch"] == 0  # mid-epoch: 4 batches done
    dm_keys = [k for k, v in ckpt.items() if isinstance(v, dict) and set(v) == {"epoch", "batches"}]
    assert len(dm_keys) == 1
    del ckpt[dm_keys[0]]
    torch.save(ckpt, path)
    recwarn.clear()
    train(compose_cfg(BASE + ["trainer.max_steps=8", "ckpt_path=last"], split))
    assert not [w for w in recwarn if "not resumable" in str(w.message)]
    la, lb = train_losses(ref), train_losses(split)
    assert sorted(lb) == sorted(la) == list(range(8))
    for s in la:
        assert lb[s] == pytest.approx(la[s], abs=1e-6), (s, la[s], lb[s])


@pytest.mark.parametrize("saved_gpus, present", [(8, 1), (2, 4), (2, 0)])
def test_cuda_generator_states_restored_onto_the_gpus_present(saved_gpus, present, monkeypatch):
    """A run saved on 8 GPUs resumes on 1 (issue 51 item 8: set_rng_state_all raised IndexError): each saved
    state goes to the GPU of its index while there is one; extra GPUs keep their state; no GPU: nothing."""
    from attnzoo.training.lit_lm import rng_states, set_rng_states

    states = rng_states()
    states["cuda"] = [torch.full((16,), i, dtype=torch.uint8) for i in range(saved_gpus)]
    restored = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: present > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: present)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.__setitem__(device, int(state[0])))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda _: pytest.fail("restores every saved state"))
    set_rng_states(states)
    assert restored == {i: i for i in range(min(saved_gpus, present))}
