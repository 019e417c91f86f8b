"""The litdata side of data=shards (data/shards.py): the stateful training loader and the data-parallel env.

Imported only where shards are read (ShardsDataModule's loaders), so a run on another data module never imports
litdata; the data registry skips this module (data/__init__.py: modules named `_*` are helpers, not data modules).
"""
from __future__ import annotations

import os
from typing import Any, Iterator
from unittest import mock

from litdata import StreamingDataLoader, StreamingDataset
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

    def checked(self, batches: Iterator) -> Iterator:
        for batch in batches:
            ids = batch[0] if isinstance(batch, (tuple, list)) else batch
            top = max(int(ids.max()), int(batch[1].max())) if isinstance(batch, (tuple, list)) else int(ids.max())
            if self.vocab_size and top >= self.vocab_size:
                from attnzoo.config.errors import ConfigError

                raise ConfigError(f"{self.root} holds token id {top}, outside the model's vocabulary of "
                                  f"{self.vocab_size} ids (a corrupt chunk, or one another tokenizer wrote); allowed: "
                                  f"a folder attnzoo-data prepare wrote (prepare it again)", field="data.path")
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
