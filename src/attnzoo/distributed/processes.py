"""Process lifetime: the processes a run starts end with it.

- `die_with_parent(ppid)`: called first thing in a child (a DDP worker). On Linux the kernel sends the
  child SIGKILL when its parent dies (`prctl(PR_SET_PDEATHSIG)`), so a SIGKILLed launcher leaves no worker
  behind; the parent is checked again right after, which closes the race of a parent that died before the
  request was made. Elsewhere it does nothing (the run-dir lock still counts those workers as live).
- `die_with(pid)`: the same for a process that is not the parent (a worker forked from a fork server watches its
  launcher): a thread waiting on a pidfd.
- `kill_tree(pid)`: stop every descendant of `pid` (SIGSTOP, so none forks another meanwhile), then SIGKILL
  them all; what a sweep does on SIGTERM / SIGINT to its joblib/loky workers, their resource trackers and
  the jobs' DDP workers.
- `descendants`, `alive`: from /proc (Linux), `ps` elsewhere.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(ppid: int, sig: int = signal.SIGKILL) -> None:
    """Ask the kernel for `sig` when this process's parent ends; exit now if `ppid` is no longer the parent
    (it died before the request, and this process was reparented)."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != ppid:
        os._exit(1)


def die_with(pid: int, sig: int = signal.SIGKILL) -> None:
    """`sig` to this process when process `pid` (not necessarily its parent) ends; exit now if it has ended. For a
    worker forked from a fork server, whose parent is the server: a daemon thread waits on a pidfd of `pid`
    (Linux >= 5.3), or polls it every 0.2 s where pidfds are missing."""
    import threading

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(1)
    except (AttributeError, OSError):  # no pidfd here: poll
        fd = None
    if not alive(pid):
        os._exit(1)

    def watch() -> None:
        if fd is not None:
            import select

            select.select([fd], [], [])
        else:
            while alive(pid):
                time.sleep(0.2)
        os.kill(os.getpid(), sig)

    threading.Thread(target=watch, name=f"die-with-{pid}", daemon=True).start()


def alive(pid: int) -> bool:
    """`pid` exists and is not a zombie (an exited child its parent has not waited for yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return True  # no /proc: os.kill said it exists


def command_line(pid: int) -> str | None:
    """The process's command line ('' if unknown), None if it does not exist."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except FileNotFoundError:
        return None
    except OSError:
        return "" if alive(pid) else None


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process visible here."""
    table = {}
    if os.path.isdir("/proc"):
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as f:
                    # the command name (2nd field) may hold spaces and parentheses: split after its last ')'
                    table[int(name)] = int(f.read().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue  # ended meanwhile
        return table
    out = subprocess.run(["ps", "-A", "-o", "pid=,ppid="], capture_output=True, text=True, check=False).stdout
    for line in out.splitlines():
        pid, ppid = line.split()
        table[int(pid)] = int(ppid)
    return table


def descendants(pid: int) -> list[int]:
    """Children, grandchildren, ... of `pid` (breadth first)."""
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    found, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop(0)
        found.append(p)
        todo += children.get(p, [])
    return found


def kill_tree(pid: int | None = None, timeout: float = 10.0) -> list[int]:
    """SIGKILL every descendant of `pid` (default: this process), stopping them first so that none starts
    another meanwhile; returns the pids killed. Waits (bounded) until they are gone or zombies."""
    pid = os.getpid() if pid is None else pid
    stopped: list[int] = []
    while True:  # stop the tree until it no longer changes: a stopped process cannot fork
        new = [p for p in descendants(pid) if p not in stopped]
        if not new:
            break
        for p in new:
            _signal(p, signal.SIGSTOP)
        stopped += new
    for p in stopped:
        _signal(p, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in stopped) and time.monotonic() < deadline:
        _reap()
        time.sleep(0.05)
    _reap()
    return stopped


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _reap() -> None:
    """Collect this process's exited children (no zombies left behind while it still runs)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
