"""What a checkpoint path must be before anything reads it, torch-free (the CLI refuses a missing, truncated or
half-written checkpoint before it imports torch: issue 45): `last` resolved to the run's own, a `.ckpt` file that is a
complete zip archive (torch's format), or a complete torch.distributed.checkpoint folder (trainer=fsdp). Loading
it (training/checkpoint_io.check_checkpoint) checks the rest: its pickles, its keys, every shard.
"""
from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Optional

from attnzoo.config.errors import ConfigError

META = "meta.pt"  # Lightning's name for the non-tensor part of a sharded checkpoint
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index, written last by the coordinator


def is_sharded_checkpoint(path: str | Path) -> bool:
    """A complete torch.distributed.checkpoint folder as FSDPStrategy writes it (a link to one included)."""
    p = Path(path)
    return p.is_dir() and (p / META).is_file() and (p / DCP_METADATA).is_file()


STEP_PREFIX = "step-"  # callbacks.step_checkpoints: checkpoints/step-<8-digit step>.ckpt


def step_checkpoint(run_dir: str | Path, step: int) -> Path:
    """The step checkpoint a run kept at optimizer step `step` (callbacks.step_checkpoints)."""
    return Path(run_dir).expanduser() / "checkpoints" / f"{STEP_PREFIX}{int(step):08d}.ckpt"


def kept_steps(run_dir: str | Path) -> list[int]:
    """The steps whose checkpoints a run keeps (files, or links to sharded folders), ascending."""
    folder = Path(run_dir).expanduser() / "checkpoints"
    names = [p.name for p in folder.glob(f"{STEP_PREFIX}*.ckpt")] if folder.is_dir() else []
    return sorted(int(n[len(STEP_PREFIX):-5]) for n in names if n[len(STEP_PREFIX):-5].isdigit())


def existing_step(run_dir: str | Path, step: int, field: str) -> Path:
    """`step_checkpoint`, refused in one line (with the steps there are) when the run kept none at that step."""
    p = step_checkpoint(run_dir, step)
    if not p.exists():
        kept = kept_steps(run_dir)
        there = f"steps kept there: {', '.join(map(str, kept))}" if kept else \
            "it kept no step checkpoints (callbacks.step_checkpoints=true keeps them)"
        raise ConfigError(f"no checkpoint of step {step} in {Path(run_dir).expanduser() / 'checkpoints'}; {there}",
                          field=field)
    return p


def checkpoint_file(ckpt_path: Optional[str], out: Path) -> Optional[Path]:
    """`ckpt_path` as a path: `last` -> <out>/checkpoints/last.ckpt (which must exist), `step:N` -> the step
    checkpoint this run kept at step N (must exist); None: no checkpoint."""
    if ckpt_path is None:
        return None
    if str(ckpt_path).startswith("step:"):
        step = str(ckpt_path)[5:]
        if not step.isdigit():
            raise ConfigError(f"got {ckpt_path!r}; allowed: step:N with N an optimizer step the run kept, `last`, "
                              "or a .ckpt path", field="ckpt_path")
        return existing_step(out, int(step), "ckpt_path")
    if ckpt_path == "last":
        p = Path(out).expanduser() / "checkpoints" / "last.ckpt"
        if not p.exists():
            raise ConfigError(f"no checkpoint at {p}; allowed: `last` with hydra.run.dir set to the earlier run's "
                              "directory, or a .ckpt path", field="ckpt_path")
        return p
    return Path(ckpt_path).expanduser()


def check_checkpoint_file(path: str | Path, field: str = "ckpt_path") -> None:
    """One line naming `field` unless `path` is a complete sharded folder or a non-empty zip archive."""
    p = Path(path)
    if is_sharded_checkpoint(p):
        return
    if p.is_dir():
        what = "a sharded checkpoint whose save did not finish (no .metadata / meta.pt)" if (p / META).exists() or \
            any(p.glob("*.distcp")) else "a directory"
        raise ConfigError(f"{path} is {what}; allowed: a .ckpt file, a complete sharded checkpoint folder, or `last` "
                          f"with hydra.run.dir=<run dir>", field=field)
    if not p.is_file():
        raise ConfigError(f"{path} does not exist; allowed: an existing .ckpt file or `last`", field=field)
    if p.stat().st_size == 0 or not zipfile.is_zipfile(p):
        raise ConfigError(f"{path} is corrupt or truncated (not a complete torch zip archive)", field=field)


def check_consolidate_paths(src: str | Path, dst: str | Path) -> Path:
    """`attnzoo-ckpt consolidate SRC DST`'s paths, before the checkpoint is read (and before torch's import):
    SRC a complete sharded checkpoint folder, DST a file path that can be written. Returns DST."""
    from attnzoo.config.errors import check
    from attnzoo.config.paths import unwritable

    check(is_sharded_checkpoint(src), "SRC", f"{src} is not a complete sharded checkpoint folder (meta.pt and "
          f".metadata); allowed: a trainer=fsdp run's checkpoints/last.ckpt or best.ckpt")
    dst = Path(dst)
    check(not dst.is_dir(), "DST", f"{dst} is a directory; allowed: a file path (e.g. model.ckpt)")
    inside = Path(src).resolve()  # a file of SRC itself (meta.pt: was overwritten, the sharded checkpoint lost)
    check(inside not in dst.absolute().resolve().parents, "DST", f"{dst} is inside SRC {src}, which the file would "
          f"overwrite or join; allowed: a path outside the checkpoint folder (e.g. model.ckpt)")
    why = unwritable(dst)  # under a file, or a read-only folder: refused before the checkpoint is read
    check(why is None, "DST", f"{dst} cannot be written ({why}); allowed: a path under a writable directory")
    return dst


def saved_run_config(path: str | Path) -> Optional[dict]:
    """The run config a `.ckpt` file carries (Lightning's hyper_parameters.cfg), read without torch (issue 45: a
    refusal that needs only the run's config - a prompt past its learned position table - comes before torch's
    import). The archive's pickle is read with an allowlist as torch's weights_only load is, stricter: a tensor,
    storage or any other torch global reads as None (its bytes are never touched), an OrderedDict as a dict, and
    any other global stops the read. None when the file is not such a checkpoint or its config is not plain data;
    the caller then loads it with torch as before, which makes the same checks."""
    import pickle

    class _Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            if module == "collections" and name == "OrderedDict":
                return _Record  # a state dict: its `_metadata` attribute is set on it
            if module == "torch" or module.startswith("torch."):
                return _nothing
            raise pickle.UnpicklingError(f"{module}.{name} is not read here")

        def persistent_load(self, pid):  # a tensor's storage record: left unread
            return None

    p = Path(path)
    if not p.is_file():
        return None
    try:
        with zipfile.ZipFile(p) as z:
            name = next((n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
            if name is None:
                return None
            with z.open(name) as f:
                state = _Unpickler(f).load()
    except Exception:  # noqa: BLE001 - anything unexpected: torch reads it as before
        return None
    cfg = ((state.get("hyper_parameters") or {}).get("cfg") if isinstance(state, dict) else None)
    return cfg if isinstance(cfg, dict) and _plain(cfg) else None


class _Record(dict):
    """An OrderedDict of the archive, read as a dict that takes attributes."""


def _nothing(*args, **kwargs) -> None:
    return None


def _plain(node) -> bool:
    """Only the types a resolved OmegaConf container holds."""
    if isinstance(node, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in node.items())
    if isinstance(node, (list, tuple)):
        return all(_plain(v) for v in node)
    return node is None or isinstance(node, (str, int, float, bool))
