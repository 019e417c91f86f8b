"""One live run per run directory: a lock file holding the owner's pid and host.

Two runs writing one directory corrupt each other's metrics, checkpoints and summary.json. `run_dir_lock`
creates `<run dir>/.attnzoo.lock` atomically (O_EXCL); a second run finding a lock whose process is alive
on this host is refused in one line, before it writes anything. A lock left by a dead process (killed,
crashed, or from another host's finished job) is stale and taken over. DDP worker processes run under
their launcher's lock and take none of their own.
"""
from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

from .errors import ConfigError

LOCK_NAME = ".attnzoo.lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _owner(path: Path) -> tuple[int, str] | None:
    try:
        pid, host = path.read_text().split()[:2]
        return int(pid), host
    except (OSError, ValueError):
        return None  # unreadable or half-written: treat as stale


@contextlib.contextmanager
def run_dir_lock(out: Path):
    from .launch import WORKER_ENV

    if os.environ.get(WORKER_ENV):
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
            if owner and owner[1] == socket.gethostname() and owner[0] != os.getpid() and _alive(owner[0]):
                raise ConfigError(
                    f"{out} is in use by a live run (pid {owner[0]} on {owner[1]}); allowed: another "
                    f"hydra.run.dir, or wait for that run to end", field="hydra.run.dir") from None
            path.unlink(missing_ok=True)  # stale: its owner is gone
            continue
        with os.fdopen(fd, "w") as f:
            f.write(me)
        break
    try:
        yield
    finally:
        if path.is_file() and path.read_text() == me:
            path.unlink(missing_ok=True)
