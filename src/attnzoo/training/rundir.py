"""One live run per run directory: a lock file holding the owner's pid and host.

Two runs writing one directory corrupt each other's metrics, checkpoints and summary.json. `run_dir_lock`
creates `<run dir>/.attnzoo.lock` atomically (O_EXCL); a second run finding a lock whose process is alive
on this host is refused in one line, before it writes anything. A lock left by a dead process (killed,
crashed, or from another host's finished job) is stale and taken over. DDP worker processes run under
their launcher's lock and take none of their own: the launcher records their pids in it (a second line,
`workers PID PID...`), and the lock is live while the launcher or any of its workers lives (workers left
running by a killed launcher still write into the directory; on Linux they are killed with it).
"""
from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

from attnzoo.config.errors import ConfigError
from attnzoo.distributed.processes import alive, command_line

LOCK_NAME = ".attnzoo.lock"


def _owner(path: Path) -> tuple[int, str, list[int]] | None:
    """(launcher pid, host, worker pids) of a lock file."""
    try:
        lines = path.read_text().splitlines()
        pid, host = lines[0].split()[:2]
        workers = [int(w) for line in lines[1:] if line.startswith("workers ") for w in line.split()[1:]]
        return int(pid), host, workers
    except (OSError, ValueError, IndexError):
        return None  # unreadable or half-written: treat as stale


def _live_workers(pids: list[int]) -> list[int]:
    """The recorded workers still running (a reused pid running something else is not one of them)."""
    live = []
    for pid in pids:
        cmd = command_line(pid)
        # a fork server's child carries the server's command line, which names attnzoo.cli.worker (launch.py)
        if cmd is not None and alive(pid) and (cmd == "" or "attnzoo.cli.worker" in cmd):
            live.append(pid)
    return live


def record_workers(out: Path, pids: list[int]) -> None:
    """Add the DDP workers this process launched to its lock on `out` (rewritten atomically)."""
    path = out / LOCK_NAME
    owner = _owner(path)
    if owner is None or owner[0] != os.getpid() or owner[1] != socket.gethostname():
        return  # not ours (train() called without the lock, e.g. under an outer launcher)
    tmp = path.with_name(f"{LOCK_NAME}.{os.getpid()}.tmp")
    tmp.write_text(f"{owner[0]} {owner[1]}\nworkers {' '.join(map(str, owner[2] + pids))}\n")
    os.replace(tmp, path)


@contextlib.contextmanager
def run_dir_lock(out: Path):
    from attnzoo.training.launch import WORKER_ENV, global_rank, launched_externally

    # attnzoo's own workers run under their launcher's lock; under torchrun / srun, global rank 0 holds it for all
    # ranks (the others, possibly on other hosts, would see a live lock, or a foreign host's lock as stale)
    if os.environ.get(WORKER_ENV) or (launched_externally() and global_rank() != 0):
        yield
        return
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_NAME
    me = f"{os.getpid()} {socket.gethostname()}\n"
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            owner = _owner(path)
            if owner and owner[1] == socket.gethostname() and owner[0] != os.getpid():
                launcher_alive, workers = alive(owner[0]), _live_workers(owner[2])
                if launcher_alive or workers:
                    orphans = "" if launcher_alive else f", whose DDP workers {', '.join(map(str, workers))} still run"
                    raise ConfigError(
                        f"{out} is in use by a live run (pid {owner[0]} on {owner[1]}{orphans}); allowed: another "
                        f"hydra.run.dir, or wait for that run to end", field="hydra.run.dir") from None
            path.unlink(missing_ok=True)  # stale: its owner is gone
            continue
        with os.fdopen(fd, "w") as f:
            f.write(me)
        break
    try:
        yield
    finally:
        owner = _owner(path)
        if owner and owner[:2] == (os.getpid(), socket.gethostname()):
            path.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------ refused runs

def is_new_run_dir(out: Path) -> bool:
    """Whether `out` was just created for this run: missing, or holding only Hydra's empty job log."""
    out = Path(out)
    if not out.is_dir():
        return not out.exists()
    return all(p.name == "train.log" and p.is_file() and p.stat().st_size == 0 for p in out.iterdir())


def holds_checkpoints(out: Path) -> bool:
    """Whether the run dir holds a checkpoint (a .ckpt file or a sharded checkpoint folder; not a temp file)."""
    folder = Path(out) / "checkpoints"
    return folder.is_dir() and any(not p.name.startswith(".") for p in folder.iterdir())


def remove_new_run_dir(out: Path) -> None:
    """A run refused before any work in a dir created for it (`is_new_run_dir` before it started): nothing of
    it is left, not the dir (outputs/<task>/<time>) and not the parents it leaves empty up to the working
    directory."""
    import shutil

    out = Path(out)
    if out.is_dir():
        shutil.rmtree(out)
    cwd, parent = Path.cwd().resolve(), out.resolve().parent
    while parent != cwd and cwd in parent.parents and parent.is_dir() and not any(parent.iterdir()):
        parent.rmdir()
        parent = parent.parent
