"""Context parallelism (attnzoo/distributed/context_parallel.py): layouts, the ring's visibility logic, sharded forward/backward ==
the single-process run for every mixer with a sharded path on 2 and 4 gloo processes, refusals, and a training
run with trainer.context_parallel=2 that logs the losses of the single-process run."""
import csv
import random

import pytest
import torch

from attnzoo.bench.context_parallel import CASES, run_check, tolerance
from attnzoo.config.schema import ConfigError
from attnzoo.distributed.context_parallel import Layout, MaskSpec, check_layout, resolve_layout
from attnzoo.config.registry import MIXERS
from attnzoo.training.run import train
from attnzoo.training.config_checks import validate
from tests.conftest import SMALL_TEXT, compose_cfg


# ----------------------------------------------------------------------------- layouts, no processes
def test_zigzag_gives_each_rank_one_early_and_one_late_segment():
    lay = Layout(16, 4, zigzag=True)
    assert [lay.segments(r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert lay.positions(1).tolist() == [2, 3, 12, 13]
    # equal causal work: the keys before each rank's queries sum to the same count on every rank
    work = [sum(int(p) + 1 for p in lay.positions(r)) for r in range(4)]
    assert len(set(work)) == 1
    contiguous = Layout(16, 4, zigzag=False)
    assert contiguous.positions(3).tolist() == [12, 13, 14, 15]
    assert len({sum(int(p) + 1 for p in contiguous.positions(r)) for r in range(4)}) == 4


@pytest.mark.parametrize("zigzag", [True, False])
def test_shard_then_unshard_is_the_identity(zigzag):
    lay = Layout(24, 3, zigzag)
    x = torch.randn(2, 24, 5)
    parts = [lay.shard(x, r) for r in range(3)]
    assert all(p.shape == (2, 8, 5) for p in parts)
    assert torch.equal(lay.unshard(parts), x)
    assert torch.equal(torch.cat([lay.positions(r) for r in range(3)]).sort().values, torch.arange(24))


def test_lengths_that_do_not_split_are_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"50 does not split into 8 equal segments.*multiple of 8"):
        check_layout(50, 4, "zigzag")
    assert check_layout(52, 4, "contiguous").seg_len == 13
    with pytest.raises(ConfigError, match="shorter than the short convolution"):
        check_layout(8, 4, "zigzag", min_segment=3)


def test_visibility_of_segment_pairs_matches_the_token_mask():
    """The ring skips pairs it calls "none" and drops the mask for "all": both must agree with the mask."""
    rng = random.Random(0)
    for _ in range(400):
        spec = MaskSpec(causal=True, window=rng.choice([None, 1, 3, 7]), sinks=rng.choice([0, 2]), scale=1.0)
        if spec.window is None and spec.sinks:
            continue
        a, c = rng.randrange(0, 30), rng.randrange(0, 30)
        q, k = (a, a + rng.randrange(1, 6)), (c, c + rng.randrange(1, 6))
        m = spec.mask(torch.arange(*q), torch.arange(*k))
        expect = "none" if not m.any() else "all" if m.all() else "partial"
        got = spec.visibility(q, k)
        assert got == expect or (got == "partial" and expect == "all"), (spec, q, k, got, expect)


def test_a_window_needs_one_hop_with_the_contiguous_layout():
    from attnzoo.distributed.context_parallel import ContextParallel

    cp = ContextParallel.__new__(ContextParallel)  # the hop count is arithmetic on the layout: no group needed
    cp.layout, cp.size, cp._hops = Layout(64, 4, zigzag=False), 4, {}
    assert cp.n_hops(MaskSpec(True, 16, 0, 1.0)) == 2  # its own block and the previous rank's
    assert cp.n_hops(MaskSpec(True, None, 0, 1.0)) == 4  # full causal: every earlier rank
    assert cp.n_hops(MaskSpec(True, 16, 1, 1.0)) == 4  # a sink on rank 0 is seen by every rank
    assert resolve_layout("auto", ["gated_deltanet", "sliding_window"]) == "contiguous"
    assert resolve_layout("auto", ["gated_deltanet", "gqa"]) == "zigzag"


def test_the_sampler_shards_over_data_parallel_groups_only(monkeypatch):
    import attnzoo.data.sampling as sampling
    from attnzoo.distributed import context_parallel as parallel

    monkeypatch.setitem(parallel._TOPOLOGY, "cp", 2)
    monkeypatch.setitem(parallel._TOPOLOGY, "dp_rank", 1)
    monkeypatch.setitem(parallel._TOPOLOGY, "dp_world", 2)
    assert sampling._rank_world() == (1, 2)  # world 4 = 2 DP groups x 2 CP ranks: ranks 2 and 3 share data


# ----------------------------------------------------------------------------- equivalence on gloo processes
def _assert_equal(rows):
    assert rows, "no results"
    for r in rows:
        assert "error" not in r, r
        out_tol, grad_tol = tolerance(r)  # float32: 10x the one-process run's own float32-vs-float64 gap
        assert out_tol < 1e-4 and grad_tol < 1e-4, r  # far below what a sharding bug moves (O(0.1))
        assert r["out err"] <= out_tol and r["grad err"] <= grad_tol, r


def test_every_mixer_sharded_on_two_processes_equals_one_process():
    # the reference ring (the plain, obviously-correct exchange beside the fast one) in float64 only, where it is
    # checked exactly; the fast ring, the one runs use, in both dtypes (float32: its casts on the way round)
    jobs = [(c, lay, dt, 48, 2, impl) for c in CASES for lay in ("zigzag", "contiguous") for dt in ("float64", "float32")
            for impl in ("fast", "reference") if (impl, dt) != ("reference", "float32")]
    rows = run_check(2, jobs)
    assert {r["mixer"] for r in rows} == set(CASES)
    _assert_equal(rows)
    # the contiguous sliding window passed its K/V one hop only; full attention went round the ring
    hops = {(r["mixer"], r["layout"]): r["hops"] for r in rows}
    assert hops[("gqa", "zigzag")] == 2


def _mixers(case: str) -> list:
    cfg = CASES[case]
    return [cfg["mixer"]] if "mixer" in cfg else list(cfg["mixers"].values())


def test_every_mixer_sharded_on_four_processes_equals_one_process():
    # every case once, in the layout `auto` gives it (both layouts of every case run on 2 processes above), and
    # full attention contiguously too: it must go round the whole ring where the window stops after one hop
    jobs = [(c, resolve_layout("auto", [m["name"] for m in _mixers(c)]), "float64", 96, 1) for c in CASES]
    jobs += [("gqa", "contiguous", "float64", 96, 1)]
    jobs += [(c, "zigzag", "float32", 96, 1) for c in ("gqa", "gated_deltanet", "hybrid gdn/gqa/swa")]
    jobs += [(c, "zigzag", "float64", 96, 1, "reference") for c in ("gqa+alibi", "sliding_window W5 + 2 sinks", "mla")]
    jobs += [("gqa", "zigzag", "float64", 100, 1)]  # 100 tokens do not split into 8 segments: refused
    rows = run_check(4, jobs)
    refused = rows.pop()
    assert "does not split into 8 equal segments" in refused["error"]
    _assert_equal(rows)
    hops = {(r["mixer"], r["layout"]): r["hops"] for r in rows}
    assert hops[("sliding_window W5", "contiguous")] == 2 and hops[("gqa", "contiguous")] == 4


# ----------------------------------------------------------------------------- refusals and training
FAST = ["debug=smoke", *SMALL_TEXT, "data.tokenizer=char", "data.seq_len=32", "data.batch_size=4", "optim.lr=3e-3",
        "perf.measure_decode=false", "sample.max_new_tokens=0"]


@pytest.mark.parametrize("overrides, match", [
    (["trainer.context_parallel=2"], r"trainer.context_parallel: 2 needs 2 processes per sequence"),
    (["trainer=ddp_cpu", "trainer.context_parallel=3"], r"3 does not divide the 2 processes"),
    (["trainer=ddp_cpu", "trainer.context_parallel=2", "model/mixer=nsa", "model.mixer.block_size=8"],
     r"layer 0 is nsa, which has no sharded form; allowed mixers: .*gated_deltanet"),
    (["trainer=ddp_cpu", "trainer.context_parallel=2", "data.seq_len=30"], r"30 does not split into 4 equal segments \(context_parallel=2, zigzag layout\); allowed: a multiple of 4"),
    (["trainer=ddp_cpu", "trainer.context_parallel=2", "model.dropout=0.1"], r"model.dropout: .*allowed: 0"),
    (["trainer=ddp_cpu", "trainer.context_parallel=2", "trainer.context_parallel_layout=striped"],
     r"trainer.context_parallel_layout: .*allowed: auto, zigzag, contiguous"),
])
def test_context_parallel_refusals(overrides, match, tmp_path):
    with pytest.raises(ConfigError, match=match):
        validate(compose_cfg(FAST + overrides, tmp_path / "run"))


def _losses(run_dir):
    with open(run_dir / "csv" / "metrics.csv") as f:
        return {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")}


def test_training_with_context_parallel_2_logs_the_losses_of_one_process(tmp_path):
    common = FAST + ["trainer.max_steps=6", "trainer.val_check_interval=3", "trainer.log_every_n_steps=1",
                     "model.pattern=[gdn,attn]", "+model/mixer@model.mixers.gdn=gated_deltanet",
                     "+model/mixer@model.mixers.attn=gqa", "model.mixers.gdn.chunk_size=4"]
    one = train(compose_cfg(common, tmp_path / "one"))
    two = train(compose_cfg(common + ["trainer=ddp_cpu", "trainer.context_parallel=2"], tmp_path / "two"))
    a, b = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert sorted(a) == sorted(b) and len(a) >= 5
    for step in a:
        assert abs(a[step] - b[step]) <= 1e-5, (step, a[step], b[step])
    assert abs(one["val/loss"] - two["val/loss"]) <= 1e-5
    assert MIXERS.get("gated_deltanet").cls.context_parallel and not MIXERS.get("nsa").cls.context_parallel
