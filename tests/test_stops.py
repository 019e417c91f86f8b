"""How long a run trains (attnzoo/config/stops.py): trainer.max_steps / max_tokens / max_flops, whichever comes first;
the budget becomes steps once the model is built, the learning-rate schedule decays over them, and
train/tokens / train/flops are logged as the run goes, counted on from the checkpoint by a resumed run."""
import csv
import json
import math

import pytest
import torch

from attnzoo.config.errors import ConfigError
from attnzoo.config.stops import Spent, run_length, tokens_per_step
from attnzoo.training.run import train
from tests.conftest import SMALL_TEXT, compose_cfg

B, T = 4, 16
FAST = ["debug=smoke", *SMALL_TEXT, "data.tokenizer=char", f"data.seq_len={T}", f"data.batch_size={B}",
        "perf.measure_decode=false", "sample.max_new_tokens=0", "trainer.val_check_interval=1000",
        "trainer.limit_val_batches=1", "model.n_layers=1", "callbacks.save_best=false"]


def spent_rows(run_dir) -> list[dict]:
    with open(run_dir / "csv" / "metrics.csv", newline="") as f:
        return [r for r in csv.DictReader(f) if r.get("train/flops")]


def test_the_smallest_limit_decides_and_a_budget_rounds_up_to_whole_steps():
    assert tokens_per_step(4, 16, 3, 2) == 4 * 16 * 3 * 2
    per = run_length(None, 1000, None, 64, 10.0)
    assert (per.steps, per.limit) == (16, "trainer.max_tokens")  # 15.6 steps -> 16 (1024 tokens: >= the budget)
    assert run_length(None, 1024, None, 64, 10.0).steps == 16  # exactly 16 steps: not one more
    assert run_length(None, 1, None, 64, 10.0).steps == 1
    flops = run_length(None, None, 64 * 10.0 * 7.5, 64, 10.0)
    assert (flops.steps, flops.limit, flops.flops_per_step) == (8, "trainer.max_flops", 640.0)
    first = run_length(5, 10**9, 10**12, 64, 10.0)
    assert (first.steps, first.limit) == (5, "trainer.max_steps")
    both = run_length(None, 64 * 3, 640.0 * 2, 64, 10.0)  # tokens allow 3 steps, FLOPs 2
    assert (both.steps, both.limit) == (2, "trainer.max_flops")
    summary = both.summary(64 * 3, 640.0 * 2)
    assert summary["tokens"] == 2 * 64 and summary["flops"] == 2 * 640.0


def test_a_token_budget_sets_the_steps_and_the_schedule(tmp_path):
    out = tmp_path / "tokens"
    budget = 10 * B * T - 5  # 9.92 steps' worth: 10 steps
    metrics = train(compose_cfg(FAST + [f"trainer.max_tokens={budget}", "trainer.max_steps=null"], out))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["global_step"] == 10 and summary["config"]["trainer"]["max_steps"] == 10
    length = summary["length"]
    assert length["limit"] == "trainer.max_tokens" and length["tokens"] == 10 * B * T >= budget
    # the FLOPs per token are the ones MFU uses
    assert length["flops_per_token"] == pytest.approx(metrics["perf/flops_per_token"])
    rows = spent_rows(out)
    assert [float(r["train/tokens"]) for r in rows] == [float(s * B * T) for s in range(1, 11)]
    assert float(rows[-1]["train/flops"]) == pytest.approx(10 * B * T * metrics["perf/flops_per_token"])
    # the cosine schedule decayed over the budget's 10 steps (to its floor at the last), not over a default length
    sched = torch.load(out / "checkpoints" / "last.ckpt", weights_only=False)["lr_schedulers"][0]
    floor = summary["config"]["scheduler"]["min_lr_ratio"]
    assert sched["_last_lr"][0] == pytest.approx(sched["base_lrs"][0] * floor)


def test_a_flop_budget_and_max_steps_whichever_comes_first(tmp_path):
    probe = tmp_path / "probe"
    per_token = train(compose_cfg(FAST + ["trainer.max_steps=1"], probe))["perf/flops_per_token"]
    out = tmp_path / "flops"
    train(compose_cfg(FAST + [f"trainer.max_flops={per_token * B * T * 6.5}", "trainer.max_steps=100"], out))
    length = json.loads((out / "summary.json").read_text())["length"]
    assert (length["steps"], length["limit"]) == (7, "trainer.max_flops")
    capped = tmp_path / "capped"
    train(compose_cfg(FAST + [f"trainer.max_flops={per_token * B * T * 6.5}", "trainer.max_steps=3"], capped))
    summary = json.loads((capped / "summary.json").read_text())
    assert summary["global_step"] == 3 and summary["length"]["limit"] == "trainer.max_steps"


def test_a_token_budget_counts_every_data_parallel_rank(tmp_path):
    out = tmp_path / "ddp"
    train(compose_cfg(FAST + ["trainer=ddp_cpu", f"trainer.max_tokens={6 * B * T}", "trainer.max_steps=null"], out))
    summary = json.loads((out / "summary.json").read_text())
    # two ranks train on 2 x B x T tokens a step: the budget of 6 one-rank steps is 3 steps
    assert summary["global_step"] == 3 and summary["length"]["tokens_per_step"] == 2 * B * T
    assert math.isclose(float(spent_rows(out)[-1]["train/tokens"]), 6 * B * T)


def test_a_resumed_budget_spends_what_is_left_and_a_budget_below_one_step_is_refused():
    fresh = run_length(None, None, 640.0 * 6.5, 64, 10.0)
    assert fresh.steps == 7 and fresh.spent_at(7) == Spent(7, 7 * 64, 7 * 640.0)
    # resumed after 3 steps at the same cost: the uninterrupted run's 7 steps
    same = run_length(None, None, 640.0 * 6.5, 64, 10.0, Spent(3, 3 * 64, 3 * 640.0))
    assert (same.steps, same.limit) == (7, "trainer.max_flops") and same.spent_at(7) == fresh.spent_at(7)
    # resumed at twice the tokens per step: 3.5 single steps' worth left = 2 double steps (5 in all)
    double = run_length(None, None, 640.0 * 6.5, 128, 10.0, Spent(3, 3 * 64, 3 * 640.0))
    assert double.steps == 5 and double.spent_at(5) == Spent(5, 3 * 64 + 2 * 128, 3 * 640.0 + 2 * 1280.0)
    assert double.summary(None, 640.0 * 6.5)["flops"] == 7 * 640.0
    # a budget already spent: no step more; a token budget counts on the same way
    assert run_length(None, None, 640.0 * 2, 64, 10.0, Spent(3, 3 * 64, 3 * 640.0)).steps == 3
    assert run_length(None, 64 * 5, None, 32, 10.0, Spent(2, 2 * 64, 2 * 640.0)).steps == 2 + 6
    assert run_length(2, None, 640.0 * 6.5, 64, 10.0, Spent(1, 64, 640.0)).limit == "trainer.max_steps"
    with pytest.raises(ConfigError, match=r"^trainer.max_flops: 639 is below one optimizer step \(640 FLOPs"):
        run_length(None, None, 639.0, 64, 10.0)


def test_a_flop_budget_resumed_from_its_checkpoint_counts_on(tmp_path):
    """A FLOP-budget run stopped after 3 steps and resumed equals the uninterrupted one: the same steps, the same
    train/flops and train/loss rows; the checkpoint holds the count. Resumed with twice the tokens per step
    (gradient accumulation 2), it spends the rest of the budget at the new cost instead of recounting from zero."""
    probe = tmp_path / "probe"
    per_token = train(compose_cfg(FAST + ["trainer.max_steps=1"], probe))["perf/flops_per_token"]
    # the checkpoint at step 3 written on the step schedule, as the one a crashed or preempted run resumes from
    constant = ["scheduler=constant", f"trainer.max_flops={per_token * B * T * 6.5}", "callbacks.checkpoint_every_n_steps=3"]
    ref, split, wider = tmp_path / "ref", tmp_path / "split", tmp_path / "wider"
    train(compose_cfg(FAST + constant + ["trainer.max_steps=null"], ref))
    for d in (split, wider):
        train(compose_cfg(FAST + constant + ["trainer.max_steps=3"], d))
    state = torch.load(split / "checkpoints" / "last.ckpt", weights_only=True)["callbacks"]["TrainingSpend"]
    assert state == {"steps": 3, "tokens": 3 * B * T, "flops": pytest.approx(3 * B * T * per_token)}
    train(compose_cfg(FAST + constant + ["trainer.max_steps=null", "ckpt_path=last"], split))
    a, b = spent_rows(ref), spent_rows(split)
    assert [r["step"] for r in b] == [r["step"] for r in a] and len(a) == 7
    assert [float(r["train/flops"]) for r in b] == [float(r["train/flops"]) for r in a]
    assert [float(r["train/loss"]) for r in b] == pytest.approx([float(r["train/loss"]) for r in a], abs=1e-6)
    assert json.loads((split / "summary.json").read_text())["length"] == json.loads((ref / "summary.json").read_text())["length"]
    train(compose_cfg(FAST + constant + ["trainer.max_steps=null", "trainer.accumulate_grad_batches=2", "ckpt_path=last"],
                      wider))
    summary = json.loads((wider / "summary.json").read_text())
    assert summary["global_step"] == 5 and summary["length"]["tokens"] == 7 * B * T  # 3 single + 2 double steps
    flops = [float(r["train/flops"]) for r in spent_rows(wider)]
    assert flops == pytest.approx([per_token * B * T * k for k in (1, 2, 3, 5, 7)])  # after steps 1, 2, 3, 4, 5
