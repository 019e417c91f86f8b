"""data=needle (data/needle.py): the token-level needle-in-a-haystack task a small model is trained on - its layout
(needles where the depth puts them, distinct keys, the asked value as the answer positions), its refusals, and the
per (length, depth) grid `attnzoo-eval RUN --task niah` computes for a needle run (inference/niah.py)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from attnzoo.data.configs import NeedleConfig
from attnzoo.data.needle import NEEDLE, QUERY, generate_needle


def needles_of(row, cfg) -> list[tuple]:
    """(start, key, value) of each needle in the haystack part of `row`."""
    K, M = cfg.key_len, cfg.value_len
    H = cfg.seq_len - (1 + K + M)
    return [(i, tuple(row[i + 1:i + 1 + K]), tuple(row[i + 1 + K:i + 1 + K + M])) for i in range(H) if row[i] == NEEDLE]


@pytest.mark.parametrize("num_needles,depth", [(1, 0.0), (1, 0.5), (1, 1.0), (3, 0.25), (4, None)])
def test_layout(num_needles, depth):
    cfg = NeedleConfig(seq_len=96, vocab_size=64, key_len=2, value_len=3, num_needles=num_needles, depth=depth)
    x, y, mask = generate_needle(cfg, 50, np.random.default_rng(0))
    K, M, T = 2, 3, 6
    H = cfg.seq_len - (1 + K + M)
    noise_len = H - num_needles * T
    for row, target, m in zip(x, y, mask):
        found = needles_of(row, cfg)
        assert len(found) == num_needles and len({k for _, k, _ in found}) == num_needles  # distinct keys
        q = row[H:]
        assert q[0] == QUERY and (tuple(q[1:1 + K]), tuple(q[1 + K:])) in [(k, v) for _, k, v in found]
        # the answer positions: the query's last key token and each value token but the last, predicting the values
        assert list(np.flatnonzero(m)) == list(range(H + K, H + K + M))
        assert tuple(target[m]) == tuple(q[1 + K:])
        hay = [t for t in row[:H]]
        assert all(t >= 2 + (cfg.vocab_size - 2) // 2 for i, t in enumerate(hay)  # noise from the upper half
                   if not any(s <= i < s + T for s, _, _ in found))
        if depth is not None:  # the asked needle after `depth` of the noise tokens
            (start,) = [s for s, k, _ in found if k == tuple(q[1:1 + K])]
            noise_before = start - T * sum(s < start for s, _, _ in found)
            assert noise_before == round(depth * noise_len)


@pytest.mark.parametrize("extra,field,phrase", [
    (["data.depth=1.5"], "data.depth", "got 1.5; allowed: a fraction of the haystack in [0, 1], or null"),
    (["data.seq_len=12", "data.num_needles=2"], "data.seq_len", "12 cannot hold 2 needle(s) of 5 tokens"),
    (["data.key_len=0"], "data.key_len", "must be >= 1, got 0"),
    (["data.vocab_size=5"], "data.vocab_size", "5 leaves no noise / key tokens"),
])
def test_bad_settings_are_one_line(extra, field, phrase, make_cfg):
    from attnzoo.config.errors import ConfigError
    from attnzoo.training.config_checks import validate

    with pytest.raises(ConfigError) as e:
        validate(make_cfg("data=needle", "debug=smoke", *extra))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{field}: ") and phrase in msg, msg


def test_niah_grid_of_a_needle_run(tmp_path, make_cfg, capsys):
    """attnzoo-eval --task niah on a data=needle run: one accuracy per (length, depth), each the run's val/acc on a
    regenerated validation set at that length and depth; a heatmap beside the JSON."""
    import dataclasses

    from torch.utils.data import DataLoader

    from attnzoo.analysis.extrapolation import evaluate_loader
    from attnzoo.inference.generate import eval_main, load
    from attnzoo.training.run import train

    out = tmp_path / "run"
    train(make_cfg("data=needle", "debug=smoke", "data.train_size=64", "data.val_size=16", "trainer.max_steps=2",
                   "trainer.val_check_interval=2", "perf.measure_decode=false", "sample.max_new_tokens=0",
                   output_dir=out))
    eval_main([str(out), "--task", "niah", "--lengths", "32", "48", "--depths", "0", "1", "--samples", "16",
               "--out", str(tmp_path / "niah.json")])
    res = json.loads((tmp_path / "niah.json").read_text())
    assert set(res["accuracy"]["needle"]) == {"32", "48"} and (tmp_path / "niah.png").exists()
    run = load(out)
    cfg = dataclasses.replace(run.datamodule.cfg, seq_len=48, depth=1.0, train_size=run.datamodule.cfg.batch_size,
                              val_size=16)
    dm = type(run.datamodule)(cfg, seed=run.datamodule.seed)
    dm.setup("validate")
    want = evaluate_loader(run.lit, DataLoader(dm.val_set, batch_size=4, collate_fn=dm.collate_fn))["val/acc"]
    assert res["accuracy"]["needle"]["48"]["1.0"] == pytest.approx(want)


def test_a_needle_run_writes_its_grid_at_the_end(tmp_path, make_cfg):
    """eval.niah_depths: the run evaluates its depth x length grid after training (data.seq_len and each context
    length), writes niah.json / niah.png beside its summary and logs niah/acc@<length>@<depth>."""
    from attnzoo.training.run import train

    out = tmp_path / "run"
    metrics = train(make_cfg("data=needle", "debug=smoke", "data.train_size=64", "data.val_size=16", "trainer.max_steps=2",
                             "trainer.val_check_interval=2", "perf.measure_decode=false", "sample.max_new_tokens=0",
                             "eval.context_lengths=[48]", "eval.niah_depths=[0,1]", "eval.niah_samples=8",
                             output_dir=out))
    res = json.loads((out / "niah.json").read_text())
    assert set(res["accuracy"]["needle"]) == {"32", "48"} and (out / "niah.png").exists()
    summary = json.loads((out / "summary.json").read_text())
    for L in (32, 48):
        for d in ("0.0", "1.0"):
            assert metrics[f"niah/acc@{L}@{d}"] == res["accuracy"]["needle"][str(L)][d]
            assert summary["metrics"][f"niah/acc@{L}@{d}"] == metrics[f"niah/acc@{L}@{d}"]
