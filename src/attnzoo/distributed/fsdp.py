"""FSDP2 on the model, without Lightning: shard a decoder (`fully_shard` per block, then the root), gather it back
whole, and read a sharded checkpoint folder (torch.distributed.checkpoint) in one process. The Lightning strategy,
its atomic checkpoint folders and `attnzoo-ckpt consolidate` are training/fsdp.py; docs/distributed.md.
"""
from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from attnzoo.config.errors import ConfigError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
from attnzoo.distributed.checkpoint_files import DCP_METADATA, META, is_sharded_checkpoint  # noqa: E402,F401


# What a torch.distributed.checkpoint `.metadata` holds (torch 2.5-2.13): DCP's own dataclasses, torch.Size, dtypes,
# layouts (by name, through torch.serialization._get_layout), the checkpoint id as a path. Nothing else is looked up
# while reading one, so a pickle that names any other callable (os.system, builtins.eval, ...) fails before it runs.
_DCP_GLOBALS = {
    *(("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
}


class MetadataUnpickler(pickle.Unpickler):
    """`pickle` restricted to the classes of a DCP index (`_DCP_GLOBALS`, torch dtypes): torch's FileSystemReader
    reads `.metadata` with plain `pickle.load`, which runs whatever the file names."""

    def find_class(self, module: str, name: str):
        if (module, name) in _DCP_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which no checkpoint index holds")


def read_dcp_metadata(folder: Path):
    """The `.metadata` of a DCP folder through MetadataUnpickler (raises pickle.UnpicklingError and the like)."""
    from torch.distributed.checkpoint.metadata import Metadata

    with open(folder / DCP_METADATA, "rb") as f:
        md = MetadataUnpickler(f).load()
    if not isinstance(md, Metadata):
        raise pickle.UnpicklingError(f"it holds a {type(md).__name__}, not a torch.distributed.checkpoint Metadata")
    return md


def verify_sharded(path: str | Path, field: str = "ckpt_path"):
    """Check a sharded checkpoint folder before anything in it is loaded, in one line naming the file (ConfigError):
    its `.metadata` holds only DCP's index classes (MetadataUnpickler: read, never run); every shard it names is a
    file inside the folder, long enough for its entries; every non-tensor entry (torch.save bytes: optimizer
    param_groups, which DCP's default planner reads with `torch.load(weights_only=False)`) loads with
    `weights_only=True`; `meta.pt` loads with `weights_only=True`. After it, torch's and Lightning's own readers
    run on files that hold plain data only. Returns the Metadata."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    p = Path(path)
    folder = p.resolve()

    def refuse(file: str, why: str) -> ConfigError:
        return ConfigError(f"{p}/{file} {why}; nothing in the checkpoint was loaded", field=field)

    try:
        md = read_dcp_metadata(folder)
    except Exception as e:  # a payload, a truncated or garbage file: never a traceback
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise refuse(DCP_METADATA, f"is not a plain torch.distributed.checkpoint index ({first[:160]})") from None
    infos = md.storage_data if isinstance(md.storage_data, dict) else {}
    sizes: dict[str, int] = {}
    for index, info in infos.items():
        rel = str(getattr(info, "relative_path", ""))
        if not rel or Path(rel).is_absolute() or Path(rel).name != rel:
            raise refuse(DCP_METADATA, f"names a shard outside the folder ({rel!r}); allowed: file names in the folder")
        if rel not in sizes:
            shard = folder / rel
            if not shard.is_file():
                raise refuse(rel, "is missing (the index names it): an incomplete copy of the checkpoint")
            sizes[rel] = shard.stat().st_size
        if getattr(info, "transform_descriptors", None):
            raise refuse(rel, f"stores {index.fqn} through transforms {list(info.transform_descriptors)}, which attnzoo "
                              f"does not read; allowed: checkpoints written by trainer=fsdp")
        if info.offset < 0 or info.length < 0 or info.offset + info.length > sizes[rel]:
            raise refuse(rel, f"is truncated ({sizes[rel]} bytes; {index.fqn} needs {info.offset + info.length})")
    for fqn, item in md.state_dict_metadata.items():
        if not isinstance(item, BytesStorageMetadata):
            continue
        info = infos.get(MetadataIndex(fqn))
        if info is None:
            raise refuse(DCP_METADATA, f"lists {fqn} without a place in any shard")
        with open(folder / info.relative_path, "rb") as f:
            f.seek(info.offset)
            raw = f.read(info.length)
        try:
            torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except Exception as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise refuse(info.relative_path, f"holds {fqn}, which is not plain data ({first[:120]})") from None
    try:
        torch.load(folder / META, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise refuse(META, f"cannot be loaded as plain data ({first[:160]})") from None
    return md


def _safe_dcp_reading():
    """A FileSystemReader whose `.metadata` goes through MetadataUnpickler, and the empty-state-dict planner with its
    non-tensor entries read `weights_only=True` (DCP's default reads them with weights_only=False)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):  # FileSystemReader.read_metadata, without pickle.load
            md = read_dcp_metadata(Path(self.path))
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    class SafePlanner(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item, value) -> None:  # DefaultLoadPlanner.load_bytes, with weights_only=True
            obj = torch.load(value, map_location="cpu", weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeReader, SafePlanner


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


def load_sharded(path: str | Path, field: str = "ckpt_path") -> dict:
    """A sharded checkpoint folder as one checkpoint dict, in this process alone (no process group): Lightning's
    `meta.pt` (global_step, callbacks, hyper_parameters, ...) with `state_dict` (full tensors, the model's own
    names) and `optimizer_states` in torch.optim's form (state and param_groups keyed by parameter index, in the
    optimizer's own order), so a DDP or single-process run resumes from it and every reader of .ckpt files loads it.
    Checked first (`verify_sharded`: refused in one line naming the file, `field` the option that named it), then
    read with the restricted readers of `_safe_dcp_reading`: nothing in the folder is unpickled unrestricted."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    p = Path(path)
    verify_sharded(p, field)
    reader, planner = _safe_dcp_reading()
    tensors: dict = {}
    _load_state_dict(tensors, storage_reader=reader(str(p)), planner=planner(), no_dist=True)
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
