"""Fully sharded data parallelism through PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`) on Lightning's
`ModelParallelStrategy`, and its sharded checkpoints (`torch.distributed.checkpoint`).

    trainer=fsdp (GPUs) / trainer=fsdp_cpu (gloo)  ->  strategy: fsdp, trainer.fsdp.* (config/schema.FSDPConfig)

Each block of the decoder is one FSDP unit (`fully_shard(block)`), the root (embedding, final norm, head) another:
every rank holds 1/N of each parameter, its gradient and both Adam moments; a block's weights are all-gathered for
its forward (and again for its backward when `reshard_after_forward`), its gradients reduce-scattered. The mesh is
1-D over the whole world: with context parallelism the sequence shards of one row live on ranks that also shard
the weights (torchtitan's flattened dp_shard x cp mesh), so the gradient average is the DDP one.

Checkpoints are folders written by every rank at once (`torch.distributed.checkpoint`: each rank its shards, rank 0
the metadata and Lightning's `meta.pt`). `last.ckpt` / `best.ckpt` are symlinks to `<name>.shards-<step>-<tag>/`
folders: a save writes a new folder, then swaps the link (`os.replace`, atomic), then deletes the folder it replaced,
so a kill at any moment leaves the link on a complete checkpoint. A sharded checkpoint loads onto any world size
(DCP reshards), and `load_sharded` / `attnzoo-ckpt consolidate` turn it into the single-file form the rest of
attnzoo reads (model weights as in a DDP checkpoint, the optimizer state re-keyed from names to indices).
"""
from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from attnzoo.distributed.fsdp import gather_full_model, is_sharded_checkpoint, verify_sharded


def unshard_for_rank_zero(lit) -> None:
    """After the final validation of an FSDP run: rank 0's module gets a plain copy of the whole model (collective:
    every rank calls it), for what rank 0 measures and writes alone (decode timing, cache bytes, the text sample)."""
    plain = gather_full_model(lit.model)
    if plain is not None:
        lit.model = plain
        if hasattr(lit, "_fwd"):  # LitLM's training callables (training/lit_lm.py): eager on the plain model
            object.__setattr__(lit, "_fwd", plain)
            object.__setattr__(lit, "_hidden", plain.hidden_states)


class FSDPStrategy(ModelParallelStrategy):
    """Lightning's FSDP2 strategy on a 1-D mesh over every process (data_parallel = world, tensor_parallel = 1),
    whose checkpoints are swapped in atomically (module doc). The LightningModule shards itself in
    `configure_model` (TrainingModule.configure_model -> shard_model with `fsdp_cfg`)."""

    def __init__(self, fsdp_cfg, **kwargs: Any) -> None:
        super().__init__(data_parallel_size=1, tensor_parallel_size=1, save_distributed_checkpoint=True, **kwargs)
        self.fsdp_cfg = fsdp_cfg

    def setup_environment(self) -> None:
        # the process counts are known now (Lightning's accelerator connector set them)
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options: Optional[Any] = None) -> None:
        path = Path(self.broadcast(str(filepath)))
        tag = self.broadcast(f"{int(checkpoint.get('global_step', 0)):07d}-{uuid.uuid4().hex[:8]}")
        folder = path.parent / f"{path.name}.shards-{tag}"
        tmp = folder.with_name(folder.name + ".tmp")
        try:
            super().save_checkpoint(checkpoint, tmp, storage_options)  # every rank its shards, rank 0 meta.pt
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            # DCP gathers every rank's result, so each rank sees a failed write (a full disk: torch's writer error in
            # each rank's shard): the unfinished folder removed, the failure one OSError for the one-line report
            from attnzoo.training.checkpoint_io import write_failure

            failure = None if isinstance(e, (KeyboardInterrupt, SystemExit)) else write_failure(e, folder)
            if self.global_rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            if failure is None:
                raise
            raise failure from e
        self.barrier("attnzoo.fsdp.save")
        if self.global_rank == 0:
            os.replace(tmp, folder)  # complete: give it its final name, then point the link at it
            publish(folder, path)
        self.barrier("attnzoo.fsdp.publish")

    def load_checkpoint(self, checkpoint_path, *args: Any, **kwargs: Any):
        """Lightning's DCP load (plain pickle for `.metadata`, weights_only=False for non-tensor entries) runs only on
        a folder that `verify_sharded` found to hold plain data: a payload is refused in one line, unrun."""
        if is_sharded_checkpoint(checkpoint_path):
            verify_sharded(checkpoint_path)
        return super().load_checkpoint(checkpoint_path, *args, **kwargs)

    def remove_checkpoint(self, filepath) -> None:
        if self.global_rank == 0:
            remove_sharded(Path(filepath))


def publish(folder: Path, link: Path) -> None:
    """Point `link` at `folder` atomically (a relative symlink swapped in with os.replace), then delete what `link`
    pointed to before and any folder a killed save left behind."""
    old = Path(os.path.realpath(link)) if link.is_symlink() else None
    tmp_link = link.with_name(f".{link.name}.{uuid.uuid4().hex[:8]}.link")
    os.symlink(folder.name, tmp_link)
    if link.is_dir() and not link.is_symlink():  # a real folder cannot be replaced by a link in one step
        shutil.rmtree(link)
    os.replace(tmp_link, link)
    keep = {Path(os.path.realpath(p)) for p in link.parent.iterdir() if p.is_symlink()}
    for stale in link.parent.glob(f"{link.name}.shards-*"):
        if stale.resolve() not in keep and (stale == old or stale.name.endswith(".tmp")):
            shutil.rmtree(stale, ignore_errors=True)


def remove_sharded(path: Path) -> None:
    target = Path(os.path.realpath(path)) if path.is_symlink() else None
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
    if target is not None and target.is_dir():
        shutil.rmtree(target, ignore_errors=True)


def consolidate(src: str | Path, dst: str | Path) -> Path:
    """`attnzoo-ckpt consolidate SRC DST`: the sharded checkpoint SRC (a folder, or a run's last.ckpt link to one)
    as one .ckpt file DST, written atomically; refused in one line when SRC is not a complete sharded checkpoint."""
    from attnzoo.distributed.checkpoint_files import check_consolidate_paths
    from attnzoo.training.checkpoint_io import AtomicCheckpointIO, check_checkpoint

    dst = check_consolidate_paths(src, dst)
    AtomicCheckpointIO().save_checkpoint(check_checkpoint(src, field="SRC"), dst)
    return dst
