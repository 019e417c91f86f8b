"""trainer=fsdp (FSDP2, attnzoo/training/fsdp.py, attnzoo/distributed/fsdp.py): the same training as DDP and as one
process, sharded checkpoints that resume exactly, onto another world size (resharding) and without FSDP, that
every reader of checkpoints accepts directly or after `attnzoo-ckpt consolidate`, and saves that are atomic.

Tolerances. The model-level check (bench/fsdp.run_check) runs in float64: 1e-10, or 10x the gap that changing only
the order of the sums makes in one process (one process on the whole batch vs accumulating the ranks' row splits)
where a part computes in fp32 (the MoE router). End to end (fp32; Lightning's FSDP2 strategy has no 64-true), the
one-process run's own fp32-vs-fp64 gap per step (conftest.gap_atol), measured on the same config."""
from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnzoo.bench.fsdp import CASES, run_check, run_memory
from attnzoo.config.errors import ConfigError
from attnzoo.distributed.fsdp import indexed_optimizer_state, is_sharded_checkpoint
from attnzoo.inference.generate import load
from attnzoo.training.checkpoint_io import check_checkpoint
from attnzoo.training.config_checks import validate
from attnzoo.training.fsdp import publish
from attnzoo.training.launch import START_ENV, start_method
from attnzoo.training.run import train
from tests.conftest import SESSION_CACHE, SMALL_TEXT, compose_cfg, gap_atol
from scripts.warm_run import run_python

# constant LR after warmup (a run stopped at step 4 and resumed to 8 follows the schedule of one run to 8); the global
# batch is 8 rows: 8 on one process, 4 per rank on two, 2 per rank on four
BASE = ["debug=smoke", *SMALL_TEXT, "data.tokenizer=char", "data.seq_len=32", "optim.lr=3e-3", "scheduler=constant",
        "perf.measure_decode=false", "sample.max_new_tokens=0", "trainer.val_check_interval=4",
        "callbacks.checkpoint_every_n_steps=4", "callbacks.save_best=false", "trainer.limit_val_batches=1",
        "trainer.log_every_n_steps=1", "logger=csv"]
ONE, TWO, FOUR = ["data.batch_size=8"], ["trainer=fsdp_cpu", "data.batch_size=4"], \
    ["trainer=fsdp_cpu", "trainer.devices=4", "data.batch_size=2"]


def losses(run_dir: Path, column: str = "train/loss") -> torch.Tensor:
    """The column's values by step: train/loss at steps 0..7, or val/loss at its validations (steps 3 and 7, and
    the final one)."""
    with open(run_dir / "csv" / "metrics.csv", newline="") as f:
        rows = {int(r["step"]): float(r[column]) for r in csv.DictReader(f) if r.get(column)}
    assert sorted(rows) == (list(range(8)) if column == "train/loss" else [3, 7, 8]), sorted(rows)
    return torch.tensor([rows[s] for s in sorted(rows)], dtype=torch.float64)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference: 8 steps in one process, fp32 and fp64 (their per-step gap sizes the fp32 tolerance)."""
    root = tmp_path_factory.mktemp("one")
    train(compose_cfg(BASE + ONE + ["trainer.max_steps=8"], root / "fp32"))
    train(compose_cfg(BASE + ONE + ["trainer.max_steps=8", "trainer.precision=64-true"], root / "fp64"))
    out32, out64 = losses(root / "fp32"), losses(root / "fp64")
    val32, val64 = losses(root / "fp32", "val/loss"), losses(root / "fp64", "val/loss")
    return Reference((out32, gap_atol(out32, out64)), val=(val32, gap_atol(val32, val64)))


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    """Runs on 2 FSDP ranks that several tests read and never write: 8 steps ("to8", keeping its step checkpoints of
    steps 4, 6 and 8: every 2 steps, the newest 3), and 4 steps ("to4", a step-4 sharded checkpoint: a test that
    resumes from it works on a copy, `copy_run`)."""
    root = tmp_path_factory.mktemp("fsdp2")
    train(compose_cfg(BASE + TWO + ["trainer.max_steps=8", "callbacks.checkpoint_every_n_steps=2",
                                    "callbacks.step_checkpoints=true", "callbacks.keep_latest=3"], root / "to8"))
    train(compose_cfg(BASE + TWO + ["trainer.max_steps=4"], root / "to4"))
    return root


def copy_run(src: Path, dst: Path) -> Path:
    """A copy of a run folder (its `last.ckpt` link kept a link), to resume without touching the original."""
    shutil.copytree(src, dst, symlinks=True)
    return dst


class Reference(tuple):
    """(train losses, their tolerance), and in `.val` the same for val/loss: every world size validates on the
    one process's set (docs/reliability.md)."""

    def __new__(cls, pair, val):
        self = super().__new__(cls, pair)
        self.val = val
        return self


# ----------------------------------------------------------------------------- model level, float64
@pytest.mark.slow  # 4 worker processes (~20-35 s on 2 busy cores)
def test_fsdp_and_ddp_on_four_processes_train_as_one_process():
    """gqa, mla, gated_deltanet, a hybrid and a MoE (aux-loss-free bias): 3 AdamW steps sharded over 4 ranks (and
    under DDP) give the one-process losses and parameters (float64)."""
    rows = run_check(4, steps=3)
    assert [r["case"] for r in rows] == list(CASES)
    for r in rows:
        for key in ("fsdp loss err", "fsdp param err", "ddp loss err", "ddp param err"):
            assert r[key] <= r["tolerance"], (r["case"], key, r[key], r["tolerance"])
        assert r["tolerance"] <= 1e-6, r  # only fp32 rounding inside the float64 model may widen it
    moe = next(r for r in rows if r["case"].startswith("moe"))
    assert moe["bias moved"] > 0  # the aux-loss-free bias was updated (from the load summed over the ranks)


def test_the_memory_benchmark_measures_half_of_ddps_training_state_on_two_ranks():
    """attnzoo-bench fsdp (memory): rank 0's parameters, gradients and AdamW moments, measured from the tensors it
    holds after a step: FSDP on 2 ranks holds half of DDP's (every dimension here splits evenly), 16 bytes/parameter
    in fp32 under DDP, 8 under FSDP."""
    spec = {"model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "mixer": {"name": "gqa"}, "ffn": {"name": "swiglu"}},
            "vocab": 64, "seq_len": 16, "batch": 1, "threads": 1, "device": "cpu", "param_dtype": None}
    ddp, fsdp = (run_memory(2, {**spec, "strategy": s})[0] for s in ("ddp", "fsdp"))
    assert ddp["bytes/param"] == 16 and fsdp["bytes/param"] == 8
    for key in ("params MiB", "grads MiB", "optimizer MiB", "total MiB"):
        assert fsdp[key] == ddp[key] / 2, key


# ----------------------------------------------------------------------------- end to end
def test_fsdp_logs_the_losses_of_ddp_and_of_one_process(tmp_path, one_process, fsdp_runs, monkeypatch):
    """FSDP's workers forked from the launcher's fork server (the default), DDP's started as `python -m
    attnzoo.cli.worker` (ATTNZOO_WORKER_START=spawn): both log one process's losses."""
    ref, atol = one_process
    runs = {"fsdp": fsdp_runs / "to8", "ddp": tmp_path / "ddp"}
    with monkeypatch.context() as m:
        m.setenv(START_ENV, "spawn")
        train(compose_cfg(BASE + ["trainer=ddp_cpu", "data.batch_size=4", "trainer.max_steps=8"], runs["ddp"]))
    fsdp, ddp = losses(runs["fsdp"]), losses(runs["ddp"])
    torch.testing.assert_close(fsdp, ref, atol=atol, rtol=0)
    torch.testing.assert_close(ddp, ref, atol=atol, rtol=0)
    torch.testing.assert_close(fsdp, ddp, atol=atol, rtol=0)
    val_ref, val_atol = one_process.val
    for run in runs.values():  # each validation the one process's set: the same val/loss
        torch.testing.assert_close(losses(run, "val/loss"), val_ref, atol=val_atol, rtol=0)
    ckpt = runs["fsdp"] / "checkpoints" / "last.ckpt"
    assert ckpt.is_symlink() and is_sharded_checkpoint(ckpt)
    assert {p.name for p in ckpt.resolve().iterdir()} >= {"meta.pt", ".metadata", "__0_0.distcp", "__1_0.distcp"}
    # one folder per link: the step-4 checkpoint was deleted once the step-8 one was in place
    assert [p.name for p in ckpt.parent.iterdir() if p.is_dir() and not p.is_symlink()
                and not p.name.startswith("step-")] == [ckpt.resolve().name]  # to8's step checkpoints aside
    for run in runs.values():  # a worker's wait for its first step counts from its launcher's train() call
        summary = json.loads((run / "summary.json").read_text())
        assert summary["status"] == "ok" and summary["first_step_origin"] == "train()", summary
        assert 0 < summary["first_step_seconds"]


def test_an_unknown_worker_start_method_is_refused_in_one_line(monkeypatch):
    monkeypatch.setenv(START_ENV, "fork")
    with pytest.raises(ConfigError, match=r"ATTNZOO_WORKER_START: 'fork'; allowed: forkserver, spawn"):
        start_method()


def test_fsdp_resume_is_exact_and_every_reader_takes_the_sharded_checkpoint(tmp_path, fsdp_runs):
    """Stopped at step 4 and resumed to 8 on the same 2 ranks: every train/loss row equals the uninterrupted run's;
    attnzoo.load, attnzoo-ckpt consolidate and the consolidated file give the same model. The uninterrupted run's
    sharded step checkpoints: the newest 3 kept (step 2's folder deleted with its link), step 4's resumes exactly."""
    ckpts = fsdp_runs / "to8" / "checkpoints"
    kept = sorted(p.name for p in ckpts.glob("step-*.ckpt"))
    assert kept == ["step-00000004.ckpt", "step-00000006.ckpt", "step-00000008.ckpt"], kept
    assert all((ckpts / k).is_symlink() and is_sharded_checkpoint(ckpts / k) for k in kept)
    assert len(list(ckpts.glob("step-*.shards-*"))) == 3  # step 2's folder went with its link
    split = copy_run(fsdp_runs / "to4", tmp_path / "split")
    train(compose_cfg(BASE + TWO + ["trainer.max_steps=8", "ckpt_path=last"], split))
    assert torch.equal(losses(tmp_path / "split"), losses(fsdp_runs / "to8"))
    at_step = copy_run(fsdp_runs / "to8", tmp_path / "at_step")
    train(compose_cfg(BASE + TWO + ["trainer.max_steps=8", "ckpt_path=step:4"], at_step))
    assert torch.equal(losses(at_step), losses(fsdp_runs / "to8"))
    sharded = tmp_path / "split" / "checkpoints" / "last.ckpt"
    out = tmp_path / "model.ckpt"
    r = run_python(["-m", "attnzoo.cli.ckpt", "consolidate", str(sharded), str(out)], timeout=300)
    assert r.returncode == 0, r.stderr
    a, b = load(tmp_path / "split"), load(out)
    assert a.global_step == b.global_step == 8
    for (k, v), (k2, v2) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert k == k2 and torch.equal(v, v2), k
    ref = load(fsdp_runs / "to8").model.state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in a.model.state_dict().items())
    # the consolidated optimizer state is torch.optim's: indices over the param groups, both AdamW moments
    opt = torch.load(out, weights_only=True)["optimizer_states"][0]
    n = sum(len(g["params"]) for g in opt["param_groups"])
    assert sorted(opt["state"]) == list(range(n)) and {"exp_avg", "exp_avg_sq"} <= set(opt["state"][0])


@pytest.mark.slow  # 4 worker processes
def test_resume_onto_another_world_size_reshards(tmp_path, one_process, fsdp_runs):
    """2 -> 4 processes (the same global batch: data.batch_size 4 -> 2 is accepted), then the curve of one process."""
    ref, atol = one_process
    run = copy_run(fsdp_runs / "to4", tmp_path / "run")
    train(compose_cfg(BASE + FOUR + ["trainer.max_steps=8", "ckpt_path=last"], run))
    torch.testing.assert_close(losses(run), ref, atol=atol, rtol=0)


@pytest.mark.slow  # 4 worker processes
def test_resume_from_four_processes_onto_two_and_onto_ddp(tmp_path, one_process):
    """4 -> 2 processes; and the same sharded step-4 checkpoint resumed by DDP (consolidated in memory)."""
    ref, atol = one_process
    train(compose_cfg(BASE + FOUR + ["trainer.max_steps=4"], tmp_path / "run"))
    shutil.copytree(tmp_path / "run", tmp_path / "ddp", symlinks=True)
    train(compose_cfg(BASE + TWO + ["trainer.max_steps=8", "ckpt_path=last"], tmp_path / "run"))
    torch.testing.assert_close(losses(tmp_path / "run"), ref, atol=atol, rtol=0)
    train(compose_cfg(BASE + ["trainer=ddp_cpu", "data.batch_size=4", "trainer.max_steps=8", "ckpt_path=last"],
                      tmp_path / "ddp"))
    torch.testing.assert_close(losses(tmp_path / "ddp"), ref, atol=atol, rtol=0)


# ----------------------------------------------------------------------------- checkpoint files
def test_a_killed_save_leaves_the_previous_checkpoint_in_place(tmp_path):
    """publish() swaps the link only once a folder is complete; a save killed before that leaves `<name>.tmp`
    folders, which the next publish deletes; the link never points at an incomplete folder."""
    ck = tmp_path / "checkpoints"
    ck.mkdir()

    def folder(name: str) -> Path:
        f = ck / name
        f.mkdir()
        (f / "meta.pt").write_bytes(b"x")
        (f / ".metadata").write_bytes(b"x")
        return f

    link = ck / "last.ckpt"
    publish(folder("last.ckpt.shards-0000004-a"), link)
    (ck / "last.ckpt.shards-0000008-b.tmp").mkdir()  # a save killed while its ranks wrote
    assert os.readlink(link) == "last.ckpt.shards-0000004-a" and is_sharded_checkpoint(link)
    publish(folder("last.ckpt.shards-0000012-c"), link)
    assert os.readlink(link) == "last.ckpt.shards-0000012-c"
    assert sorted(p.name for p in ck.iterdir()) == ["last.ckpt", "last.ckpt.shards-0000012-c"]


def test_an_incomplete_sharded_folder_is_refused_in_one_line(tmp_path):
    bad = tmp_path / "last.ckpt.shards-0000004-a.tmp"
    bad.mkdir()
    (bad / "__0_0.distcp").write_bytes(b"x")
    with pytest.raises(ConfigError, match=r"ckpt_path: .* is a sharded checkpoint whose save did not finish"):
        check_checkpoint(bad)
    r = run_python(["-m", "attnzoo.cli.ckpt", "consolidate", str(bad), str(tmp_path / "x.ckpt")], timeout=300)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not a complete sharded checkpoint" in r.stderr


def test_named_optimizer_state_becomes_torch_optims_indexed_form():
    named = {"state": {"a.w": {"step": torch.tensor(1.0)}, "b.w": {"step": torch.tensor(2.0)}},
             "param_groups": [{"lr": 1.0, "params": ["b.w"]}, {"lr": 2.0, "params": ["a.w", "c.w"]}]}
    out = indexed_optimizer_state(named)
    assert [g["params"] for g in out["param_groups"]] == [[0], [1, 2]]
    assert float(out["state"][0]["step"]) == 2.0 and float(out["state"][1]["step"]) == 1.0 and 2 not in out["state"]
    assert out["param_groups"][1]["lr"] == 2.0


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("overrides, match", [
    (["trainer.precision=64-true"], r"trainer.precision: 64-true does not run under FSDP .*allowed: 32-true"),
    (["trainer.fsdp.cpu_offload=true"], r"trainer.fsdp.cpu_offload: true on a CPU run .*allowed: false"),
    (["trainer.fsdp.reduce_dtype=int8"], r"trainer.fsdp.reduce_dtype: got 'int8'; allowed: null .*bf16, fp16, fp32"),
    (["trainer.context_parallel=3"], r"trainer.context_parallel: 3 does not divide the 2 processes"),
    (["model=encdec", "data=reversal"], r"trainer.strategy: fsdp shards decoder LMs .*allowed with model=encdec: ddp"),
])
def test_fsdp_refusals(overrides, match, tmp_path):
    with pytest.raises(ConfigError, match=match):
        validate(compose_cfg(["debug=smoke", "trainer=fsdp_cpu", *overrides], tmp_path / "run"))


# ----------------------------------------------------------------------------- two nodes on this machine
def _torchrun_two_nodes(run_dir: Path, extra: list, timeout: float = 240) -> list[str]:
    """`torchrun --nnodes 2 --nproc-per-node 1` twice (node ranks 0 and 1, rendezvous on 127.0.0.1), the command a
    user runs on each node (one process a node: the node ranks, the rendezvous and the global ranks are what this
    checks; several processes a node are the other tests' launcher); returns each node's output."""
    from attnzoo.bench.context_parallel import _free_port

    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def cmd(node: int) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
                "-m", "attnzoo.cli.train", *BASE, "trainer=fsdp_cpu", "trainer.devices=1", "trainer.num_nodes=2",
                "data.batch_size=4", "trainer.enable_progress_bar=false", f"hydra.run.dir={run_dir}",
                f"paths.cache_dir={SESSION_CACHE}", *extra]

    procs = [subprocess.Popen(cmd(n), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for n in (0, 1)]
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    return outs


@pytest.mark.slow  # 2 x 2 ranks + 2 x 2 torchrun agents (~20 s on 2 cores)
def test_two_nodes_on_one_machine_train_and_resume(tmp_path, one_process):
    """torchrun, 2 nodes x 1 process: 4 steps, then the same commands with ckpt_path=last to 8: the curve of one
    process; one summary, one lock, every rank's shard in the checkpoint."""
    ref, atol = one_process
    run = tmp_path / "run"
    _torchrun_two_nodes(run, ["trainer.max_steps=4"])
    assert sorted(p.name for p in (run / "checkpoints" / "last.ckpt").iterdir() if p.suffix == ".distcp") == \
        [f"__{r}_0.distcp" for r in range(2)]
    outs = _torchrun_two_nodes(run, ["trainer.max_steps=8", "ckpt_path=last"])
    torch.testing.assert_close(losses(run), ref, atol=atol, rtol=0)
    assert sum(out.count("attnzoo run summary") for out in outs) == 1  # rank 0 alone prints and writes the summary
    assert not (run / ".attnzoo.lock").exists()


# ----------------------------------------------------------------------------- FSDP with the memory options and CP
HYBRID = ["model.pattern=[gdn,attn]", "+model/mixer@model.mixers.gdn=gated_deltanet",
          "+model/mixer@model.mixers.attn=gqa", "model.mixers.gdn.chunk_size=4"]
COMBOS = {
    # the chunked loss reads the head's weight outside forward; checkpointed blocks regather in backward; the
    # balance loss is per rank (as under DDP), so it is off for the comparison with one process (the bias is global)
    "checkpointing+chunked-ce+moe": (["trainer.activation_checkpointing=true", "trainer.ce_chunk_tokens=24",
                                      "model/ffn=moe", "model.ffn.bias_update_speed=0.01",
                                      "model.ffn.aux_loss_coef=0.0"], 2),
    # each sequence over the 2 ranks, which also shard the weights: both ranks see the same rows
    "context-parallel-2+hybrid": (["trainer.context_parallel=2", *HYBRID], 1),
}


@pytest.mark.slow  # 2 x 2 worker processes + 2 one-process runs
@pytest.mark.parametrize("combo", list(COMBOS))
def test_fsdp_with_memory_options_and_context_parallel_logs_ddps_losses(combo, tmp_path):
    """FSDP and DDP (2 processes) log the same per-step losses as one process on the rows each rank sees (within
    10x that run's own fp32-vs-fp64 gap)."""
    extra, dp = COMBOS[combo]
    base = BASE + extra + ["trainer.max_steps=8"]
    rows = 4 * dp  # one process sees the global batch: 8 rows (2 data-parallel ranks), 4 (CP: the ranks share rows)
    one = [o for o in extra if not o.startswith("trainer.context_parallel")]
    train(compose_cfg(BASE + one + ["trainer.max_steps=8", f"data.batch_size={rows}"], tmp_path / "fp32"))
    train(compose_cfg(BASE + one + ["trainer.max_steps=8", f"data.batch_size={rows}", "trainer.precision=64-true"],
                      tmp_path / "fp64"))
    ref = losses(tmp_path / "fp32")
    atol = gap_atol(ref, losses(tmp_path / "fp64"))
    train(compose_cfg(base + ["trainer=fsdp_cpu", "data.batch_size=4"], tmp_path / "fsdp"))
    train(compose_cfg(base + ["trainer=ddp_cpu", "data.batch_size=4"], tmp_path / "ddp"))
    torch.testing.assert_close(losses(tmp_path / "fsdp"), losses(tmp_path / "ddp"), atol=atol, rtol=0)
    torch.testing.assert_close(losses(tmp_path / "fsdp"), ref, atol=atol, rtol=0)


# ----------------------------------------------------------------------------- parameter flags survive sharding
def _groups_worker(rank: int, world: int, port: int, spec: dict, out: str) -> None:
    import json as _json

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from attnzoo.bench.context_parallel import _init
    from attnzoo.config.schema import FSDPConfig
    from attnzoo.distributed.fsdp import shard_model
    from attnzoo.models.decoder import DecoderLM
    from attnzoo.training.lit_lm import param_groups

    _init(rank, world, port, 1)

    def summary(model) -> list:
        return [(len(g["params"]), g["weight_decay"], g.get("lr")) for g in param_groups(model, 0.1, 1e-3)]

    torch.manual_seed(0)
    plain = summary(DecoderLM(spec, vocab_size=64))
    torch.manual_seed(0)
    sharded = summary(shard_model(DecoderLM(spec, vocab_size=64), init_device_mesh("cpu", (world,)), FSDPConfig()))
    Path(f"{out}.{rank}").write_text(_json.dumps({"plain": plain, "sharded": sharded}))
    dist.barrier()
    dist.destroy_process_group()


def test_sharding_keeps_the_optimizer_groups_parameter_flags_make():
    """fully_shard replaces every Parameter: Gated DeltaNet's `_no_weight_decay` and µP's `_lr_scale` / `_wd_scale`
    flags are carried over, so AdamW gets the same groups (sizes, weight decay, learning rates) as without FSDP."""
    from attnzoo.bench.common import spawn_ranks

    spec = {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "mixer": {"name": "gated_deltanet"},
            "ffn": {"name": "swiglu"}, "parametrization": "mup", "mup_base_width": 16, "tie_embeddings": False}
    row = spawn_ranks(_groups_worker, 2, spec)[0]
    assert row["sharded"] == row["plain"] and len(row["plain"]) >= 3  # decayed, not decayed, µP's scaled groups


def test_several_nodes_without_torchrun_or_srun_are_refused_at_launch(tmp_path):
    """The config is valid (torchrun / srun run it on every node); started alone it is refused before any work."""
    cfg = compose_cfg(["debug=smoke", "trainer=fsdp_cpu", "trainer.num_nodes=2"], tmp_path / "run")
    validate(cfg)
    with pytest.raises(ConfigError, match=r"^trainer.num_nodes: 2 nodes need one launch per node .*allowed here: 1$"):
        train(cfg)
    assert not (tmp_path / "run").exists()
