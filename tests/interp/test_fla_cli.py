"""The issue's command through the real entry (train(), Lightning, the CSV logger, summary.json) under Triton's
interpreter: `TRITON_INTERPRET=1 attnzoo-train debug=smoke model/mixer=gated_deltanet model.impl=fla`."""
from __future__ import annotations

import csv
import json

import torch

from tests.conftest import gap_atol


def metrics_losses(run_dir) -> list[float]:
    rows = list(csv.DictReader(open(next(run_dir.rglob("metrics.csv")))))
    return [float(r["train/loss"]) for r in rows if r.get("train/loss")]


def test_cli_smoke_run_on_fla_equals_torch(make_cfg, tmp_path):
    """The issue's command, `TRITON_INTERPRET=1 attnzoo-train debug=smoke model/mixer=gated_deltanet
    model.impl=fla` (2 layers, 2 steps): its logged per-step losses equal model.impl=torch's within the
    torch run's fp32-vs-fp64 gap (trainer.precision=64-true) x FP32_FACTOR, and summary.json says fla ran."""
    from attnzoo.training.run import train

    runs = {}
    for name, extra in (("fla", ["model.impl=fla"]), ("torch", ["model.impl=torch"]),
                        ("torch64", ["model.impl=torch", "trainer.precision=64-true"])):
        out = tmp_path / name
        train(make_cfg("debug=smoke", "model/mixer=gated_deltanet", "model.n_layers=2", "model.n_heads=2",
                       "trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
                       "data.seq_len=16", "data.batch_size=2",
                       "perf.decode_tokens=0", *extra,
                       output_dir=out))
        runs[name] = (metrics_losses(out), json.loads((out / "summary.json").read_text()))
    (fla, s_fla), (t32, _), (t64, _) = runs["fla"], runs["torch"], runs["torch64"]
    assert len(fla) == len(t32) == len(t64) == 2
    assert s_fla["model"]["kernels"] == ["fla", "fla"], s_fla["model"]["kernels"]
    for step, (a, b, b32) in enumerate(zip(fla, t64, t32)):
        tol = gap_atol(torch.tensor(b32), torch.tensor(b))
        assert abs(a - b) <= tol, f"step {step}: {a} vs {b} (tol {tol:.3g})"
