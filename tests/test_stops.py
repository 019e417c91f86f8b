"""How long a run trains (attnzoo/config/stops.py): trainer.max_steps / max_tokens / max_flops, whichever comes first;
the budget becomes steps once the model is built, the learning-rate schedule decays over them, and
train/tokens / train/flops are logged as the run goes."""
import csv
import json
import math

import pytest
import torch

from attnzoo.config.stops import run_length, tokens_per_step
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
