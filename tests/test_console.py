"""What a new user sees (issue 30, item 7): run names keep their values, the HParams tab opens on the run's
overrides, train.log holds the console log, a refused run leaves no folder, the progress bar counts the run's
steps, no advert / bogus FLOPs table / deprecation warning, and per-layer-kind heads in the summary line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from attnzoo.training.console import ConsoleLog, remove_new_run_dir
from attnzoo.training.csv_logger import run_hparams
from attnzoo.training.summary import describe_model
from attnzoo.training.trainer import short_override
from tests.conftest import SESSION_CACHE

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "ATTNZOO_CACHE": str(SESSION_CACHE), "PYTHONWARNINGS": "default"}


def test_run_names_keep_float_values():
    assert short_override("optim.lr=0.003") == "lr=0.003"
    assert short_override("+model.mixer.window=1e-4") == "window=1e-4"
    assert short_override("model/mixer=gqa") == "mixer=gqa"
    assert short_override("model.init_from=/data/m") == "init_from=-data-m"  # `/` cannot be in a folder name


def test_hparams_are_the_overrides_first_then_the_key_fields():
    flat = {"callbacks.monitor": "val/loss", "callbacks.save_best": True, "optim.lr": 0.003, "model.d_model": 32,
            "model.n_layers": 4, "seed": 1, "paths.output_dir": "/x", "data.name": "mqar"}
    got = run_hparams(flat, ["model/mixer=gqa", "optim.lr=3e-3", "paths.output_dir=/x", "hydra.run.dir=/x",
                             "+sweeps=mqar", "ckpt_path=last"])
    assert list(got) == ["model/mixer", "optim.lr", "model.d_model", "model.n_layers", "data.name", "seed"]
    assert got["optim.lr"] == 0.003 and got["model/mixer"] == "gqa"  # the resolved value, else the override's


@pytest.mark.parametrize("preset, overrides, heads", [
    ("default", [], "4/2kv"),
    ("local_global", [], "4/2kv"),  # every layer with heads has 4 query / 2 KV heads
    ("hybrid_gdn", [], "gated_deltanet:4,gqa:4/2kv"),
    ("default", ["model/mixer=gated_deltanet", "model.mixer.n_v_heads=8"], "4/8v"),
])
def test_summary_heads_per_layer_kind(preset, overrides, heads):
    import attnzoo

    model = attnzoo.build_model(preset, vocab_size=64, overrides=["model.d_model=32", "model.n_heads=4", *overrides])
    assert f" heads={heads} " in describe_model(model)


def test_console_log_holds_what_was_printed_once_accepted(tmp_path, capsys):
    log = tmp_path / "run" / "train.log"
    with ConsoleLog(log) as console:
        print("before accept")
        sys.stderr.write("bar  0%\rbar 50%\rbar 100%\n")
        console.start()
        print("\x1b[Asummary line")
    assert log.read_text() == "before accept\nbar 100%\nsummary line\n"
    assert "bar 50%" in capsys.readouterr().err  # the console itself is untouched
    refused = tmp_path / "refused" / "train.log"
    with ConsoleLog(refused):
        print("never accepted")
    assert not refused.parent.exists()


def test_refused_run_dir_and_its_empty_parents_are_removed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "outputs" / "train" / "2026-01-01_00-00-00"
    run.mkdir(parents=True)
    (run / "train.log").touch()
    (tmp_path / "outputs" / "other").mkdir()
    remove_new_run_dir(run)
    assert not (tmp_path / "outputs" / "train").exists() and (tmp_path / "outputs" / "other").is_dir()


def _cli(args, cwd):
    return subprocess.run([sys.executable, "-m", "attnzoo.cli.train", *args], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=600)


def test_a_refused_run_leaves_no_outputs_folder(tmp_path):
    r = _cli(["debug=smoke", "model.n_kv_heads=3"], tmp_path)
    assert r.returncode == 2 and "model.n_kv_heads" in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_what_a_run_prints(tmp_path):
    """One small CLI run (3 batches per epoch, 6 steps): the bar counts to the run's 6 steps, the console has no
    Lightning tip / module table / deprecation warning, train.log holds the console log with the summary, the
    TensorBoard folder keeps `lr=0.003`, and the HParams experiment lists the overrides first."""
    run = tmp_path / "run"
    r = _cli(["debug=smoke", "data=mqar", "data.train_size=12", "data.val_size=8", "data.num_kv_pairs=2",
              "trainer.enable_progress_bar=true", "logger=tensorboard", "optim.lr=0.003", f"hydra.run.dir={run}"],
             tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    console = r.stdout + r.stderr
    for unwanted in ("Tip:", "litlogger", "FLOPs  ", "Total FLOPs", "LeafSpec", "Warning", "not resumable"):
        assert unwanted not in console, (unwanted, console[-3000:])
    assert "attnzoo: training " in r.stdout and "MFLOPs/token" in r.stdout
    bar = [ln.rsplit("\r", 1)[-1] for ln in r.stdout.splitlines() if ln.rsplit("\r", 1)[-1].startswith("Epoch")]
    assert bar and "6/6" in bar[-1] and "Epoch 1" in bar[-1], bar  # two epochs of 3, one bar of 6 steps
    assert not any("/3 [" in ln for ln in bar)
    log = (run / "train.log").read_text()
    assert "\r" not in log and "attnzoo run summary" in log and "attnzoo: training " in log
    assert "GPU available" in log  # Lightning's own logger lines too
    assert log.count("6/6") >= 1
    # a command's wait for its first step counts from its first import (`python -m attnzoo.cli.train`: the process's
    # __main__), imports included
    summary = json.loads((run / "summary.json").read_text())
    assert summary["first_step_origin"] == "command" and summary["first_step_seconds"] > 0

    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.hparams import plugin_data_pb2

    (tb,) = (run / "tensorboard").iterdir()
    assert tb.name == "debug=smoke,data=mqar,train_size=12,val_size=8,num_kv_pairs=2,enable_progress_bar=true,lr=0.003"
    (events,) = tb.glob("events.out.tfevents.*")
    experiments = [plugin_data_pb2.HParamsPluginData.FromString(v.metadata.plugin_data.content).experiment
                   for ev in EventFileLoader(str(events)).Load() for v in ev.summary.value
                   if v.tag == "_hparams_/experiment"]
    assert len(experiments) == 1
    names = [h.name for h in experiments[0].hparam_infos]
    assert names[:7] == ["debug", "data", "data.train_size", "data.val_size", "data.num_kv_pairs",
                         "trainer.enable_progress_bar", "optim.lr"]
    assert not any(n.startswith("callbacks.") for n in names) and len(names) < 25
    assert "hparams/val/acc" in [m.name.tag for m in experiments[0].metric_infos]


def test_a_resumed_runs_bar_starts_at_its_step(tmp_path, capsys):
    from attnzoo.training.run import train
    from tests.conftest import compose_cfg

    base = ["debug=smoke", "data=mqar", "data.train_size=12", "data.val_size=8", "data.num_kv_pairs=2",
            "trainer.enable_progress_bar=true", "perf.measure_decode=false", "sample.max_new_tokens=0",
            "callbacks.checkpoint_every_n_steps=2", "scheduler=constant"]  # extended 4 -> 8: a length-free schedule
    train(compose_cfg(base + ["trainer.max_steps=4"], tmp_path / "run"))
    capsys.readouterr()
    train(compose_cfg(base + ["trainer.max_steps=8", "ckpt_path=last"], tmp_path / "run"))
    states = [s for ln in capsys.readouterr().out.splitlines() for s in ln.split("\r") if s.startswith("Epoch")]
    assert states and "4/8" in states[0] and "8/8" in states[-1], states
