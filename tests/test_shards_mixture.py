"""data=shards data.mixture (issue 47 item 4): several prepared folders blended by weight. The blend follows the
weights in every prefix and ends when the first source runs out; over an epoch on 2 ranks x 2 workers no block is
seen twice and the source that ends it is seen whole (less the drop_last tails), in the same order for the same
seed; the loader resumes at the consumed batch; a two-source run stopped and resumed logs the uninterrupted run's
every train/loss and data/tokens/<name>; sources of another tokenizer (the model's, with model.init_from),
end-of-text id or too few blocks are refused in one line before any work (config-only refusals:
tests/test_bad_input.py)."""
import csv
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from omegaconf import OmegaConf

import attnzoo.data._shards_loader as shards_loader
from attnzoo.config.errors import ConfigError
from attnzoo.data._shards_loader import blend
from attnzoo.data.corpus import stdlib_files
from attnzoo.data.shards import ShardsDataConfig, ShardsDataModule
from attnzoo.data.shards_configs import MixtureSource
from attnzoo.data.tokenizer import BPETokenizer
from attnzoo.interop.hf.convert import _use_model_tokenizer
from attnzoo.training.run import train
from tests.conftest import compose_cfg
from tests.shards_fixture import write_prepared

B, T = 8, 32
B_FAR = 100_000  # source b's token ids start here, a's at 1: a block's source is its largest id


def numbered(out: Path, start: int, n_docs: int, seed: int) -> Path:
    """A prepared folder of documents of distinct ids (a counter from `start`, each ending with id 0), every
    source with the same stub tokenizer and vocabulary."""
    rng, docs, nxt = np.random.default_rng(seed), [], start
    for _ in range(n_docs):
        n = int(rng.integers(5, 60))
        docs.append(np.array(list(range(nxt, nxt + n)) + [0], dtype=np.uint32))
        nxt += n
    stub = BPETokenizer.train("abc abd", 260).tok.to_str()
    return write_prepared(out, docs[4:], docs[:4], stub, 0, 2 * B_FAR, chunk_size=120)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixture_numbered")
    return numbered(root / "a", 1, 60, 0), numbered(root / "b", B_FAR, 30, 1)


@pytest.fixture(scope="module")
def text_pair(tmp_path_factory):
    """Two real-text sources prepared with one byte-level BPE (stdlib files 0-19 and 20-39)."""
    root = tmp_path_factory.mktemp("mixture_text")
    texts = [f.read_text(errors="replace")[:200] for f in stdlib_files()[:40]]
    tok = BPETokenizer.train("\n".join(texts), 300)
    eos = tok.tok.token_to_id("<|endoftext|>")
    docs = [np.array(tok.encode(t) + [eos], dtype=np.uint16) for t in texts]
    return tuple(write_prepared(root / name, part[2:], part[:2], tok.tok.to_str(), eos, tok.vocab_size, 4096)
                 for name, part in (("a", docs[:20]), ("b", docs[20:])))


def mixture(a, b, wa=0.7, wb=0.3) -> str:
    return f"data.mixture={{a: {{path: {a}, weight: {wa}}}, b: {{path: {b}, weight: {wb}}}}}"


def module(pair, rank=0, world=1, monkeypatch=None, seed=5, workers=2, **kw) -> ShardsDataModule:
    if monkeypatch is not None:
        monkeypatch.setattr(shards_loader, "_rank_world", lambda: (rank, world))
    cfg = ShardsDataConfig(mixture={"a": MixtureSource(str(pair[0]), 0.7), "b": MixtureSource(str(pair[1]), 0.3)},
                           **{"seq_len": 15, "batch_size": 3, "num_workers": workers, **kw})
    dm = ShardsDataModule(cfg, seed=seed)
    dm.setup("fit")
    return dm


def epoch(loader, n=None) -> list[torch.Tensor]:
    """The (B, seq_len + 1) blocks of each batch, the first n batches (all: an epoch)."""
    out = []
    for i, (x, y) in enumerate(loader):
        if n is not None and i == n:
            break
        out.append(torch.cat([x, y[:, -1:]], 1))
    return out


def test_blend_keeps_every_prefix_at_the_weights_and_ends_when_the_first_source_runs_out():
    rng = np.random.default_rng(0)
    for _ in range(100):
        n_sources = int(rng.integers(2, 5))
        w, cap = rng.random(n_sources) + 0.01, rng.integers(1, 300, n_sources)
        order = blend(list(w), list(cap))
        assert np.array_equal(order, blend(list(w), list(cap)))  # deterministic
        counts = np.bincount(order, minlength=n_sources)
        assert (counts <= cap).all() and (counts == cap).any()  # one source used whole, none beyond its blocks
        limit = int(np.argmin((cap + 0.5) / w))  # the first to run out ends the epoch
        assert counts[limit] == cap[limit]
        share = np.eye(n_sources)[order].cumsum(0) - (w / w.sum()) * np.arange(1, len(order) + 1)[:, None]
        assert np.abs(share).max() < (n_sources + 1) / 2  # every prefix at the weights
        if n_sources == 2:
            assert np.abs(share).max() <= 0.5


def test_a_mixture_epoch_on_two_ranks_times_two_workers_sees_each_block_at_most_once(pair, monkeypatch):
    """2 ranks x 2 loader workers per source: each batch holds the blend's sources in its order (the weights to
    within half a block), no block twice across ranks; source a, which runs out first at these weights, is seen
    whole but for the tails (drop_last's and the epoch's last part-batch: fewer than 2 x world x B blocks), b is not
    used up; every rank blends the same order (so data/tokens/<name> summed over ranks is world x one rank's); the
    same seed gives the same batches, another seed others."""
    seen, orders = {"a": [], "b": []}, []
    for rank in range(2):
        loader = module(pair, rank, 2, monkeypatch).train_dataloader()
        batches = epoch(loader)
        assert len(batches) == len(loader) > 0
        sources = [["b" if int(r.max()) >= B_FAR else "a" for r in x] for x in batches]
        assert sources == [["ab"[s] for s in loader.order[k * 3:(k + 1) * 3]] for k in range(len(loader))]
        for x, names in zip(batches, sources):
            for r, name in zip(x, names):
                seen[name].append(tuple(r.tolist()))
        orders.append((loader.order.tolist(), batches))
    assert orders[0][0] == orders[1][0]
    for name in "ab":
        assert len(seen[name]) == len(set(seen[name])), name
    train_a = module(pair).info["mixture"]["a"]["train_blocks"]
    assert len(set(seen["a"])) > train_a - 2 * 2 * 3  # the tails only
    assert len(set(seen["b"])) < module(pair).info["mixture"]["b"]["train_blocks"]
    again = epoch(module(pair, 0, 2, monkeypatch).train_dataloader())
    assert all(torch.equal(p, q) for p, q in zip(again, orders[0][1]))
    other = epoch(module(pair, 0, 2, monkeypatch, seed=6).train_dataloader())
    assert not all(torch.equal(p, q) for p, q in zip(other, orders[0][1]))


def test_the_mixture_loader_resumes_at_the_consumed_batch(pair):
    """The state after k consumed batches (one more fetched) gives a fresh loader the uninterrupted epoch's
    batches from k on, then the second epoch's; at an epoch's end, the next epoch's."""
    ref = module(pair).train_dataloader()
    first_epoch, second_epoch = epoch(ref), epoch(ref)
    n = len(first_epoch)
    assert not all(torch.equal(p, q) for p, q in zip(first_epoch, second_epoch))
    for k in (5, n):
        stopped = module(pair).train_dataloader()
        epoch(stopped, k + 1)
        stopped.position = {"epoch": 0, "batches": k} if k < n else {"epoch": 1, "batches": 0}
        resumed = module(pair).train_dataloader()
        resumed.load_state_dict(stopped.state_dict())
        want = first_epoch[k:] + second_epoch if k < n else second_epoch
        got = epoch(resumed) + (epoch(resumed) if k < n else [])
        assert len(got) == len(want) and all(torch.equal(p, q) for p, q in zip(got, want)), k


def rows(run_dir) -> list[dict]:
    with open(run_dir / "csv" / "metrics.csv", newline="") as f:
        return [r for r in csv.DictReader(f) if r.get("train/loss")]


def test_a_two_source_mixture_run_resumes_exactly_and_logs_tokens_per_source(text_pair, tmp_path):
    """One process x 2 workers per source, in process: a run stopped at step 9 and resumed to 20 (an epoch is 14
    batches: the resumed part crosses an epoch boundary) logs the uninterrupted run's every train/loss and
    data/tokens/<name>; the two sum to train/tokens_seen at every step; summary.json has the sources."""
    common = ["debug=smoke", "data=shards", mixture(*text_pair), f"data.seq_len={T}", f"data.batch_size={B}",
              "data.num_workers=2", "perf.measure_decode=false", "sample.max_new_tokens=0", "optim.lr=3e-3",
              "scheduler=constant", "callbacks.save_best=false", "trainer.limit_val_batches=1",
              "trainer.val_check_interval=100", "callbacks.checkpoint_every_n_steps=3"]
    ref, split = tmp_path / "ref", tmp_path / "split"
    train(compose_cfg(common + ["trainer.max_steps=20"], ref))
    train(compose_cfg(common + ["trainer.max_steps=9"], split))
    ckpt = torch.load(split / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"epoch": 0, "batches": 9}]
    train(compose_cfg(common + ["trainer.max_steps=20", "ckpt_path=last"], split))
    keys = ("train/loss", "train/tokens_seen", "data/tokens/a", "data/tokens/b")
    want = {int(r["step"]): [float(r[k]) for k in keys] for r in rows(ref)}
    got = {int(r["step"]): [float(r[k]) for k in keys] for r in rows(split)}
    assert sorted(want) == sorted(got) == list(range(20))
    for step, values in want.items():
        assert got[step] == pytest.approx(values, abs=1e-6), step
        assert values[2] + values[3] == values[1] == (step + 1) * B * T
    summary = json.loads((ref / "summary.json").read_text())
    data = summary["data"]
    assert set(data["mixture"]) == {"a", "b"} and data["mixture"]["b"]["weight"] == 0.3
    assert data["epoch"]["batches"] < 20 and summary["metrics"]["data/tokens/a"] == want[19][2]
    blocks = data["epoch"]["blocks_per_rank"]
    assert abs(blocks["a"] - 0.7 * data["epoch"]["batches"] * B) <= 0.5
    assert summary["metrics"]["val/loss"] > 0


def _refused(overrides, tmp_path, field, match):
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as e:
        train(compose_cfg(["debug=smoke", "data=shards", f"data.seq_len={T}", f"data.batch_size={B}",
                           "data.num_workers=0", *overrides], out))
    msg = str(e.value)
    assert msg.startswith(f"{field}:") and "\n" not in msg and match in msg, msg
    assert not out.exists() or not any(out.iterdir())  # refused before anything was written
    return msg


def test_sources_that_cannot_be_mixed_are_refused_in_one_line_before_any_work(text_pair, tmp_path):
    a, b = text_pair

    def copy(name, manifest_change=None, tokenizer=None):
        folder = tmp_path / name
        subprocess.run(["cp", "-r", str(b), str(folder)], check=True)
        manifest = json.loads((folder / "manifest.json").read_text())
        manifest["tokenizer"].update(manifest_change or {})
        (folder / "manifest.json").write_text(json.dumps(manifest))
        if tokenizer is not None:
            (folder / "tokenizer.json").write_text(tokenizer)
        return folder

    other = copy("other", tokenizer=BPETokenizer.train("another corpus entirely", 260).tok.to_str())
    _refused([mixture(a, other)], tmp_path, "data.mixture.b.path",
             f"{other} was prepared with another tokenizer than data.mixture.a ({a}: tokenizer.json sha256")
    # model.init_from=DIR (here a's folder: its tokenizer.json): every source must be prepared with DIR's tokenizer
    cfg = OmegaConf.create({"data": {"name": "shards", "path": None, "vocab_size": None, "mixture": {
        "a": {"path": str(a), "weight": 1}, "b": {"path": str(other), "weight": 1}}}})
    with pytest.raises(ConfigError, match=rf"^data.mixture.b.path: {other} was prepared with another tokenizer than "
                                          rf"{a}/tokenizer.json"):
        _use_model_tokenizer(cfg, a, 300, [])
    eos = copy("eos", {"eos_id": 1})
    _refused([mixture(a, eos)], tmp_path, "data.mixture.b.path", "ends its documents with id 1, data.mixture.a with")
    longest = max(json.loads((p / "manifest.json").read_text())["splits"]["train"]["max_document_tokens"]
                  for p in text_pair)
    _refused([mixture(a, b), "data.packing=true", f"data.seq_len={longest + 1}", f"model.max_seq_len={longest + 1}"],
             tmp_path, "data.seq_len", f"longer than every document of every source (the longest: {longest} tokens)")
    _refused([mixture(a, tmp_path / "nope")], tmp_path, "data.mixture.b.path", "does not exist")
    val = [json.loads((p / "manifest.json").read_text())["splits"]["val"]["tokens"] for p in text_pair]
    _refused([mixture(a, b), f"data.seq_len={max(val)}", f"model.max_seq_len={max(val)}", "data.batch_size=1"],
             tmp_path, "data.seq_len", f"{a.resolve()}'s val split ({val[0]:,} tokens) holds 0 blocks")
