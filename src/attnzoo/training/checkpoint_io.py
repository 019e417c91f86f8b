"""Checkpoint safety: atomic writes and a clear one-line error for unreadable checkpoints."""
from __future__ import annotations

import contextlib
import errno
import os
import pickle
import re
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from attnzoo.config.errors import ConfigError
from attnzoo.config.paths import follow_umask
from attnzoo.distributed.checkpoint_files import check_checkpoint_file
from attnzoo.distributed.fsdp import META, is_sharded_checkpoint, load_sharded, verify_sharded
from attnzoo.training.config_checks import MIN_FREE_BYTES


# torch's zip writer reports a failed write (a full disk among them) as a RuntimeError of its own, not an OSError:
# "[enforce fail at inline_container.cc:672] . unexpected pos 71017600 vs 71017488", "... file write failed"
_WRITER_FAILED = re.compile(r"inline_container|PytorchStreamWriter|unexpected pos|file write failed")
FULL_BELOW = MIN_FREE_BYTES  # free bytes under which a failed write is taken for a full disk (the preflight's floor)


def free_bytes(folder: Path) -> int:
    return shutil.disk_usage(folder).free


def write_failure(e: BaseException, path: Path) -> OSError | None:
    """torch.save's failed write (or a distributed checkpoint's, whose CheckpointException quotes each rank's) as the
    OSError it is (ENOSPC where the filesystem is out of space, else EIO), for the run's one-line report
    (training/run.py); None for any other error."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return OSError(e.errno, e.strerror, str(path))
    if not _WRITER_FAILED.search(str(e)) and "No space left" not in str(e):
        return None
    if free_bytes(path.parent) < FULL_BELOW:
        return OSError(errno.ENOSPC, "No space left on device", str(path))
    return OSError(errno.EIO, f"write failed: {str(e).strip().splitlines()[0][:160]}", str(path))


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write to a temp file in the same folder, fsync, then `os.replace` onto the target: a process killed
    mid-write leaves the previous checkpoint intact (and a stray `.tmp`, removed by the next successful
    save), never a truncated one. The file's mode follows the umask, as every other file of the run."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options: Optional[Any] = None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            follow_umask(fd)  # mkstemp's 0600 would make the checkpoint unreadable to the group (shared filesystems)
            f = os.fdopen(fd, "wb")
            try:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            except (RuntimeError, OSError) as e:
                with contextlib.suppress(OSError):  # the buffered rest may fail again as the file closes
                    f.close()
                # torch's writer failing (a full disk among the causes) as the OSError it is, with the file named;
                # the free space is read while the partial temp file still holds it
                failure = write_failure(e, path) if isinstance(e, RuntimeError) else (
                    OSError(e.errno, e.strerror, str(path)) if e.filename is None else None)
                if failure is None:
                    raise
                raise failure from e
            f.close()
            os.replace(tmp, path)
            # temp files of writes that a killed process left behind are garbage now
            for stale in path.parent.glob(f".{path.name}.*.tmp"):
                stale.unlink(missing_ok=True)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def load_checkpoint(self, path, map_location: Optional[Any] = None, weights_only: Optional[bool] = None) -> dict:
        if is_sharded_checkpoint(path):  # an FSDP run's folder, resumed without FSDP: consolidated in memory
            return load_sharded(path)
        # our checkpoints hold tensors, numbers, strings and dicts only: safe to load weights_only
        return torch.load(path, map_location=map_location or "cpu", weights_only=True)


def flatten(d: Any, prefix: str = "") -> dict:
    """{'model': {'d_model': 8}} -> {'model.d_model': 8}; lists become strings (dashboard filters)."""
    out = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}{k}."))
    elif isinstance(d, (list, tuple)):
        out[prefix[:-1]] = str(list(d))
    else:
        out[prefix[:-1]] = d
    return out


def check_checkpoint(path: str | Path, field: str = "ckpt_path", weights: bool = True) -> dict:
    """Fail with one line if `path` is not a complete, loadable checkpoint (before any work); return it
    (memory-mapped: reading `hyper_parameters` or `global_step` does not load the weights). A sharded checkpoint
    folder (trainer=fsdp, training/fsdp.py) is consolidated in memory, or with `weights=False` read without its
    tensors (its meta.pt: step, callbacks, hyper-parameters)."""
    p = Path(path)
    if is_sharded_checkpoint(p):  # checked whole before anything is loaded (distributed/fsdp.py verify_sharded)
        if weights:
            state = load_sharded(p, field)
        else:
            verify_sharded(p, field)
            state = torch.load(p / META, map_location="cpu", weights_only=True)
        if "global_step" not in state:
            raise ConfigError(f"{path} is not a training checkpoint (missing global_step)", field=field)
        return state
    check_checkpoint_file(path, field)  # a folder, a missing file, a truncated zip: the same line as the CLI's preflight
    try:
        state = torch.load(p, map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, zipfile.BadZipFile, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{path} cannot be loaded ({first[:160]})", field=field) from None
    if not isinstance(state, dict):  # torch.save of a tensor or a list (was: a traceback from `in` on a Tensor)
        raise ConfigError(f"{path} is not a training checkpoint (it holds an object of type {type(state).__name__}, "
                          f"not a dict with state_dict and global_step); allowed: a checkpoint attnzoo-train wrote",
                          field=field)
    missing = [k for k in ("state_dict", "global_step") if k not in state]
    if missing:
        raise ConfigError(f"{path} is not a training checkpoint (missing {', '.join(missing)})", field=field)
    if not isinstance(state["state_dict"], dict):
        raise ConfigError(f"{path} is not a training checkpoint (its state_dict is of type "
                          f"{type(state['state_dict']).__name__}, not a dict of tensors)", field=field)
    return state


# a resumed run may change these without changing what the checkpoint means (model.impl: the kernels, not the weights)
RESUMABLE_CHANGES = ("data.num_workers", "model.impl")


def _model_defaults() -> dict:
    """model.* defaults of the typed config (flattened), for fields a saved config may predate."""
    import dataclasses

    from attnzoo.config.schema import ModelConfig

    return {k: v for k, v in flatten({"model": dataclasses.asdict(ModelConfig())}).items() if v is not None}


def global_batch(cfg: dict) -> int | None:
    """data.batch_size x processes (trainer.devices x num_nodes), None when devices is not a plain count."""
    t, bs = cfg.get("trainer") or {}, (cfg.get("data") or {}).get("batch_size")
    devices = t.get("devices", 1)
    if bs is None or not str(devices).isdigit():
        return None
    return int(bs) * int(devices) * int(t.get("num_nodes", 1) or 1)


def check_resume_compatible(saved_cfg: dict | None, cfg: dict, path: str | Path) -> None:
    """Refuse, in one line naming the differing fields, to resume a checkpoint under a model or data
    config other than the one it was trained with (weights of another shape fail to load; a silent
    change, e.g. of the positional encoding, would load and mean something else)."""
    if not saved_cfg:
        return
    old = flatten({s: saved_cfg.get(s) for s in ("model", "data")})
    new = flatten({s: cfg.get(s) for s in ("model", "data")})
    # a field added to the config after the checkpoint was written, at its default value, changes nothing
    defaults = _model_defaults()
    absent = lambda k, d: k not in d and k in defaults  # noqa: E731
    diff = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k) and k not in RESUMABLE_CHANGES
            and not (absent(k, old) and new.get(k) == defaults[k]) and not (absent(k, new) and old.get(k) == defaults[k])]
    if "data.batch_size" in diff and global_batch(saved_cfg) == global_batch(cfg) is not None:
        diff.remove("data.batch_size")  # another world size, the same global batch: the same steps (resharding)
    diff.sort(key=lambda k: not k.endswith(".name"))  # a swapped part (mixer, ffn, ...) first, then its fields
    if diff:
        shown = ", ".join(f"{k} ({old.get(k)!r} -> {new.get(k)!r})" for k in diff[:6])
        more = f" and {len(diff) - 6} more" if len(diff) > 6 else ""
        raise ConfigError(
            f"{path} was trained with another model/data config: {shown}{more}; allowed: the run's own values "
            f"(attnzoo-train --resume RUN_DIR reuses them)", field="ckpt_path")
    was, now = ((c.get("optim") or {}).get("name", "adamw") for c in (saved_cfg, cfg))  # its state is one rule's
    if was != now:
        raise ConfigError(f"{path} holds the optimizer state of optim={was}, which optim={now} cannot continue; "
                          f"allowed: optim={was}, or a new run", field="optim.name")
