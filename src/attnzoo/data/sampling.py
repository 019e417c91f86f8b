"""A shuffling sampler that shards across DDP ranks and resumes mid-epoch at the exact batch.

Epoch e's order is `randperm(n, seed + e)`; rank r takes every world_size-th index of it (equal
shares, tail dropped). The position (epoch, batches done) is recorded by `DataPositionCallback`
after every training batch and saved in the checkpoint as the training loader's state (`ResumableDataLoader`,
stateful for Lightning) and the datamodule's, so a resumed run continues with the very next batch the
interrupted run would have seen.
"""
from __future__ import annotations

from typing import Iterator

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Sampler

from attnzoo.distributed.context_parallel import data_rank_world


def end_with_the_rank(worker_id: int) -> None:
    """`worker_init_fn` of every loader attnzoo builds: a loader worker ends with the process that started it (the
    kernel's SIGKILL when it dies: distributed/processes.die_with_parent). A training process SIGKILLed mid-run
    left its litdata workers waiting in their reads for ever (torch's watchdog looks at the parent only between
    batches)."""
    import multiprocessing

    from attnzoo.distributed.processes import die_with_parent

    parent = multiprocessing.parent_process()
    if parent is not None:
        die_with_parent(parent.pid)


def _rank_world() -> tuple[int, int]:
    """The data-parallel rank and world: with context parallelism (parallel.py) the ranks of one group share
    a batch, so the data is sharded over the groups only."""
    split = data_rank_world()
    if split is not None:
        return split
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def own_generator(seed: int) -> torch.Generator:
    """A loader's own generator: every DataLoader iterator draws its workers' base seed from it, which would
    otherwise be one draw from the global generator per iterator (per validation), so dropout masks after a
    resume would depend on how many loaders had been iterated."""
    return torch.Generator().manual_seed(seed)


class ResumableShuffleSampler(Sampler[int]):
    def __init__(self, n: int, seed: int, batch_size: int, shuffle: bool = True):
        self.n, self.seed, self.batch_size, self.shuffle = n, seed, batch_size, shuffle
        self.epoch = 0
        self.skip_batches = 0  # consumed once, by the first iteration after a resume

    def set_epoch(self, epoch: int) -> None:  # Lightning calls this at every epoch start
        self.epoch = epoch

    def resume(self, epoch: int, batches_done: int) -> None:
        self.epoch, self.skip_batches = epoch, batches_done

    def _indices(self) -> list[int]:
        rank, world = _rank_world()
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.n, generator=g)
        else:
            order = torch.arange(self.n)
        per_rank = self.n // world
        return order[rank : per_rank * world : world].tolist()

    def __iter__(self) -> Iterator[int]:
        idx = self._indices()
        skip, self.skip_batches = self.skip_batches * self.batch_size, 0
        return iter(idx[skip:])

    def __len__(self) -> int:
        return self.n // _rank_world()[1]


class ResumableDataLoader(DataLoader):
    """The training DataLoader, stateful as Lightning understands it (`state_dict` / `load_state_dict`: the fit
    loop saves it in the checkpoint and restores it on resume, and knows a mid-epoch resume is exact). Its state
    is the position the training loop has consumed, (epoch, batches done in it), recorded after every batch by
    DataPositionCallback — not how far the sampler has run ahead (the loader's workers and Lightning's fetcher
    prefetch batches); loading it makes the sampler continue with the next batch."""

    position: dict | None = None

    def state_dict(self) -> dict:
        return dict(self.position or {"epoch": 0, "batches": 0})

    def load_state_dict(self, state: dict) -> None:
        self.position = {"epoch": int(state["epoch"]), "batches": int(state["batches"])}
        self.sampler.resume(self.position["epoch"], self.position["batches"])


class ResumableDataMixin:
    """For LightningDataModules: `self.position` is saved in checkpoints and re-applied on resume. The loaders
    read `self.train_set` / `self.val_set`, `self.cfg.batch_size` / `num_workers`, `self.seed` and the class's
    `collate_fn` (None: the default collation)."""

    position: dict = {"epoch": 0, "batches": 0}
    collate_fn = None
    _train_sampler: ResumableShuffleSampler | None = None
    _resume: dict | None = None

    def make_train_sampler(self, n: int, seed: int, batch_size: int) -> ResumableShuffleSampler:
        self._train_sampler = ResumableShuffleSampler(n, seed, batch_size)
        if self._resume:
            self._train_sampler.resume(self._resume["epoch"], self._resume["batches"])
            self._resume = None
        return self._train_sampler

    def train_loader(self, dataset, batch_size: int, seed: int, num_workers: int = 0, collate_fn=None) -> DataLoader:
        """Shuffled per epoch from the seed, sharded over DDP ranks, resumable at the exact batch."""
        sampler = self.make_train_sampler(len(dataset), seed, batch_size)
        return ResumableDataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True,
                                   num_workers=num_workers, collate_fn=collate_fn, generator=own_generator(seed),
                                   worker_init_fn=end_with_the_rank)

    @staticmethod
    def val_loader(dataset, batch_size: int, num_workers: int = 0, collate_fn=None) -> DataLoader:
        """In order, sharded over DDP ranks (the LightningModule reduces the metrics exactly)."""
        sampler = ResumableShuffleSampler(len(dataset), 0, batch_size, shuffle=False)
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers, collate_fn=collate_fn,
                          generator=own_generator(0), worker_init_fn=end_with_the_rank)

    def train_dataloader(self) -> DataLoader:
        return self.train_loader(self.train_set, self.cfg.batch_size, self.seed, self.cfg.num_workers,
                                 collate_fn=self.collate_fn)

    def val_dataloader(self) -> DataLoader:
        return self.val_loader(self.val_set, self.cfg.batch_size, self.cfg.num_workers, collate_fn=self.collate_fn)

    def state_dict(self) -> dict:
        return dict(self.position)

    def load_state_dict(self, state: dict) -> None:
        self.position = dict(state)
        self._resume = dict(state)
        if self._train_sampler is not None:
            self._train_sampler.resume(state["epoch"], state["batches"])
            self._resume = None


class DataPositionCallback(L.Callback):
    """Records (epoch, batches done in it) after every training batch, before checkpoints are written: on the
    training loader (its state in the checkpoint's fit loop) and on the datamodule (its own checkpoint entry,
    which checkpoints written before the loader was stateful carry alone)."""

    @staticmethod
    def _record(trainer, position: dict) -> None:
        dm = trainer.datamodule
        if isinstance(dm, ResumableDataMixin):
            dm.position = position
        loader = trainer.train_dataloader
        if isinstance(loader, ResumableDataLoader):
            loader.position = dict(position)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self._record(trainer, {"epoch": trainer.current_epoch, "batches": batch_idx + 1})

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._record(trainer, {"epoch": trainer.current_epoch + 1, "batches": 0})
