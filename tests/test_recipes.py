"""Training recipes: the warmup-stable-decay schedule (its shapes, a stable part that does not depend on the run's
length), step checkpoints kept with keep-latest-k, and a cooldown branched from a stable run's step checkpoint,
which equals the same schedule trained straight through (Hägele et al. 2024's premise, exactly); a profiled window
of steps (perf.profile)."""
import csv
import json
import math

import pytest
import torch

from attnzoo.config.errors import ConfigError
from attnzoo.config.schema import SchedulerConfig
from attnzoo.training.run import train
from attnzoo.training.schedules import lr_lambda, schedule_digest
from tests.conftest import SMALL_TEXT, compose_cfg

WSD = dict(name="wsd", warmup_steps=4, min_lr_ratio=0.1)


@pytest.mark.parametrize("shape, left", [("linear", lambda x: 1 - x), ("cosine", lambda x: (1 + math.cos(math.pi * x)) / 2),
                                         ("1-sqrt", lambda x: 1 - math.sqrt(x))])
def test_wsd_warms_up_holds_and_decays_in_its_shape_to_the_floor(shape, left):
    f = lr_lambda(SchedulerConfig(**WSD, decay_shape=shape, decay_steps=10), max_steps=50, d_model=64)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert all(f(s) == 1.0 for s in range(4, 40))  # stable until max_steps - decay_steps
    for s in range(40, 50):  # the decay's k-th step is at progress k/10; the last step is at the floor
        assert f(s) == pytest.approx(0.1 + 0.9 * left((s - 39) / 10), abs=1e-15)
    assert f(49) == pytest.approx(0.1, abs=1e-15)


def test_wsd_decay_fraction_and_a_stable_part_independent_of_the_length():
    """decay_steps null: the last decay_fraction of the run decays; and every run's steps before its own decay have
    the rates of a longer run's: a cooldown branched there continues that run (the schedule digest a resume checks)."""
    sched = SchedulerConfig(**WSD, decay_fraction=0.25)
    short, long = lr_lambda(sched, 40, 64), lr_lambda(sched, 400, 64)
    assert short(29) == 1.0 and short(30) < 1.0
    assert schedule_digest(short, 30) == schedule_digest(long, 30)
    assert schedule_digest(short, 31) != schedule_digest(long, 31)


BASE = ["debug=smoke", *SMALL_TEXT, "data.tokenizer=char", "data.seq_len=32", "data.batch_size=8", "optim.lr=3e-3",
        "perf.measure_decode=false", "sample.max_new_tokens=0", "scheduler=wsd", "scheduler.warmup_steps=2",
        "trainer.val_check_interval=4", "callbacks.save_best=false", "trainer.limit_val_batches=1"]


def train_losses(run_dir) -> dict[int, float]:
    with open(run_dir / "csv" / "metrics.csv", newline="") as f:
        return {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")}


def test_a_cooldown_branched_from_a_kept_step_equals_the_schedule_trained_straight(tmp_path):
    stable, branch, straight = tmp_path / "stable", tmp_path / "cooldown", tmp_path / "straight"
    s = train(compose_cfg(BASE + ["scheduler.decay_steps=0", "trainer.max_steps=8", "callbacks.step_checkpoints=true",
                                  "callbacks.checkpoint_every_n_steps=2", "callbacks.keep_latest=2"], stable))
    kept = sorted(p.name for p in (stable / "checkpoints").glob("step-*"))
    assert kept == ["step-00000006.ckpt", "step-00000008.ckpt"]  # 2 and 4 deleted: the newest two kept
    assert torch.load(stable / "checkpoints" / kept[0], weights_only=True)["global_step"] == 6
    summary = (stable / "summary.json").read_text()
    assert '"steps_kept": [\n      6,\n      8\n    ]' in summary
    cooldown = ["scheduler.decay_steps=2", "trainer.max_steps=8"]
    b = train(compose_cfg(BASE + cooldown + [f"branch_from={stable}"], branch))
    # the straight run profiled (perf.profile): a trace of steps 2-3 in its folder, which changes none of its numbers
    c = train(compose_cfg(BASE + cooldown + ["perf.profile=true", "perf.profile_wait=2", "perf.profile_steps=2"],
                          straight))
    prof = json.loads((straight / "summary.json").read_text())["profile"]
    assert prof["steps"] == [2, 4] and prof["trace"] == str(straight / "profile" / "trace.json")
    events = json.loads((straight / "profile" / "trace.json").read_text())["traceEvents"]
    assert any(e.get("name") == "aten::mm" for e in events) and len(prof["top_ops"]) == 8
    assert all(op["self_ms_per_step"] > 0 and op["calls"] >= 1 for op in prof["top_ops"])
    assert (straight / "profile" / "top_ops.txt").read_text().count("aten::") >= 8
    lb, lc = train_losses(branch), train_losses(straight)
    assert sorted(lb) == [6, 7] and all(lb[k] == lc[k] for k in lb), (lb, {k: lc[k] for k in lb})  # bit for bit
    assert b["val/loss"] == c["val/loss"] != s["val/loss"]
    assert b["train/tokens"] == c["train/tokens"] == 8 * 8 * 32  # the stable part counted in the branch's budget
    # a step the stable run did not keep, and a stable run loaded at a kept step of its own
    with pytest.raises(ConfigError, match=r"^branch_from: no checkpoint of step 4 in .*; steps kept there: 6, 8$"):
        train(compose_cfg(BASE + ["scheduler.decay_steps=4", "trainer.max_steps=8", f"branch_from={stable}"],
                          tmp_path / "nope"))
    with pytest.raises(ConfigError, match=r"^ckpt_path: no checkpoint of step 3 in"):
        train(compose_cfg(BASE + ["scheduler.decay_steps=0", "trainer.max_steps=8", "ckpt_path=step:3"], stable))


def test_a_cooldown_sized_by_flops_branches_where_the_stable_run_kept_its_budget(tmp_path):
    """callbacks.branch_budgets keeps the step where each FLOP budget's 20% cooldown starts; a run with that
    trainer.max_flops and branch_from starts there (its steps known once its model is built), equals the same budget
    trained straight on its schedule, and is a point of the report's iso-FLOP study (stopped by its budget)."""
    flops_per_step = json.loads((_stable_for_budgets(tmp_path) / "summary.json").read_text())["length"]["flops"] / 10
    budget = 5 * flops_per_step  # 5 steps: the cooldown starts at step 4 (20%: 1 step)
    assert sorted(p.name for p in (tmp_path / "stable" / "checkpoints").glob("step-*")) == \
        ["step-00000004.ckpt", "step-00000008.ckpt"]  # budgets of 5 and 10 steps
    sized = ["trainer.max_steps=null", f"trainer.max_flops={budget!r}", "scheduler.decay_fraction=0.2"]
    b = train(compose_cfg(BASE + sized + [f"branch_from={tmp_path / 'stable'}"], tmp_path / "cooldown"))
    c = train(compose_cfg(BASE + sized, tmp_path / "straight"))
    lb, lc = train_losses(tmp_path / "cooldown"), train_losses(tmp_path / "straight")
    assert sorted(lb) == [4] and lb[4] == lc[4] and b["val/loss"] == c["val/loss"]
    summary = json.loads((tmp_path / "cooldown" / "summary.json").read_text())
    # what the report's iso-FLOP study takes a job by (analysis/report/scaling.py): a FLOP budget, reached
    assert summary["length"]["max_flops"] == budget and summary["length"]["flops"] >= budget


def _stable_for_budgets(tmp_path):
    """A stable 10-step run whose branch_budgets are the FLOPs of 5 and 10 of its steps (a first run measures them)."""
    probe = tmp_path / "probe"
    train(compose_cfg(BASE + ["trainer.max_steps=1", "scheduler.warmup_steps=0"], probe))
    per_step = json.loads((probe / "summary.json").read_text())["length"]["flops"]
    stable = tmp_path / "stable"
    train(compose_cfg(BASE + ["scheduler.decay_steps=0", "trainer.max_steps=10",
                              f"callbacks.branch_budgets=[{5 * per_step!r},{10 * per_step!r}]"], stable))
    return stable
