"""The litdata side of data=shards (data/shards.py): the stateful training loader and the data-parallel env.

Imported only where shards are read (ShardsDataModule's loaders), so a run on another data module never imports
litdata; the data registry skips this module (data/__init__.py: modules named `_*` are helpers, not data modules).
"""
from __future__ import annotations

import os
from collections import deque
from typing import Any, Iterator
from unittest import mock

import numpy as np
from litdata import StreamingDataLoader, StreamingDataset
from torch.utils.data import IterableDataset
from litdata.utilities.env import _DistributedEnv

from attnzoo.data.sampling import ResumableDataLoader, _rank_world


def data_parallel_env(dataset: StreamingDataset) -> _DistributedEnv:
    """The data-parallel rank and world the dataset shards over (context-parallel groups share a batch, so they
    count once: sampling._rank_world), in litdata's terms."""
    rank, world = _rank_world()
    found = dataset.distributed_env
    if (found.world_size, found.global_rank) == (world, rank):
        return found
    return _DistributedEnv(world_size=world, global_rank=rank, num_nodes=1)


class CheckedIds:
    """A loader whose batches' token ids are checked against the model's vocabulary in the training process (a
    corrupt or foreign chunk otherwise ends in an IndexError deep in the embedding, or a device assert on a GPU;
    issue 43 item 2): one ConfigError naming data.path. A max over a CPU batch, before it reaches the device."""

    vocab_size: int = 0
    root: str = ""
    field: str = "data.path"  # a mixture's source: data.mixture.<name>.path

    def checked(self, batches: Iterator) -> Iterator:
        for batch in batches:
            ids = batch[0] if isinstance(batch, (tuple, list)) else batch
            top = max(int(ids.max()), int(batch[1].max())) if isinstance(batch, (tuple, list)) else int(ids.max())
            if self.vocab_size and top >= self.vocab_size:
                from attnzoo.config.errors import ConfigError

                raise ConfigError(f"{self.root} holds token id {top}, outside the model's vocabulary of "
                                  f"{self.vocab_size} ids (a corrupt chunk, or one another tokenizer wrote); allowed: "
                                  f"a folder attnzoo-data prepare wrote (prepare it again)", field=self.field)
            yield batch


class ValLoader(CheckedIds, StreamingDataLoader):
    def __iter__(self) -> Iterator:
        yield from self.checked(super().__iter__())


class ShardsLoader(CheckedIds, StreamingDataLoader, ResumableDataLoader):
    """litdata's StreamingDataLoader, stateful for Lightning at the consumed position: `position` (epoch, batches
    done in it) is set by DataPositionCallback after every training batch (as for data=text's
    ResumableDataLoader), and `state_dict` is litdata's state after exactly those batches. litdata hands out
    batch k of an epoch from worker k mod num_workers, so that state is its own, computed for k batches."""

    _resuming = False  # a loaded state not yet iterated from

    def __iter__(self) -> Iterator:
        # litdata replays a loaded state on every iteration until one runs to its end, but the training loop
        # stops an epoch after len(loader) batches without exhausting it: the state is for the next iteration only
        if not self._resuming:
            self.restore = False
        self._resuming = False
        yield from self.checked(super().__iter__())

    def state_dict(self) -> dict[str, Any]:
        if self.position is None:
            return super().state_dict()
        epoch, batches = int(self.position["epoch"]), int(self.position["batches"])
        workers = max(1, self.num_workers)
        samples = batches * self.batch_size
        dataset = dict(self.dataset.state_dict(samples, self.num_workers, self.batch_size))
        # litdata counts epochs from 1 (each new iteration adds one): Lightning's epoch E is litdata's E + 1; an
        # epoch just finished (batches 0) is saved as the last one, so the next iteration starts epoch E + 1
        dataset["current_epoch"] = epoch + 1 if batches else epoch
        return {"dataset": dataset, "current_epoch": dataset["current_epoch"], "num_samples_yielded": samples,
                "latest_worker_idx": (batches - 1) % workers if batches else 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # litdata compares the saved world with torch.distributed's (WORLD_SIZE wins), which counts context-parallel
        # ranks too: tell it the data-parallel world the state was saved under
        world = str(self.dataset.distributed_env.world_size)
        with mock.patch.dict(os.environ, {"WORLD_SIZE": world}):
            StreamingDataLoader.load_state_dict(self, state)  # mid-epoch: the next iteration replays to the position
        self._resuming = True


# ----------------------------------------------------------------------------- mixtures (data.mixture)

def blend(weights: list[float], capacity: list[int]) -> np.ndarray:
    """The sources of one epoch of a mixture, block by block (an int array of source indexes): Megatron-LM's
    deterministic blending (BlendableDataset), ending when the first source runs out (the "first exhausted" rule of
    litdata's weighted CombinedStreamingDataset and HF `interleave_datasets`).

    Source s's k-th block is placed at time (k + 1/2) / w_s (w normalised); the epoch is every block placed before
    the time the first source would need one beyond its `capacity` (its blocks per rank and epoch), in time order
    (ties: the lower source). That source is used whole, the others to their weighted share; every prefix holds
    each source's share to within half a block with two sources (less than (S + 1) / 2 blocks with S)."""
    w = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
    cap = np.asarray(capacity, dtype=np.int64)
    end = float(np.min((cap + 0.5) / w))
    times = [(np.arange(c) + 0.5) / ws for c, ws in zip(cap, w)]
    times = [t[t < end] for t in times]
    order = np.lexsort((np.concatenate([np.full(len(t), s) for s, t in enumerate(times)]), np.concatenate(times)))
    return np.concatenate([np.full(len(t), s, dtype=np.int64) for s, t in enumerate(times)])[order]


def stack_blocks(blocks: list) -> np.ndarray:
    """A source's batch as it crosses from its workers: (b, seq_len + 1) token ids, the prepared dtype."""
    return np.stack([np.asarray(b) for b in blocks])


class _Batches(IterableDataset):
    """What MixtureLoader's DataLoader iterates in the training process: the mixture's batches."""

    def __init__(self, loader: "MixtureLoader"):
        self.loader = loader

    def __len__(self) -> int:
        return self.loader.n_batches

    def __iter__(self) -> Iterator:
        return self.loader.batches()


def _as_is(batch: Any) -> Any:
    return batch


class MixtureLoader(ResumableDataLoader):
    """The batches of a mixture (data.mixture): each source a ShardsLoader (its litdata workers, its shuffle),
    their blocks taken in `blend` order in the training process and collated into batches of `batch_size`.

    An epoch of the mixture is `blend`'s, cut to whole batches: the same `n_batches` every epoch and on every rank
    (each source's blocks per rank are equal over ranks and epochs: litdata's drop_last), and each source's epoch
    advances with it (a source not used up is reshuffled for the next one). Resume is exact: the state is the
    consumed position (epoch, batches: DataPositionCallback), from which each source's consumed blocks follow
    (`cum`); a source resumes from litdata's state at its whole batches consumed, less the blocks of its next
    batch already taken."""

    world: int = 1  # the data-parallel ranks (every one blends the same order: ShardsDataModule.tokens_by_source)

    def __init__(self, sources: dict[str, ShardsLoader], weights: list[float], batch_size: int, collate_fn,
                 drop_last: bool):
        """drop_last (training): the epoch cut to whole batches; else (validation) its last part-batch kept."""
        self.names, self.sources = list(sources), list(sources.values())
        capacity = [len(src.dataset) for src in self.sources]
        order = blend(weights, capacity)
        n = len(order) // batch_size * batch_size if drop_last else len(order)
        self.order, self.per_batch, self.blocks_collate = order[:n], batch_size, collate_fn
        self.n_batches = -(-n // batch_size)
        counts = np.zeros((self.n_batches, len(self.sources)), dtype=np.int64)  # each source's blocks per batch
        np.add.at(counts, (np.arange(n) // batch_size, self.order), 1)
        self.cum = counts.cumsum(0)  # cum[k - 1]: each source's blocks in the epoch's first k batches
        self._next = (0, 0)  # (epoch, batches done) the next iteration starts from
        super().__init__(_Batches(self), batch_size=None, num_workers=0, collate_fn=_as_is)

    def batches(self) -> Iterator:
        (epoch, done), self._next = self._next, (self._next[0] + 1, 0)
        taken = self.cum[done - 1] if done else np.zeros(len(self.sources), dtype=np.int64)
        skip = []
        for src, n in zip(self.sources, taken.tolist()):
            whole, part = divmod(n, src.batch_size)
            if whole or part:  # resumed mid-epoch: litdata's state after the source's whole batches consumed
                src.position = {"epoch": epoch, "batches": whole}
                src.load_state_dict(src.state_dict())
            else:  # a fresh epoch of the source (litdata counts from 1: this iteration is its epoch + 1)
                src.restore, src._resuming, src.current_epoch = False, False, epoch
            skip.append(part)
        iters: list = [None] * len(self.sources)
        buffers: list[deque] = [deque() for _ in self.sources]
        try:
            for k in range(done, self.n_batches):
                rows = []
                for s in self.order[k * self.per_batch:(k + 1) * self.per_batch].tolist():
                    while not buffers[s]:
                        if iters[s] is None:
                            iters[s] = iter(self.sources[s])
                        got = list(next(iters[s]))
                        buffers[s].extend(got[skip[s]:])
                        skip[s] = 0
                    rows.append(buffers[s].popleft())
                yield self.blocks_collate(rows)
        finally:  # the sources' workers end with the epoch (a source not used up is not run to its end)
            for it in iters:
                if it is not None:
                    it.close()

    def state_dict(self) -> dict[str, Any]:
        return dict(self.position or {"epoch": 0, "batches": 0})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = {"epoch": int(state["epoch"]), "batches": int(state["batches"])}
        self._next = (self.position["epoch"], self.position["batches"])
