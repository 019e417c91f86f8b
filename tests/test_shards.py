"""data=shards (issue 27): a prepared corpus streamed with litdata. Batches as data=text gives them (packing's
document masks included); over an epoch on 2 ranks x 2 workers every block exactly once; the loader's checkpoint
state resumes at the exact batch (in process, after a SIGKILL through `attnzoo-train --resume`, and on 2 DDP ranks
x 2 workers); train/tokens_seen and trainer.max_tokens; the manifest in summary.json; bad input in one line."""
import csv
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from litdata import StreamingDataset, TokensLoader

import attnzoo.data._shards_loader as shards_loader
from attnzoo.config.errors import ConfigError
from attnzoo.data.corpus import stdlib_files
from attnzoo.data.prepare import prepare
from attnzoo.data.shards import BlockBatch, ShardsDataConfig, ShardsDataModule
from attnzoo.data.text import PackedBlocks, TextDataConfig, TextDataModule
from attnzoo.inference.generate import load
from attnzoo.training.run import train
from tests.conftest import compose_cfg
from tests.shards_fixture import numbered_corpus, text_corpus
from tests.test_faults_ddp import ENV, cli, losses, wait_for_checkpoint
from scripts.warm_run import run_python

B, T = 8, 32


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return text_corpus(tmp_path_factory.mktemp("shards") / "out")


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    """A few documents: an epoch is ~12 batches of 8 x 32, so runs cross epochs."""
    return text_corpus(tmp_path_factory.mktemp("shards_small") / "out", n_files=5, vocab_size=300, chars=2500)


@pytest.fixture(scope="module")
def numbered(tmp_path_factory):
    return numbered_corpus(tmp_path_factory.mktemp("shards_numbered") / "out")


def base(path) -> list[str]:
    return ["debug=smoke", "data=shards", f"data.path={path}", f"data.seq_len={T}", f"data.batch_size={B}",
            "data.num_workers=2", "perf.measure_decode=false", "sample.max_new_tokens=0", "optim.lr=3e-3",
            "scheduler=constant", "callbacks.save_best=false", "trainer.limit_val_batches=1"]


def rows(run_dir) -> list[dict]:
    with open(run_dir / "csv" / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def module(path, rank=0, world=1, monkeypatch=None, **kw) -> ShardsDataModule:
    if monkeypatch is not None:
        monkeypatch.setattr(shards_loader, "_rank_world", lambda: (rank, world))
    dm = ShardsDataModule(ShardsDataConfig(path=str(path), **{"seq_len": 15, "batch_size": 3, **kw}), seed=5)
    dm.setup("fit")
    return dm


def test_packed_batches_are_data_texts_packed_blocks():
    """The shards stream (each document ending with its end-of-text) is data=text's document stream (each
    starting with its separator) without the first separator: the same blocks give the same (x, y, masks, doc_ids)."""
    rng = np.random.default_rng(0)
    eos, docs = 0, [rng.integers(1, 50, int(n)).tolist() for n in rng.integers(1, 30, 40)]
    text_ids = torch.tensor([t for d in docs for t in [eos] + d], dtype=torch.int32)
    starts = torch.nonzero(text_ids == eos).flatten()
    packed = PackedBlocks(text_ids, starts, seq_len=16)
    for i in range(len(packed)):
        block = text_ids[i * 16:i * 16 + 17].numpy()
        got = BlockBatch(eos)([block])
        want = packed[i]
        assert len(got) == len(want) == 5
        for g, w in zip(got, want):
            assert torch.equal(g[0], w.to(g.dtype)), i
        assert got[0].dtype == got[1].dtype == got[4].dtype == torch.int64
    x, y = BlockBatch()([block, block])  # plain blocks: (x, y) only
    assert x.shape == y.shape == (2, 16) and torch.equal(x[:, 1:], y[:, :-1])


def test_every_block_exactly_once_on_two_ranks_times_two_workers(numbered, monkeypatch):
    """Over one epoch, 2 ranks x 2 loader workers (real worker processes; each rank's dataset told its rank as
    DDP would) see every training block at most once, and miss only less than one batch per rank and worker
    (drop_last). Blocks are recognisable: the token ids are a global counter."""
    every = StreamingDataset(str(numbered / "train"), item_loader=TokensLoader(block_size=16))
    assert every.distributed_env.world_size == 1
    all_blocks = {tuple(every[i].tolist()) for i in range(len(every))}
    assert len(all_blocks) == len(every) == module(numbered).info["train_blocks"]
    seen, orders = [], []
    for rank in range(2):
        loader = module(numbered, rank, 2, monkeypatch, num_workers=2).train_dataloader()
        order = [tuple(r.tolist()) + (int(yb[i, -1]),) for x, yb in loader for i, r in enumerate(x)]
        assert len(order) == len(loader) * 3 > 0
        orders.append(order)
        seen += order
    assert len(seen) == len(set(seen))  # no block twice, across ranks and workers
    assert set(seen) <= all_blocks
    assert len(all_blocks) - len(seen) < 2 * 2 * 3  # the drop_last tail only
    # shuffled from the run's seed: the same seed gives the same order, another seed another
    again = module(numbered, 0, 2, monkeypatch, num_workers=2).train_dataloader()
    assert [tuple(r.tolist()) + (int(yb[i, -1]),) for x, yb in again for i, r in enumerate(x)] == orders[0]
    other = ShardsDataModule(ShardsDataConfig(path=str(numbered), seq_len=15, batch_size=3), seed=6)
    other.setup("fit")
    assert [tuple(r.tolist()) for x, _ in other.train_dataloader() for r in x] != [o[:-1] for o in orders[0]]


def test_validation_on_n_ranks_scores_the_one_process_set_less_its_tail(numbered, monkeypatch):
    """Validation on N ranks scores every block of the one-process validation at most once, and misses only the
    tail an equal split drops (every rank must take the same number of batches: under FSDP each forward is a
    collective, and uneven shares hung), for data=shards and for the map-style loaders (ResumableShuffleSampler
    in order, rank r every r-th index): docs/reliability.md says when 1 and N ranks report the same val/loss."""
    def blocks(loader):
        return [tuple(r.tolist()) + (int(yb[i, -1]),) for x, yb in loader for i, r in enumerate(x)]

    one = blocks(module(numbered).val_dataloader())
    for world in (2, 3):
        seen = [b for rank in range(world) for b in blocks(module(numbered, rank, world, monkeypatch).val_dataloader())]
        assert len(seen) == len(set(seen)) and set(seen) <= set(one), world
        assert len(one) - len(seen) < world * 3, (world, len(one), len(seen))  # batch 3: the drop_last tail only
    from attnzoo.data import sampling

    for n in range(1, 12):
        for world in (1, 2, 3, 4):
            shares = []
            for rank in range(world):
                monkeypatch.setattr(sampling, "_rank_world", lambda r=rank, w=world: (r, w))
                sampler = sampling.ResumableShuffleSampler(n, 0, 2, shuffle=False)
                shares.append(list(sampler))
                assert len(sampler) == len(shares[-1]) == n // world
            assert sorted(i for share in shares for i in share) == list(range(n - n % world)), (n, world)


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_state_resumes_at_the_consumed_batch(numbered, monkeypatch, workers):
    """The state saved after k consumed batches (whatever litdata and Lightning fetched ahead) gives a fresh
    loader the uninterrupted epoch's batches from k on; at an epoch's end, the next epoch's."""
    def run(loader, n=None):
        out = []
        for i, (x, _) in enumerate(loader):
            if n is not None and i == n:
                break
            out.append(x)
        return out

    dm = module(numbered, 1, 2, monkeypatch, num_workers=workers)
    ref = dm.train_dataloader()
    epoch1, epoch2 = run(ref), run(ref)
    n = len(epoch1)
    assert n >= 6 and not all(torch.equal(a, b) for a, b in zip(epoch1, epoch2))
    for k in (1, 4, 5, n):
        first = dm.train_dataloader()
        run(first, k + 1)  # one batch more fetched than consumed
        first.position = {"epoch": 0, "batches": k} if k < n else {"epoch": 1, "batches": 0}
        state = first.state_dict()
        resumed = module(numbered, 1, 2, monkeypatch, num_workers=workers).train_dataloader()
        resumed.load_state_dict(state)
        rest = run(resumed)
        want = epoch1[k:] if k < n else epoch2
        assert len(rest) == len(want) and all(torch.equal(a, b) for a, b in zip(rest, want)), k
        if k < n:  # the epoch after the resumed one is the uninterrupted run's second epoch
            assert all(torch.equal(a, b) for a, b in zip(run(resumed), epoch2))


def killed_mid_run(overrides: list, run: Path, steps: int = 60) -> int:
    """`attnzoo-train` (the CLI, in its own process) SIGKILLed once a checkpoint at step >= 8 exists (of `steps`);
    returns the step of the checkpoint it left."""
    from attnzoo.training.rundir import LOCK_NAME, _live_workers, _owner

    p = cli(overrides + [f"hydra.run.dir={run}"])
    wait_for_checkpoint(run / "checkpoints" / "last.ckpt", 8, p)
    owner = _owner(run / LOCK_NAME)  # (launcher, host, its DDP workers): the workers die with the launcher
    p.send_signal(signal.SIGKILL)
    p.wait()
    # ... on their own schedule (the parent-death signal reaches them after the launcher is reaped): the resume
    # below would be refused while they live (run_dir_lock), so wait for them, 30 s at most
    deadline = time.monotonic() + 30.0
    while owner and _live_workers(owner[2]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not (owner and _live_workers(owner[2])), f"DDP workers {_live_workers(owner[2])} outlived their launcher"
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    assert 8 <= saved < steps
    return saved


def assert_rows_equal_from(ref: Path, run: Path, saved: int) -> None:
    """Every train/loss row of `run` from step `saved` (its checkpoint) on equals the uninterrupted `ref`'s."""
    a, b = losses(ref), losses(run)
    after = [s for s in a if s >= saved]
    assert after and all(s in b for s in after)
    for s in after:
        assert b[s] == pytest.approx(a[s], abs=1e-6), (s, a[s], b[s])


def test_stop_and_resume_equals_uninterrupted_across_epochs(small_corpus, tmp_path):
    """1 process x 2 workers, in process: a run stopped at step 9 and resumed to 28 (an epoch is ~20 batches, so
    the resumed part crosses an epoch boundary, with checkpoints inside both epochs) logs the uninterrupted run's
    every train/loss."""
    common = base(small_corpus) + ["trainer.val_check_interval=100", "callbacks.checkpoint_every_n_steps=3"]
    ref, split = tmp_path / "ref", tmp_path / "split"
    train(compose_cfg(common + ["trainer.max_steps=28"], ref))
    train(compose_cfg(common + ["trainer.max_steps=9"], split))
    ckpt = torch.load(split / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["num_samples_yielded"] == 9 * B
    train(compose_cfg(common + ["trainer.max_steps=28", "ckpt_path=last"], split))
    la, lb = losses(ref), losses(split)
    assert sorted(la) == sorted(lb) == list(range(28))
    for s in la:
        assert lb[s] == pytest.approx(la[s], abs=1e-6), (s, la[s], lb[s])
    summary = json.loads((ref / "summary.json").read_text())
    assert summary["data"]["train_blocks"] // B < 28  # it did cross epochs


def test_sigkill_then_resume_cli_equals_uninterrupted(corpus, tmp_path):
    """SIGKILL mid-run (1 process x 2 loader workers), then `attnzoo-train --resume RUN_DIR`: every train/loss
    row from the checkpoint on equals the uninterrupted run's."""
    common = base(corpus) + ["trainer.max_steps=60", "trainer.val_check_interval=100",
                             "callbacks.checkpoint_every_n_steps=4"]
    ref = tmp_path / "ref"
    train(compose_cfg(common, ref))
    run = tmp_path / "killed"
    saved = killed_mid_run(common, run)
    r = run_python(["-m", "attnzoo.cli.train", "--resume", str(run)], env=ENV, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert_rows_equal_from(ref, run, saved)


def test_ddp_two_ranks_two_workers_sigkill_then_resume_equals_uninterrupted(small_corpus, tmp_path):
    """2 DDP processes (trainer=ddp_cpu) x 2 loader workers on shards: the run trains on both ranks and logs
    train/tokens_seen for both; SIGKILL of the launcher mid-run (its ranks die with it), then a resume from the
    last checkpoint: every train/loss row from there on equals the uninterrupted run's, across an epoch boundary
    (~6 steps an epoch on two ranks; 36 steps: the kill at step >= 8 leaves ~28 steps, ~5 s idle, for the poll of
    wait_for_checkpoint, every 0.2 s, to see it)."""
    steps = 36
    common = base(small_corpus) + ["trainer=ddp_cpu", "trainer.val_check_interval=100",
                                   "callbacks.checkpoint_every_n_steps=4", f"trainer.max_steps={steps}"]
    ref = tmp_path / "ref"
    train(compose_cfg(common, ref))
    summary = json.loads((ref / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_step"] == steps
    seen = [float(r["train/tokens_seen"]) for r in rows(ref) if r.get("train/tokens_seen")]
    assert seen == [float(2 * B * T * s) for s in range(1, steps + 1)]
    run = tmp_path / "killed"
    saved = killed_mid_run(common, run, steps)
    train(compose_cfg(common + ["ckpt_path=last"], run))
    assert_rows_equal_from(ref, run, saved)


def test_token_budget_tokens_seen_and_the_manifest_in_the_summary(corpus, tmp_path):
    """trainer.max_tokens stops a data=shards run (5 steps for 4.5 batches' worth); train/tokens_seen (the
    loader's consumed count) equals train/tokens step for step; summary.json's data section has the path and
    the manifest; the run's sample and attnzoo-generate's load() encode / decode with OUT/tokenizer.json."""
    out = tmp_path / "run"
    train(compose_cfg(base(corpus) + [f"trainer.max_tokens={int(4.5 * B * T)}", "trainer.max_steps=null",
                                      "sample.max_new_tokens=8", "trainer.val_check_interval=100"], out))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["global_step"] == 5 and summary["length"]["limit"] == "trainer.max_tokens"
    spent = [r for r in rows(out) if r.get("train/tokens_seen")]
    assert [float(r["train/tokens_seen"]) for r in spent] == [float(r["train/tokens"]) for r in spent] == \
        [float(B * T * s) for s in range(1, 6)]
    data = summary["data"]
    assert data["name"] == "shards" and data["path"] == str(corpus.resolve())
    assert data["manifest"] == json.loads((corpus / "manifest.json").read_text())
    assert summary["model"]["vocab_size"] == data["manifest"]["tokenizer"]["vocab_size"]
    assert isinstance(summary["sample"], str) and summary["sample"]
    run = load(out)
    assert run.decode(run.encode("def main():")) == "def main():"


def _refused(overrides, tmp_path, field, match):
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as e:
        train(compose_cfg(overrides, out))
    msg = str(e.value)
    assert msg.startswith(f"{field}:") and "\n" not in msg and match in msg, msg
    assert not out.exists()  # refused before anything was written
    return msg


def test_bad_input_is_refused_in_one_line_before_any_work(corpus, tmp_path):
    def prepared(name, **change):
        folder = tmp_path / name
        subprocess.run(["cp", "-r", str(corpus), str(folder)], check=True)
        manifest = json.loads((folder / "manifest.json").read_text())
        for key, value in change.items():
            if value is None:
                manifest.pop(key)
            else:
                manifest[key] = value
        (folder / "manifest.json").write_text(json.dumps(manifest))
        return folder

    def bad(path, *extra):
        return base(path) + ["trainer.max_steps=2", *extra]

    _refused(bad(tmp_path / "nope"), tmp_path, "data.path", "does not exist")
    _refused(["debug=smoke", "data=shards"], tmp_path, "data.path", "is required with data=shards")
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "a.txt").write_text("hello")
    _refused(bad(raw), tmp_path, "data.path", "no manifest.json")
    _refused(bad(prepared("partial", complete=False)), tmp_path, "data.path", "is not complete")
    _refused(bad(prepared("partial2", complete=None)), tmp_path, "data.path", "is not complete")
    _refused(bad(prepared("newer", version=2)), tmp_path, "data.path", "is version 2 (attnzoo tests); this attnzoo reads")
    longest = json.loads((corpus / "manifest.json").read_text())["splits"]["train"]["max_document_tokens"]
    _refused(base(corpus) + ["data.packing=true", f"data.seq_len={longest + 1}", f"model.max_seq_len={longest + 1}"],
             tmp_path, "data.seq_len", f"longer than every document of {corpus} (the longest: {longest} tokens)")
    vocab = json.loads((corpus / "manifest.json").read_text())["tokenizer"]["vocab_size"]
    _refused(bad(corpus, f"data.vocab_size={vocab - 1}"), tmp_path, "data.vocab_size", f"allowed: >= {vocab}")
    _refused(bad(corpus, f"trainer.max_tokens={B * T - 1}", "trainer.max_steps=null"), tmp_path,
             "trainer.max_tokens", f"is below one batch ({B * T} tokens a step")
    # a context longer than the training split (issue 43 item 3: one line from the start, found when the split is
    # opened: the run dir is made for its lock by then, left empty; attnzoo-train removes it)
    tokens = json.loads((corpus / "manifest.json").read_text())["splits"]["train"]["tokens"]
    with pytest.raises(ConfigError) as e:
        train(compose_cfg(bad(corpus, f"data.seq_len={tokens}", f"model.max_seq_len={tokens}"), tmp_path / "long"))
    assert str(e.value).startswith(f"data.seq_len: {corpus}'s train split ({tokens:,} tokens) holds 0 blocks of "
                                   f"seq_len + 1 = {tokens + 1} tokens, fewer than one batch; allowed:")
    assert not any((tmp_path / "long").iterdir())
    with pytest.raises(ConfigError, match=rf"^model.vocab_size: {vocab - 1} embedding rows, fewer than"):
        ShardsDataConfig(path=str(corpus)).validate(type("M", (), {"vocab_size": vocab - 1})(), "data")


def test_packing_run_trains_on_document_masks(corpus, tmp_path):
    out = tmp_path / "packed"
    metrics = train(compose_cfg(base(corpus) + ["data.packing=true", "trainer.max_steps=3",
                                                "trainer.val_check_interval=3"], out))
    assert metrics["val/loss"] > 0


def test_data_text_says_in_one_line_when_max_chars_cuts_a_users_corpus(tmp_path, capsys):
    """data=text with a data.path longer than data.max_chars names `attnzoo-data prepare` in one line instead of
    cutting silently; a corpus within the cap and the embedded corpus (capped by design) print nothing."""
    (tmp_path / "big.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    for path, cap, said in ((tmp_path / "big.txt", 3000, True), (tmp_path / "big.txt", 10**6, False),
                            (None, 300000, False)):
        dm = TextDataModule(TextDataConfig(path=path and str(path), max_chars=cap, tokenizer="char", seq_len=16),
                            cache_dir=str(tmp_path / "cache"))
        dm.setup("fit")
        lines = [ln for ln in capsys.readouterr().out.splitlines() if "data.max_chars" in ln]
        assert len(lines) == int(said), lines
        if said:
            assert f"data.path={path} (0.0 MB) is longer than data.max_chars=3,000" in lines[0]
            assert f"`attnzoo-data prepare {path} OUT` then data=shards data.path=OUT" in lines[0]
            assert dm.info["chars"] == 3000


def test_trains_on_what_attnzoo_data_prepare_wrote(tmp_path):
    """The contract end to end: a folder `attnzoo-data prepare` wrote (prepare(), its library entry) trains
    with data=shards, in its tokenizer's vocabulary."""
    src = tmp_path / "src"
    src.mkdir()
    for f in stdlib_files()[:12]:
        (src / f"{f.stem}.txt").write_text(f.read_text(errors="replace")[:8000])
    out = tmp_path / "out"
    prepare(str(src), str(out), vocab_size=300, val_fraction=0.2, num_workers=1, txt_docs="file", progress=False,
            chunk_bytes=4096)
    run = tmp_path / "run"
    metrics = train(compose_cfg(base(out) + ["trainer.max_steps=2", "trainer.val_check_interval=2"], run))
    summary = json.loads((run / "summary.json").read_text())
    assert metrics["val/loss"] > 0 and summary["model"]["vocab_size"] == summary["data"]["manifest"]["tokenizer"]["vocab_size"]


def test_lm_125m_recipe_runs_in_its_smoke_form_on_cpu(corpus, tmp_path):
    """experiment=lm_125m (the GPU recipe: docs/data.md) in its debug=smoke form on CPU: the recipe composes with
    data=shards, trains (bf16 autocast and 4-step accumulation as on GPUs) and validates."""
    out = tmp_path / "run"
    # two of its 12 layers: the recipe's options (not its depth) are what this checks, and depth is what costs on CPU
    cfg = compose_cfg(["experiment=lm_125m", "debug=smoke", "trainer=cpu", "compile=false", f"data.path={corpus}",
                       "data.num_workers=1", "sample.max_new_tokens=4", "perf.measure_decode=false",
                       "model.n_layers=2"], out)
    assert cfg.data.name == "shards" and cfg.trainer.max_tokens == 2_500_000_000 and cfg.optim.lr == 6e-4
    assert cfg.trainer.precision == "bf16-mixed" and cfg.trainer.accumulate_grad_batches == 4
    train(cfg)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["global_step"] == cfg.trainer.max_steps
    assert summary["data"]["manifest"]["tokenizer"]["vocab_size"] == summary["model"]["vocab_size"]


def _source(tmp_path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for i, f in enumerate(stdlib_files()[:12]):
        (src / f"doc{i}.txt").write_text(f.read_text(errors="replace")[:3000].replace("\n\n", "\n"))
    return src


def test_data_source_is_prepared_once_per_source_and_options(tmp_path, capsys):
    """data.source=SRC (no data.path): prepared on first use into paths.cache_dir/shards/<key>; a second run (a
    sweep's next job) with the same source and options reuses it untouched; other options (a vocabulary sweep)
    prepare their own folder once."""
    src, cache = _source(tmp_path), tmp_path / "cache"
    common = ["data=shards", f"data.source={src}", "+data.prepare.vocab_size=300", "+data.prepare.val_fraction=0.2",
              "+data.prepare.txt_docs=file", "data.seq_len=32", "data.batch_size=4", "data.num_workers=0",
              "model.d_model=32", "model.n_layers=1", "trainer.max_steps=2", "trainer.val_check_interval=2",
              "trainer.limit_val_batches=1", "sample.max_new_tokens=0", "perf.measure_decode=false"]
    def run(overrides, out):
        cfg = compose_cfg(overrides, out)
        cfg.paths.cache_dir = str(cache)  # this test's own cache (compose_cfg sets the session's)
        train(cfg)

    run(common, tmp_path / "a")
    (prepared,) = [d for d in (cache / "shards").iterdir() if d.is_dir()]
    assert "preparing it once" in capsys.readouterr().out
    stamp = (prepared / "manifest.json").stat().st_mtime_ns
    run(common + ["seed=2"], tmp_path / "b")
    assert "preparing it once" not in capsys.readouterr().out
    assert (prepared / "manifest.json").stat().st_mtime_ns == stamp
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert summary["data"]["path"] == str(prepared.resolve()) and summary["data"]["manifest"]["tokenizer"]["vocab_size"] == 300
    run([c.replace("vocab_size=300", "vocab_size=320") for c in common], tmp_path / "c")
    assert len([d for d in (cache / "shards").iterdir() if d.is_dir()]) == 2


@pytest.mark.parametrize("extra,field,match", [
    (["data.source=SRC", "data.path=OUT"], "data.source", "one of them"),
    (["data.source=SRC", "+data.prepare.vocab_sise=300"], "data.prepare", "unknown option 'vocab_sise'"),
    (["data.source=SRC", "+data.prepare.vocab_size=100"], "data.prepare.vocab_size", ">= 260"),
    (["data.source=MISSING"], "data.source", "does not exist"),
    (["data.path=OUT", "+data.prepare.vocab_size=300"], "data.prepare", "without data.source"),
], ids=["both", "unknown-option", "bad-option", "missing-source", "options-without-source"])
def test_data_source_refusals_are_one_line_before_any_work(corpus, tmp_path, extra, field, match):
    src = _source(tmp_path)
    extra = [e.replace("=SRC", f"={src}").replace("=OUT", f"={corpus}").replace("=MISSING", f"={tmp_path / 'nope'}")
             for e in extra]
    _refused(["data=shards", *extra], tmp_path, field, match)


def test_export_of_a_shards_run_carries_the_prepared_tokenizer(corpus, tmp_path):
    """attnzoo-export on a data=shards run writes OUT/tokenizer.json's tokenizer beside the weights (as for a
    data=text run), so transformers encodes text exactly as the run did."""
    from tokenizers import Tokenizer

    from attnzoo.cli import export

    run = tmp_path / "run"
    train(compose_cfg(base(corpus) + ["trainer.max_steps=2", "trainer.val_check_interval=2"], run))
    export.main([str(run), str(tmp_path / "export")])
    ours = Tokenizer.from_file(str(corpus / "tokenizer.json"))
    theirs = Tokenizer.from_file(str(tmp_path / "export" / "tokenizer.json"))
    text = "def main():\n    return 1"
    assert theirs.encode(text).ids == ours.encode(text).ids


def test_init_from_on_shards_needs_the_models_tokenizer(corpus, tmp_path):
    """model.init_from=DIR with data=shards: a corpus prepared with DIR's tokenizer trains (the embedding rows are
    the model's); one prepared with another tokenizer is refused in one line naming data.path."""
    from attnzoo.cli import export

    trained, model_dir = tmp_path / "trained", tmp_path / "model"
    train(compose_cfg(base(corpus) + ["trainer.max_steps=2", "trainer.val_check_interval=2"], trained))
    export.main([str(trained), str(model_dir)])  # a transformers directory with this corpus's tokenizer
    common = ["data=shards", "data.seq_len=32", "data.batch_size=4", "data.num_workers=0", "trainer.max_steps=2",
              "trainer.val_check_interval=2", "trainer.limit_val_batches=1", "sample.max_new_tokens=0",
              "perf.measure_decode=false", f"model.init_from={model_dir}"]
    train(compose_cfg(common + [f"data.path={corpus}"], tmp_path / "ok"))
    assert json.loads((tmp_path / "ok" / "summary.json").read_text())["status"] == "ok"
    other = text_corpus(tmp_path / "other", n_files=10, vocab_size=320)
    _refused(common + [f"data.path={other}"], tmp_path, "data.path", "prepared with another tokenizer")


def test_token_ids_outside_the_vocabulary_are_one_line_naming_the_folder(tmp_path):
    """A prepared folder whose chunks hold ids its manifest's vocabulary does not (a corrupt chunk, or one another
    tokenizer wrote; issue 43 item 2: an IndexError in the embedding): the training and validation loaders check
    each batch in the training process and refuse in one line naming data.path, through train() too."""
    from attnzoo.data.tokenizer import BPETokenizer
    from tests.shards_fixture import write_prepared

    rng = np.random.default_rng(0)
    docs = [np.array(list(rng.integers(1, 40, 50)) + [999, 0], dtype=np.uint16) for _ in range(40)]
    stub = BPETokenizer.train("abc abd", 260).tok.to_str()
    out = write_prepared(tmp_path / "bad", docs[4:], docs[:4], stub, 0, 300, chunk_size=400)
    dm = module(out, seq_len=15, batch_size=2, num_workers=2)
    for loader in (dm.train_dataloader(), dm.val_dataloader()):
        with pytest.raises(ConfigError) as e:
            for _ in loader:
                pass
        assert str(e.value) == (f"data.path: {dm.root} holds token id 999, outside the model's vocabulary of 300 ids "
                                f"(a corrupt chunk, or one another tokenizer wrote); allowed: a folder attnzoo-data "
                                f"prepare wrote (prepare it again)")
    with pytest.raises(ConfigError, match=r"^data.path: .* holds token id 999, outside the model's vocabulary"):
        train(compose_cfg([*base(out), "trainer.max_steps=2"], tmp_path / "run"))
