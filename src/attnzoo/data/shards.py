"""`data=shards data.path=OUT`: language modelling on a corpus prepared once by `attnzoo-data prepare SRC OUT`
(token shards + manifest; the format: docs/data.md), streamed with Lightning's litdata.

Nothing is loaded whole: litdata memory-maps the shards, so memory does not grow with the corpus. Training reads
`StreamingDataset(OUT/train, TokensLoader(block_size=seq_len + 1), shuffle, seed=run seed, drop_last=True)`: the
documents' token stream cut into blocks, shuffled per epoch from the seed and shared out over the data-parallel
ranks and the loader's workers with no overlap. A batch is (x, y) int64 (B, T), y = x shifted by one, as data=text
gives it; with packing the document masks come from the end-of-text ids inside each block (data=text's packed
form, ops/packing.py). Validation reads OUT/val in order.

Resume is exact: the training loader's state in the checkpoint is litdata's state at the batch the training
loop has consumed (recorded after every batch by `DataPositionCallback`), not at the batch litdata has handed
out (a fetcher may run ahead: Lightning's fetches one batch ahead of a loader without a length), so a resumed run
continues with the very next batch.

`data.mixture` (instead of data.path) blends several prepared folders of one tokenizer by weight: a loader per
source, blended in the training process (_shards_loader.MixtureLoader: what an epoch of the mixture is, and why
not litdata's CombinedStreamingDataset: docs/data.md#mixtures); each source's tokens are logged.
"""
from __future__ import annotations

import json
import warnings
import hashlib
from dataclasses import asdict, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import lightning as L
import numpy as np
import torch
from filelock import FileLock

from attnzoo.config.errors import ConfigError, check
from attnzoo.data import register_data
from attnzoo.data.prepare import prepare
from attnzoo.data.tokenizer import FileTokenizer
from attnzoo.data.sampling import end_with_the_rank
from attnzoo.data.configs import PREPARE, ShardsDataConfig, _relabel, prepare_options, read_manifest  # noqa: F401 (torch-free: config checks)

if TYPE_CHECKING:  # litdata itself is imported where shards are read (data/_shards_loader.py), not by every run
    from litdata import StreamingDataLoader, StreamingDataset

    from attnzoo.data._shards_loader import MixtureLoader, ShardsLoader

# Lightning warns that an IterableDataset with __len__ may repeat data across workers; litdata gives each
# worker its own share (tests/test_shards.py: every block exactly once)
warnings.filterwarnings("ignore", message="Your `IterableDataset` has `__len__` defined")


def prepared_source(source: str, options: dict, cache_dir: str) -> Path:
    """The prepared folder of data.source with data.prepare's options: paths.cache_dir/shards/<key>, the key a hash of
    the source's fingerprint, the tokenizer's identity and every option that shapes the folder. Prepared on first
    use under a file lock: the jobs of a sweep and the ranks of a run that ask at once wait for one prepare, and
    later ones find it finished (prepare does nothing then)."""
    o, record, tok = prepare_options(source, options)
    shaping = {k: v for k, v in asdict(o).items() if k != "progress"}
    key = hashlib.sha256(json.dumps({"fingerprint": record["fingerprint"], "tokenizer": tok, "options": shaping},
                                    sort_keys=True, default=str).encode()).hexdigest()[:16]
    out = Path(cache_dir).expanduser() / "shards" / key
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if not (out / "manifest.json").is_file():
            print(f"attnzoo: data.source={source}: preparing it once into {out} (attnzoo-data prepare)", flush=True)
        try:
            prepare(source, out, **{**options, "progress": False})
        except ConfigError as e:
            raise _relabel(e, "data") from None
    return out


def read_split_index(split_dir: Path, field: str = "data.path") -> dict:
    """A split's litdata index.json, checked before litdata reads anything (one-line ConfigError naming the file):
    valid JSON with a `chunks` list; every chunk file named by a plain file name of this folder (never `../x` or an
    absolute path: litdata joins the name to the folder and would read files outside it), present, and at least
    as long as the index says (a truncated or missing chunk otherwise ends in litdata's ChunkWaitTimeoutError
    after minutes)."""
    index_file = split_dir / "index.json"
    try:
        index = json.loads(index_file.read_text())
        chunks = index["chunks"]
        if not isinstance(chunks, list):
            raise TypeError("chunks is not a list")
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise ConfigError(f"{index_file} is not a litdata index ({type(e).__name__}: {str(e)[:120]}); allowed: a "
                          f"folder written by `{PREPARE}` (rerun it)", field=field) from None
    for c in chunks:
        name = str(c.get("filename", "")) if isinstance(c, dict) else ""
        if not name or Path(name).is_absolute() or Path(name).name != name or name in (".", ".."):
            raise ConfigError(f"{index_file} names a chunk outside its folder ({name!r}); allowed: file names in "
                              f"{split_dir}", field=field)
        chunk = split_dir / name
        if not chunk.is_file():
            raise ConfigError(f"{chunk} is missing (its index.json names it); allowed: a complete prepared folder "
                              f"(rerun `{PREPARE}`)", field=field)
        want = int(c.get("chunk_bytes") or 0)
        if chunk.stat().st_size < want:
            raise ConfigError(f"{chunk} is truncated ({chunk.stat().st_size} of {want} bytes); allowed: a complete "
                              f"prepared folder (rerun `{PREPARE}`)", field=field)
    return index


def count_blocks(split_dir: Path, block: int) -> int:
    """Blocks of `block` tokens litdata's TokensLoader cuts from a split (each chunk's tail shorter than a block is
    left out), from its index.json (checked: read_split_index)."""
    return sum(int(c["dim"] or 0) // block for c in read_split_index(split_dir)["chunks"])


class BlockBatch:
    """Collates blocks of seq_len + 1 token ids into (x, y) int64 (B, T), y = x shifted by one. With `eos_id`
    (data.packing) also (loss_mask, token_mask, doc_ids) as data=text's PackedBlocks: doc_ids counts the
    end-of-text ids at x[1..t], so each end-of-text starts the next document as data=text's separator does
    (the previous document's last target is that end-of-text)."""

    def __init__(self, eos_id: Optional[int] = None):
        self.eos_id = eos_id

    def __call__(self, blocks: list) -> tuple:
        ids = torch.from_numpy(np.stack([np.asarray(b) for b in blocks]).astype(np.int64))  # (B, T + 1)
        x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
        if self.eos_id is None:
            return x, y
        starts = x == self.eos_id
        starts[:, 0] = False  # the block's first token belongs to document 0 whatever it is
        ones = torch.ones_like(x, dtype=torch.bool)
        return x, y, ones, ones, starts.cumsum(1)


@register_data("shards", ShardsDataConfig)
class ShardsDataModule(L.LightningDataModule):
    def __init__(self, cfg: ShardsDataConfig, cache_dir: str = "~/.cache/attnzoo", seed: int = 0):
        super().__init__()
        self.cfg, self.cache_dir, self.seed = cfg, cache_dir, seed
        self.tokenizer: Optional[FileTokenizer] = None
        self.manifest: dict = {}
        self.info: dict = {}
        self.mixture: dict[str, Path] = {}  # data.mixture: each source's folder
        self.train_loader: Optional[ShardsLoader | MixtureLoader] = None

    def setup(self, stage: Optional[str] = None) -> None:
        if self.tokenizer is not None:
            return
        cfg = self.cfg
        if cfg.mixture is not None:
            return self._setup_mixture()
        if cfg.path is None and cfg.source is None:
            raise ConfigError(f"is required with data=shards; allowed: a folder written by `{PREPARE}`",
                              field="data.path")
        path = str(cfg.path) if cfg.path is not None else str(prepared_source(cfg.source, cfg.prepare, self.cache_dir))
        self.manifest = read_manifest(path)
        self.root = Path(path).expanduser().resolve()
        self.tokenizer = FileTokenizer.from_file(self.root / "tokenizer.json")
        self.eos_id = int(self.manifest["tokenizer"]["eos_id"])
        blocks = self._blocks(path, self.root, self.manifest)
        self.info = {"path": str(self.root), "manifest": self.manifest, "train_blocks": blocks["train"],
                     "val_blocks": blocks["val"]}

    def _blocks(self, path: str, root: Path, manifest: dict) -> dict[str, int]:
        """Blocks of seq_len + 1 tokens per split, refused (one line) below one batch to train on or one block."""
        cfg, block = self.cfg, self.cfg.seq_len + 1
        blocks = {split: count_blocks(root / split, block) for split in ("train", "val")}
        if blocks["train"] < cfg.batch_size or blocks["val"] < 1:
            split = "train" if blocks["train"] < cfg.batch_size else "val"
            tokens = manifest["splits"][split]["tokens"]
            raise ConfigError(f"{path}'s {split} split ({tokens:,} tokens) holds {blocks[split]} blocks of "
                              f"seq_len + 1 = {block} tokens, fewer than {'one batch' if split == 'train' else 'one'}; "
                              f"allowed: a smaller data.seq_len / data.batch_size, or a larger corpus",
                              field="data.seq_len")
        return blocks

    def _setup_mixture(self) -> None:
        """data.mixture: each source's folder and blocks (checked as data.path's are); the tokenizer is the
        sources' one (checked by the config: data/shards_configs.py), read from the first."""
        self.mixture = {name: Path(src.path).expanduser().resolve() for name, src in self.cfg.mixture.items()}
        sources = {}
        for name, root in self.mixture.items():
            manifest = read_manifest(self.cfg.mixture[name].path, f"data.mixture.{name}.path")
            sources[name] = {"path": str(root), "weight": self.cfg.mixture[name].weight, "manifest": manifest,
                             **{f"{split}_blocks": n for split, n in self._blocks(str(root), root, manifest).items()}}
        self.root = next(iter(self.mixture.values()))
        self.manifest = sources[next(iter(sources))]["manifest"]
        self.tokenizer = FileTokenizer.from_file(self.root / "tokenizer.json")
        self.eos_id = int(self.manifest["tokenizer"]["eos_id"])
        self.info = {"mixture": sources, "train_blocks": sum(s["train_blocks"] for s in sources.values()),
                     "val_blocks": sum(s["val_blocks"] for s in sources.values())}

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size or int(self.manifest["tokenizer"]["vocab_size"])

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids)

    def _dataset(self, split: str, shuffle: bool, root: Optional[Path] = None) -> StreamingDataset:
        from litdata import StreamingDataset, TokensLoader

        from attnzoo.data._shards_loader import data_parallel_env

        block = TokensLoader(block_size=self.cfg.seq_len + 1)
        ds = StreamingDataset(str((root or self.root) / split), item_loader=block, shuffle=shuffle, seed=self.seed,
                              drop_last=shuffle)
        ds.distributed_env = data_parallel_env(ds)
        if ds.distributed_env.world_size > 1:
            ds.set_drop_last(True)  # every rank the same number of batches (its collectives stay in step)
        return ds

    def _collate(self) -> BlockBatch:
        return BlockBatch(self.eos_id if self.cfg.packing else None)

    def train_dataloader(self) -> ShardsLoader:
        """Shuffled per epoch from the run's seed, shared over ranks and workers, resumable at the exact batch."""
        from attnzoo.data._shards_loader import ShardsLoader

        if self.cfg.mixture is not None:
            self.train_loader = self._mixture_loader("train", self.cfg.shuffle)
            epoch = dict(zip(self.train_loader.names, self.train_loader.cum[-1].tolist()))
            self.info["epoch"] = {"batches": len(self.train_loader), "blocks_per_rank": epoch}
            return self.train_loader
        self.train_loader = ShardsLoader(self._dataset("train", self.cfg.shuffle), batch_size=self.cfg.batch_size,
                                         num_workers=self.cfg.num_workers, collate_fn=self._collate(),
                                         worker_init_fn=end_with_the_rank)
        self.train_loader.vocab_size, self.train_loader.root = self.vocab_size, str(self.root)
        if len(self.train_loader) == 0:
            raise ConfigError(f"{self.root}'s train split gives no batch of {self.cfg.batch_size} per rank and "
                              f"loader worker; allowed: fewer data.num_workers, a smaller data.batch_size / seq_len",
                              field="data.batch_size")
        return self.train_loader

    def val_dataloader(self) -> StreamingDataLoader:
        """In order, shared over ranks (the LightningModule reduces the metrics exactly)."""
        from attnzoo.data._shards_loader import ValLoader

        if self.cfg.mixture is not None:
            return self._mixture_loader("val", False)
        loader = ValLoader(self._dataset("val", False), batch_size=self.cfg.batch_size,
                           num_workers=self.cfg.num_workers, collate_fn=self._collate(), worker_init_fn=end_with_the_rank)
        loader.vocab_size, loader.root = self.vocab_size, str(self.root)
        return loader

    def _mixture_loader(self, split: str, shuffle: bool) -> MixtureLoader:
        """data.mixture's loader of a split: a ShardsLoader per source (its own workers; training: whole
        batches, drop_last) blended in the training process (_shards_loader.MixtureLoader, docs/data.md#mixtures)."""
        from attnzoo.data._shards_loader import MixtureLoader, ShardsLoader, stack_blocks

        sources = {}
        for name, root in self.mixture.items():
            ds = self._dataset(split, shuffle, root)
            if split == "train":
                ds.set_drop_last(True)  # every batch of every worker whole: a source's blocks are its batches x B
            src = sources[name] = ShardsLoader(ds, batch_size=self.cfg.batch_size, num_workers=self.cfg.num_workers,
                                               collate_fn=stack_blocks, worker_init_fn=end_with_the_rank)
            src.vocab_size, src.root, src.field = self.vocab_size, str(root), f"data.mixture.{name}.path"
            if split == "train" and len(src) == 0:  # (validation as data.path's: no batch on a rank, none scored)
                raise ConfigError(f"{root}'s train split gives no batch of {self.cfg.batch_size} per rank and "
                                  f"loader worker; allowed: fewer data.num_workers, a smaller data.batch_size / "
                                  f"seq_len", field=f"data.mixture.{name}.path")
        loader = MixtureLoader(sources, [s.weight for s in self.cfg.mixture.values()], self.cfg.batch_size,
                               self._collate(), drop_last=split == "train")
        loader.world = ds.distributed_env.world_size
        return loader

    def tokens_seen(self) -> Optional[int]:
        """Training tokens the loaders have delivered to the training step so far, all data-parallel ranks
        together (each the same number of batches): from the training loader's consumed position."""
        loader = self.train_loader
        if loader is None or loader.position is None:
            return None
        world = getattr(loader, "world", None) or loader.dataset.distributed_env.world_size
        batches = int(loader.position["epoch"]) * len(loader) + int(loader.position["batches"])
        return batches * self.cfg.batch_size * self.cfg.seq_len * world

    def tokens_by_source(self) -> Optional[dict[str, int]]:
        """data.mixture: each source's training tokens delivered so far (`data/tokens/<name>`), all data-parallel
        ranks together: every rank blends the same order over the same number of blocks per source (equal shares),
        so the sum is the world x this rank's count, exactly, with no collective."""
        loader = self.train_loader
        if self.cfg.mixture is None or loader is None or loader.position is None:
            return None
        epoch, done = int(loader.position["epoch"]), int(loader.position["batches"])
        blocks = epoch * loader.cum[-1] + (loader.cum[done - 1] if done else 0)
        return {name: int(n) * self.cfg.seq_len * loader.world for name, n in zip(loader.names, blocks.tolist())}
