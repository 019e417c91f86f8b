"""FSDP2 on the model, without Lightning: shard a decoder (`fully_shard` per block, then the root), gather it back
whole, and read a sharded checkpoint folder (torch.distributed.checkpoint) in one process. The Lightning strategy,
its atomic checkpoint folders and `attnzoo-ckpt consolidate` are training/fsdp.py; docs/distributed.md.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from torch import nn

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
META = "meta.pt"  # Lightning's name for the non-tensor part of a sharded checkpoint
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index, written last by the coordinator


def is_sharded_checkpoint(path: str | Path) -> bool:
    """A complete torch.distributed.checkpoint folder as FSDPStrategy writes it (a link to one included)."""
    p = Path(path)
    return p.is_dir() and (p / META).is_file() and (p / DCP_METADATA).is_file()


def shard_model(model: nn.Module, mesh, cfg) -> nn.Module:
    """`fully_shard` each block (`model.blocks`), then the root, with trainer.fsdp's mixed-precision and offload
    policies; in place (also returned). Parameter flags (every attribute set on a parameter) carry over to the
    sharded parameters."""
    from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard,
                                        register_fsdp_forward_method)

    # fully_shard makes new Parameters: the flags set on the old ones (the optimizer groups' `_no_weight_decay`,
    # `_lr_scale`, µP's `_wd_scale`: training/lit_lm.param_groups) are copied over, whatever they are
    flags = {name: dict(vars(p)) for name, p in model.named_parameters()}
    param_dtype = DTYPES.get(cfg.param_dtype) if cfg.param_dtype else None
    reduce_dtype = DTYPES.get(cfg.reduce_dtype) if cfg.reduce_dtype else None
    kw = dict(mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
              offload_policy=CPUOffloadPolicy() if cfg.cpu_offload else OffloadPolicy())
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        # the last block's weights are needed again first in backward: keeping them gathered saves one all-gather
        fully_shard(block, reshard_after_forward=cfg.reshard_after_forward and i < len(blocks) - 1, **kw)
    # the root (embedding, final norm, head) stays gathered after forward: the head is used right after it (the
    # chunked loss reads lm_head.weight outside the forward) and first in backward (FSDP2's own default for a root)
    fully_shard(model, reshard_after_forward=False, **kw)
    if hasattr(model, "hidden_states"):  # the chunked loss enters by hidden_states, not forward: the same hooks
        register_fsdp_forward_method(model, "hidden_states")
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
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    plain = cls(model.cfg).to(dtype)  # built in the default dtype: the sharded model's own, before the copy
    plain.load_state_dict(full)
    plain.activation_checkpointing = getattr(model, "activation_checkpointing", False)
    device = next(model.parameters()).device
    return plain.to(device).train(model.training)


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
