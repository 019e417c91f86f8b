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

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
META = "meta.pt"  # Lightning's name for the non-tensor part of a sharded checkpoint
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index, written last by the coordinator
# per-parameter flags param_groups reads (lit_lm.param_groups); fully_shard makes new Parameter objects
PARAM_FLAGS = ("_no_weight_decay", "_lr_scale")


def is_sharded_checkpoint(path: str | Path) -> bool:
    """A complete torch.distributed.checkpoint folder as FSDPStrategy writes it (a link to one included)."""
    p = Path(path)
    return p.is_dir() and (p / META).is_file() and (p / DCP_METADATA).is_file()


def shard_model(model: nn.Module, mesh, cfg) -> nn.Module:
    """`fully_shard` each block (`model.blocks`), then the root, with trainer.fsdp's mixed-precision and offload
    policies; in place (also returned). Parameter flags (`_no_weight_decay`, `_lr_scale`) carry over to the sharded
    parameters."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    flags = {name: {f: getattr(p, f) for f in PARAM_FLAGS if hasattr(p, f)} for name, p in model.named_parameters()}
    param_dtype = DTYPES.get(cfg.param_dtype) if cfg.param_dtype else None
    reduce_dtype = DTYPES.get(cfg.reduce_dtype) if cfg.reduce_dtype else None
    kw = dict(mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
              offload_policy=CPUOffloadPolicy() if cfg.cpu_offload else OffloadPolicy())
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        # the last block's weights are needed again first in backward: keeping them gathered saves one all-gather
        fully_shard(block, reshard_after_forward=cfg.reshard_after_forward and i < len(blocks) - 1, **kw)
    fully_shard(model, reshard_after_forward=cfg.reshard_after_forward, **kw)
    for name, p in model.named_parameters():
        for f, v in flags.get(name, {}).items():
            setattr(p, f, v)
    return model


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def gather_full_model(model: nn.Module) -> Optional[nn.Module]:
    """A plain (unsharded, unwrapped) copy of a `shard_model`ed model on global rank 0, None on the other ranks.
    Collective: every rank calls it. For what rank 0 does alone at the end of a run (decode timing, samples)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from torch.distributed.fsdp import FSDPModule

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if torch.distributed.get_rank() != 0:
        return None
    # fully_shard gave the module a class of its own (FSDP<Name>(FSDPModule, <Name>)): build the plain one
    cls = next(c for c in type(model).__mro__[1:] if issubclass(c, nn.Module) and not issubclass(c, FSDPModule))
    plain = cls(model.cfg)
    plain.load_state_dict(full)
    plain.activation_checkpointing = getattr(model, "activation_checkpointing", False)
    device = next(model.parameters()).device
    return plain.to(device).train(model.training)


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
        super().save_checkpoint(checkpoint, tmp, storage_options)  # every rank its shards, rank 0 meta.pt
        self.barrier("attnzoo.fsdp.save")
        if self.global_rank == 0:
            os.replace(tmp, folder)  # complete: give it its final name, then point the link at it
            publish(folder, path)
        self.barrier("attnzoo.fsdp.publish")

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


def load_sharded(path: str | Path) -> dict:
    """A sharded checkpoint folder as one checkpoint dict, in this process alone (no process group): Lightning's
    `meta.pt` (global_step, callbacks, hyper_parameters, ...) with `state_dict` (full tensors, the model's own
    names) and `optimizer_states` in torch.optim's form (state and param_groups keyed by parameter index, in the
    optimizer's own order), so a DDP or single-process run resumes from it and every reader of .ckpt files loads it."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    p = Path(path)
    tensors: dict = {}
    _load_state_dict(tensors, storage_reader=FileSystemReader(str(p)), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    out = torch.load(p / META, map_location="cpu", weights_only=True)
    out["state_dict"] = tensors.pop("state_dict")
    opts = sorted(k for k in tensors if k.startswith("optimizer_"))
    out["optimizer_states"] = [indexed_optimizer_state(tensors.pop(k)) for k in opts]
    return out


def indexed_optimizer_state(named: dict) -> dict:
    """torch.distributed.checkpoint's optimizer state (keyed by parameter name) -> torch.optim's (keyed by the
    parameter's position over the param groups)."""
    index, groups = {}, []
    for group in named["param_groups"]:
        ids = []
        for name in group["params"]:
            index.setdefault(name, len(index))
            ids.append(index[name])
        groups.append({**group, "params": ids})
    state = {index[name]: s for name, s in named.get("state", {}).items() if name in index}
    return {"state": state, "param_groups": groups}


def consolidate(src: str | Path, dst: str | Path) -> Path:
    """`attnzoo-ckpt consolidate SRC DST`: the sharded checkpoint SRC as one .ckpt file DST (written atomically)."""
    from attnzoo.training.checkpoint_io import AtomicCheckpointIO

    dst = Path(dst)
    AtomicCheckpointIO().save_checkpoint(load_sharded(src), dst)
    return dst
